-- The library's publishing functions in PL/pgSQL, for the plain-SQL install (scripts/hosted_sql.py).
--
-- Same names, argument lists, defaults and return types as the Rust functions of src/api/publish.rs
-- (and autonomous_publish of src/api/admin.rs), the same checks in the same order with the same
-- messages and SQLSTATEs, and the same row: one INSERT into amqp.message (or, with a
-- deliver_after, amqp.scheduled_message), written as the install's owner (SECURITY DEFINER):
-- publishers need EXECUTE on the function, no right on the tables. Every object is qualified and
-- every operator on user data is OPERATOR(pg_catalog.x), as search_path is pg_catalog, pg_temp.
--
-- Instead of the worker's commit wake-up, a transaction that wrote a row into amqp.message runs
-- pg_notify('amqp_outbox', '') (a delayed one: amqp.scheduled_message's trigger notifies
-- 'scheduled'), delivered at commit only to the relay that LISTENs on channel amqp_outbox, but
-- only while the relay sleeps: PostgreSQL commits notifying transactions one at a time (a
-- database-wide lock held until the commit is flushed), which would cap publishing at one
-- commit per disk flush. While the relay claims without sleeping it holds the advisory lock
-- (1634562416, 2) and a publisher that cannot take it in share mode does not notify; every
-- publishing transaction holds (1634562416, 3) in share mode until it ends, and the relay takes
-- that one alone after it released the first and before its last claim, so no commit can fall
-- between that claim and its sleep (see amqp._wake_relay()).
--
-- What differs from the extension (nothing here can do what needs the library):
-- * Settings are custom placeholders: amqp_outbox.max_message_size, .idempotency_window,
--   .traceparent, .system_id and .host_id are read with current_setting(name, true) at each
--   publish (unset or empty: the extension's default). SHOW of one that was never set fails
--   (unrecognized parameter); any role may SET them (the extension restricts max_message_size
--   to superusers and idempotency_window to the server's configuration); a value that is not a
--   valid setting (e.g. '1 parsec') is refused at the publish that reads it, with the error SET
--   would have given (22023), not at SET.
-- * Not checked: that the library is preloaded (there is none), whether a worker serves this
--   database (no warning: the relay does), and amqp_outbox.max_pending (the backlog is counted
--   by the extension's worker in shared memory; counting amqp.message at each publish would
--   cost a scan of the backlog: left to the relay).
-- * A publish runs pg_notify(): a transaction that published cannot PREPARE TRANSACTION
--   (0A000 "cannot PREPARE a transaction that has executed LISTEN, UNLISTEN, or NOTIFY"); the
--   extension allows two-phase commit.
-- * The broker check reads amqp.broker at each publish (an index lookup) instead of a
--   per-session list dropped on the table's invalidation: the same answers.
-- * Idempotency keys are claimed by the upsert (the extension's fallback path) every time,
--   not by its lock-free lookup: the same answers, racing sessions wait at the primary key.
-- * producer_started_at: the session's backend_start (pg_stat_activity), read once per session
--   and kept in the setting amqp_outbox.producer_started_at (the extension reads
--   MyStartTimestamp). pg_stat_activity shows another role's backend_start only to members of
--   that role or of pg_read_all_stats, and publish() runs as the install's owner: when the owner
--   lacks pg_read_all_stats (pg_monitor) and the publisher is another role, the session's
--   producer key is the time of its first publishing transaction instead (still unique with
--   the pid, and the same for all its messages). A session may also SET that setting (the key
--   of its own messages only; the pid stays pg_backend_pid()). _producer_started_at() is
--   PARALLEL RESTRICTED (the extension's is PARALLEL SAFE, and a parallel worker would give
--   its own start time).
-- * last_message_id() keeps the id in the setting amqp_outbox.last_message_id. A rolled-back
--   setting reverts, but the session's currval() of the message sequence does not: a publish
--   whose transaction rolled back still counts, as in the extension. Where they still differ:
--   after a rolled-back publish that returned an existing id (an idempotency key seen before)
--   the id before it is returned; a direct INSERT into amqp.message (an admin's) or any other
--   nextval() of amqp.message's sequence in the session counts as the last message.
-- * Invalid headers: the messages of serde_json's errors ("number out of range", "recursion
--   limit exceeded") carry no line and column; when several header names are too long, the one
--   named may differ.

-- ---- message ids and the producer key ----

-- A UUIDv7 (RFC 9562) as amqp_outbox_broker::identity::uuid_v7 writes it: 48 bits of Unix
-- milliseconds, version 7, the variant, and 74 random bits (gen_random_uuid(), from the server's
-- strong random source). One expression, so the planner inlines it into the publish's INSERT.
CREATE FUNCTION amqp._new_message_id() RETURNS pg_catalog.text
    LANGUAGE sql VOLATILE STRICT PARALLEL SAFE
AS $$
    SELECT OVERLAY(
               pg_catalog.lpad(pg_catalog.to_hex(pg_catalog.floor(
                   EXTRACT(epoch FROM pg_catalog.clock_timestamp())
                   OPERATOR(pg_catalog.*) 1000)::pg_catalog.int8), 12, '0')
               OPERATOR(pg_catalog.||) '-7'
               OPERATOR(pg_catalog.||) pg_catalog.substr(pg_catalog.gen_random_uuid()::pg_catalog.text, 16)
           PLACING '-' FROM 9 FOR 0)
$$;
-- (No SET search_path: it would stop the planner from inlining the body, fully qualified
-- instead.)

-- This session's start time: with pg_backend_pid(), the producer key. Read from
-- pg_stat_activity once per session (reading it copies every backend's status) and kept in a
-- setting; see the top of this file for when it is the first publish's time instead.
CREATE FUNCTION amqp._producer_started_at() RETURNS timestamptz
    LANGUAGE plpgsql STABLE STRICT PARALLEL RESTRICTED
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    kept text := pg_catalog.current_setting('amqp_outbox.producer_started_at', true);
    started timestamptz;
BEGIN
    IF kept IS NOT NULL AND kept OPERATOR(pg_catalog.<>) '' THEN
        RETURN kept::timestamptz;
    END IF;
    SELECT a.backend_start INTO started
      FROM pg_catalog.pg_stat_get_activity(pg_catalog.pg_backend_pid()) a;
    started := coalesce(started, pg_catalog.now());
    -- ISO 8601 in UTC: read back the same whatever DateStyle and TimeZone say.
    PERFORM pg_catalog.set_config('amqp_outbox.producer_started_at',
        pg_catalog.to_char(started AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'), false);
    RETURN started;
END
$$;

-- ---- settings (custom placeholders: the extension's GUCs do not exist here) ----

-- An integer setting as PostgreSQL reads one with a unit (GUC_UNIT_BYTE or GUC_UNIT_MIN):
-- a number, optionally fractional, and a unit; rounded; within [min, max].
CREATE FUNCTION amqp._setting_integer(setting text, value text, unit text, lo integer, hi integer)
    RETURNS integer
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    parts text[] := pg_catalog.regexp_match(value,
        '^\s*([-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*$');
    factor numeric;
    result numeric;
BEGIN
    IF parts IS NULL THEN
        RAISE EXCEPTION 'invalid value for parameter "%": "%"', setting, value
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF unit OPERATOR(pg_catalog.=) 'B' THEN
        factor := CASE parts[2] WHEN '' THEN 1 WHEN 'B' THEN 1 WHEN 'kB' THEN 1024
                                WHEN 'MB' THEN 1048576 WHEN 'GB' THEN 1073741824
                                WHEN 'TB' THEN 1099511627776 END;
        IF factor IS NULL THEN
            RAISE EXCEPTION 'invalid value for parameter "%": "%"', setting, value
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'Valid units for this parameter are "B", "kB", "MB", "GB", and "TB".';
        END IF;
    ELSE
        factor := CASE parts[2] WHEN '' THEN 1 WHEN 'min' THEN 1 WHEN 'us' THEN 1 / 60000000.0
                                WHEN 'ms' THEN 1 / 60000.0 WHEN 's' THEN 1 / 60.0
                                WHEN 'h' THEN 60 WHEN 'd' THEN 1440 END;
        IF factor IS NULL THEN
            RAISE EXCEPTION 'invalid value for parameter "%": "%"', setting, value
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'Valid units for this parameter are "us", "ms", "s", "min", "h", and "d".';
        END IF;
    END IF;
    result := pg_catalog.round(parts[1]::numeric OPERATOR(pg_catalog.*) factor);
    IF result OPERATOR(pg_catalog.<) lo OR result OPERATOR(pg_catalog.>) hi THEN
        RAISE EXCEPTION '% % is outside the valid range for parameter "%" (% .. %)',
                        result, CASE unit WHEN 'B' THEN 'B' ELSE 'min' END, setting, lo, hi
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN result::integer;
END
$$;

-- ---- headers ----

-- What the worker could not send is refused here, as NewMessage::check does (src/headers.rs,
-- amqp_outbox_broker::header_table_size), in the extension's order: a value AMQP cannot carry,
-- a value that is not an object, a name over 255 bytes, a table over 64 KiB once encoded. The
-- first two checks are shared with queue and binding arguments (amqp._check_arguments). Checks
-- cost little on small headers: each one runs only where the text is long enough to fail it.

-- Why the JSON value cannot be sent as AMQP field values (NULL: it can): numbers AMQP would get
-- as another value or that a double cannot hold, nesting deeper than serde_json's 128 levels.
CREATE FUNCTION amqp._amqp_value_error(value jsonb) RETURNS text
    LANGUAGE plpgsql STABLE PARALLEL SAFE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    text_bytes integer := pg_catalog.octet_length(value::text);
    n numeric;
    shown text;
    why text;
BEGIN
    -- Numbers: none under 20 characters can be out of range or inexact.
    IF text_bytes OPERATOR(pg_catalog.>=) 20 THEN
        -- First a number AMQP would get as another value: an integer beyond 64 bits (an
        -- inexact double), a non-zero number too small for a double (0).
        FOR n IN
            SELECT v::text::numeric FROM pg_catalog.jsonb_path_query(value,
                'strict $.** ? (@.type() == "number" && (@ > 18446744073709551615 || @ < -9223372036854775808 || (@ != 0 && @ < 2.4703282292062328e-324 && @ > -2.4703282292062328e-324)))') v
        LOOP
            shown := n::text;
            IF pg_catalog.octet_length(shown) OPERATOR(pg_catalog.>) 40 THEN
                shown := pg_catalog.left(shown, 40) OPERATOR(pg_catalog.||) '...';
            END IF;
            IF pg_catalog.scale(n) OPERATOR(pg_catalog.=) 0
               AND pg_catalog.abs(n) OPERATOR(pg_catalog.<) 1.7976931348623158e308 THEN
                why := pg_catalog.format('number %s is an integer beyond 64 bits (AMQP would get an inexact double)', shown);
                EXIT;
            ELSIF pg_catalog.scale(n) OPERATOR(pg_catalog.>) 0
                  AND pg_catalog.abs(n) OPERATOR(pg_catalog.<) 2.4703282292062328e-324 THEN
                why := pg_catalog.format('number %s is too small for a double (AMQP would get 0)', shown);
                EXIT;
            END IF;
        END LOOP;
        -- Then what the JSON parser refuses: a number beyond a double's range.
        IF why IS NULL AND pg_catalog.jsonb_path_exists(value,
               'strict $.** ? (@.type() == "number" && (@ >= 1.7976931348623158e308 || @ <= -1.7976931348623158e308))') THEN
            why := 'number out of range';
        END IF;
        IF why IS NOT NULL THEN
            RETURN 'cannot be sent as AMQP field values: ' OPERATOR(pg_catalog.||) why;
        END IF;
    END IF;
    -- ... and nesting deeper than 128 (serde_json's limit: a container at level 127).
    IF text_bytes OPERATOR(pg_catalog.>=) 256 AND pg_catalog.jsonb_path_exists(value,
           'strict $.**{127} ? (@.type() == "object" || @.type() == "array")') THEN
        RETURN 'cannot be sent as AMQP field values: recursion limit exceeded';
    END IF;
    RETURN NULL;
END
$$;

-- A name (at any depth) over 255 bytes, AMQP's short string (NULL: none): why, as the
-- extension says it.
CREATE FUNCTION amqp._amqp_name_error(value jsonb) RETURNS text
    LANGUAGE plpgsql STABLE PARALLEL SAFE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    long_name text;
    shown text;
BEGIN
    IF pg_catalog.octet_length(value::text) OPERATOR(pg_catalog.<=) 256 THEN
        RETURN NULL;
    END IF;
    SELECT k #>> '{}' INTO long_name
      FROM pg_catalog.jsonb_path_query(value, 'strict $.** ? (@.type() == "object").keyvalue().key') k
     WHERE pg_catalog.octet_length(k #>> '{}') OPERATOR(pg_catalog.>) 255
     LIMIT 1;
    IF long_name IS NULL THEN
        RETURN NULL;
    END IF;
    -- At most 40 bytes of it, cut on a character boundary.
    shown := pg_catalog.left(long_name, 40);
    WHILE pg_catalog.octet_length(shown) OPERATOR(pg_catalog.>) 40 LOOP
        shown := pg_catalog.left(shown, -1);
    END LOOP;
    RETURN pg_catalog.format('header name longer than 255 bytes: %s...', shown);
END
$$;

CREATE FUNCTION amqp._check_headers(headers jsonb) RETURNS void
    LANGUAGE plpgsql STABLE PARALLEL SAFE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    text_bytes integer := pg_catalog.octet_length(headers::text);
    why text;
    bytes bigint;
BEGIN
    why := amqp._amqp_value_error(headers);
    IF why IS NOT NULL THEN
        RAISE EXCEPTION 'amqp_outbox: invalid headers: %', why USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF pg_catalog.jsonb_typeof(headers) OPERATOR(pg_catalog.<>) 'object' THEN
        RAISE EXCEPTION 'amqp_outbox: invalid headers: expected a JSON object of header names to values, got %',
                        CASE pg_catalog.jsonb_typeof(headers) WHEN 'array' THEN 'an array'
                             WHEN 'string' THEN 'a string' WHEN 'number' THEN 'a number'
                             WHEN 'boolean' THEN 'a boolean' ELSE 'null' END
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    why := amqp._amqp_name_error(headers);
    IF why IS NOT NULL THEN
        RAISE EXCEPTION 'amqp_outbox: invalid headers: %', why USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The encoded size: no JSON text is more than 5 times smaller than its AMQP table, so short
    -- headers need no count. Each value: its own bytes (a table or array 4, a long string 4 and
    -- its bytes, a number 8, a boolean 1, null 0), 1 + name + 1 as a table entry, 1 as an
    -- array element.
    IF text_bytes::bigint OPERATOR(pg_catalog.*) 5 OPERATOR(pg_catalog.+) 4 OPERATOR(pg_catalog.>) 65536 THEN
        SELECT coalesce(pg_catalog.sum(CASE pg_catalog.jsonb_typeof(v)
                   WHEN 'object' THEN 4
                   WHEN 'array' THEN 4 OPERATOR(pg_catalog.+) pg_catalog.jsonb_array_length(v)
                   WHEN 'string' THEN 4 OPERATOR(pg_catalog.+) pg_catalog.octet_length(v #>> '{}')
                   WHEN 'number' THEN 8
                   WHEN 'boolean' THEN 1
                   ELSE 0 END), 0)
          INTO bytes
          FROM pg_catalog.jsonb_path_query(headers, 'strict $.**') v;
        bytes := bytes OPERATOR(pg_catalog.+) coalesce((
            SELECT pg_catalog.sum(2 OPERATOR(pg_catalog.+) pg_catalog.octet_length(k #>> '{}'))
              FROM pg_catalog.jsonb_path_query(headers, 'strict $.** ? (@.type() == "object").keyvalue().key') k), 0);
        IF bytes OPERATOR(pg_catalog.>) 65536 THEN
            RAISE EXCEPTION 'amqp_outbox: headers take % bytes in AMQP, more than the 65536 bytes a message''s headers may take', bytes
                USING ERRCODE = 'program_limit_exceeded';
        END IF;
    END IF;
END
$$;

-- ---- publishing ----

-- Asks for the relay's wake-up at this transaction's commit, once per transaction (or per
-- savepoint rolled back): a NOTIFY only while the relay sleeps (see the head of this file).
-- True when it notified. Each step is an expression, not a PERFORM: PL/pgSQL runs a PERFORM as
-- a query, with an executor (and a snapshot) of its own, in every transaction that publishes.
CREATE OR REPLACE FUNCTION amqp._wake_relay() RETURNS boolean
    LANGUAGE plpgsql VOLATILE
    -- (No SET search_path: every name is qualified, and one costs each publish a few
    -- microseconds.)
    AS $wake$
DECLARE
    done boolean;
BEGIN
    IF pg_catalog.current_setting('amqp_outbox.wake_asked', true) IS NOT DISTINCT FROM 'on' THEN
        RETURN false;
    END IF;
    -- Until this transaction ends: the relay waits for it before its last claim. (A void
    -- result is never NULL.)
    done := pg_catalog.pg_advisory_xact_lock_shared(1634562416, 3) IS NOT NULL;
    done := pg_catalog.set_config('amqp_outbox.wake_asked', 'on', true) IS NOT NULL;
    IF pg_catalog.pg_try_advisory_lock_shared(1634562416, 2) THEN
        -- Free: the relay sleeps, or is about to.
        done := pg_catalog.pg_advisory_unlock_shared(1634562416, 2);
        PERFORM pg_catalog.pg_notify('amqp_outbox', '');
        RETURN true;
    END IF;
    RETURN false;
END
$wake$;

-- NewMessage::check, Later::check and NewMessage::insert_with in one, every case: every check
-- in the extension's order with its message and SQLSTATE, a delay, an idempotency key. Called
-- by amqp._publish() for what its one test does not cover (as the owner: the callers are
-- SECURITY DEFINER). The NULL body is called "message", as the extension does for all three.
CREATE OR REPLACE FUNCTION amqp._publish_checked(
    broker_id integer, exchange text, routing_key text, body bytea, headers jsonb,
    delivery_mode integer, content_type text, reply_to text, correlation_id text,
    business_type text, business_key text, traceparent text, deliver_after interval,
    idempotency_key text
) RETURNS bigint
    LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
    -- (No SET search_path: its callers set it, and a second one costs each publish a few
    -- microseconds. Not granted to publishers.)
AS $$
DECLARE
    mode smallint;
    max_size text;
    max_bytes integer;
    trace text;
    system_id text;
    host_id text;
    later boolean := false;
    window_text text;
    key_window interval;
    new_id bigint;
    seen_id bigint;
    started timestamptz := NULLIF(pg_catalog.current_setting('amqp_outbox.producer_started_at', true), '')::timestamptz;
BEGIN
    -- Required arguments, in the extension's order.
    IF broker_id IS NULL THEN
        RAISE EXCEPTION 'amqp_outbox: broker_id must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    ELSIF exchange IS NULL THEN
        RAISE EXCEPTION 'amqp_outbox: exchange must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    ELSIF routing_key IS NULL THEN
        RAISE EXCEPTION 'amqp_outbox: routing_key must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    ELSIF body IS NULL THEN
        RAISE EXCEPTION 'amqp_outbox: message must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    -- AMQP short strings: at most 255 bytes.
    IF pg_catalog.octet_length(exchange) OPERATOR(pg_catalog.>) 255 THEN
        RAISE EXCEPTION 'amqp_outbox: exchange is % bytes long; AMQP allows at most 255', pg_catalog.octet_length(exchange)
            USING ERRCODE = 'string_data_right_truncation';
    ELSIF pg_catalog.octet_length(routing_key) OPERATOR(pg_catalog.>) 255 THEN
        RAISE EXCEPTION 'amqp_outbox: routing_key is % bytes long; AMQP allows at most 255', pg_catalog.octet_length(routing_key)
            USING ERRCODE = 'string_data_right_truncation';
    ELSIF pg_catalog.octet_length(content_type) OPERATOR(pg_catalog.>) 255 THEN
        RAISE EXCEPTION 'amqp_outbox: content_type is % bytes long; AMQP allows at most 255', pg_catalog.octet_length(content_type)
            USING ERRCODE = 'string_data_right_truncation';
    ELSIF pg_catalog.octet_length(reply_to) OPERATOR(pg_catalog.>) 255 THEN
        RAISE EXCEPTION 'amqp_outbox: reply_to is % bytes long; AMQP allows at most 255', pg_catalog.octet_length(reply_to)
            USING ERRCODE = 'string_data_right_truncation';
    ELSIF pg_catalog.octet_length(correlation_id) OPERATOR(pg_catalog.>) 255 THEN
        RAISE EXCEPTION 'amqp_outbox: correlation_id is % bytes long; AMQP allows at most 255', pg_catalog.octet_length(correlation_id)
            USING ERRCODE = 'string_data_right_truncation';
    END IF;
    -- Delivery mode: NULL (persistent), 1 or 2.
    IF delivery_mode IS NULL OR delivery_mode OPERATOR(pg_catalog.=) 2 THEN
        mode := 2;
    ELSIF delivery_mode OPERATOR(pg_catalog.=) 1 THEN
        mode := 1;
    ELSE
        RAISE EXCEPTION 'amqp_outbox: invalid delivery_mode %; use 1 (transient) or 2 (persistent)', delivery_mode
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The body's size, against amqp_outbox.max_message_size (bytes; 8MB when unset).
    max_size := pg_catalog.current_setting('amqp_outbox.max_message_size', true);
    IF max_size IS NULL OR max_size OPERATOR(pg_catalog.=) '' THEN
        max_bytes := 8388608;
    ELSIF max_size OPERATOR(pg_catalog.~) '^[0-9]{1,9}$' THEN
        max_bytes := max_size::integer;
    ELSE
        max_bytes := amqp._setting_integer('amqp_outbox.max_message_size', max_size, 'B', 0, 2147483647);
    END IF;
    IF pg_catalog.octet_length(body) OPERATOR(pg_catalog.>) max_bytes THEN
        RAISE EXCEPTION 'amqp_outbox: message body is % bytes, over amqp_outbox.max_message_size (% bytes)',
                        pg_catalog.octet_length(body), max_bytes
            USING ERRCODE = 'program_limit_exceeded';
    END IF;
    IF headers IS NOT NULL THEN
        PERFORM amqp._check_headers(headers);
    END IF;
    -- Tags: the caller's, else the session's settings (empty: none).
    trace := coalesce(traceparent,
                      NULLIF(pg_catalog.current_setting('amqp_outbox.traceparent', true), ''));
    IF trace IS NOT NULL AND NOT (
           trace OPERATOR(pg_catalog.~) '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'
           AND pg_catalog.left(trace, 2) OPERATOR(pg_catalog.<>) 'ff'
           AND pg_catalog.substr(trace, 4, 32) OPERATOR(pg_catalog.<>) '00000000000000000000000000000000'
           AND pg_catalog.substr(trace, 37, 16) OPERATOR(pg_catalog.<>) '0000000000000000') THEN
        RAISE EXCEPTION 'amqp_outbox: invalid traceparent "%"; expected W3C trace context: 00-<32 hex>-<16 hex>-<2 hex>, lower case',
                        pg_catalog.left(trace, 80)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF business_type OPERATOR(pg_catalog.=) '' THEN
        RAISE EXCEPTION 'amqp_outbox: business_type must not be empty' USING ERRCODE = 'invalid_parameter_value';
    ELSIF pg_catalog.octet_length(business_type) OPERATOR(pg_catalog.>) 255 THEN
        RAISE EXCEPTION 'amqp_outbox: business_type is % bytes long; at most 255 are allowed', pg_catalog.octet_length(business_type)
            USING ERRCODE = 'string_data_right_truncation';
    END IF;
    IF business_key OPERATOR(pg_catalog.=) '' THEN
        RAISE EXCEPTION 'amqp_outbox: business_key must not be empty' USING ERRCODE = 'invalid_parameter_value';
    ELSIF pg_catalog.octet_length(business_key) OPERATOR(pg_catalog.>) 1000 THEN
        RAISE EXCEPTION 'amqp_outbox: business_key is % bytes long; at most 1000 are allowed', pg_catalog.octet_length(business_key)
            USING ERRCODE = 'string_data_right_truncation';
    END IF;
    system_id := NULLIF(pg_catalog.current_setting('amqp_outbox.system_id', true), '');
    IF pg_catalog.octet_length(system_id) OPERATOR(pg_catalog.>) 255 THEN
        RAISE EXCEPTION 'amqp_outbox: amqp_outbox.system_id is % bytes long; at most 255 are allowed', pg_catalog.octet_length(system_id)
            USING ERRCODE = 'string_data_right_truncation';
    END IF;
    host_id := NULLIF(pg_catalog.current_setting('amqp_outbox.host_id', true), '');
    IF pg_catalog.octet_length(host_id) OPERATOR(pg_catalog.>) 255 THEN
        RAISE EXCEPTION 'amqp_outbox: amqp_outbox.host_id is % bytes long; at most 255 are allowed', pg_catalog.octet_length(host_id)
            USING ERRCODE = 'string_data_right_truncation';
    END IF;
    -- Later::check: a positive delay schedules the message (zero or NULL: at once).
    IF deliver_after IS NOT NULL THEN
        IF NOT pg_catalog.isfinite(deliver_after) THEN
            RAISE EXCEPTION 'amqp_outbox: deliver_after must not be infinite' USING ERRCODE = 'invalid_parameter_value';
        ELSIF deliver_after OPERATOR(pg_catalog.<) '0'::interval THEN
            RAISE EXCEPTION 'amqp_outbox: deliver_after must not be negative' USING ERRCODE = 'invalid_parameter_value';
        END IF;
        later := deliver_after OPERATOR(pg_catalog.>) '0'::interval;
    END IF;
    IF idempotency_key OPERATOR(pg_catalog.=) '' THEN
        RAISE EXCEPTION 'amqp_outbox: idempotency_key must not be empty' USING ERRCODE = 'invalid_parameter_value';
    ELSIF pg_catalog.octet_length(idempotency_key) OPERATOR(pg_catalog.>) 1000 THEN
        RAISE EXCEPTION 'amqp_outbox: idempotency_key is % bytes long; at most 1000 are allowed', pg_catalog.octet_length(idempotency_key)
            USING ERRCODE = 'string_data_right_truncation';
    END IF;

    -- The transaction takes its id before the row draws one from the sequence, as the
    -- extension does (the scan floor of whoever delivers the rows relies on that order). Not in
    -- a read-only transaction or on a standby: the INSERT raises the proper error there.
    IF pg_catalog.current_setting('transaction_read_only') OPERATOR(pg_catalog.=) 'off' THEN
        PERFORM pg_catalog.pg_current_xact_id();
    END IF;
    IF NOT EXISTS (SELECT FROM amqp.broker b WHERE b.broker_id OPERATOR(pg_catalog.=) _publish_checked.broker_id) THEN
        RAISE EXCEPTION 'amqp_outbox: broker % does not exist in amqp.broker', broker_id
            USING ERRCODE = 'undefined_object';
    END IF;

    IF idempotency_key IS NOT NULL THEN
        -- The first publish with this key within amqp_outbox.idempotency_window (minutes, 1d
        -- by default) takes it with a new id; a later one finds the message it published. A
        -- session racing another with the same key waits for its end at the primary key.
        window_text := pg_catalog.current_setting('amqp_outbox.idempotency_window', true);
        key_window := pg_catalog.make_interval(mins =>
            CASE WHEN window_text IS NULL OR window_text OPERATOR(pg_catalog.=) '' THEN 1440
                 ELSE amqp._setting_integer('amqp_outbox.idempotency_window', window_text, 'min', 1, 2147483647) END);
        INSERT INTO amqp.idempotency_key AS k (key, id, published_at)
        VALUES (idempotency_key, pg_catalog.nextval('amqp.message_id_seq'::pg_catalog.regclass), pg_catalog.now())
        ON CONFLICT (key) DO UPDATE SET id = EXCLUDED.id, published_at = EXCLUDED.published_at
         WHERE k.published_at OPERATOR(pg_catalog.<) (pg_catalog.now() OPERATOR(pg_catalog.-) key_window)
        RETURNING k.id INTO new_id;
        IF new_id IS NULL THEN
            -- Taken within the window by a committed transaction (a racing one has ended: the
            -- INSERT waited for it), so this statement's snapshot sees the row.
            SELECT k.id INTO seen_id FROM amqp.idempotency_key k
             WHERE k.key OPERATOR(pg_catalog.=) idempotency_key;
            IF seen_id IS NULL THEN
                RAISE EXCEPTION 'amqp_outbox: could not insert into amqp.message: the idempotency key''s row is gone'
                    USING ERRCODE = 'internal_error';
            END IF;
            -- Published before: nothing new to publish, nothing to wake the relay for.
            PERFORM pg_catalog.set_config('amqp_outbox.last_message_id',
                seen_id::text OPERATOR(pg_catalog.||) '/' OPERATOR(pg_catalog.||)
                pg_catalog.currval('amqp.message_id_seq'::pg_catalog.regclass)::text, false);
            RETURN seen_id;
        END IF;
    END IF;

    -- The producer key's start time, kept in a setting after the session's first publish.
    IF started IS NULL THEN
        started := amqp._producer_started_at();
    END IF;
    IF later THEN
        INSERT INTO amqp.scheduled_message AS m (id, producer_pid, producer_started_at, broker_id,
               exchange, routing_key, body, delivery_mode, content_type, reply_to, correlation_id,
               headers, message_id, business_type, business_key, traceparent, system_id, host_id,
               deliver_at)
        VALUES (coalesce(new_id, pg_catalog.nextval('amqp.message_id_seq'::pg_catalog.regclass)),
                pg_catalog.pg_backend_pid(), started, broker_id, exchange,
                routing_key, body, mode, content_type, reply_to, correlation_id, headers,
                amqp._new_message_id(), business_type, business_key, trace, system_id, host_id,
                pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) deliver_after)
        RETURNING m.id INTO new_id;
    ELSE
        INSERT INTO amqp.message AS m (id, producer_pid, producer_started_at, broker_id, exchange,
               routing_key, body, delivery_mode, content_type, reply_to, correlation_id, headers,
               message_id, business_type, business_key, traceparent, system_id, host_id)
        VALUES (coalesce(new_id, pg_catalog.nextval('amqp.message_id_seq'::pg_catalog.regclass)),
                pg_catalog.pg_backend_pid(), started, broker_id, exchange,
                routing_key, body, mode, content_type, reply_to, correlation_id, headers,
                amqp._new_message_id(), business_type, business_key, trace, system_id, host_id)
        RETURNING m.id INTO new_id;
    END IF;
    -- The id for last_message_id(), with the sequence's value it was drawn as (see there).
    PERFORM pg_catalog.set_config('amqp_outbox.last_message_id',
        new_id::text OPERATOR(pg_catalog.||) '/' OPERATOR(pg_catalog.||) new_id::text, false);
    -- The relay's wake-up, at commit only. A delayed message wakes it through
    -- amqp.scheduled_message's trigger ('scheduled'), as in the extension.
    IF NOT later THEN
        PERFORM amqp._wake_relay();
    END IF;
    RETURN new_id;
END
$$;

-- Every publish function calls this one. What a PL/pgSQL function costs is mostly per
-- transaction: each of its statements is prepared again in every transaction that runs it. So
-- the common case is one test, one INSERT and two assignments: a message to send now, without an
-- idempotency key or a traceparent, with every argument and setting within the limits that
-- amqp._publish_checked() enforces (only the headers' own checks remain). Anything else (an
-- argument or a setting that may fail a check, a delay, a key, a read-only transaction, a
-- broker that does not exist) goes to amqp._publish_checked(), which raises the extension's
-- error in the extension's order or publishes.
CREATE OR REPLACE FUNCTION amqp._publish(
    broker_id integer, exchange text, routing_key text, body bytea, headers jsonb,
    delivery_mode integer, content_type text, reply_to text, correlation_id text,
    business_type text, business_key text, traceparent text, deliver_after interval,
    idempotency_key text
) RETURNS bigint
    LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
    -- (No SET search_path, as amqp._publish_checked(). Not granted to publishers.)
AS $$
DECLARE
    new_id bigint;
    last_id text;
    woke boolean;
BEGIN
    -- (Each function or operator here is looked up and its right to run checked again in
    -- every transaction: GREATEST, which skips NULLs, tests the 255-byte limits with one
    -- comparison.)
    IF broker_id IS NOT NULL AND exchange IS NOT NULL AND routing_key IS NOT NULL AND body IS NOT NULL
       AND GREATEST(pg_catalog.octet_length(exchange), pg_catalog.octet_length(routing_key),
                    pg_catalog.octet_length(content_type), pg_catalog.octet_length(reply_to),
                    pg_catalog.octet_length(correlation_id), pg_catalog.octet_length(business_type),
                    pg_catalog.octet_length(pg_catalog.current_setting('amqp_outbox.system_id', true)),
                    pg_catalog.octet_length(pg_catalog.current_setting('amqp_outbox.host_id', true)))
           OPERATOR(pg_catalog.<=) 255
       AND (delivery_mode IS NULL OR delivery_mode OPERATOR(pg_catalog.=) 2 OR delivery_mode OPERATOR(pg_catalog.=) 1)
       AND pg_catalog.octet_length(body) OPERATOR(pg_catalog.<=) 8388608
       AND coalesce(pg_catalog.current_setting('amqp_outbox.max_message_size', true), '') OPERATOR(pg_catalog.=) ''
       AND traceparent IS NULL
       AND coalesce(pg_catalog.current_setting('amqp_outbox.traceparent', true), '') OPERATOR(pg_catalog.=) ''
       AND business_type IS DISTINCT FROM ''
       AND (business_key IS NULL OR (business_key OPERATOR(pg_catalog.<>) ''
            AND pg_catalog.octet_length(business_key) OPERATOR(pg_catalog.<=) 1000))
       AND deliver_after IS NULL AND idempotency_key IS NULL
       AND pg_catalog.current_setting('transaction_read_only') OPERATOR(pg_catalog.=) 'off'
    THEN
        IF headers IS NOT NULL THEN
            -- The only check left that can fail: amqp._publish_checked() would raise its error.
            PERFORM amqp._check_headers(headers);
        END IF;
        -- The broker check is the join; the transaction takes its id (the filter) before the
        -- row draws one from the sequence (the projection), as in amqp._publish_checked().
        -- (The arguments are qualified: amqp.broker's columns must not capture them.)
        INSERT INTO amqp.message AS m (id, producer_pid, producer_started_at, broker_id, exchange,
               routing_key, body, delivery_mode, content_type, reply_to, correlation_id, headers,
               message_id, business_type, business_key, traceparent, system_id, host_id)
        SELECT pg_catalog.nextval('amqp.message_id_seq'::pg_catalog.regclass),
               pg_catalog.pg_backend_pid(),
               coalesce(NULLIF(pg_catalog.current_setting('amqp_outbox.producer_started_at', true), '')::timestamptz,
                        amqp._producer_started_at()),
               b.broker_id, _publish.exchange, _publish.routing_key, _publish.body,
               coalesce(_publish.delivery_mode, 2)::smallint, _publish.content_type,
               _publish.reply_to, _publish.correlation_id, _publish.headers,
               amqp._new_message_id(), _publish.business_type, _publish.business_key, NULL,
               NULLIF(pg_catalog.current_setting('amqp_outbox.system_id', true), ''),
               NULLIF(pg_catalog.current_setting('amqp_outbox.host_id', true), '')
          FROM amqp.broker b
         WHERE b.broker_id OPERATOR(pg_catalog.=) _publish.broker_id
           AND pg_catalog.pg_current_xact_id() IS NOT NULL
        RETURNING m.id INTO new_id;
        IF new_id IS NOT NULL THEN
            -- last_message_id() (see amqp._publish_checked()), and the relay's wake-up: two
            -- expressions (see amqp._wake_relay()).
            last_id := pg_catalog.set_config('amqp_outbox.last_message_id',
                           new_id::text OPERATOR(pg_catalog.||) '/' OPERATOR(pg_catalog.||) new_id::text, false);
            woke := CASE WHEN pg_catalog.current_setting('amqp_outbox.wake_asked', true) IS DISTINCT FROM 'on'
                         THEN amqp._wake_relay() END;
            RETURN new_id;
        END IF;
        -- No such broker: amqp._publish_checked() says so.
    END IF;
    RETURN amqp._publish_checked(broker_id, exchange, routing_key, body, headers, delivery_mode,
                                 content_type, reply_to, correlation_id, business_type,
                                 business_key, traceparent, deliver_after, idempotency_key);
END
$$;

-- pg_amqp's signature: existing callers work unchanged.
CREATE OR REPLACE FUNCTION amqp.publish(
    broker_id integer, exchange text, routing_key text, message text,
    delivery_mode integer DEFAULT NULL, content_type text DEFAULT NULL,
    reply_to text DEFAULT NULL, correlation_id text DEFAULT NULL
) RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER PARALLEL UNSAFE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- An expression, not a PERFORM (see amqp._wake_relay()); the id is never NULL.
    RETURN amqp._publish(broker_id, exchange, routing_key, pg_catalog.convert_to(message, 'UTF8'),
                         NULL, delivery_mode, content_type, reply_to, correlation_id,
                         NULL, NULL, NULL, NULL, NULL) IS NOT NULL;
END
$$;

-- With AMQP headers, the reconciliation tags, a delay and an idempotency key; returns the
-- message id (with a key published before within the window: that message's id).
CREATE FUNCTION amqp.publish_message(
    broker_id integer, exchange text, routing_key text, body text, headers jsonb DEFAULT NULL,
    delivery_mode integer DEFAULT NULL, content_type text DEFAULT NULL,
    reply_to text DEFAULT NULL, correlation_id text DEFAULT NULL,
    business_type text DEFAULT NULL, business_key text DEFAULT NULL,
    traceparent text DEFAULT NULL, deliver_after interval DEFAULT NULL,
    idempotency_key text DEFAULT NULL
) RETURNS bigint
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER PARALLEL UNSAFE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN amqp._publish(broker_id, exchange, routing_key, pg_catalog.convert_to(body, 'UTF8'),
                         headers, delivery_mode, content_type, reply_to, correlation_id,
                         business_type, business_key, traceparent, deliver_after, idempotency_key);
END
$$;

-- A binary body; returns the message id.
CREATE FUNCTION amqp.publish_bytes(
    broker_id integer, exchange text, routing_key text, body bytea, headers jsonb DEFAULT NULL,
    delivery_mode integer DEFAULT NULL, content_type text DEFAULT NULL,
    reply_to text DEFAULT NULL, correlation_id text DEFAULT NULL,
    business_type text DEFAULT NULL, business_key text DEFAULT NULL,
    traceparent text DEFAULT NULL, deliver_after interval DEFAULT NULL,
    idempotency_key text DEFAULT NULL
) RETURNS bigint
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER PARALLEL UNSAFE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN amqp._publish(broker_id, exchange, routing_key, body,
                         headers, delivery_mode, content_type, reply_to, correlation_id,
                         business_type, business_key, traceparent, deliver_after, idempotency_key);
END
$$;

-- pg_amqp sent this at once, outside the caller's transaction. An outbox has no such path.
CREATE FUNCTION amqp.autonomous_publish(
    broker_id integer, exchange text, routing_key text, message text,
    delivery_mode integer DEFAULT NULL, content_type text DEFAULT NULL,
    reply_to text DEFAULT NULL, correlation_id text DEFAULT NULL
) RETURNS boolean
    LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'amqp_outbox: amqp.autonomous_publish() is not supported'
        USING ERRCODE = 'feature_not_supported',
              HINT = 'Use amqp.publish(): the message is delivered when your transaction commits. To send whatever the outcome, publish in a transaction of its own.';
END
$$;

-- The id of the last message this session published (like lastval()). Kept in a setting,
-- which a rollback reverts; the session's currval() of the message sequence is not reverted, so
-- a publish rolled back since still counts, as in the extension.
CREATE FUNCTION amqp.last_message_id() RETURNS bigint
    LANGUAGE plpgsql VOLATILE STRICT SECURITY DEFINER PARALLEL RESTRICTED
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    kept text[] := pg_catalog.string_to_array(
        pg_catalog.current_setting('amqp_outbox.last_message_id', true), '/');
    drawn bigint;
BEGIN
    BEGIN
        drawn := pg_catalog.currval('amqp.message_id_seq'::pg_catalog.regclass);
    EXCEPTION WHEN object_not_in_prerequisite_state THEN
        drawn := NULL;
    END;
    IF kept[1] IS NOT NULL AND kept[1] OPERATOR(pg_catalog.<>) ''
       AND (drawn IS NULL OR kept[2] OPERATOR(pg_catalog.=) drawn::text) THEN
        RETURN kept[1]::bigint;
    ELSIF drawn IS NOT NULL THEN
        RETURN drawn;
    END IF;
    RAISE EXCEPTION 'amqp_outbox: no message has been published in this session yet'
        USING ERRCODE = 'object_not_in_prerequisite_state';
END
$$;
