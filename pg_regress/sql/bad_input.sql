-- Every input error in the contract, by SQLSTATE, and that nothing is inserted. The table's
-- CHECK constraints reject the same values on a direct INSERT.
\set VERBOSITY terse
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS amqp_outbox;
RESET client_min_messages;
\set VERBOSITY sqlstate
-- No message published in this session yet: 55000 (object_not_in_prerequisite_state), like lastval().
SELECT amqp.last_message_id();
BEGIN;
-- Each failing statement rolls back to an implicit savepoint; the transaction goes on.
\set ON_ERROR_ROLLBACK on
INSERT INTO amqp.broker (broker_id, host) VALUES (1, '127.0.0.1');
-- NULL broker_id, exchange, routing_key, message/body: 22004.
SELECT amqp.publish(NULL, 'ex', 'rk', 'body');
SELECT amqp.publish(1, NULL, 'rk', 'body');
SELECT amqp.publish(1, 'ex', NULL, 'body');
SELECT amqp.publish(1, 'ex', 'rk', NULL);
SELECT amqp.publish_message(NULL, 'ex', 'rk', 'body');
SELECT amqp.publish_message(1, NULL, 'rk', 'body');
SELECT amqp.publish_message(1, 'ex', NULL, 'body');
SELECT amqp.publish_message(1, 'ex', 'rk', NULL);
SELECT amqp.publish_bytes(NULL, 'ex', 'rk', '\x00'::bytea);
SELECT amqp.publish_bytes(1, NULL, 'rk', '\x00'::bytea);
SELECT amqp.publish_bytes(1, 'ex', NULL, '\x00'::bytea);
SELECT amqp.publish_bytes(1, 'ex', 'rk', NULL);
-- Unknown broker_id: 42704.
SELECT amqp.publish(999, 'ex', 'rk', 'body');
SELECT amqp.publish_message(999, 'ex', 'rk', 'body');
SELECT amqp.publish_bytes(999, 'ex', 'rk', '\x00'::bytea);
SELECT amqp.disconnect(999);
-- Over 255 bytes (bytes, not characters: 128 x 'é' is 256 bytes): 22001.
SELECT amqp.publish(1, repeat('x', 256), 'rk', 'body');
SELECT amqp.publish(1, repeat('é', 128), 'rk', 'body');
SELECT amqp.publish(1, 'ex', repeat('x', 256), 'body');
SELECT amqp.publish(1, 'ex', repeat('é', 128), 'body');
SELECT amqp.publish(1, 'ex', 'rk', 'body', 2, repeat('x', 256));
SELECT amqp.publish(1, 'ex', 'rk', 'body', 2, NULL, repeat('x', 256));
SELECT amqp.publish(1, 'ex', 'rk', 'body', 2, NULL, NULL, repeat('x', 256));
SELECT amqp.publish_message(1, repeat('x', 256), 'rk', 'body');
SELECT amqp.publish_message(1, 'ex', repeat('x', 256), 'body');
SELECT amqp.publish_message(1, 'ex', 'rk', 'body', NULL, 2, repeat('x', 256));
SELECT amqp.publish_message(1, 'ex', 'rk', 'body', NULL, 2, NULL, repeat('x', 256));
SELECT amqp.publish_message(1, 'ex', 'rk', 'body', NULL, 2, NULL, NULL, repeat('x', 256));
SELECT amqp.publish_bytes(1, repeat('x', 256), 'rk', '\x00'::bytea);
SELECT amqp.publish_bytes(1, 'ex', repeat('x', 256), '\x00'::bytea);
-- delivery_mode other than NULL, 1, 2: 22023.
SELECT amqp.publish(1, 'ex', 'rk', 'body', 0);
SELECT amqp.publish(1, 'ex', 'rk', 'body', 3);
SELECT amqp.publish(1, 'ex', 'rk', 'body', -1);
SELECT amqp.publish_message(1, 'ex', 'rk', 'body', NULL, 3);
SELECT amqp.publish_bytes(1, 'ex', 'rk', '\x00'::bytea, NULL, 3);
-- Body over amqp_outbox.max_message_size (1024 in regress.conf): 54000.
SHOW amqp_outbox.max_message_size;
SELECT amqp.publish(1, 'ex', 'rk', repeat('x', 1025));
SELECT amqp.publish(1, 'ex', 'rk', repeat('é', 513));
SELECT amqp.publish_message(1, 'ex', 'rk', repeat('x', 1025));
SELECT amqp.publish_bytes(1, 'ex', 'rk', convert_to(repeat('x', 1025), 'UTF8'));
-- Headers that are not a JSON object: 22023.
SELECT amqp.publish_message(1, 'ex', 'rk', 'body', '[1, 2]');
SELECT amqp.publish_message(1, 'ex', 'rk', 'body', '"text"');
SELECT amqp.publish_message(1, 'ex', 'rk', 'body', '42');
SELECT amqp.publish_message(1, 'ex', 'rk', 'body', 'null');
SELECT amqp.publish_bytes(1, 'ex', 'rk', '\x00'::bytea, '[]');
-- exchange_declare: NULL broker or exchange 22004, unknown broker 42704, long name 22001,
-- bad type or empty name 22023.
SELECT amqp.exchange_declare(NULL, 'ex', 'direct', false, true);
SELECT amqp.exchange_declare(1, NULL, 'direct', false, true);
SELECT amqp.exchange_declare(999, 'ex', 'direct', false, true);
SELECT amqp.exchange_declare(1, repeat('x', 256), 'direct', false, true);
SELECT amqp.exchange_declare(1, 'ex', 'bogus', false, true);
SELECT amqp.exchange_declare(1, 'ex', '', false, true);
SELECT amqp.exchange_declare(1, '', 'direct', false, true);
-- None of the above inserted anything.
SELECT count(*) FROM amqp.message;
SELECT count(*) FROM amqp.exchange;
-- The boundaries are accepted: '' exchange (the default exchange), '' routing key, 255 bytes,
-- delivery_mode NULL/1/2, a body of exactly max_message_size bytes, headers {} or NULL.
SELECT amqp.publish(1, '', 'a.queue', 'default exchange');
SELECT amqp.publish(1, 'amq.fanout', '', 'empty routing key');
SELECT amqp.publish(1, repeat('x', 255), repeat('y', 255), 'longest names', NULL,
                    repeat('c', 255), repeat('r', 255), repeat('i', 255));
SELECT amqp.publish(1, 'ex', repeat('é', 127), 'longest multibyte routing key (254 bytes)');
SELECT amqp.publish(1, 'ex', 'rk', 'mode 1', 1);
SELECT amqp.publish(1, 'ex', 'rk', 'mode 2', 2);
SELECT amqp.publish(1, 'ex', 'rk', repeat('x', 1024));
SELECT amqp.publish_bytes(1, 'ex', 'rk', convert_to(repeat('x', 1024), 'UTF8')) > 0 AS ok;
SELECT amqp.publish_message(1, 'ex', 'rk', 'empty headers', '{}') > 0 AS ok;
SELECT amqp.publish_message(1, 'ex', 'rk', 'null headers', NULL) > 0 AS ok;
SELECT count(*) FROM amqp.message;
SELECT delivery_mode, count(*) FROM amqp.message GROUP BY 1 ORDER BY 1;
SELECT octet_length(exchange) AS exchange_bytes, octet_length(routing_key) AS rk_bytes,
       octet_length(content_type) AS ct_bytes, octet_length(reply_to) AS rt_bytes,
       octet_length(correlation_id) AS ci_bytes
  FROM amqp.message WHERE convert_from(body, 'UTF8') = 'longest names';
-- max_message_size is read at call time (a superuser may change it per session).
SET amqp_outbox.max_message_size = 2048;
SELECT amqp.publish(1, 'ex', 'rk', repeat('x', 1025));
SELECT amqp.publish(1, 'ex', 'rk', repeat('x', 2049));
RESET amqp_outbox.max_message_size;
SELECT amqp.publish(1, 'ex', 'rk', repeat('x', 1025));
-- Headers the worker could never send are refused here, not parked later: a number out of
-- range, nesting deeper than 128, a header name over 255 bytes: 22023. Headers larger than
-- 64 KiB once encoded (a message's properties must fit in one AMQP frame): 54000.
SELECT amqp.publish_message(1, 'ex', 'rk', 'body', '{"f": 1e400}');
SELECT amqp.publish_message(1, 'ex', 'rk', 'body', ('{"n": 1' || repeat('0', 400) || '}')::jsonb);
SELECT amqp.publish_message(1, 'ex', 'rk', 'body', ('{"d": ' || repeat('[', 200) || repeat(']', 200) || '}')::jsonb);
-- Numbers AMQP would get as another value: 0 for 1e-400, an inexact double for an integer
-- beyond 64 bits.
SELECT amqp.publish_message(1, 'ex', 'rk', 'body', '{"t": 1e-400}');
SELECT amqp.publish_message(1, 'ex', 'rk', 'body', '{"w": 12345678901234567890123}');
SELECT amqp.publish_bytes(1, 'ex', 'rk', '\x00'::bytea, jsonb_build_object(repeat('n', 256), 1));
SELECT amqp.publish_message(1, 'ex', 'rk', 'body', jsonb_build_object('big', repeat('x', 200000)));
SELECT amqp.publish_message(1, 'ex', 'rk', 'body', jsonb_build_object('big', repeat('x', 60000))) > 0 AS fits;
-- The same for queue and binding arguments.
SELECT amqp.queue_declare(1, 'q', arguments => '{"x-max-length": 1e400}');
SELECT amqp.queue_bind(1, 'q', 'ex', arguments => jsonb_build_object(repeat('n', 256), 1));
SELECT count(*) AS stored FROM amqp.message;
SELECT count(*) AS declared FROM amqp.queue;
\set ON_ERROR_ROLLBACK off
ROLLBACK;
-- Direct INSERTs with bad values are rejected by the table's CHECK constraints (23514).
CREATE FUNCTION pg_temp.insert_error(stmt text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    state text;
    constraint_name text;
BEGIN
    EXECUTE stmt;
    RETURN 'accepted';
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS state = RETURNED_SQLSTATE, constraint_name = CONSTRAINT_NAME;
    RETURN state || ' ' || constraint_name;
END
$$;
BEGIN;
SELECT what, pg_temp.insert_error(format(
           'INSERT INTO amqp.message (producer_started_at, broker_id, exchange, routing_key, body, '
           'delivery_mode, content_type, reply_to, correlation_id, headers) '
           'VALUES (now(), 1, %L, %L, %L, %s, %L, %L, %L, %L)',
           coalesce(o->>'exchange', 'ex'), coalesce(o->>'routing_key', 'rk'), 'body',
           coalesce(o->>'delivery_mode', '2'), o->>'content_type', o->>'reply_to',
           o->>'correlation_id', o->>'headers')) AS result
  FROM (VALUES
    ('valid row',           '{}'::jsonb),
    ('delivery_mode 3',     '{"delivery_mode": "3"}'),
    ('delivery_mode 0',     '{"delivery_mode": "0"}'),
    ('long exchange',       jsonb_build_object('exchange', repeat('x', 256))),
    ('long routing_key',    jsonb_build_object('routing_key', repeat('é', 128))),
    ('long content_type',   jsonb_build_object('content_type', repeat('x', 256))),
    ('long reply_to',       jsonb_build_object('reply_to', repeat('x', 256))),
    ('long correlation_id', jsonb_build_object('correlation_id', repeat('x', 256))),
    ('headers array',       '{"headers": "[]"}'),
    ('headers string',      '{"headers": "\"s\""}'),
    ('headers JSON null',   '{"headers": "null"}'),
    ('headers {}',          '{"headers": "{}"}')
  ) AS t(what, o);
SELECT count(*) FROM amqp.message;
ROLLBACK;
SELECT count(*) FROM amqp.message;
-- An error PostgreSQL raises inside the extension keeps its own SQLSTATE (25006: a read-only
-- transaction), and its DETAIL carries no Rust backtrace although the server runs with
-- RUST_BACKTRACE=1 (scripts/installcheck.sh).
CREATE FUNCTION pg_temp.error_of(stmt text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    state text;
    detail text;
BEGIN
    EXECUTE stmt;
    RETURN 'no error';
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS state = RETURNED_SQLSTATE, detail = PG_EXCEPTION_DETAIL;
    RETURN state || CASE WHEN detail ~ '(rust_begin_unwind|\n\s*[0-9]+: )' THEN ' with a backtrace'
                         ELSE '' END;
END
$$;
INSERT INTO amqp.broker (broker_id, host) VALUES (1, '127.0.0.1');
BEGIN READ ONLY;
SELECT pg_temp.error_of('SELECT amqp.publish(1, ''ex'', ''rk'', ''x'')') AS publish;
SELECT pg_temp.error_of('SELECT amqp.discard(1)') AS discard;
SELECT pg_temp.error_of('SELECT amqp.queue_declare(1, ''q'')') AS queue_declare;
ROLLBACK;
DELETE FROM amqp.broker WHERE broker_id = 1;
