-- amqp_outbox: objects that need the functions defined by pgrx.

-- Direct INSERTs into amqp.message get the producer key of the inserting session too.
ALTER TABLE @extschema@.message
    ALTER COLUMN producer_started_at SET DEFAULT @extschema@._producer_started_at(),
    ALTER COLUMN message_id SET DEFAULT @extschema@._new_message_id();
ALTER TABLE @extschema@.scheduled_message
    ALTER COLUMN producer_started_at SET DEFAULT @extschema@._producer_started_at(),
    ALTER COLUMN message_id SET DEFAULT @extschema@._new_message_id();

-- The worker re-reads brokers and declarations after a transaction that changes them commits.
CREATE TRIGGER broker_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON @extschema@.broker
    FOR EACH STATEMENT EXECUTE FUNCTION @extschema@._config_changed();
CREATE TRIGGER exchange_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON @extschema@.exchange
    FOR EACH STATEMENT EXECUTE FUNCTION @extschema@._config_changed();
CREATE TRIGGER queue_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON @extschema@.queue
    FOR EACH STATEMENT EXECUTE FUNCTION @extschema@._config_changed();
CREATE TRIGGER binding_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON @extschema@.binding
    FOR EACH STATEMENT EXECUTE FUNCTION @extschema@._config_changed();
-- ... the outbox worker learns when the earliest delayed message is due (a publish, a restore, an
-- admin's UPDATE of deliver_at) ...
CREATE TRIGGER scheduled_changed AFTER INSERT OR UPDATE ON @extschema@.scheduled_message
    FOR EACH STATEMENT EXECUTE FUNCTION @extschema@._scheduled_changed();
-- ... and the subscription worker re-reads its subscriptions.
CREATE TRIGGER subscription_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON @extschema@.subscription
    FOR EACH STATEMENT EXECUTE FUNCTION @extschema@._config_changed();

-- A failed INSERT or UPDATE of amqp.broker would report the whole row ("Failing row contains
-- ...") to the client and into the server log, password included, even a stored one the
-- statement did not name. This trigger checks the NOT NULL columns and the CHECK constraints
-- first and raises the same errors (same SQLSTATE, constraint and column) without the row.
CREATE FUNCTION @extschema@._broker_check() RETURNS trigger
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $check$
DECLARE
    null_column text := CASE WHEN NEW.broker_id IS NULL THEN 'broker_id'
                             WHEN NEW.host IS NULL THEN 'host'
                             WHEN NEW.port IS NULL THEN 'port'
                             WHEN NEW.vhost IS NULL THEN 'vhost'
                             WHEN NEW.username IS NULL THEN 'username'
                             WHEN NEW.password IS NULL THEN 'password'
                             WHEN NEW.proof IS NULL THEN 'proof'
                             WHEN NEW.tls IS NULL THEN 'tls' END;
    failed text := CASE WHEN NEW.host = '' THEN 'broker_host_not_empty'
                        WHEN NEW.port NOT BETWEEN 1 AND 65535 THEN 'broker_port_range'
                        WHEN NEW.proof NOT IN ('ack_queue', 'confirm') THEN 'broker_proof_valid'
                        WHEN (NEW.tls_cert_file IS NULL) <> (NEW.tls_key_file IS NULL)
                            THEN 'broker_tls_client_pair' END;
BEGIN
    IF null_column IS NOT NULL THEN
        RAISE EXCEPTION 'null value in column "%" of relation "broker" violates not-null constraint',
                        null_column
            USING ERRCODE = 'not_null_violation', SCHEMA = 'amqp', TABLE = 'broker',
                  COLUMN = null_column;
    END IF;
    IF failed IS NOT NULL THEN
        RAISE EXCEPTION 'new row for relation "broker" violates check constraint "%"', failed
            USING ERRCODE = 'check_violation', SCHEMA = 'amqp', TABLE = 'broker',
                  CONSTRAINT = failed;
    END IF;
    RETURN NEW;
END
$check$;
CREATE TRIGGER broker_check BEFORE INSERT OR UPDATE ON @extschema@.broker
    FOR EACH ROW EXECUTE FUNCTION @extschema@._broker_check();

-- Views for DBAs. Readable by pg_monitor; they show no secrets.
CREATE VIEW @extschema@.worker_status AS
    SELECT s.worker_pid, s.published, s.confirmed, s.acknowledged, s.resent_lost,
           s.resent_timeout, s.failed, s.parked, s.ack_queue, s.steps, s.commit_wakeups,
           s.subscription_worker_pid, s.monitor_pid, d.datname::text AS database, s.state
      FROM @extschema@._worker_status() s
      LEFT JOIN pg_catalog.pg_database d ON d.oid OPERATOR(pg_catalog.=) s.database_oid
     ORDER BY d.datname;
COMMENT ON VIEW @extschema@.worker_status IS
    'One row per database the launcher serves or cannot serve, and one for this database: state (running, starting, paused, not served: why), the workers'' pids, and the outbox worker''s counters since the database got its workers.';

-- Workers serve the databases amqp_outbox.database allows: say so where it does not.
DO $served$
BEGIN
    IF NOT @extschema@._serves_this_database() THEN
        RAISE WARNING 'amqp_outbox: no worker serves database "%" (amqp_outbox.database = ''%''): messages published here wait until it is served',
                      pg_catalog.current_database(), pg_catalog.current_setting('amqp_outbox.database', true)
            USING HINT = 'Add this database to amqp_outbox.database in postgresql.conf and reload the configuration.';
    END IF;
END
$served$;

CREATE VIEW @extschema@.broker_status AS
    SELECT * FROM @extschema@._broker_status();
COMMENT ON VIEW @extschema@.broker_status IS
    'Each broker''s connection as the worker sees it: connected host, channel number, since when, messages awaiting a confirm, last error.';

CREATE VIEW @extschema@.outbox_summary AS
    SELECT broker_id, exchange,
           pg_catalog.count(*) FILTER (WHERE parked_at IS NULL) AS pending,
           pg_catalog.count(*) FILTER (WHERE parked_at IS NOT NULL) AS parked,
           pg_catalog.count(*) FILTER (WHERE attempts OPERATOR(pg_catalog.>) 0 AND parked_at IS NULL) AS retrying,
           pg_catalog.min(created_at) FILTER (WHERE parked_at IS NULL) AS oldest_pending_at,
           pg_catalog.now() OPERATOR(pg_catalog.-) pg_catalog.min(created_at) FILTER (WHERE parked_at IS NULL) AS oldest_pending_age
      FROM @extschema@.message
     GROUP BY broker_id, exchange;
COMMENT ON VIEW @extschema@.outbox_summary IS
    'Messages waiting in the outbox per broker and exchange, with the age of the oldest.';

CREATE VIEW @extschema@.message_status AS
    SELECT m.id, m.broker_id, m.exchange, m.routing_key,
           CASE WHEN m.parked_at IS NOT NULL THEN 'parked'
                WHEN f.confirmed THEN 'awaiting_ack'
                WHEN f.id IS NOT NULL THEN 'in_flight'
                WHEN m.next_attempt_at OPERATOR(pg_catalog.>) pg_catalog.now() THEN 'retry_wait'
                ELSE 'pending' END AS state,
           m.attempts, m.created_at, m.next_attempt_at, m.parked_at, m.last_error,
           m.producer_pid, m.producer_started_at, m.message_id, NULL::timestamptz AS deliver_at
      FROM @extschema@.message m
      LEFT JOIN @extschema@._in_flight() f ON f.id OPERATOR(pg_catalog.=) m.id
    UNION ALL
    SELECT s.id, s.broker_id, s.exchange, s.routing_key, 'scheduled', s.attempts, s.created_at,
           s.next_attempt_at, s.parked_at, s.last_error, s.producer_pid, s.producer_started_at,
           s.message_id, s.deliver_at
      FROM @extschema@.scheduled_message s;
COMMENT ON VIEW @extschema@.message_status IS
    'Each message in the outbox and its delivery state: pending, in_flight (published, not confirmed), awaiting_ack (confirmed, acknowledgement record not seen yet), retry_wait, parked, scheduled (published with a deliver_after, not due yet: in amqp.scheduled_message).';

GRANT SELECT ON @extschema@.worker_status, @extschema@.broker_status, @extschema@.outbox_summary,
                @extschema@.message_status TO pg_monitor;
GRANT USAGE ON SCHEMA @extschema@ TO pg_monitor;

-- Privileges. PUBLIC gets nothing. Two roles, created when missing (roles belong to the
-- cluster, so DROP EXTENSION leaves them):
--   amqp_outbox_publisher  may publish (without any right on the tables)
--   amqp_outbox_admin      may also manage brokers, declarations and parked messages, and read
--                          everything, broker passwords included
-- pg_monitor may read the status views.
DO $roles$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname OPERATOR(pg_catalog.=) 'amqp_outbox_publisher') THEN
        CREATE ROLE amqp_outbox_publisher NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname OPERATOR(pg_catalog.=) 'amqp_outbox_admin') THEN
        CREATE ROLE amqp_outbox_admin NOLOGIN;
    END IF;
END
$roles$;
GRANT amqp_outbox_publisher TO amqp_outbox_admin;

REVOKE ALL ON ALL FUNCTIONS IN SCHEMA @extschema@ FROM PUBLIC;
-- The CHECK of amqp.message calls it as whoever writes a row (a role a DBA granted UPDATE
-- too); it only tests its arguments.
GRANT EXECUTE ON FUNCTION @extschema@._message_valid(text, text, text, text, text, smallint, jsonb, text)
    TO PUBLIC;
GRANT USAGE ON SCHEMA @extschema@ TO amqp_outbox_publisher, amqp_outbox_admin;

GRANT EXECUTE ON FUNCTION
    @extschema@.publish(integer, text, text, text, integer, text, text, text),
    @extschema@.publish_message(integer, text, text, text, jsonb, integer, text, text, text, text, text, text, interval, text),
    @extschema@.publish_bytes(integer, text, text, bytea, jsonb, integer, text, text, text, text, text, text, interval, text),
    @extschema@.last_message_id(),
    @extschema@.autonomous_publish(integer, text, text, text, integer, text, text, text)
    TO amqp_outbox_publisher;

-- After its own COMMIT, a session that acknowledges to RabbitMQ itself waits for the standbys.
GRANT EXECUTE ON FUNCTION @extschema@.wait_for_standbys(interval)
    TO amqp_outbox_publisher, amqp_outbox_consumer;
COMMENT ON FUNCTION @extschema@.wait_for_standbys(interval) IS
    'Waits until the standbys named by amqp_outbox.standby_names have flushed this session''s last commit: true when they have (at once when the setting is empty or nothing was committed), false when the timeout ran out. Call it after COMMIT and before acknowledging a message to the broker.';

GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA @extschema@ TO amqp_outbox_admin;
-- Not the subscription worker's own recording of consumption (see consume_once.sql).
REVOKE EXECUTE ON FUNCTION @extschema@._consume(text, text, text) FROM amqp_outbox_admin;
GRANT SELECT, INSERT, UPDATE, DELETE ON @extschema@.broker, @extschema@.exchange,
    @extschema@.queue, @extschema@.binding TO amqp_outbox_admin;
GRANT SELECT, UPDATE, DELETE ON @extschema@.message TO amqp_outbox_admin;
GRANT SELECT ON @extschema@.discarded TO amqp_outbox_admin;
GRANT SELECT ON @extschema@.worker_status, @extschema@.broker_status, @extschema@.outbox_summary,
    @extschema@.message_status TO amqp_outbox_admin;

-- The views call these; callers of a view need EXECUTE on the functions it calls.
GRANT EXECUTE ON FUNCTION @extschema@._worker_status(), @extschema@._broker_status(),
    @extschema@._in_flight(), @extschema@._serves_this_database() TO pg_monitor;
