-- amqp_outbox: recording consumption, for applications (consume_once()) and for subscriptions
-- (the subscription worker calls _consume() under the name 'subscription:<name>'). The two
-- never share a name: consume_once() refuses names starting with 'subscription:', and no role
-- but the extension's owner writes the hot tables, so an application cannot make a
-- subscription take a real message for a duplicate. CREATE OR REPLACE, so that the update
-- script can take this file as it is.

CREATE OR REPLACE FUNCTION @extschema@._consume(consumer text, message_id text, business_key text DEFAULT NULL)
    RETURNS boolean LANGUAGE plpgsql VOLATILE AS $consume$
DECLARE
    n_a integer;
    n_b integer;
    born timestamptz;
BEGIN
    IF consumer IS NULL OR message_id IS NULL THEN
        RAISE EXCEPTION 'amqp_outbox: % must not be NULL', CASE WHEN consumer IS NULL THEN 'consumer' ELSE 'message_id' END
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF consumer OPERATOR(pg_catalog.=) '' OR message_id OPERATOR(pg_catalog.=) '' OR business_key OPERATOR(pg_catalog.=) '' THEN
        RAISE EXCEPTION 'amqp_outbox: % must not be empty',
                        CASE WHEN consumer OPERATOR(pg_catalog.=) '' THEN 'consumer'
                             WHEN message_id OPERATOR(pg_catalog.=) '' THEN 'message_id'
                             ELSE 'business_key' END
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF pg_catalog.octet_length(consumer) OPERATOR(pg_catalog.>) 255
       OR pg_catalog.octet_length(message_id) OPERATOR(pg_catalog.>) 255
       OR pg_catalog.octet_length(business_key) OPERATOR(pg_catalog.>) 1000 THEN
        RAISE EXCEPTION 'amqp_outbox: consumer and message_id are limited to 255 bytes, business_key to 1000'
            USING ERRCODE = 'string_data_right_truncation';
    END IF;
    -- Under REPEATABLE READ or SERIALIZABLE the snapshot may predate a rotation, whose
    -- TRUNCATE is not MVCC-safe: the emptied table would look empty, and the records it moved
    -- to the archive invisible. Locking the rotation's bookkeeping rows raises a serialization
    -- failure (40001) if a rotation committed after the snapshot, and makes the next rotation
    -- wait for this transaction.
    IF pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.<>) 'read committed' THEN
        PERFORM FROM @extschema@._consumed_since FOR KEY SHARE;
    END IF;
    -- Always a before b: two racing sessions wait on each other in the same order.
    INSERT INTO @extschema@._consumed_a (consumer, message_id, business_key)
        VALUES (consumer, message_id, business_key) ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS n_a = ROW_COUNT;
    INSERT INTO @extschema@._consumed_b (consumer, message_id, business_key)
        VALUES (consumer, message_id, business_key) ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS n_b = ROW_COUNT;
    IF n_a OPERATOR(pg_catalog.=) 0 OR n_b OPERATOR(pg_catalog.=) 0 THEN
        RETURN false;
    END IF;
    -- A message older than what the hot tables cover may have been consumed before: its record
    -- is then in the archive. Only UUIDv7 ids say how old a message is.
    born := @extschema@._uuid7_time(message_id);
    IF born OPERATOR(pg_catalog.<) (SELECT pg_catalog.min(since) FROM @extschema@._consumed_since) THEN
        RETURN NOT EXISTS (
            SELECT FROM @extschema@.consumption_archive c
             WHERE c.consumer OPERATOR(pg_catalog.=) _consume.consumer
               AND c.message_id OPERATOR(pg_catalog.=) _consume.message_id
               AND c.consumed_at OPERATOR(pg_catalog.>=) born);
    END IF;
    RETURN true;
END
$consume$;
COMMENT ON FUNCTION @extschema@._consume(text, text, text) IS
    'consume_once() without the check of the consumer name: what the subscription worker calls, under its subscriptions'' own names.';

CREATE OR REPLACE FUNCTION @extschema@.consume_once(consumer text, message_id text, business_key text DEFAULT NULL)
    RETURNS boolean LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    AS $consume_once$
BEGIN
    IF pg_catalog.starts_with(consumer, 'subscription:') THEN
        RAISE EXCEPTION 'amqp_outbox: consumer names starting with "subscription:" belong to subscriptions'
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'The subscription worker records its subscriptions'' consumption itself; choose another name.';
    END IF;
    RETURN @extschema@._consume(consumer, message_id, business_key);
END
$consume_once$;
COMMENT ON FUNCTION @extschema@.consume_once(text, text, text) IS
    'Records that consumer handles message_id in this transaction: true the first time (and when business_key is given, the first time for it too), false for a duplicate. Commits and rolls back with the caller''s transaction. Names starting with subscription: are reserved.';

REVOKE ALL ON FUNCTION @extschema@._consume(text, text, text), @extschema@.consume_once(text, text, text)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.consume_once(text, text, text) TO amqp_outbox_consumer;
