-- The library's administration, topology and status functions in PL/pgSQL, for the plain-SQL
-- install (scripts/hosted_sql.py assembles it; sql/hosted/publish.sql has the publishing
-- functions). Same names, arguments, results and SQLSTATEs as the extension's (src/api).
--
-- Where the two installs differ, and why:
-- - No worker runs inside the database: the relay (amqp-outbox-relay) does its work over a
--   client connection. It LISTENs on the channel amqp_outbox; what the extension tells its
--   worker through shared memory is a NOTIFY there, sent at commit and never on rollback:
--   '' (wake up: something to publish or retry), 'reload' (configuration or declarations
--   changed), 'subscriptions' (amqp.subscription changed), 'scheduled' (amqp.scheduled_message
--   changed), 'disconnect:<broker_id>'.
-- - The status functions read what a relay reports instead of shared memory: the active relay
--   is the session holding the advisory lock (1634562416, 1) in this database ('amqp' in
--   ASCII, 1 for the outbox side); its counters are in amqp._relay_counters, its connections in
--   amqp._relay_broker (both written only by the relay). Without a relay the database's state is
--   'no relay'; nothing is in flight.
-- - amqp.wait_for_standbys() waits for the WAL position the server had written when it was
--   called (at or after the session's last commit; the extension waits for that commit's end
--   exactly) and looks at pg_stat_replication every millisecond.

-- What the active relay reports: one row, replaced as it goes.
CREATE UNLOGGED TABLE amqp._relay_counters (
    one boolean PRIMARY KEY DEFAULT true CHECK (one),
    published bigint NOT NULL DEFAULT 0,
    confirmed bigint NOT NULL DEFAULT 0,
    acknowledged bigint NOT NULL DEFAULT 0,
    resent_lost bigint NOT NULL DEFAULT 0,
    resent_timeout bigint NOT NULL DEFAULT 0,
    failed bigint NOT NULL DEFAULT 0,
    parked bigint NOT NULL DEFAULT 0,
    steps bigint NOT NULL DEFAULT 0,
    commit_wakeups bigint NOT NULL DEFAULT 0,
    subscription_pid integer,
    monitor_pid integer,
    reported_at timestamptz NOT NULL DEFAULT pg_catalog.now()
);
COMMENT ON TABLE amqp._relay_counters IS
    'Plain-SQL install only: the active relay''s counters since it took over this database, read by amqp.worker_status. Written by the relay.';

-- Each broker's connection as the active relay last reported it.
CREATE UNLOGGED TABLE amqp._relay_broker (
    broker_id integer PRIMARY KEY,
    connected boolean NOT NULL,
    host text,
    channel bigint NOT NULL DEFAULT 0,
    since timestamptz NOT NULL DEFAULT pg_catalog.now(),
    in_flight integer NOT NULL DEFAULT 0,
    pending bigint,
    last_error text
);
COMMENT ON TABLE amqp._relay_broker IS
    'Plain-SQL install only: each broker''s connection as the active relay last reported it, read by amqp.broker_status. Written by the relay.';

-- The session of the relay that serves this database now, if any.
CREATE FUNCTION amqp._relay_pid() RETURNS integer
    LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp
    AS $relay_pid$
SELECT l.pid FROM pg_catalog.pg_locks l
 WHERE l.locktype OPERATOR(pg_catalog.=) 'advisory' AND l.granted
   AND l.database OPERATOR(pg_catalog.=) (SELECT d.oid FROM pg_catalog.pg_database d
                                           WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())
   AND l.classid OPERATOR(pg_catalog.=) 1634562416::pg_catalog.oid
   AND l.objid OPERATOR(pg_catalog.=) 1::pg_catalog.oid AND l.objsubid OPERATOR(pg_catalog.=) 2
 LIMIT 1
$relay_pid$;

-- Every database may be served by a relay: nothing here can tell which ones are.
CREATE FUNCTION amqp._serves_this_database() RETURNS boolean
    LANGUAGE sql STABLE PARALLEL SAFE AS $$SELECT true$$;

CREATE FUNCTION amqp._worker_status()
    RETURNS TABLE (database_oid oid, state text, worker_pid integer, published bigint,
                   confirmed bigint, acknowledged bigint, resent_lost bigint,
                   resent_timeout bigint, failed bigint, parked bigint, ack_queue text,
                   steps bigint, commit_wakeups bigint, subscription_worker_pid integer,
                   monitor_pid integer)
    LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    AS $worker_status$
SELECT d.oid,
       CASE WHEN r.pid IS NULL THEN 'no relay' ELSE 'running' END,
       r.pid,
       coalesce(c.published, 0), coalesce(c.confirmed, 0), coalesce(c.acknowledged, 0),
       coalesce(c.resent_lost, 0), coalesce(c.resent_timeout, 0), coalesce(c.failed, 0),
       coalesce(c.parked, 0),
       pg_catalog.format('amqp_outbox.ack.%s.%s',
                         (SELECT pg_catalog.to_hex(s.system_identifier) FROM pg_catalog.pg_control_system() s),
                         pg_catalog.to_hex(d.oid::pg_catalog.int8)),
       coalesce(c.steps, 0), coalesce(c.commit_wakeups, 0),
       CASE WHEN r.pid IS NOT NULL THEN c.subscription_pid END,
       CASE WHEN r.pid IS NOT NULL THEN c.monitor_pid END
  FROM pg_catalog.pg_database d
  CROSS JOIN LATERAL (SELECT amqp._relay_pid() AS pid) r
  LEFT JOIN amqp._relay_counters c ON r.pid IS NOT NULL
 WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()
$worker_status$;

CREATE FUNCTION amqp._broker_status()
    RETURNS TABLE (broker_id integer, connected boolean, host text, channel bigint,
                   since timestamptz, in_flight integer, pending bigint, last_error text)
    LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    AS $broker_status$
SELECT b.broker_id, b.connected, b.host, b.channel, b.since, b.in_flight, b.pending, b.last_error
  FROM amqp._relay_broker b
 WHERE amqp._relay_pid() IS NOT NULL
 ORDER BY b.broker_id
$broker_status$;

-- What is in flight lives in the relay's memory; the database has no copy of it.
CREATE FUNCTION amqp._in_flight() RETURNS TABLE (id bigint, confirmed boolean)
    LANGUAGE sql VOLATILE AS $$SELECT NULL::bigint, NULL::boolean WHERE false$$;

CREATE FUNCTION amqp.wake() RETURNS void
    LANGUAGE sql VOLATILE STRICT AS $$NOTIFY amqp_outbox$$;

CREATE FUNCTION amqp._config_changed() RETURNS trigger
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
    AS $config_changed$
BEGIN
    IF TG_TABLE_NAME OPERATOR(pg_catalog.=) 'subscription' THEN
        NOTIFY amqp_outbox, 'subscriptions';
    END IF;
    NOTIFY amqp_outbox, 'reload';
    RETURN NULL;
END
$config_changed$;

CREATE FUNCTION amqp._scheduled_changed() RETURNS trigger
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
    AS $scheduled_changed$
BEGIN
    NOTIFY amqp_outbox, 'scheduled';
    RETURN NULL;
END
$scheduled_changed$;

-- pg_amqp closed the session's own connection; here the relay closes and reopens its
-- connection to the broker.
CREATE FUNCTION amqp.disconnect(broker_id integer) RETURNS void
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
    AS $disconnect$
#variable_conflict use_column
BEGIN
    IF broker_id IS NULL THEN
        RAISE EXCEPTION 'amqp_outbox: broker_id must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF NOT EXISTS (SELECT FROM amqp.broker b WHERE b.broker_id OPERATOR(pg_catalog.=) disconnect.broker_id) THEN
        RAISE EXCEPTION 'amqp_outbox: broker % does not exist in amqp.broker', broker_id
            USING ERRCODE = 'undefined_object';
    END IF;
    PERFORM pg_catalog.pg_notify('amqp_outbox', 'disconnect:' OPERATOR(pg_catalog.||) broker_id::text);
END
$disconnect$;

-- A parked message made eligible again (attempts back to 0), or a delayed one moved into the
-- outbox now; it goes out after commit.
CREATE FUNCTION amqp.retry(message_id bigint) RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    AS $retry$
#variable_conflict use_column
BEGIN
    IF message_id IS NULL THEN
        RAISE EXCEPTION 'amqp_outbox: message_id must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    UPDATE amqp.message m SET parked_at = NULL, attempts = 0, next_attempt_at = NULL
     WHERE m.parked_at IS NOT NULL AND m.id OPERATOR(pg_catalog.=) retry.message_id;
    IF NOT FOUND THEN
        WITH due AS (DELETE FROM amqp.scheduled_message s
                      WHERE s.id OPERATOR(pg_catalog.=) retry.message_id RETURNING s.*)
        INSERT INTO amqp.message (id, producer_pid, producer_started_at, broker_id, exchange,
                                  routing_key, body, delivery_mode, content_type, reply_to,
                                  correlation_id, headers, created_at, attempts, next_attempt_at,
                                  last_error, parked_at, message_id, business_type, business_key,
                                  traceparent, system_id, host_id, resends)
        SELECT id, producer_pid, producer_started_at, broker_id, exchange, routing_key, body,
               delivery_mode, content_type, reply_to, correlation_id, headers, created_at,
               attempts, next_attempt_at, last_error, parked_at, due.message_id, business_type,
               business_key, traceparent, system_id, host_id, resends
          FROM due;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'amqp_outbox: message % is neither parked nor scheduled', message_id
                USING ERRCODE = 'object_not_in_prerequisite_state';
        END IF;
    END IF;
    NOTIFY amqp_outbox;
    RETURN true;
END
$retry$;

-- Retries every parked message of a broker; returns how many.
CREATE FUNCTION amqp.retry_all(broker_id integer) RETURNS bigint
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    AS $retry_all$
#variable_conflict use_column
DECLARE
    n bigint;
BEGIN
    IF broker_id IS NULL THEN
        RAISE EXCEPTION 'amqp_outbox: broker_id must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    UPDATE amqp.message m SET parked_at = NULL, attempts = 0, next_attempt_at = NULL
     WHERE m.parked_at IS NOT NULL AND m.broker_id OPERATOR(pg_catalog.=) retry_all.broker_id;
    GET DIAGNOSTICS n = ROW_COUNT;
    NOTIFY amqp_outbox;
    RETURN n;
END
$retry_all$;

-- Removes a parked message for good, or cancels a delayed one, recording it in amqp.discarded
-- with who, when and why: as the install's owner (admins cannot insert into amqp.discarded,
-- they must not forge its rows), `by` being the calling role (amqp.discard() passes it).
CREATE FUNCTION amqp._discard(message_id bigint, reason text, by name) RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    AS $_discard$
#variable_conflict use_column
BEGIN
    IF message_id IS NULL THEN
        RAISE EXCEPTION 'amqp_outbox: message_id must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    -- Recorded as the role the caller acts as: one its session may become, nobody else.
    IF by IS NULL OR NOT pg_catalog.pg_has_role(session_user, by, 'MEMBER') THEN
        RAISE EXCEPTION 'amqp_outbox: discarded_by must be a role this session may act as'
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    WITH gone AS (DELETE FROM amqp.message m
                   WHERE m.parked_at IS NOT NULL AND m.id OPERATOR(pg_catalog.=) _discard.message_id
                  RETURNING m.*)
    INSERT INTO amqp.discarded (id, producer_pid, producer_started_at, broker_id, exchange,
                                routing_key, body, delivery_mode, content_type, reply_to,
                                correlation_id, headers, created_at, attempts, next_attempt_at,
                                last_error, parked_at, message_id, business_type, business_key,
                                traceparent, system_id, host_id, resends, discarded_at,
                                discarded_by, reason)
    SELECT id, producer_pid, producer_started_at, broker_id, exchange, routing_key, body,
           delivery_mode, content_type, reply_to, correlation_id, headers, created_at, attempts,
           next_attempt_at, last_error, parked_at, gone.message_id, business_type, business_key,
           traceparent, system_id, host_id, resends, pg_catalog.now(), _discard.by, _discard.reason
      FROM gone;
    IF NOT FOUND THEN
        WITH gone AS (DELETE FROM amqp.scheduled_message s
                       WHERE s.id OPERATOR(pg_catalog.=) _discard.message_id RETURNING s.*)
        INSERT INTO amqp.discarded (id, producer_pid, producer_started_at, broker_id, exchange,
                                    routing_key, body, delivery_mode, content_type, reply_to,
                                    correlation_id, headers, created_at, attempts,
                                    next_attempt_at, last_error, parked_at, message_id,
                                    business_type, business_key, traceparent, system_id,
                                    host_id, resends, discarded_at, discarded_by, reason)
        SELECT id, producer_pid, producer_started_at, broker_id, exchange, routing_key, body,
               delivery_mode, content_type, reply_to, correlation_id, headers, created_at,
               attempts, next_attempt_at, last_error, parked_at, gone.message_id, business_type,
               business_key, traceparent, system_id, host_id, resends, pg_catalog.now(),
               _discard.by, _discard.reason
          FROM gone;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'amqp_outbox: message % is neither parked nor scheduled', message_id
                USING ERRCODE = 'object_not_in_prerequisite_state';
        END IF;
    END IF;
    RETURN true;
END
$_discard$;

CREATE FUNCTION amqp.discard(message_id bigint, reason text DEFAULT NULL) RETURNS boolean
    LANGUAGE sql VOLATILE SET search_path = pg_catalog, pg_temp
    AS $discard$SELECT amqp._discard(message_id, reason, current_user)$discard$;

-- Declarations the relay makes on each connection, recorded transactionally (as the
-- extension's amqp.exchange_declare(), pg_amqp's signature).
CREATE FUNCTION amqp.exchange_declare(broker_id integer, exchange text, exchange_type text,
                                      passive boolean, durable boolean,
                                      auto_delete boolean DEFAULT false)
    RETURNS boolean
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
    AS $exchange_declare$
#variable_conflict use_column
DECLARE
    kind text := coalesce(exchange_type, 'direct');
BEGIN
    IF broker_id IS NULL THEN
        RAISE EXCEPTION 'amqp_outbox: broker_id must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF exchange IS NULL THEN
        RAISE EXCEPTION 'amqp_outbox: exchange must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF exchange OPERATOR(pg_catalog.=) '' THEN
        RAISE EXCEPTION 'amqp_outbox: the default exchange ("") cannot be declared'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF pg_catalog.octet_length(exchange) OPERATOR(pg_catalog.>) 255 THEN
        RAISE EXCEPTION 'amqp_outbox: exchange is % bytes long; AMQP allows at most 255',
                        pg_catalog.octet_length(exchange)
            USING ERRCODE = 'string_data_right_truncation';
    END IF;
    IF kind OPERATOR(pg_catalog.<>) ALL (ARRAY['direct', 'fanout', 'topic', 'headers']) THEN
        RAISE EXCEPTION 'amqp_outbox: invalid exchange type "%"; use direct, fanout, topic or headers', kind
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO amqp.exchange AS e (broker_id, exchange, exchange_type, passive, durable, auto_delete)
    SELECT exchange_declare.broker_id, exchange_declare.exchange, kind,
           coalesce(passive, false), coalesce(durable, true), coalesce(auto_delete, false)
     WHERE EXISTS (SELECT FROM amqp.broker b WHERE b.broker_id OPERATOR(pg_catalog.=) exchange_declare.broker_id)
    ON CONFLICT (broker_id, exchange) DO UPDATE
       SET exchange_type = excluded.exchange_type, passive = excluded.passive,
           durable = excluded.durable, auto_delete = excluded.auto_delete,
           declared_at = pg_catalog.now();
    IF NOT FOUND THEN
        RAISE EXCEPTION 'amqp_outbox: broker % does not exist in amqp.broker', broker_id
            USING ERRCODE = 'undefined_object';
    END IF;
    NOTIFY amqp_outbox, 'reload';
    RETURN true;
END
$exchange_declare$;

-- A queue or exchange name argument, checked as the extension checks it.
CREATE FUNCTION amqp._check_name(value text, what text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp
    AS $check_name$
BEGIN
    IF value IS NULL THEN
        RAISE EXCEPTION 'amqp_outbox: % must not be NULL', what USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF value OPERATOR(pg_catalog.=) '' THEN
        RAISE EXCEPTION 'amqp_outbox: % must not be empty', what USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF pg_catalog.octet_length(value) OPERATOR(pg_catalog.>) 255 THEN
        RAISE EXCEPTION 'amqp_outbox: % is % bytes long; AMQP allows at most 255', what,
                        pg_catalog.octet_length(value)
            USING ERRCODE = 'string_data_right_truncation';
    END IF;
END
$check_name$;

-- Queue or binding arguments, checked as the relay will send them: a JSON object whose values
-- AMQP can carry (the checks of message headers in sql/hosted/publish.sql, in the same order).
CREATE FUNCTION amqp._check_arguments(arguments jsonb) RETURNS jsonb
    LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp
    AS $check_arguments$
DECLARE
    why text;
BEGIN
    IF arguments IS NULL THEN
        RETURN '{}'::pg_catalog.jsonb;
    END IF;
    why := amqp._amqp_value_error(arguments);
    IF why IS NOT NULL THEN
        RAISE EXCEPTION 'amqp_outbox: invalid arguments: %', why USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF pg_catalog.jsonb_typeof(arguments) OPERATOR(pg_catalog.<>) 'object' THEN
        RAISE EXCEPTION 'amqp_outbox: arguments must be a JSON object' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    why := amqp._amqp_name_error(arguments);
    IF why IS NOT NULL THEN
        RAISE EXCEPTION 'amqp_outbox: invalid arguments: %', why USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN arguments;
END
$check_arguments$;

-- A queue the relay declares on every connection to the broker.
CREATE FUNCTION amqp.queue_declare(broker_id integer, queue text, durable boolean DEFAULT true,
                                   auto_delete boolean DEFAULT false,
                                   arguments jsonb DEFAULT NULL)
    RETURNS boolean
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
    AS $queue_declare$
#variable_conflict use_column
DECLARE
    args jsonb;
BEGIN
    IF broker_id IS NULL THEN
        RAISE EXCEPTION 'amqp_outbox: broker_id must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    PERFORM amqp._check_name(queue, 'queue');
    args := amqp._check_arguments(arguments);
    INSERT INTO amqp.queue AS q (broker_id, queue, durable, auto_delete, arguments)
    SELECT queue_declare.broker_id, queue_declare.queue, coalesce(durable, true),
           coalesce(auto_delete, false), args
     WHERE EXISTS (SELECT FROM amqp.broker b WHERE b.broker_id OPERATOR(pg_catalog.=) queue_declare.broker_id)
    ON CONFLICT (broker_id, queue) DO UPDATE
       SET durable = excluded.durable, auto_delete = excluded.auto_delete,
           arguments = excluded.arguments, declared_at = pg_catalog.now();
    IF NOT FOUND THEN
        RAISE EXCEPTION 'amqp_outbox: broker % does not exist in amqp.broker', broker_id
            USING ERRCODE = 'undefined_object';
    END IF;
    NOTIFY amqp_outbox, 'reload';
    RETURN true;
END
$queue_declare$;

-- A binding of queue to exchange the relay declares on every connection.
CREATE FUNCTION amqp.queue_bind(broker_id integer, queue text, exchange text,
                                routing_key text DEFAULT '', arguments jsonb DEFAULT NULL)
    RETURNS boolean
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
    AS $queue_bind$
#variable_conflict use_column
DECLARE
    key text := coalesce(routing_key, '');
    args jsonb;
BEGIN
    IF broker_id IS NULL THEN
        RAISE EXCEPTION 'amqp_outbox: broker_id must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    PERFORM amqp._check_name(queue, 'queue');
    PERFORM amqp._check_name(exchange, 'exchange');
    IF pg_catalog.octet_length(key) OPERATOR(pg_catalog.>) 255 THEN
        RAISE EXCEPTION 'amqp_outbox: routing_key is % bytes long; AMQP allows at most 255',
                        pg_catalog.octet_length(key)
            USING ERRCODE = 'string_data_right_truncation';
    END IF;
    args := amqp._check_arguments(arguments);
    INSERT INTO amqp.binding AS bd (broker_id, queue, exchange, routing_key, arguments)
    SELECT queue_bind.broker_id, queue_bind.queue, queue_bind.exchange, key, args
     WHERE EXISTS (SELECT FROM amqp.broker b WHERE b.broker_id OPERATOR(pg_catalog.=) queue_bind.broker_id)
    ON CONFLICT (broker_id, queue, exchange, routing_key) DO UPDATE
       SET arguments = excluded.arguments, declared_at = pg_catalog.now();
    IF NOT FOUND THEN
        RAISE EXCEPTION 'amqp_outbox: broker % does not exist in amqp.broker', broker_id
            USING ERRCODE = 'undefined_object';
    END IF;
    NOTIFY amqp_outbox, 'reload';
    RETURN true;
END
$queue_bind$;

-- Waits until the standbys named by amqp_outbox.standby_names (a comma list of their
-- application_name, * for every standby connected and at least one; this server's own
-- cluster_name ignored) have flushed the WAL this session has written so far.
CREATE FUNCTION amqp.wait_for_standbys(timeout interval DEFAULT '10 seconds') RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    AS $wait_for_standbys$
DECLARE
    own text := coalesce(pg_catalog.current_setting('cluster_name', true), '');
    names text[];
    target pg_catalog.pg_lsn;
    deadline timestamptz;
    flushed pg_catalog.pg_lsn;
BEGIN
    IF timeout IS NULL THEN
        RAISE EXCEPTION 'amqp_outbox: timeout must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF timeout OPERATOR(pg_catalog.<) '0'::interval THEN
        RAISE EXCEPTION 'amqp_outbox: timeout must not be negative' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT pg_catalog.array_agg(n) INTO names
      FROM (SELECT pg_catalog.btrim(item) AS n
              FROM pg_catalog.unnest(pg_catalog.string_to_array(
                       coalesce(pg_catalog.current_setting('amqp_outbox.standby_names', true), ''), ',')) item) s
     WHERE n OPERATOR(pg_catalog.<>) '' AND (own OPERATOR(pg_catalog.=) '' OR n OPERATOR(pg_catalog.<>) own);
    IF names IS NULL THEN
        RETURN true;
    END IF;
    target := pg_catalog.pg_current_wal_lsn();
    deadline := pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) timeout;
    LOOP
        IF '*' OPERATOR(pg_catalog.=) ANY (names) THEN
            SELECT pg_catalog.min(r.flush_lsn) INTO flushed FROM pg_catalog.pg_stat_replication r;
        ELSE
            -- Each name's furthest walsender; NULL when one is not connected.
            SELECT CASE WHEN pg_catalog.count(f.lsn) OPERATOR(pg_catalog.=) pg_catalog.cardinality(names)
                        THEN pg_catalog.min(f.lsn) END
              INTO flushed
              FROM (SELECT (SELECT pg_catalog.max(r.flush_lsn) FROM pg_catalog.pg_stat_replication r
                             WHERE r.application_name OPERATOR(pg_catalog.=) n) AS lsn
                      FROM pg_catalog.unnest(names) n) f;
        END IF;
        IF flushed OPERATOR(pg_catalog.>=) target THEN
            RETURN true;
        END IF;
        IF pg_catalog.clock_timestamp() OPERATOR(pg_catalog.>=) deadline THEN
            RETURN false;
        END IF;
        PERFORM pg_catalog.pg_sleep(0.001);
    END LOOP;
END
$wait_for_standbys$;
