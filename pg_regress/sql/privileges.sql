-- Least privilege: PUBLIC gets nothing; amqp_outbox_publisher may publish without any right on
-- the tables; amqp_outbox_admin manages brokers and reads passwords; pg_monitor reads the views.
-- And a search_path hijack changes nothing.
\set VERBOSITY terse
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS amqp_outbox;
RESET client_min_messages;
CREATE ROLE regress_amqp_nobody;
CREATE ROLE regress_amqp_app IN ROLE amqp_outbox_publisher;
CREATE ROLE regress_amqp_dba IN ROLE amqp_outbox_admin;
CREATE ROLE regress_amqp_monitor IN ROLE pg_monitor;
CREATE ROLE regress_amqp_consumer IN ROLE amqp_outbox_consumer;
INSERT INTO amqp.broker (broker_id, host, username, password) VALUES (8, '127.0.0.1', 'app', 's3cret-pw');
\set VERBOSITY sqlstate
\set ON_ERROR_ROLLBACK on
BEGIN;
-- A role without grants: nothing.
SET LOCAL ROLE regress_amqp_nobody;
SELECT amqp.publish(8, 'ex', 'rk', 'denied');
SELECT count(*) FROM amqp.broker;
SELECT count(*) FROM amqp.message;
SELECT count(*) FROM amqp.worker_status;
RESET ROLE;
-- The publisher: publishes, and nothing else.
SET LOCAL ROLE regress_amqp_app;
SELECT amqp.publish(8, 'ex', 'rk', 'from the app');
SELECT amqp.publish_message(8, 'ex', 'rk', 'with headers', '{"a": 1}') > 0 AS published;
SELECT amqp.last_message_id() > 0 AS has_id;
-- Delayed and keyed publishes too, without any right on their tables.
SELECT amqp.publish_message(8, 'ex', 'rk', 'for later', deliver_after => '1 day',
                            idempotency_key => 'regress-later') > 0 AS published_later;
SELECT count(*) FROM amqp.scheduled_message;
SELECT count(*) FROM amqp.idempotency_key;
DELETE FROM amqp.idempotency_key;
SELECT password FROM amqp.broker;
SELECT count(*) FROM amqp.message;
UPDATE amqp.broker SET host = 'attacker.example';
SELECT amqp.exchange_declare(8, 'x', 'direct', false, true);
SELECT amqp.retry_all(8);
RESET ROLE;
SELECT convert_from(body, 'UTF8') AS body, producer_pid = pg_backend_pid() AS own_pid
  FROM amqp.message ORDER BY id;
-- pg_monitor: the views, which show no password; not the tables.
SET LOCAL ROLE regress_amqp_monitor;
SELECT published >= 0 AS readable FROM amqp.worker_status;
SELECT count(*) >= 0 AS readable FROM amqp.broker_status;
SELECT pending FROM amqp.outbox_summary;
SELECT state FROM amqp.message_status ORDER BY id;
SELECT password FROM amqp.broker;
RESET ROLE;
-- The administrator: brokers, passwords, declarations, parked messages.
SET LOCAL ROLE regress_amqp_dba;
SELECT password FROM amqp.broker WHERE broker_id = 8;
UPDATE amqp.broker SET port = 5671 WHERE broker_id = 8;
SELECT amqp.exchange_declare(8, 'x', 'direct', false, true);
SELECT amqp.retry_all(8);
-- It discards a parked message without any right on amqp.discarded (which it cannot forge),
-- recorded under its own name; a message that is not parked: 55000.
UPDATE amqp.message SET parked_at = now() WHERE body = 'from the app'::bytea;
SELECT amqp.discard(id, 'not wanted') FROM amqp.message WHERE body = 'from the app'::bytea;
SELECT amqp.discard(999999);
INSERT INTO amqp.discarded SELECT * FROM amqp.discarded;
SELECT discarded_by, reason, convert_from(body, 'UTF8') AS body FROM amqp.discarded;
-- It reads delayed messages and keys, may cancel a delayed message, but insert neither.
SELECT convert_from(body, 'UTF8') AS body FROM amqp.scheduled_message;
SELECT key FROM amqp.idempotency_key;
INSERT INTO amqp.scheduled_message SELECT * FROM amqp.scheduled_message;
INSERT INTO amqp.idempotency_key VALUES ('forged', 1);
SELECT amqp.discard(id, 'not needed') FROM amqp.scheduled_message;
RESET ROLE;
-- The consuming side. A handler only the superuser may execute, and one anybody may.
CREATE FUNCTION public.regress_private_handler(d amqp.delivery) RETURNS void LANGUAGE sql AS '';
REVOKE ALL ON FUNCTION public.regress_private_handler(amqp.delivery) FROM PUBLIC;
CREATE FUNCTION public.regress_handler(d amqp.delivery) RETURNS void LANGUAGE sql AS '';
-- Without grants: no subscription, no consumption record, no receipt.
SET LOCAL ROLE regress_amqp_nobody;
SELECT amqp.subscribe('s_nobody', 8, 'q', 'public.regress_handler(amqp.delivery)');
SELECT amqp.consume_once('billing', 'm-1');
SELECT amqp.send_receipt(8, 'm-1', 'billing', true);
SELECT count(*) FROM amqp.subscription;
RESET ROLE;
-- amqp_outbox_consumer: records consumption, but subscribing is the administrator's.
SET LOCAL ROLE regress_amqp_consumer;
SELECT amqp.consume_once('billing', 'm-1');
SELECT amqp.consume_once('billing', 'm-1');
-- ... but not under a subscription's name (a real message would then be taken for a
-- duplicate), not by writing the records directly, and not through the worker's function.
SELECT amqp.consume_once('subscription:s_dba', 'm-2');
INSERT INTO amqp._consumed_a (consumer, message_id) VALUES ('subscription:s_dba', 'm-3');
SELECT amqp._consume('subscription:s_dba', 'm-4');
SELECT amqp.subscribe('s_consumer', 8, 'q', 'public.regress_handler(amqp.delivery)');
RESET ROLE;
-- The administrator subscribes with a handler it may execute (the subscription is its own, the
-- handler runs with its rights), not with one it may not.
SET LOCAL ROLE regress_amqp_dba;
SELECT amqp.subscribe('s_private', 8, 'q', 'public.regress_private_handler(amqp.delivery)');
SELECT amqp.subscribe('s_dba', 8, 'q', 'public.regress_handler(amqp.delivery)');
SELECT subscription, owner FROM amqp.subscription;
RESET ROLE;
ROLLBACK;
\set ON_ERROR_ROLLBACK off
\set VERBOSITY terse
-- No setting carries a broker password.
SELECT count(*) FROM pg_settings WHERE setting LIKE '%s3cret%';
-- A search_path hijack: public objects that shadow built-ins, first on the path.
CREATE FUNCTION public.octet_length(text) RETURNS integer LANGUAGE sql AS 'SELECT 0';
CREATE FUNCTION public.pg_backend_pid() RETURNS integer LANGUAGE sql AS 'SELECT 42';
CREATE FUNCTION public.always(integer, integer) RETURNS boolean LANGUAGE sql AS 'SELECT true';
CREATE OPERATOR public.= (LEFTARG = integer, RIGHTARG = integer, FUNCTION = public.always);
BEGIN;
SET LOCAL search_path = public, pg_catalog;
\set VERBOSITY sqlstate
\set ON_ERROR_ROLLBACK on
-- Still an unknown broker (the lookup is not fooled by public.=) and still too long.
SELECT amqp.publish(999, 'ex', 'rk', 'x');
SELECT amqp.publish(8, repeat('e', 256), 'rk', 'x');
INSERT INTO amqp.message (broker_id, exchange, routing_key, body) VALUES (8, repeat('e', 256), 'rk', 'x');
\set ON_ERROR_ROLLBACK off
\set VERBOSITY terse
SELECT amqp.publish(8, 'ex', 'rk', 'hijack-proof');
SELECT producer_pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid() AS real_pid
  FROM amqp.message WHERE body OPERATOR(pg_catalog.=) 'hijack-proof'::bytea;
ROLLBACK;
DROP OPERATOR public.= (integer, integer);
DROP FUNCTION public.always(integer, integer);
DROP FUNCTION public.pg_backend_pid();
DROP FUNCTION public.octet_length(text);
DELETE FROM amqp.broker WHERE broker_id = 8;
DROP ROLE regress_amqp_nobody, regress_amqp_app, regress_amqp_dba, regress_amqp_monitor,
    regress_amqp_consumer;
