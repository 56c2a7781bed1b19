-- amqp_outbox 0.10.0 -> 0.11.0
--
-- The eight CHECK constraints of amqp.message (and of amqp.scheduled_message, made LIKE it)
-- become one, message_valid, that calls amqp._message_valid(): the same rules, the same
-- SQLSTATE (23514) and the same constraint name in a violation's error, for less work at each
-- INSERT (see sql/schema.sql). Adding it reads both tables once, under their ACCESS EXCLUSIVE
-- lock (every row there passed the eight, and passes it).
\echo Use "ALTER EXTENSION amqp_outbox UPDATE TO '0.11.0'" to load this file. \quit

CREATE FUNCTION @extschema@._message_valid(
    exchange text, routing_key text, content_type text, reply_to text, correlation_id text,
    delivery_mode smallint, headers jsonb, message_id text
) RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    rule text;
    why text;
BEGIN
    -- One expression for the common case (a NULL passes, as it passes a CHECK).
    IF (pg_catalog.octet_length(exchange) OPERATOR(pg_catalog.<=) 255
        AND pg_catalog.octet_length(routing_key) OPERATOR(pg_catalog.<=) 255
        AND pg_catalog.octet_length(content_type) OPERATOR(pg_catalog.<=) 255
        AND pg_catalog.octet_length(reply_to) OPERATOR(pg_catalog.<=) 255
        AND pg_catalog.octet_length(correlation_id) OPERATOR(pg_catalog.<=) 255
        AND (delivery_mode OPERATOR(pg_catalog.=) 1 OR delivery_mode OPERATOR(pg_catalog.=) 2)
        AND pg_catalog.jsonb_typeof(headers) OPERATOR(pg_catalog.=) 'object'
        AND message_id OPERATOR(pg_catalog.<>) ''
        AND pg_catalog.octet_length(message_id) OPERATOR(pg_catalog.<=) 255) IS NOT FALSE
    THEN
        RETURN true;
    END IF;
    SELECT r.rule, r.why INTO rule, why
      FROM (VALUES
            (1, 'message_exchange_length', 'exchange is longer than 255 bytes',
             pg_catalog.octet_length(exchange) OPERATOR(pg_catalog.<=) 255),
            (2, 'message_routing_key_length', 'routing_key is longer than 255 bytes',
             pg_catalog.octet_length(routing_key) OPERATOR(pg_catalog.<=) 255),
            (3, 'message_content_type_length', 'content_type is longer than 255 bytes',
             pg_catalog.octet_length(content_type) OPERATOR(pg_catalog.<=) 255),
            (4, 'message_reply_to_length', 'reply_to is longer than 255 bytes',
             pg_catalog.octet_length(reply_to) OPERATOR(pg_catalog.<=) 255),
            (5, 'message_correlation_id_length', 'correlation_id is longer than 255 bytes',
             pg_catalog.octet_length(correlation_id) OPERATOR(pg_catalog.<=) 255),
            (6, 'message_delivery_mode_valid', 'delivery_mode is neither 1 nor 2',
             delivery_mode OPERATOR(pg_catalog.=) 1 OR delivery_mode OPERATOR(pg_catalog.=) 2),
            (7, 'message_headers_object', 'headers is not a JSON object',
             pg_catalog.jsonb_typeof(headers) OPERATOR(pg_catalog.=) 'object'),
            (8, 'message_message_id_valid', 'message_id is empty or longer than 255 bytes',
             message_id OPERATOR(pg_catalog.<>) ''
             AND pg_catalog.octet_length(message_id) OPERATOR(pg_catalog.<=) 255)
           ) AS r (n, rule, why, ok)
     WHERE r.ok IS FALSE
     ORDER BY r.n
     LIMIT 1;
    RAISE check_violation
        USING MESSAGE = pg_catalog.format('new row violates check constraint "%s"', rule),
              DETAIL = why, CONSTRAINT = rule;
END
$$;

REVOKE ALL ON FUNCTION @extschema@._message_valid(text, text, text, text, text, smallint, jsonb, text)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@._message_valid(text, text, text, text, text, smallint, jsonb, text)
    TO PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@._message_valid(text, text, text, text, text, smallint, jsonb, text)
    TO amqp_outbox_admin;

ALTER TABLE @extschema@.message
    DROP CONSTRAINT message_exchange_length,
    DROP CONSTRAINT message_routing_key_length,
    DROP CONSTRAINT message_content_type_length,
    DROP CONSTRAINT message_reply_to_length,
    DROP CONSTRAINT message_correlation_id_length,
    DROP CONSTRAINT message_delivery_mode_valid,
    DROP CONSTRAINT message_headers_object,
    DROP CONSTRAINT message_message_id_valid,
    ADD CONSTRAINT message_valid CHECK (
    @extschema@._message_valid(exchange, routing_key, content_type, reply_to, correlation_id,
                               delivery_mode, headers, message_id));
ALTER TABLE @extschema@.scheduled_message
    DROP CONSTRAINT message_exchange_length,
    DROP CONSTRAINT message_routing_key_length,
    DROP CONSTRAINT message_content_type_length,
    DROP CONSTRAINT message_reply_to_length,
    DROP CONSTRAINT message_correlation_id_length,
    DROP CONSTRAINT message_delivery_mode_valid,
    DROP CONSTRAINT message_headers_object,
    DROP CONSTRAINT message_message_id_valid,
    ADD CONSTRAINT message_valid CHECK (
    @extschema@._message_valid(exchange, routing_key, content_type, reply_to, correlation_id,
                               delivery_mode, headers, message_id));
