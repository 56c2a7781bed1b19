-- DROP EXTENSION would drop the outbox with the messages in it: it is refused while messages
-- wait (2BP01), and goes through once they were deleted on purpose.
\set VERBOSITY terse
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS amqp_outbox;
RESET client_min_messages;
BEGIN;
INSERT INTO amqp.broker (broker_id, host) VALUES (1, '127.0.0.1');
SELECT amqp.publish(1, 'ex', 'rk', 'waiting'), amqp.publish(1, 'ex', 'rk', 'parked');
UPDATE amqp.message SET parked_at = now() WHERE body = 'parked'::bytea;
SAVEPOINT s;
\set VERBOSITY sqlstate
DROP EXTENSION amqp_outbox;
ROLLBACK TO s;
DROP EXTENSION amqp_outbox CASCADE;
\set VERBOSITY terse
ROLLBACK TO s;
SELECT count(*) AS still_there FROM amqp.message;
-- Another extension is not concerned; a missing one neither.
DROP EXTENSION IF EXISTS no_such_extension;
-- Messages published for later count as well.
DELETE FROM amqp.message;
SELECT amqp.publish_message(1, 'ex', 'rk', 'later', deliver_after => '1 day') > 0 AS scheduled;
SAVEPOINT t;
\set VERBOSITY sqlstate
DROP EXTENSION amqp_outbox;
\set VERBOSITY terse
ROLLBACK TO t;
-- Deleted on purpose first: the drop goes through.
DELETE FROM amqp.scheduled_message;
DROP EXTENSION amqp_outbox;
SELECT count(*) AS installed FROM pg_extension WHERE extname = 'amqp_outbox';
ROLLBACK;
SELECT count(*) AS installed FROM pg_extension WHERE extname = 'amqp_outbox';
