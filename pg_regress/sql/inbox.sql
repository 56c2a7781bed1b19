-- The consuming side's SQL contract: consume_once(), subscribe() and its bad input,
-- pause/resume/unsubscribe, inbox_retry(), body_text(), the retention of consumption records.
\set VERBOSITY terse
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS amqp_outbox;
RESET client_min_messages;
BEGIN;
\set ON_ERROR_ROLLBACK on
-- consume_once: true the first time, false after; per consumer; business keys.
SELECT amqp.consume_once('billing', 'm-1') AS first, amqp.consume_once('billing', 'm-1') AS again,
       amqp.consume_once('shipping', 'm-1') AS other_consumer;
SELECT amqp.consume_once('billing', 'm-2', 'order-42') AS new_key,
       amqp.consume_once('billing', 'm-3', 'order-42') AS same_key_new_id,
       amqp.consume_once('billing', 'm-4', 'order-43') AS other_key;
-- A rolled back consumption is not recorded.
SAVEPOINT s;
SELECT amqp.consume_once('billing', 'm-5');
ROLLBACK TO SAVEPOINT s;
SELECT amqp.consume_once('billing', 'm-5') AS after_rollback;
-- Both hot tables hold every record; the view shows each once.
SELECT (SELECT count(*) FROM amqp._consumed_a) AS a, (SELECT count(*) FROM amqp._consumed_b) AS b,
       (SELECT count(*) FROM amqp.consumption) AS shown;
\set VERBOSITY sqlstate
-- Bad input: 22004, 22023, 22001.
SELECT amqp.consume_once(NULL, 'm');
SELECT amqp.consume_once('c', NULL);
SELECT amqp.consume_once('', 'm');
SELECT amqp.consume_once('c', '');
SELECT amqp.consume_once('c', 'm', '');
SELECT amqp.consume_once(repeat('c', 256), 'm');
SELECT amqp.consume_once('c', repeat('m', 256));
\set VERBOSITY terse
-- UUIDv7 ids carry their creation time; other ids none.
SELECT amqp._uuid7_time('0190163d-8694-739b-aea5-966c26f8ad91') AS v7,
       amqp._uuid7_time('6ba7b810-9dad-11d1-80b4-00c04fd430c8') AS v1,
       amqp._uuid7_time('not-a-uuid') AS other,
       amqp._uuid7_time(NULL) IS NULL AS null_for_null;
-- Inlined into the statement that calls it (a SQL function that is called instead is parsed and
-- planned again in each transaction and subtransaction): its name is not in the plan.
CREATE FUNCTION pg_temp.plan_of(statement text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE line text; plan text := '';
BEGIN
    FOR line IN EXECUTE 'EXPLAIN (VERBOSE, COSTS OFF) ' || statement LOOP
        plan := plan || line || E'\n';
    END LOOP;
    RETURN plan;
END $$;
SELECT pg_temp.plan_of('SELECT amqp._uuid7_time(message_id) FROM amqp._consumed_a') NOT LIKE '%uuid7_time%' AS inlined;

-- Subscriptions.
INSERT INTO amqp.broker (broker_id, host) VALUES (1, '127.0.0.1');
CREATE TABLE inbox_effect (message_id text, n int);
CREATE FUNCTION inbox_handler(d amqp.delivery) RETURNS void LANGUAGE sql
    AS $$ INSERT INTO inbox_effect VALUES (d.message_id, 1) $$;
CREATE FUNCTION wrong_args(t text) RETURNS void LANGUAGE sql AS $$ SELECT $$;
CREATE FUNCTION wrong_return(d amqp.delivery) RETURNS int LANGUAGE sql AS $$ SELECT 1 $$;
CREATE PROCEDURE a_procedure(d amqp.delivery) LANGUAGE sql AS $$ SELECT $$;
SELECT amqp.subscribe('orders', 1, 'orders.q', 'inbox_handler(amqp.delivery)');
SELECT subscription, broker_id, queue, handler, prefetch, max_attempts, dead_letter_exchange,
       owner = current_user::regrole AS owned_by_caller, paused
  FROM amqp.subscription;
SELECT subscription, state, consumer_connected, delivered, handled, duplicates, failed, retrying, dead
  FROM amqp.subscription_status;
\set VERBOSITY sqlstate
-- Already there: 42710. Unknown broker: 42704. Unknown function: 42883. Wrong signature: 42P13.
SELECT amqp.subscribe('orders', 1, 'orders.q', 'inbox_handler(amqp.delivery)');
SELECT amqp.subscribe('s2', 999, 'q', 'inbox_handler(amqp.delivery)');
SELECT amqp.subscribe('s2', 1, 'q', 'no_such_handler(amqp.delivery)');
SELECT amqp.subscribe('s2', 1, 'q', 'wrong_args(text)');
SELECT amqp.subscribe('s2', 1, 'q', 'wrong_return(amqp.delivery)');
SELECT amqp.subscribe('s2', 1, 'q', 'a_procedure(amqp.delivery)');
-- NULLs: 22004. Out of range or empty: 22023.
SELECT amqp.subscribe(NULL, 1, 'q', 'inbox_handler(amqp.delivery)');
SELECT amqp.subscribe('s2', NULL, 'q', 'inbox_handler(amqp.delivery)');
SELECT amqp.subscribe('s2', 1, NULL, 'inbox_handler(amqp.delivery)');
SELECT amqp.subscribe('s2', 1, 'q', NULL);
SELECT amqp.subscribe('s2', 1, 'q', 'inbox_handler(amqp.delivery)', NULL);
SELECT amqp.subscribe('', 1, 'q', 'inbox_handler(amqp.delivery)');
SELECT amqp.subscribe('s2', 1, '', 'inbox_handler(amqp.delivery)');
SELECT amqp.subscribe('s2', 1, repeat('q', 256), 'inbox_handler(amqp.delivery)');
SELECT amqp.subscribe('s2', 1, 'q', 'inbox_handler(amqp.delivery)', 0);
SELECT amqp.subscribe('s2', 1, 'q', 'inbox_handler(amqp.delivery)', 65536);
SELECT amqp.subscribe('s2', 1, 'q', 'inbox_handler(amqp.delivery)', 10, 0);
SELECT amqp.subscribe('s2', 1, 'q', 'inbox_handler(amqp.delivery)', 10, 3, '');
-- Unknown subscription: 42704.
SELECT amqp.pause_subscription('nope');
SELECT amqp.resume_subscription('nope');
SELECT amqp.unsubscribe('nope');
SELECT amqp.inbox_retry('nope');
SELECT amqp.pause_subscription(NULL);
\set VERBOSITY terse
-- Nothing of the failed calls was recorded.
SELECT count(*) AS subscriptions FROM amqp.subscription;
SELECT amqp.pause_subscription('orders');
SELECT state FROM amqp.subscription_status;
SELECT amqp.resume_subscription('orders');
SELECT state FROM amqp.subscription_status;
-- The handler is kept by its schema-qualified name (pg_upgrade keeps names, not function OIDs).
-- A direct write resolves it with the writer's search_path, as a regprocedure column did.
CREATE SCHEMA regress_handlers;
CREATE FUNCTION regress_handlers.inbox_handler(d amqp.delivery) RETURNS void LANGUAGE sql
    AS $$ SELECT $$;
SET LOCAL search_path = regress_handlers, public;
UPDATE amqp.subscription SET handler = 'inbox_handler(amqp.delivery)' WHERE subscription = 'orders';
RESET search_path;
SELECT handler, handler::regprocedure = 'regress_handlers.inbox_handler(amqp.delivery)'::regprocedure
       AS resolves FROM amqp.subscription WHERE subscription = 'orders';
UPDATE amqp.subscription SET handler = 'inbox_handler(amqp.delivery)'::regprocedure
 WHERE subscription = 'orders';
SELECT handler FROM amqp.subscription WHERE subscription = 'orders';
\set VERBOSITY sqlstate
-- A name no function has is refused (42883), as a regprocedure refused it.
UPDATE amqp.subscription SET handler = 'no_such_handler(amqp.delivery)' WHERE subscription = 'orders';
\set VERBOSITY terse
SELECT handler FROM amqp.subscription WHERE subscription = 'orders';
DROP SCHEMA regress_handlers CASCADE;

-- Lanes: parallelism and ordering, at subscribe() and later; bad values change nothing.
SELECT amqp.subscribe('lanes', 1, 'lanes.q', 'inbox_handler(amqp.delivery)',
                      parallelism => 4, ordering => 'business_key');
SELECT amqp.alter_subscription('lanes', ordering => 'header:tenant');
SELECT amqp.alter_subscription('lanes', prefetch => 20, max_attempts => 5);
SELECT subscription, parallelism, ordering, prefetch, max_attempts FROM amqp.subscription
 WHERE subscription = 'lanes';
SELECT parallelism, ordering, waiting, oldest_waiting_at, blocked_keys, blocked_since
  FROM amqp.subscription_status WHERE subscription = 'lanes';
\set VERBOSITY sqlstate
SELECT amqp.subscribe('s3', 1, 'q', 'inbox_handler(amqp.delivery)', parallelism => 0);
SELECT amqp.subscribe('s3', 1, 'q', 'inbox_handler(amqp.delivery)', parallelism => 17);
SELECT amqp.subscribe('s3', 1, 'q', 'inbox_handler(amqp.delivery)', parallelism => NULL);
SELECT amqp.subscribe('s3', 1, 'q', 'inbox_handler(amqp.delivery)', ordering => 'by_key');
SELECT amqp.subscribe('s3', 1, 'q', 'inbox_handler(amqp.delivery)', ordering => 'header:');
SELECT amqp.subscribe('s3', 1, 'q', 'inbox_handler(amqp.delivery)', ordering => NULL);
SELECT amqp.alter_subscription('lanes', parallelism => 0);
SELECT amqp.alter_subscription('lanes', ordering => 'header:' || repeat('h', 256));
SELECT amqp.alter_subscription('lanes', prefetch => 0);
SELECT amqp.alter_subscription('lanes', max_attempts => 0);
SELECT amqp.alter_subscription('nope', parallelism => 2);
UPDATE amqp.subscription SET parallelism = 99 WHERE subscription = 'lanes';
UPDATE amqp.subscription SET ordering = 'sometimes' WHERE subscription = 'lanes';
\set VERBOSITY terse
SELECT count(*) FILTER (WHERE subscription = 's3') AS s3, max(parallelism) AS parallelism,
       max(ordering) AS ordering
  FROM amqp.subscription;
-- What waits for a lane goes with unsubscribe() (it is still unacknowledged in the queue).
INSERT INTO amqp.inbox_waiting (subscription, message_id, exchange, routing_key, body)
VALUES ('lanes', 'w-1', 'x', 'k', 'b');
SELECT waiting FROM amqp.subscription_status WHERE subscription = 'lanes';
SELECT amqp.unsubscribe('lanes');
SELECT count(*) AS waiting_left FROM amqp.inbox_waiting;

-- Failed messages: retried on request, dead ones included.
INSERT INTO amqp.inbox_failed (subscription, message_id, exchange, routing_key, body, last_error,
                               attempts, next_attempt_at, dead_lettered_at)
VALUES ('orders', 'f-1', 'x', 'k', 'b', 'boom', 3, now() + interval '1 hour', now()),
       ('orders', 'f-2', 'x', 'k', 'b', 'boom', 1, now() + interval '1 hour', NULL);
SELECT retrying, dead FROM amqp.subscription_status;
SELECT amqp.inbox_retry('orders', 'f-1') AS one, amqp.inbox_retry() AS all_of_them;
SELECT message_id, attempts, dead_lettered_at IS NULL AS live, next_attempt_at <= now() AS due
  FROM amqp.inbox_failed ORDER BY message_id;
SELECT amqp.unsubscribe('orders');
SELECT count(*) AS subscriptions, (SELECT count(*) FROM amqp.inbox_failed) AS failed_kept
  FROM amqp.subscription;

-- body_text: UTF-8 or 22021 with a clear message.
SELECT amqp.body_text(ROW('s', 'm1', 'x', 'k', convert_to('grüße', 'UTF8'), NULL, NULL, NULL, NULL,
                          false, 1, NULL, 1, NULL)::amqp.delivery);
\set VERBOSITY sqlstate
SELECT amqp.body_text(ROW('s', 'm1', 'x', 'k', '\xff00'::bytea, NULL, NULL, NULL, NULL,
                          false, 1, NULL, 1, NULL)::amqp.delivery);
\set VERBOSITY terse

-- Receipts: none without amqp_outbox.receipts_exchange.
SELECT amqp.send_receipt(1, 'billing', 'm-1');

-- Retention: not due while the younger hot table is younger than the window.
SELECT amqp.rotate_consumption();
-- Make both tables look old: the older one's own records move to the archive (a partition per
-- day), the table is emptied by TRUNCATE, and every record stays findable.
UPDATE amqp._consumed_since SET since = now() - interval '40 days' WHERE hot = 'a';
UPDATE amqp._consumed_since SET since = now() - interval '20 days' WHERE hot = 'b';
DELETE FROM amqp._consumed_b WHERE message_id = 'm-1' AND consumer = 'billing';
SELECT amqp.rotate_consumption();
SELECT (SELECT count(*) FROM amqp._consumed_a) AS a, (SELECT count(*) FROM amqp._consumed_b) AS b,
       (SELECT count(*) FROM amqp.consumption_archive) AS archived,
       (SELECT count(*) FROM pg_inherits WHERE inhparent = 'amqp.consumption_archive'::regclass) AS days;
SELECT consumer, message_id, storage FROM amqp.consumption WHERE storage = 'archive';
-- The emptied table starts again now; the other is now the older one.
SELECT hot, since > now() - interval '1 minute' AS fresh FROM amqp._consumed_since ORDER BY hot;
ROLLBACK;
