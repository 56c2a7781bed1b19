-- amqp.exchange_declare() records the declaration in amqp.exchange (a transactional upsert);
-- the worker declares it on every connection to that broker.
\set VERBOSITY terse
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS amqp_outbox;
RESET client_min_messages;
BEGIN;
INSERT INTO amqp.broker (broker_id, host) VALUES (7, '127.0.0.1');
-- pg_amqp's signature; auto_delete defaults to false.
SELECT amqp.exchange_declare(7, 'orders', 'topic', false, true);
SELECT broker_id, exchange, exchange_type, passive, durable, auto_delete FROM amqp.exchange;
-- Declaring it again updates the row (one row per broker and exchange).
SELECT amqp.exchange_declare(7, 'orders', 'fanout', false, false, true);
SELECT broker_id, exchange, exchange_type, passive, durable, auto_delete FROM amqp.exchange;
-- Every exchange type.
SELECT amqp.exchange_declare(7, 'direct-ex', 'direct', false, true);
SELECT amqp.exchange_declare(7, 'topic-ex', 'topic', false, true);
SELECT amqp.exchange_declare(7, 'headers-ex', 'headers', false, true);
SELECT amqp.exchange_declare(7, 'passive-ex', 'direct', true, true);
SELECT broker_id, exchange, exchange_type, passive, durable, auto_delete
  FROM amqp.exchange ORDER BY exchange;
-- Transactional: a rolled-back declaration leaves nothing.
SAVEPOINT s;
SELECT amqp.exchange_declare(7, 'temporary', 'direct', false, true);
SELECT amqp.exchange_declare(7, 'orders', 'direct', false, true);
ROLLBACK TO SAVEPOINT s;
SELECT exchange, exchange_type FROM amqp.exchange WHERE exchange IN ('temporary', 'orders');
-- Errors: bad type or empty name 22023; nothing recorded.
\set VERBOSITY sqlstate
\set ON_ERROR_ROLLBACK on
SELECT amqp.exchange_declare(7, 'bad', 'bogus', false, true);
SELECT amqp.exchange_declare(7, 'bad', 'x-delayed-message', false, true);
SELECT amqp.exchange_declare(7, '', 'direct', false, true);
\set ON_ERROR_ROLLBACK off
\set VERBOSITY terse
SELECT count(*) FROM amqp.exchange;
ROLLBACK;
SELECT count(*) FROM amqp.exchange;
