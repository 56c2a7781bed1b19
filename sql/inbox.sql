-- amqp_outbox: the consuming side. consume_once() and the subscriptions' exactly-once record,
-- its retention, subscriptions, failed deliveries, receipts.
-- Included in the install script (after the Rust functions).

-- What a subscription's handler receives, one message.
CREATE TYPE @extschema@.delivery AS (
    subscription text,
    message_id text,
    exchange text,
    routing_key text,
    body bytea,
    headers jsonb,
    content_type text,
    correlation_id text,
    reply_to text,
    redelivered boolean,
    delivery_tag bigint,
    "timestamp" timestamptz,
    attempt integer,
    user_id text
);
COMMENT ON TYPE @extschema@.delivery IS
    'One consumed message as a subscription handler receives it. attempt is 1 on the first try, more on retries from amqp.inbox_failed; user_id is the AMQP property, which RabbitMQ checks against the publisher''s user.';

CREATE FUNCTION @extschema@.body_text(d @extschema@.delivery) RETURNS text
    LANGUAGE plpgsql STABLE PARALLEL SAFE AS $body_text$
BEGIN
    RETURN pg_catalog.convert_from(d.body, 'UTF8');
EXCEPTION WHEN character_not_in_repertoire OR untranslatable_character THEN
    RAISE EXCEPTION 'amqp_outbox: the body of message % is not valid UTF-8 text', d.message_id
        USING ERRCODE = 'character_not_in_repertoire',
              DETAIL = SQLERRM,
              HINT = 'Read the body as bytea (d.body), or decode it with convert_from() and its real encoding.';
END
$body_text$;
COMMENT ON FUNCTION @extschema@.body_text(@extschema@.delivery) IS
    'The delivery''s body as text (UTF-8); SQLSTATE 22021 when it is not valid UTF-8.';

-- The exactly-once record. Two hot tables with the same unique keys; every record goes into
-- both. Retention never deletes rows: when the younger table has covered the whole window, the
-- older one's records that only it holds are copied to the archive and it is TRUNCATEd, to
-- start again. So a record stays in a unique index for at least amqp_outbox.dedup_window, and
-- two sessions racing on one key always meet in one index (INSERT ... ON CONFLICT waits for
-- the other's commit or rollback).
CREATE TABLE @extschema@._consumed_a (
    consumer text NOT NULL,
    message_id text NOT NULL,
    business_key text,
    consumed_at timestamptz NOT NULL DEFAULT pg_catalog.now(),
    PRIMARY KEY (consumer, message_id)
);
CREATE UNIQUE INDEX _consumed_a_business_key ON @extschema@._consumed_a (consumer, business_key)
    WHERE business_key IS NOT NULL;
CREATE TABLE @extschema@._consumed_b (LIKE @extschema@._consumed_a INCLUDING ALL);
COMMENT ON TABLE @extschema@._consumed_a IS
    'Consumption records (hot, one of two): see amqp.consumption and amqp.rotate_consumption().';
COMMENT ON TABLE @extschema@._consumed_b IS
    'Consumption records (hot, one of two): see amqp.consumption and amqp.rotate_consumption().';

-- When each hot table was last emptied: it holds every record made since. Not dumped: a
-- restored database starts both at the restore, which only keeps records hot longer.
CREATE TABLE @extschema@._consumed_since (
    hot text PRIMARY KEY CHECK (hot IN ('a', 'b')),
    since timestamptz NOT NULL
);
INSERT INTO @extschema@._consumed_since VALUES ('a', pg_catalog.now()), ('b', pg_catalog.now());

-- Records past the window, kept until amqp_outbox.dedup_retention: one partition per day
-- (UTC), dropped whole. No unique index: they are never inserted twice (see rotate). Each day
-- gets its own lookup index (made with it), not one on the parent: a partitioned index of the
-- extension would make pg_dump's copy of a day's index collide with the one ATTACH creates.
CREATE TABLE @extschema@.consumption_archive (
    consumer text NOT NULL,
    message_id text NOT NULL,
    business_key text,
    consumed_at timestamptz NOT NULL
) PARTITION BY RANGE (consumed_at);
COMMENT ON TABLE @extschema@.consumption_archive IS
    'Consumption records older than amqp_outbox.dedup_window, one partition per day (UTC), dropped after amqp_outbox.dedup_retention.';

CREATE VIEW @extschema@.consumption AS
    SELECT consumer, message_id, business_key, consumed_at, 'hot' AS storage
      FROM @extschema@._consumed_a
    UNION
    SELECT consumer, message_id, business_key, consumed_at, 'hot'
      FROM @extschema@._consumed_b
    UNION ALL
    SELECT consumer, message_id, business_key, consumed_at, 'archive'
      FROM @extschema@.consumption_archive;
COMMENT ON VIEW @extschema@.consumption IS
    'Every consumption record: hot (within the window, unique) and archived.';

-- The creation time a UUIDv7 message_id carries (amqp_outbox's own ids are UUIDv7), else NULL
-- (NULL for NULL too). Not STRICT: PostgreSQL inlines a SQL function into the statement that
-- calls it only if a STRICT one's body is strict too, and a CASE is not. Called, it is parsed and
-- planned again in every transaction and subtransaction (each message a subscription handles).
CREATE FUNCTION @extschema@._uuid7_time(message_id text) RETURNS timestamptz
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $uuid7$
    SELECT CASE WHEN message_id OPERATOR(pg_catalog.~) '^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$'
        THEN pg_catalog.to_timestamp(
            (('x' OPERATOR(pg_catalog.||) pg_catalog.substr(pg_catalog.replace(message_id, '-', ''), 1, 12))::pg_catalog.bit(48)::pg_catalog.int8)::pg_catalog.float8
            OPERATOR(pg_catalog./) 1000) END
$uuid7$;

-- Moves the older hot table's own records to the archive and empties it, once the younger one
-- covers the whole window; drops archive days past the retention. Run by the subscription
-- worker about once a minute; callable by hand. Returns what it did.
CREATE FUNCTION @extschema@.rotate_consumption() RETURNS text
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $rotate$
DECLARE
    win interval := pg_catalog.current_setting('amqp_outbox.dedup_window') :: interval;
    keep interval := pg_catalog.current_setting('amqp_outbox.dedup_retention') :: interval;
    older text;
    younger_since timestamptz;
    moved bigint := 0;
    day date;
    part text;
    dropped integer := 0;
BEGIN
    -- One rotation at a time.
    PERFORM FROM @extschema@._consumed_since FOR UPDATE;
    SELECT s.hot INTO older FROM @extschema@._consumed_since s ORDER BY s.since, s.hot LIMIT 1;
    SELECT s.since INTO younger_since FROM @extschema@._consumed_since s WHERE s.hot <> older;
    IF younger_since <= pg_catalog.now() - win THEN
        -- The records only the older table holds were all committed before the younger one was
        -- emptied: copy them without blocking consumers.
        FOR day IN EXECUTE pg_catalog.format(
                'SELECT DISTINCT (o.consumed_at AT TIME ZONE ''UTC'')::date FROM @extschema@.%I o
                  WHERE NOT EXISTS (SELECT FROM @extschema@.%I y
                                     WHERE y.consumer = o.consumer AND y.message_id = o.message_id)',
                '_consumed_' || older, '_consumed_' || CASE older WHEN 'a' THEN 'b' ELSE 'a' END) LOOP
            PERFORM @extschema@._archive_day(day);
        END LOOP;
        EXECUTE pg_catalog.format(
            'INSERT INTO @extschema@.consumption_archive (consumer, message_id, business_key, consumed_at)
             SELECT o.consumer, o.message_id, o.business_key, o.consumed_at FROM @extschema@.%I o
              WHERE NOT EXISTS (SELECT FROM @extschema@.%I y
                                 WHERE y.consumer = o.consumer AND y.message_id = o.message_id)',
            '_consumed_' || older, '_consumed_' || CASE older WHEN 'a' THEN 'b' ELSE 'a' END);
        GET DIAGNOSTICS moved = ROW_COUNT;
        -- A short exclusive lock: consumers wait for it, and every record of the window stays
        -- in the younger table meanwhile.
        EXECUTE pg_catalog.format('TRUNCATE @extschema@.%I', '_consumed_' || older);
        UPDATE @extschema@._consumed_since SET since = pg_catalog.clock_timestamp() WHERE hot = older;
    END IF;
    FOR part IN
        SELECT c.relname FROM pg_catalog.pg_inherits i
          JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent = '@extschema@.consumption_archive'::regclass
           AND c.relname ~ '^consumption_archive_[0-9]{8}$'
           AND pg_catalog.to_date(pg_catalog.right(c.relname, 8), 'YYYYMMDD')
               < ((pg_catalog.now() - keep) AT TIME ZONE 'UTC')::date
    LOOP
        EXECUTE pg_catalog.format('DROP TABLE @extschema@.%I', part);
        dropped := dropped + 1;
    END LOOP;
    RETURN CASE WHEN younger_since <= pg_catalog.now() - win
                THEN pg_catalog.format('rotated: %s records archived, hot table %s emptied', moved, older)
                ELSE 'not due' END
           || pg_catalog.format('; %s archive days dropped', dropped);
END
$rotate$;
COMMENT ON FUNCTION @extschema@.rotate_consumption() IS
    'Retention of consumption records without DELETE: archives and truncates the older hot table once the window has passed, drops archive days past amqp_outbox.dedup_retention. The subscription worker runs it; safe to call by hand.';

CREATE FUNCTION @extschema@._archive_day(day date) RETURNS void
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $archive_day$
BEGIN
    EXECUTE pg_catalog.format(
        'CREATE TABLE IF NOT EXISTS @extschema@.%I PARTITION OF @extschema@.consumption_archive
             FOR VALUES FROM (%L) TO (%L)',
        'consumption_archive_' || pg_catalog.to_char(day, 'YYYYMMDD'),
        (day::timestamp AT TIME ZONE 'UTC'), ((day + 1)::timestamp AT TIME ZONE 'UTC'));
    EXECUTE pg_catalog.format(
        'CREATE INDEX IF NOT EXISTS %I ON @extschema@.%I (consumer, message_id)',
        'consumption_archive_' || pg_catalog.to_char(day, 'YYYYMMDD') || '_key',
        'consumption_archive_' || pg_catalog.to_char(day, 'YYYYMMDD'));
END
$archive_day$;

-- Subscriptions: queues the subscription worker consumes, each message handled by a SQL
-- function in the same transaction as its consumption record.
CREATE TABLE @extschema@.subscription (
    subscription text PRIMARY KEY,
    broker_id integer NOT NULL,
    queue text NOT NULL,
    -- The function, by name: amqp._handler_name() (runs_as.sql) says why.
    handler text NOT NULL,
    prefetch integer NOT NULL DEFAULT 100,
    max_attempts integer NOT NULL DEFAULT 10,
    dead_letter_exchange text,
    -- The handler runs with this role's rights (who subscribed), never the worker's.
    owner regrole NOT NULL DEFAULT CURRENT_USER::regrole,
    paused boolean NOT NULL DEFAULT false,
    created_at timestamptz NOT NULL DEFAULT pg_catalog.now(),
    -- Messages in progress at once, each in its own transaction (lanes: worker processes).
    parallelism integer NOT NULL DEFAULT 1,
    -- 'none', 'business_key' (the x-amqp-outbox-business-key header) or 'header:<name>':
    -- messages with the same key are handled one after another, in the order they arrived.
    ordering text NOT NULL DEFAULT 'none',
    CONSTRAINT subscription_name_valid CHECK (subscription <> '' AND pg_catalog.octet_length(subscription) <= 200),
    CONSTRAINT subscription_queue_valid CHECK (queue <> '' AND pg_catalog.octet_length(queue) <= 255),
    CONSTRAINT subscription_prefetch_range CHECK (prefetch BETWEEN 1 AND 65535),
    CONSTRAINT subscription_max_attempts_range CHECK (max_attempts BETWEEN 1 AND 1000000),
    CONSTRAINT subscription_dead_letter_exchange_valid
        CHECK (dead_letter_exchange <> '' AND pg_catalog.octet_length(dead_letter_exchange) <= 255),
    CONSTRAINT subscription_parallelism_range CHECK (parallelism BETWEEN 1 AND 16),
    CONSTRAINT subscription_ordering_valid CHECK (ordering IN ('none', 'business_key')
        OR (ordering LIKE 'header:%' AND pg_catalog.octet_length(ordering) BETWEEN 8 AND 262))
);
COMMENT ON TABLE @extschema@.subscription IS
    'Queues consumed by the subscription worker (amqp.subscribe()); each message is handled by handler(amqp.delivery) exactly once.';

-- What the subscription worker last saw; not dumped (it starts again from zero).
CREATE TABLE @extschema@._subscription_state (
    subscription text PRIMARY KEY,
    connected boolean NOT NULL DEFAULT false,
    host text,
    state_since timestamptz NOT NULL DEFAULT pg_catalog.now(),
    delivered bigint NOT NULL DEFAULT 0,
    handled bigint NOT NULL DEFAULT 0,
    duplicates bigint NOT NULL DEFAULT 0,
    failed bigint NOT NULL DEFAULT 0,
    dead_lettered bigint NOT NULL DEFAULT 0,
    last_error text,
    last_error_at timestamptz,
    queue_ready bigint,
    queue_consumers integer,
    queue_seen_at timestamptz,
    last_handled_at timestamptz,
    -- Every message in the queue before this time has been handled (the queue was seen empty
    -- then, and what had come in was handled since): how far receipts are collected.
    caught_up_at timestamptz
);

-- Messages whose handler failed: kept with their body and headers until a retry succeeds (then
-- removed) — never lost. Retried with the product's backoff up to the subscription's
-- max_attempts; then dead-lettered (dead_lettered_at) and kept until amqp.inbox_retry().
CREATE TABLE @extschema@.inbox_failed (
    id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    subscription text NOT NULL,
    message_id text NOT NULL,
    exchange text NOT NULL,
    routing_key text NOT NULL,
    body bytea NOT NULL,
    headers jsonb,
    content_type text,
    correlation_id text,
    reply_to text,
    "timestamp" timestamptz,
    attempts integer NOT NULL DEFAULT 1,
    first_failed_at timestamptz NOT NULL DEFAULT pg_catalog.now(),
    last_failed_at timestamptz NOT NULL DEFAULT pg_catalog.now(),
    next_attempt_at timestamptz,
    last_error text NOT NULL,
    last_sqlstate text,
    dead_lettered_at timestamptz,
    user_id text,
    -- The message's key under its subscription's ordering: while it is here and not dead, later
    -- messages with the same key wait (amqp.inbox_waiting).
    ordering_key text,
    UNIQUE (subscription, message_id)
);
COMMENT ON TABLE @extschema@.inbox_failed IS
    'Consumed messages whose handler failed: retried with backoff, dead-lettered after max_attempts, removed once handled. Never lost.';
CREATE INDEX inbox_failed_due ON @extschema@.inbox_failed (next_attempt_at)
    WHERE dead_lettered_at IS NULL;
CREATE INDEX inbox_failed_blocking ON @extschema@.inbox_failed (subscription, ordering_key)
    WHERE ordering_key IS NOT NULL AND dead_lettered_at IS NULL;

-- Messages of subscriptions with lanes (parallelism above 1, or an ordering), taken from the
-- queue and waiting for a lane. The broker keeps each unacknowledged until its row is gone
-- (handled, a duplicate, or moved to amqp.inbox_failed), so this table is at most prefetch
-- rows per subscription and is not dumped: what it holds is still in the queue.
CREATE TABLE @extschema@.inbox_waiting (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    subscription text NOT NULL,
    message_id text NOT NULL,
    ordering_key text,
    exchange text NOT NULL,
    routing_key text NOT NULL,
    body bytea NOT NULL,
    headers jsonb,
    content_type text,
    correlation_id text,
    reply_to text,
    "timestamp" timestamptz,
    user_id text,
    redelivered boolean NOT NULL DEFAULT false,
    received_at timestamptz NOT NULL DEFAULT pg_catalog.now(),
    -- Its handler ended the lane that ran it (1: past the hard timeout, 2: terminated): it is
    -- recorded as failed instead of run again.
    ended smallint,
    UNIQUE (subscription, message_id)
);
COMMENT ON TABLE @extschema@.inbox_waiting IS
    'Messages of subscriptions with lanes (parallelism, ordering) received and waiting for a lane; still unacknowledged in the queue until handled.';
CREATE INDEX inbox_waiting_key ON @extschema@.inbox_waiting (subscription, ordering_key, id)
    WHERE ordering_key IS NOT NULL;

CREATE FUNCTION @extschema@._subscription_or_raise(name text) RETURNS void
    LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $find$
BEGIN
    IF name IS NULL THEN
        RAISE EXCEPTION 'amqp_outbox: subscription must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF NOT EXISTS (SELECT FROM @extschema@.subscription s WHERE s.subscription = name) THEN
        RAISE EXCEPTION 'amqp_outbox: subscription "%" does not exist', name
            USING ERRCODE = 'undefined_object';
    END IF;
END
$find$;

CREATE FUNCTION @extschema@.pause_subscription(subscription text) RETURNS void
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $pause$
BEGIN
    PERFORM @extschema@._subscription_or_raise(subscription);
    UPDATE @extschema@.subscription s SET paused = true WHERE s.subscription = pause_subscription.subscription;
END
$pause$;
COMMENT ON FUNCTION @extschema@.pause_subscription(text) IS
    'Stops consuming until resume_subscription(); unacknowledged messages go back to the queue.';

CREATE FUNCTION @extschema@.resume_subscription(subscription text) RETURNS void
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $resume$
BEGIN
    PERFORM @extschema@._subscription_or_raise(subscription);
    UPDATE @extschema@.subscription s SET paused = false WHERE s.subscription = resume_subscription.subscription;
END
$resume$;
COMMENT ON FUNCTION @extschema@.resume_subscription(text) IS 'Consumes again after pause_subscription().';

CREATE FUNCTION @extschema@.inbox_retry(subscription text DEFAULT NULL, message_id text DEFAULT NULL)
    RETURNS bigint LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $retry$
DECLARE
    n bigint;
BEGIN
    IF subscription IS NOT NULL THEN
        PERFORM @extschema@._subscription_or_raise(subscription);
    END IF;
    UPDATE @extschema@.inbox_failed f
       SET dead_lettered_at = NULL, attempts = 0, next_attempt_at = pg_catalog.now()
     WHERE (inbox_retry.subscription IS NULL OR f.subscription = inbox_retry.subscription)
       AND (inbox_retry.message_id IS NULL OR f.message_id = inbox_retry.message_id);
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$retry$;
COMMENT ON FUNCTION @extschema@.inbox_retry(text, text) IS
    'Retries failed messages now (all, one subscription''s, or one message), dead-lettered ones included, with a fresh count of attempts. Returns how many.';

-- A receipt: published through the outbox, so it leaves if and only if the transaction that
-- calls this commits. Routing key: the consumer.
CREATE FUNCTION @extschema@.send_receipt(broker_id integer, consumer text, message_id text,
                                         ok boolean DEFAULT true, error text DEFAULT NULL)
    RETURNS boolean LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $receipt$
DECLARE
    exchange text := pg_catalog.current_setting('amqp_outbox.receipts_exchange', true);
BEGIN
    IF exchange IS NULL OR exchange = '' THEN
        RETURN false;
    END IF;
    IF consumer IS NULL OR message_id IS NULL OR ok IS NULL THEN
        RAISE EXCEPTION 'amqp_outbox: consumer, message_id and ok must not be NULL'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    PERFORM @extschema@.publish_message(
        broker_id, exchange, consumer,
        pg_catalog.jsonb_build_object('v', 1, 'message_id', message_id, 'consumer', consumer,
                                      'status', CASE WHEN ok THEN 'ok' ELSE 'failed' END,
                                      'error', error, 'at', pg_catalog.now())::text,
        pg_catalog.jsonb_build_object('x-amqp-outbox-receipt-for', message_id),
        2, 'application/json');
    RETURN true;
END
$receipt$;
COMMENT ON FUNCTION @extschema@.send_receipt(integer, text, text, boolean, text) IS
    'Publishes a receipt (message_id, consumer, ok or failed with error, when) to amqp_outbox.receipts_exchange through the outbox: sent if and only if this transaction commits. false when no receipts exchange is set.';

SELECT pg_catalog.pg_extension_config_dump('@extschema@._consumed_a', '');
SELECT pg_catalog.pg_extension_config_dump('@extschema@._consumed_b', '');
SELECT pg_catalog.pg_extension_config_dump('@extschema@.subscription', '');
SELECT pg_catalog.pg_extension_config_dump('@extschema@.inbox_failed', '');
SELECT pg_catalog.pg_extension_config_dump(
    pg_catalog.pg_get_serial_sequence('@extschema@.inbox_failed', 'id')::pg_catalog.regclass, '');

-- Privileges. amqp_outbox_consumer may call consume_once() (application consumers) and send
-- receipts (so it may publish); amqp_outbox_admin manages subscriptions and failed messages.
DO $roles$
DECLARE
    r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['amqp_outbox_publisher', 'amqp_outbox_consumer', 'amqp_outbox_admin'] LOOP
        IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname OPERATOR(pg_catalog.=) r) THEN
            EXECUTE pg_catalog.format('CREATE ROLE %I NOLOGIN', r);
        END IF;
    END LOOP;
END
$roles$;
GRANT amqp_outbox_publisher TO amqp_outbox_consumer;
GRANT amqp_outbox_consumer TO amqp_outbox_admin;
REVOKE ALL ON FUNCTION @extschema@.body_text(@extschema@.delivery),
    @extschema@._uuid7_time(text), @extschema@.send_receipt(integer, text, text, boolean, text),
    @extschema@.pause_subscription(text),
    @extschema@.resume_subscription(text), @extschema@.inbox_retry(text, text),
    @extschema@.rotate_consumption(), @extschema@._archive_day(date),
    @extschema@._subscription_or_raise(text) FROM PUBLIC;
-- In this order, so that a new install and an updated one list the schema's grantees alike.
GRANT USAGE ON SCHEMA @extschema@ TO pg_monitor, amqp_outbox_publisher, amqp_outbox_admin, amqp_outbox_consumer;
GRANT EXECUTE ON FUNCTION @extschema@._uuid7_time(text),
    @extschema@.body_text(@extschema@.delivery), @extschema@.send_receipt(integer, text, text, boolean, text)
    TO amqp_outbox_consumer;
-- Read only: consumption is recorded through consume_once() (see consume_once.sql).
GRANT SELECT ON @extschema@._consumed_a, @extschema@._consumed_b TO amqp_outbox_consumer;
GRANT SELECT ON @extschema@._consumed_since, @extschema@.consumption_archive, @extschema@.consumption
    TO amqp_outbox_consumer;
GRANT EXECUTE ON FUNCTION
    @extschema@.pause_subscription(text),
    @extschema@.resume_subscription(text), @extschema@.inbox_retry(text, text),
    @extschema@.rotate_consumption(), @extschema@._subscription_or_raise(text)
    TO amqp_outbox_admin;
GRANT SELECT, INSERT, UPDATE, DELETE ON @extschema@.subscription TO amqp_outbox_admin;
GRANT SELECT, DELETE ON @extschema@._subscription_state TO amqp_outbox_admin;
GRANT SELECT, UPDATE, DELETE ON @extschema@.inbox_failed TO amqp_outbox_admin;
GRANT SELECT ON @extschema@.inbox_waiting TO amqp_outbox_admin;
