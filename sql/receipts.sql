-- amqp_outbox: who may answer for a consumer. A receipt says "consumer C handled (or failed)
-- message M"; anyone who can publish to the receipts exchange could say so. RabbitMQ checks a
-- message's user_id property against the user of the connection that publishes it, and the
-- outbox sets it on every receipt it sends; so listing the RabbitMQ user of each consumer here
-- makes receipts from anyone else fail (into amqp.inbox_failed) instead of counting.
-- CREATE OR REPLACE and IF NOT EXISTS, so that the update script can take this file as it is.

CREATE TABLE IF NOT EXISTS @extschema@.receipt_sender (
    consumer text PRIMARY KEY,
    user_id text NOT NULL,
    CONSTRAINT receipt_sender_consumer_valid
        CHECK (consumer <> '' AND pg_catalog.octet_length(consumer) <= 255),
    CONSTRAINT receipt_sender_user_id_valid
        CHECK (user_id <> '' AND pg_catalog.octet_length(user_id) <= 255)
);
COMMENT ON TABLE @extschema@.receipt_sender IS
    'The RabbitMQ user each consumer sends its receipts as. Empty: every receipt is trusted. Once it lists anyone, a receipt counts only if its user_id (checked by RabbitMQ) is the one listed for its consumer.';
SELECT pg_catalog.pg_extension_config_dump('@extschema@.receipt_sender', '');

CREATE OR REPLACE FUNCTION @extschema@.record_receipt(d @extschema@.delivery) RETURNS void
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $record$
DECLARE
    b jsonb;
    mid text;
    at_ timestamptz;
    kind text;
    status_ text;
    answered timestamptz;
    sender text;
BEGIN
    BEGIN
        b := pg_catalog.convert_from(d.body, 'UTF8')::jsonb;
    EXCEPTION WHEN OTHERS THEN
        RAISE EXCEPTION 'amqp_outbox: receipt % is not JSON: %', d.message_id, SQLERRM
            USING ERRCODE = 'invalid_text_representation';
    END;
    IF pg_catalog.jsonb_typeof(b) IS DISTINCT FROM 'object' OR pg_catalog.jsonb_typeof(b -> 'message_id') IS DISTINCT FROM 'string'
       OR pg_catalog.jsonb_typeof(b -> 'consumer') IS DISTINCT FROM 'string'
       OR (b ->> 'status') IS NULL OR (b ->> 'status') NOT IN ('ok', 'failed') THEN
        RAISE EXCEPTION 'amqp_outbox: message % is not a receipt (expected {"message_id", "consumer", "status": "ok"|"failed"})', d.message_id
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    mid := b ->> 'message_id';
    status_ := b ->> 'status';
    IF mid = '' OR pg_catalog.octet_length(mid) > 255 OR (b ->> 'consumer') = '' OR pg_catalog.octet_length(b ->> 'consumer') > 255 THEN
        RAISE EXCEPTION 'amqp_outbox: receipt % names an empty or too long message_id or consumer', d.message_id
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Who sent it: once amqp.receipt_sender lists any consumer, a receipt counts only when
    -- its user_id (which RabbitMQ checks against the publishing connection's user) is the one
    -- listed for the consumer it names.
    IF EXISTS (SELECT FROM @extschema@.receipt_sender) THEN
        SELECT s.user_id INTO sender FROM @extschema@.receipt_sender s
         WHERE s.consumer OPERATOR(pg_catalog.=) (b ->> 'consumer');
        IF sender IS NULL OR d.user_id IS DISTINCT FROM sender THEN
            RAISE EXCEPTION 'amqp_outbox: receipt % for consumer "%" was sent by RabbitMQ user %, not by the one amqp.receipt_sender lists',
                d.message_id, b ->> 'consumer', coalesce('"' OPERATOR(pg_catalog.||) d.user_id OPERATOR(pg_catalog.||) '"', '(none)')
                USING ERRCODE = 'insufficient_privilege';
        END IF;
    END IF;
    at_ := coalesce(@extschema@._uuid7_time(mid), pg_catalog.now());
    -- A message_id of amqp_outbox's own says when the message was made: never after now (a
    -- forged one would make history partitions for days to come, which retention never drops).
    IF at_ OPERATOR(pg_catalog.>) (pg_catalog.now() OPERATOR(pg_catalog.+) interval '1 hour') THEN
        RAISE EXCEPTION 'amqp_outbox: receipt % names message % from the future (%)', d.message_id, mid, at_
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    kind := pg_catalog.left(b ->> 'business_type', 255);
    BEGIN
        answered := (b ->> 'at')::timestamptz;
    EXCEPTION WHEN OTHERS THEN
        answered := NULL;  -- the consumer's clock reading is informative only
    END;
    INSERT INTO @extschema@.receipt (message_id, message_at, consumer, status, error, business_type, answered_at)
    VALUES (mid, at_, b ->> 'consumer', status_, pg_catalog.left(b ->> 'error', 10000), nullif(kind, ''),
            answered);
END
$record$;
COMMENT ON FUNCTION @extschema@.record_receipt(@extschema@.delivery) IS
    'Subscription handler that records a consumer''s receipt in amqp.receipt (set up by amqp.collect_receipts()); the monitor counts it. Checks the sender against amqp.receipt_sender once that lists anyone.';

REVOKE ALL ON @extschema@.receipt_sender FROM PUBLIC;
GRANT SELECT, INSERT, UPDATE, DELETE ON @extschema@.receipt_sender TO amqp_outbox_admin;
GRANT SELECT ON @extschema@.receipt_sender TO pg_monitor;
REVOKE ALL ON FUNCTION @extschema@.record_receipt(@extschema@.delivery) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.record_receipt(@extschema@.delivery) TO amqp_outbox_admin;
