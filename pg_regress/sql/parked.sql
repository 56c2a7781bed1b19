-- Parked messages: amqp.retry(), amqp.retry_all() and amqp.discard(). The worker is off
-- (regress.conf), so rows are parked here by hand, as the worker would after max_attempts.
\set VERBOSITY terse
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS amqp_outbox;
RESET client_min_messages;
BEGIN;
INSERT INTO amqp.broker (broker_id, host) VALUES (4, '127.0.0.1'), (5, '127.0.0.1');
SELECT amqp.publish_message(4, 'ex', 'a', 'one') AS one \gset
SELECT amqp.publish_message(4, 'ex', 'b', 'two') AS two \gset
SELECT amqp.publish_message(5, 'ex', 'c', 'three') AS three \gset
SELECT amqp.publish_message(4, 'ex', 'd', 'pending') AS pending \gset
UPDATE amqp.message SET attempts = 10, last_error = '312 NO_ROUTE', parked_at = now()
 WHERE id IN (:one, :two, :three);
SELECT routing_key, state, attempts, last_error FROM amqp.message_status ORDER BY id;
-- Retry one: it is pending again, attempts back to 0 (the last error is kept for the record).
SELECT amqp.retry(:one);
SELECT routing_key, state, attempts, last_error FROM amqp.message_status ORDER BY id;
-- Retry all of broker 5.
SELECT amqp.retry_all(5);
SELECT routing_key, state FROM amqp.message_status ORDER BY id;
-- Discard: the row moves to amqp.discarded with the reason and who did it.
SELECT amqp.discard(:two, 'route removed on purpose');
SELECT routing_key, convert_from(body, 'UTF8') AS body, attempts, last_error, reason,
       discarded_by = current_user AS by_me
  FROM amqp.discarded;
SELECT count(*) FROM amqp.message WHERE id = :two;
-- Only parked messages can be retried or discarded: 55000; NULL: 22004.
\set VERBOSITY sqlstate
\set ON_ERROR_ROLLBACK on
SELECT amqp.retry(:pending);
SELECT amqp.discard(:pending, 'no');
SELECT amqp.retry(-1);
SELECT amqp.retry(NULL);
SELECT amqp.discard(NULL);
SELECT amqp.retry_all(NULL);
\set ON_ERROR_ROLLBACK off
\set VERBOSITY terse
SELECT count(*) FROM amqp.message;
ROLLBACK;
