-- A message exists exactly when the transaction that published it commits: every way of
-- rolling back (ROLLBACK, ROLLBACK TO SAVEPOINT, a plpgsql EXCEPTION block, an error after the
-- publish) leaves nothing behind, and what the outer transaction published survives.
\set VERBOSITY terse
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS amqp_outbox;
RESET client_min_messages;
INSERT INTO amqp.broker (broker_id, host) VALUES (10, 'rollback.test');
-- ROLLBACK: the row was there inside the transaction, and is gone after it.
BEGIN;
SELECT amqp.publish(10, 'ex', 'rolled-back', 'one');
SELECT amqp.publish_message(10, 'ex', 'rolled-back', 'two', '{"h": 1}') > 0 AS has_id;
SELECT amqp.publish_bytes(10, 'ex', 'rolled-back', '\x0102'::bytea) > 0 AS has_id;
SELECT count(*) FROM amqp.message;
ROLLBACK;
SELECT count(*) FROM amqp.message;
-- ROLLBACK TO SAVEPOINT: the savepoint's messages go, the outer transaction's message stays.
BEGIN;
SELECT amqp.publish(10, 'ex', 'outer', 'kept');
SAVEPOINT s1;
SELECT amqp.publish(10, 'ex', 'inner', 'dropped 1');
SELECT amqp.publish_message(10, 'ex', 'inner', 'dropped 2') > 0 AS has_id;
ROLLBACK TO SAVEPOINT s1;
SELECT routing_key, convert_from(body, 'UTF8') AS body FROM amqp.message ORDER BY id;
-- ... and a released savepoint keeps its message.
SAVEPOINT s2;
SELECT amqp.publish(10, 'ex', 'released', 'kept too');
RELEASE SAVEPOINT s2;
COMMIT;
SELECT routing_key, convert_from(body, 'UTF8') AS body FROM amqp.message ORDER BY id;
DELETE FROM amqp.message;
-- Nested savepoints: only the innermost is rolled back.
BEGIN;
SAVEPOINT a;
SELECT amqp.publish(10, 'ex', 'level-a', 'kept');
SAVEPOINT b;
SELECT amqp.publish(10, 'ex', 'level-b', 'dropped');
ROLLBACK TO SAVEPOINT b;
RELEASE SAVEPOINT a;
COMMIT;
SELECT routing_key, convert_from(body, 'UTF8') AS body FROM amqp.message ORDER BY id;
DELETE FROM amqp.message;
-- A plpgsql EXCEPTION block is a subtransaction: its message is rolled back with it.
DO $$
BEGIN
    PERFORM amqp.publish(10, 'ex', 'outer-do', 'kept');
    BEGIN
        PERFORM amqp.publish(10, 'ex', 'inner-do', 'dropped');
        RAISE EXCEPTION 'boom';
    EXCEPTION WHEN raise_exception THEN
        RAISE NOTICE 'caught: %', SQLERRM;
    END;
END
$$;
SELECT routing_key, convert_from(body, 'UTF8') AS body FROM amqp.message ORDER BY id;
DELETE FROM amqp.message;
-- An error after the publish aborts the transaction: COMMIT then rolls back.
BEGIN;
SELECT amqp.publish(10, 'ex', 'doomed', 'x');
SELECT 1 / 0;
COMMIT;
SELECT count(*) FROM amqp.message;
-- The same within one statement (autocommit).
DO $$
BEGIN
    PERFORM amqp.publish(10, 'ex', 'doomed-do', 'x');
    RAISE EXCEPTION 'failed after publish';
END
$$;
SELECT count(*) FROM amqp.message;
-- A failing statement in a transaction aborts it, including the earlier publishes.
BEGIN;
SELECT amqp.publish(10, 'ex', 'doomed-2', 'x');
SELECT 'not a number'::integer;
ROLLBACK;
SELECT count(*) FROM amqp.message;
-- A committed publish after all this: exactly one row.
SELECT amqp.publish(10, 'ex', 'committed', 'survivor');
SELECT routing_key, convert_from(body, 'UTF8') AS body FROM amqp.message ORDER BY id;
DELETE FROM amqp.message;
DELETE FROM amqp.broker WHERE broker_id = 10;
