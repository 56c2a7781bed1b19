-- amqp.queue_declare() and amqp.queue_bind() record what the worker declares on every
-- connection (after exchanges), transactionally, like amqp.exchange_declare().
\set VERBOSITY terse
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS amqp_outbox;
RESET client_min_messages;
BEGIN;
INSERT INTO amqp.broker (broker_id, host) VALUES (3, '127.0.0.1');
-- Defaults: durable, not auto-delete, no arguments.
SELECT amqp.queue_declare(3, 'orders');
-- A quorum queue with a dead-letter exchange.
SELECT amqp.queue_declare(3, 'payments', arguments => '{"x-queue-type": "quorum", "x-dead-letter-exchange": "dlx"}');
SELECT broker_id, queue, durable, auto_delete, arguments FROM amqp.queue ORDER BY queue;
-- Declaring again updates the row.
SELECT amqp.queue_declare(3, 'orders', false, true);
SELECT queue, durable, auto_delete FROM amqp.queue WHERE queue = 'orders';
-- Bindings: the routing key defaults to '' (fanout), arguments for headers exchanges.
SELECT amqp.queue_bind(3, 'orders', 'events', 'order.*');
SELECT amqp.queue_bind(3, 'orders', 'fan');
SELECT amqp.queue_bind(3, 'payments', 'hdr', arguments => '{"x-match": "all", "kind": "payment"}');
SELECT broker_id, queue, exchange, routing_key, arguments FROM amqp.binding ORDER BY exchange;
-- A rolled-back declaration leaves nothing.
SAVEPOINT s;
SELECT amqp.queue_declare(3, 'temporary');
SELECT amqp.queue_bind(3, 'temporary', 'events', 'x');
ROLLBACK TO SAVEPOINT s;
SELECT count(*) FROM amqp.queue WHERE queue = 'temporary';
SELECT count(*) FROM amqp.binding WHERE queue = 'temporary';
-- Errors, each with its SQLSTATE; nothing recorded.
\set VERBOSITY sqlstate
\set ON_ERROR_ROLLBACK on
SELECT amqp.queue_declare(NULL, 'q');
SELECT amqp.queue_declare(3, NULL);
SELECT amqp.queue_declare(3, '');
SELECT amqp.queue_declare(3, repeat('q', 256));
SELECT amqp.queue_declare(3, 'q', arguments => '[1, 2]');
SELECT amqp.queue_declare(999, 'q');
SELECT amqp.queue_bind(3, 'orders', '');
SELECT amqp.queue_bind(3, 'orders', NULL);
SELECT amqp.queue_bind(3, 'orders', 'events', repeat('k', 256));
SELECT amqp.queue_bind(3, 'orders', 'events', 'k', '"all"');
SELECT amqp.queue_bind(999, 'orders', 'events');
\set ON_ERROR_ROLLBACK off
\set VERBOSITY terse
SELECT count(*) AS queues FROM amqp.queue;
SELECT count(*) AS bindings FROM amqp.binding;
ROLLBACK;
