-- Delayed publishing (deliver_after) and idempotent publishing (idempotency_key). The worker is
-- off (regress.conf): delayed rows stay in amqp.scheduled_message for the tests to inspect.
\set VERBOSITY terse
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS amqp_outbox;
RESET client_min_messages;
BEGIN;
INSERT INTO amqp.broker (broker_id, host) VALUES (7, '127.0.0.1');

-- A delayed message waits in amqp.scheduled_message, not in the outbox, with its message_id
-- made already; the status view shows it as scheduled.
SELECT amqp.publish_message(7, 'ex', 'later', 'in an hour', deliver_after => '1 hour') AS later \gset
SELECT amqp.last_message_id() = :later AS last_id_is_it;
SELECT count(*) AS in_outbox FROM amqp.message;
SELECT routing_key, convert_from(body, 'UTF8') AS body, attempts,
       deliver_at BETWEEN now() + '59 minutes' AND clock_timestamp() + '1 hour' AS due_in_an_hour,
       message_id <> '' AS has_message_id, producer_pid = pg_backend_pid() AS mine
  FROM amqp.scheduled_message;
SELECT routing_key, state, deliver_at > now() AS later FROM amqp.message_status WHERE id = :later;
-- Binary bodies, tags and headers as for any message; zero and NULL delays publish at once.
SELECT amqp.publish_bytes(7, 'ex', 'later.bytes', '\x00ff'::bytea, '{"h": 1}',
                          business_key => 'order-1', deliver_after => '2 days') AS bytes \gset
SELECT routing_key, body, headers, business_key FROM amqp.scheduled_message WHERE id = :bytes;
SELECT amqp.publish_message(7, 'ex', 'now.zero', 'x', deliver_after => '0') AS zero \gset
SELECT amqp.publish_message(7, 'ex', 'now.null', 'x', deliver_after => NULL) AS null_delay \gset
SELECT routing_key, state FROM amqp.message_status ORDER BY id;
-- Ids come from one sequence, in publishing order, whichever table holds the message.
SELECT :later < :bytes AND :bytes < :zero AND :zero < :null_delay AS in_order;

-- retry() sends a delayed message now: it moves into the outbox with its id and message_id.
SELECT message_id AS later_mid FROM amqp.scheduled_message WHERE id = :later \gset
SELECT amqp.retry(:later);
SELECT id = :later AS same_id, message_id = :'later_mid' AS same_message_id, routing_key
  FROM amqp.message WHERE id = :later;
SELECT count(*) AS still_scheduled FROM amqp.scheduled_message WHERE id = :later;
-- discard() cancels one: recorded in amqp.discarded, never sent.
SELECT amqp.discard(:bytes, 'order cancelled');
SELECT routing_key, business_key, reason FROM amqp.discarded WHERE id = :bytes;
SELECT count(*) AS scheduled FROM amqp.scheduled_message;

-- Idempotency: the second publish with a key returns the first message's id and publishes
-- nothing; last_message_id() follows.
SELECT amqp.publish_message(7, 'ex', 'once', 'first', idempotency_key => 'payment-42') AS first \gset
SELECT amqp.publish_message(7, 'ex', 'once', 'second', idempotency_key => 'payment-42') AS second \gset
SELECT :first = :second AS same_id, amqp.last_message_id() = :first AS last_id;
SELECT convert_from(body, 'UTF8') AS body FROM amqp.message WHERE routing_key = 'once';
SELECT key, id = :first AS its_id FROM amqp.idempotency_key;
-- Another key, another message; a key of a delayed message works the same.
SELECT amqp.publish_message(7, 'ex', 'once', 'other', idempotency_key => 'payment-43') <> :first AS other_id;
SELECT amqp.publish_bytes(7, 'ex', 'once.later', 'a', deliver_after => '1 day',
                          idempotency_key => 'reminder-1') AS reminder \gset
SELECT amqp.publish_message(7, 'ex', 'once.later', 'b', idempotency_key => 'reminder-1') = :reminder AS same_reminder;
SELECT count(*) AS reminders FROM amqp.scheduled_message WHERE routing_key = 'once.later';
-- A publish rolled back to a savepoint leaves no key: the next one publishes.
SAVEPOINT s;
SELECT amqp.publish_message(7, 'ex', 'undone', 'x', idempotency_key => 'undone-1') AS undone \gset
ROLLBACK TO SAVEPOINT s;
SELECT amqp.publish_message(7, 'ex', 'undone', 'y', idempotency_key => 'undone-1') <> :undone AS new_id;
SELECT count(*) AS undone FROM amqp.message WHERE routing_key = 'undone';
-- After the window (amqp_outbox.idempotency_window, 24 h by default) a key publishes again.
SHOW amqp_outbox.idempotency_window;
UPDATE amqp.idempotency_key SET published_at = now() - interval '25 hours' WHERE key = 'payment-42';
SELECT amqp.publish_message(7, 'ex', 'once', 'after the window', idempotency_key => 'payment-42') AS again \gset
SELECT :again <> :first AS new_message, (SELECT id FROM amqp.idempotency_key WHERE key = 'payment-42') = :again AS key_moved;
SELECT count(*) AS payments FROM amqp.message WHERE routing_key = 'once';
-- A trigger a DBA puts on the key table sends every claim through the upsert: the same answers,
-- and the trigger fires (the session's direct path forgets the table's shape when it changes).
CREATE FUNCTION public.keep_key() RETURNS trigger LANGUAGE plpgsql
    AS $$BEGIN RAISE NOTICE 'key table trigger: %', NEW.key; RETURN NEW; END$$;
CREATE TRIGGER keep BEFORE INSERT OR UPDATE ON amqp.idempotency_key
    FOR EACH ROW EXECUTE FUNCTION public.keep_key();
SELECT amqp.publish_message(7, 'ex', 'once', 'again', idempotency_key => 'payment-42') = :again AS seen_by_upsert;
SELECT amqp.publish_message(7, 'ex', 'kept', 'z', idempotency_key => 'kept-1') AS kept \gset
SELECT amqp.publish_message(7, 'ex', 'kept', 'z', idempotency_key => 'kept-1') = :kept AS kept_once,
       (SELECT id FROM amqp.idempotency_key WHERE key = 'kept-1') = :kept AS claimed_by_upsert;
DROP TRIGGER keep ON amqp.idempotency_key;
DROP FUNCTION public.keep_key();
SELECT amqp.publish_message(7, 'ex', 'kept', 'z', idempotency_key => 'kept-1') = :kept AS seen_directly;
SELECT count(*) AS payments, (SELECT count(*) FROM amqp.message WHERE routing_key = 'kept') AS kept
  FROM amqp.message WHERE routing_key = 'once';

-- Bad input: 22023 (negative delay, empty key), 22001 (key over 1000 bytes); nothing written.
SELECT count(*) AS before FROM amqp.message \gset
\set VERBOSITY sqlstate
\set ON_ERROR_ROLLBACK on
SELECT amqp.publish_message(7, 'ex', 'bad', 'x', deliver_after => '-1 second');
SELECT amqp.publish_message(7, 'ex', 'bad', 'x', deliver_after => '1 day -25 hours');
SELECT amqp.publish_message(7, 'ex', 'bad', 'x', idempotency_key => '');
SELECT amqp.publish_message(7, 'ex', 'bad', 'x', idempotency_key => repeat('k', 1001));
SELECT amqp.publish_bytes(7, 'ex', 'bad', 'x', deliver_after => '-1 day');
-- The table's own checks stand too (direct writes by an admin).
UPDATE amqp.scheduled_message SET exchange = repeat('e', 256);
UPDATE amqp.scheduled_message SET deliver_at = 'infinity';
SELECT amqp.publish_message(7, 'ex', 'bad', 'x', deliver_after => '300000 years');
INSERT INTO amqp.idempotency_key (key, id) VALUES ('', 1);
\set ON_ERROR_ROLLBACK off
\set VERBOSITY terse
SELECT count(*) = :before AS nothing_written FROM amqp.message;
SELECT count(*) AS bad FROM amqp.scheduled_message WHERE routing_key = 'bad';
ROLLBACK;
-- The messages' old nine- and twelve-argument calls still work (defaults).
BEGIN;
INSERT INTO amqp.broker (broker_id, host) VALUES (7, '127.0.0.1');
SELECT amqp.publish_message(7, 'ex', 'rk', 'b', '{}', 2, 'text/plain', NULL, 'c1') > 0 AS nine;
SELECT amqp.publish_bytes(7, 'ex', 'rk', 'b', NULL, 1, NULL, NULL, NULL, 'type', 'key', NULL) > 0 AS twelve;
ROLLBACK;
-- amqp.trace() tells of a message scheduled for later.
BEGIN;
INSERT INTO amqp.broker (broker_id, host) VALUES (7, '127.0.0.1');
SELECT amqp.publish_message(7, 'ex', 'traced', 'x', deliver_after => '1 hour') AS traced \gset
SELECT event, detail LIKE '%: ex / traced' AS detail
  FROM amqp.trace((SELECT message_id FROM amqp.scheduled_message WHERE id = :traced));
ROLLBACK;
