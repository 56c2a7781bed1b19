-- amqp.publish(), publish_message(), publish_bytes(): each call inserts exactly one row into
-- amqp.message, in the caller's transaction, keyed by the producing session.
\set VERBOSITY terse
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS amqp_outbox;
RESET client_min_messages;
-- regress.conf is in effect: the worker is off, so rows stay where the tests can see them.
SHOW amqp_outbox.enabled;
SHOW amqp_outbox.database;
BEGIN;
INSERT INTO amqp.broker (broker_id, host) VALUES (1, '127.0.0.1');
SELECT count(*) FROM amqp.message;
-- pg_amqp's signature; returns true and inserts one row.
SELECT amqp.publish(1, 'amq.direct', 'first', 'hello');
SELECT count(*) FROM amqp.message;
-- The producer key: this backend's pid and start time (pids are reused, the pair is not).
SELECT producer_pid = pg_backend_pid() AS pid_is_mine,
       producer_started_at = (SELECT backend_start FROM pg_stat_activity
                              WHERE pid = pg_backend_pid()) AS started_at_is_mine
  FROM amqp.message;
-- Defaults: persistent delivery, no properties, no headers, never attempted.
SELECT broker_id, exchange, routing_key, convert_from(body, 'UTF8') AS body, delivery_mode,
       content_type, reply_to, correlation_id, headers, attempts, next_attempt_at, last_error,
       parked_at
  FROM amqp.message;
-- last_message_id() is the id of the row just inserted.
SELECT amqp.last_message_id() = (SELECT max(id) FROM amqp.message) AS last_id_matches;
-- All properties are stored.
SELECT amqp.publish(1, 'orders', 'order.created', '{"order": 42}', 1, 'application/json',
                    'reply.queue', 'corr-1');
SELECT count(*) FROM amqp.message;
SELECT exchange, routing_key, convert_from(body, 'UTF8') AS body, delivery_mode, content_type,
       reply_to, correlation_id
  FROM amqp.message WHERE id = amqp.last_message_id();
-- Named arguments, as pg_amqp callers write them.
SELECT amqp.publish(broker_id => 1, exchange => '', routing_key => 'a.queue', message => 'named',
                    correlation_id => 'corr-2');
SELECT exchange, routing_key, convert_from(body, 'UTF8') AS body, delivery_mode, correlation_id
  FROM amqp.message WHERE id = amqp.last_message_id();
-- Non-ASCII text is stored as its UTF-8 bytes.
SELECT amqp.publish(1, 'ex', 'utf8', 'grüße ☃');
SELECT body, convert_from(body, 'UTF8') AS text FROM amqp.message WHERE id = amqp.last_message_id();
-- publish_message() returns the new id; last_message_id() agrees; headers are stored.
SELECT amqp.publish_message(1, 'events', 'user.signup', 'with headers',
                            '{"tenant": "acme", "attempt": 1, "tags": ["a", "b"]}') AS msg_id \gset
SELECT :msg_id = amqp.last_message_id() AS last_id_matches,
       :msg_id > (SELECT max(id) FROM amqp.message WHERE id <> :msg_id) AS ids_increase;
SELECT exchange, routing_key, convert_from(body, 'UTF8') AS body, headers, delivery_mode
  FROM amqp.message WHERE id = :msg_id;
SELECT amqp.publish_message(1, 'events', 'props', 'all properties', '{}', 1, 'text/plain',
                            'replies', 'corr-3') AS msg_id \gset
SELECT headers, delivery_mode, content_type, reply_to, correlation_id
  FROM amqp.message WHERE id = :msg_id;
-- publish_bytes() stores the body as given, byte for byte.
SELECT amqp.publish_bytes(1, 'binary', 'blob', '\x00ff10fe0a'::bytea) AS bin_id \gset
SELECT :bin_id = amqp.last_message_id() AS last_id_matches;
SELECT body, octet_length(body) AS bytes, headers, delivery_mode FROM amqp.message WHERE id = :bin_id;
SELECT amqp.publish_bytes(1, 'binary', 'blob', '\x'::bytea, '{"k": "v"}', 2,
                          'application/octet-stream') AS bin_id \gset
SELECT body, headers, content_type FROM amqp.message WHERE id = :bin_id;
-- One row per call, every row from this session.
SELECT count(*) AS messages, count(DISTINCT id) AS distinct_ids,
       bool_and(producer_pid = pg_backend_pid()) AS all_mine
  FROM amqp.message;
ROLLBACK;
SELECT count(*) FROM amqp.message;
SELECT count(*) FROM amqp.broker;
