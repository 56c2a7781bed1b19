-- The views DBAs query, and who may read them.
\set VERBOSITY terse
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS amqp_outbox;
RESET client_min_messages;
-- The worker is disabled by regress.conf: its counters stay at zero, and it asks no commit to
-- wake it.
SELECT published, confirmed, acknowledged,
       resent_lost, resent_timeout, failed, parked, commit_wakeups
  FROM amqp.worker_status;
-- This database's acknowledgement queue: unique to the cluster and the database.
SELECT ack_queue = format('amqp_outbox.ack.%s.%s', to_hex(s.system_identifier),
                          to_hex(d.oid::bigint)) AS ack_queue_named
  FROM amqp.worker_status, pg_control_system() s, pg_database d
 WHERE d.datname = current_database();
BEGIN;
INSERT INTO amqp.broker (broker_id, host) VALUES (6, '127.0.0.1');
SELECT amqp.publish(6, 'orders', 'a', 'x');
SELECT amqp.publish(6, 'orders', 'b', 'y');
SELECT amqp.publish(6, 'audit', 'c', 'z');
UPDATE amqp.message SET parked_at = now(), attempts = 1 WHERE routing_key = 'c';
SELECT broker_id, exchange, pending, parked, retrying, oldest_pending_at IS NOT NULL AS has_oldest
  FROM amqp.outbox_summary ORDER BY exchange;
SELECT exchange, routing_key, state FROM amqp.message_status ORDER BY id;
-- A retry that is not due yet.
UPDATE amqp.message SET attempts = 1, next_attempt_at = now() + interval '1 hour' WHERE routing_key = 'b';
SELECT routing_key, state FROM amqp.message_status ORDER BY id;
ROLLBACK;
-- pg_monitor may read the views; a plain role may not.
SELECT has_table_privilege('pg_monitor', 'amqp.worker_status', 'SELECT') AS monitor_worker,
       has_table_privilege('pg_monitor', 'amqp.broker_status', 'SELECT') AS monitor_broker,
       has_table_privilege('pg_monitor', 'amqp.outbox_summary', 'SELECT') AS monitor_summary,
       has_table_privilege('pg_monitor', 'amqp.message_status', 'SELECT') AS monitor_messages;
SELECT has_table_privilege('public', 'amqp.message', 'SELECT') AS public_messages,
       has_table_privilege('public', 'amqp.broker', 'SELECT') AS public_brokers;
