
-- publish_message() and publish_bytes() take deliver_after and idempotency_key (the earlier
-- calls keep working: the new arguments come last and have defaults).
DROP FUNCTION @extschema@.publish_message(integer, text, text, text, jsonb, integer, text, text, text, text, text, text);
DROP FUNCTION @extschema@.publish_bytes(integer, text, text, bytea, jsonb, integer, text, text, text, text, text, text);
CREATE FUNCTION @extschema@."publish_message"(
	"broker_id" INT,
	"exchange" TEXT,
	"routing_key" TEXT,
	"body" TEXT,
	"headers" jsonb DEFAULT NULL,
	"delivery_mode" INT DEFAULT NULL,
	"content_type" TEXT DEFAULT NULL,
	"reply_to" TEXT DEFAULT NULL,
	"correlation_id" TEXT DEFAULT NULL,
	"business_type" TEXT DEFAULT NULL,
	"business_key" TEXT DEFAULT NULL,
	"traceparent" TEXT DEFAULT NULL,
	"deliver_after" interval DEFAULT NULL,
	"idempotency_key" TEXT DEFAULT NULL
) RETURNS bigint
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'publish_message_later_wrapper';
CREATE FUNCTION @extschema@."publish_bytes"(
	"broker_id" INT,
	"exchange" TEXT,
	"routing_key" TEXT,
	"body" bytea,
	"headers" jsonb DEFAULT NULL,
	"delivery_mode" INT DEFAULT NULL,
	"content_type" TEXT DEFAULT NULL,
	"reply_to" TEXT DEFAULT NULL,
	"correlation_id" TEXT DEFAULT NULL,
	"business_type" TEXT DEFAULT NULL,
	"business_key" TEXT DEFAULT NULL,
	"traceparent" TEXT DEFAULT NULL,
	"deliver_after" interval DEFAULT NULL,
	"idempotency_key" TEXT DEFAULT NULL
) RETURNS bigint
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'publish_bytes_later_wrapper';
REVOKE ALL ON FUNCTION
    @extschema@.publish_message(integer, text, text, text, jsonb, integer, text, text, text, text, text, text, interval, text),
    @extschema@.publish_bytes(integer, text, text, bytea, jsonb, integer, text, text, text, text, text, text, interval, text)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    @extschema@.publish_message(integer, text, text, text, jsonb, integer, text, text, text, text, text, text, interval, text),
    @extschema@.publish_bytes(integer, text, text, bytea, jsonb, integer, text, text, text, text, text, text, interval, text)
    TO amqp_outbox_publisher, amqp_outbox_admin;

-- Whoever writes amqp.scheduled_message (a delayed publish, a restore, an admin's UPDATE of
-- deliver_at), the outbox worker learns after the commit when the earliest is due.
CREATE FUNCTION @extschema@."_scheduled_changed"()
	RETURNS TRIGGER
	LANGUAGE c
	AS 'MODULE_PATHNAME', '_scheduled_changed_wrapper';
REVOKE ALL ON FUNCTION @extschema@._scheduled_changed() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@._scheduled_changed() TO amqp_outbox_admin;
CREATE TRIGGER scheduled_changed AFTER INSERT OR UPDATE ON @extschema@.scheduled_message
    FOR EACH STATEMENT EXECUTE FUNCTION @extschema@._scheduled_changed();

-- The status view shows the delayed messages (state 'scheduled', and when they are due).
CREATE OR REPLACE VIEW @extschema@.message_status AS
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
