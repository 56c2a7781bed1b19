-- The plain-SQL publish functions (sql/hosted/publish.sql): what the shared tests do not show.
-- The relay's wake-up (a notification on channel amqp_outbox at commit, none at rollback), the
-- rows' shape, message ids, header and setting errors.
\set VERBOSITY terse
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS dblink;
RESET client_min_messages;
INSERT INTO amqp.broker (broker_id, host) VALUES (1, '127.0.0.1');
-- The relay's part: another session listening on amqp_outbox.
SELECT dblink_connect('relay', format('host=%s port=%s dbname=%s',
           split_part(current_setting('unix_socket_directories'), ',', 1),
           current_setting('port'), current_database())) AS relay;
SELECT dblink_exec('relay', 'LISTEN amqp_outbox') AS listen;
-- The notifications the relay got: waits up to `patience` for the first, then a moment more
-- (a second one would show there).
CREATE FUNCTION pg_temp.wakeups(patience interval) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    got text[] := '{}';
    deadline timestamptz := clock_timestamp() + patience;
BEGIN
    LOOP
        got := got || ARRAY(SELECT format('%s "%s"', notify_name, extra) FROM dblink_get_notify('relay'));
        EXIT WHEN clock_timestamp() > deadline;
        IF cardinality(got) > 0 AND deadline > clock_timestamp() + interval '0.3 s' THEN
            deadline := clock_timestamp() + interval '0.3 s';
        END IF;
        PERFORM pg_sleep(0.01);
    END LOOP;
    RETURN coalesce(array_to_string(got, ', '), '') || format(' (%s)', cardinality(got));
END
$$;
-- A transaction that published wakes the relay once, at commit: not before, however many
-- messages it published (PostgreSQL folds identical notifications of a transaction).
BEGIN;
SELECT amqp.publish(1, 'ex', 'rk', 'one');
SELECT amqp.publish_message(1, 'ex', 'rk', 'two') > 0 AS published;
SELECT amqp.publish_bytes(1, 'ex', 'rk', '\x03') > 0 AS published;
SELECT pg_temp.wakeups('0.5 s') AS before_commit;
COMMIT;
SELECT pg_temp.wakeups('10 s') AS after_commit;
-- Autocommit: the same.
SELECT amqp.publish(1, 'ex', 'rk', 'autocommit');
SELECT pg_temp.wakeups('10 s') AS after_autocommit;
-- Rolled back: no wake-up; a rolled-back savepoint leaves the outer transaction's.
BEGIN;
SELECT amqp.publish(1, 'ex', 'rk', 'rolled back');
ROLLBACK;
SELECT pg_temp.wakeups('0.5 s') AS after_rollback;
BEGIN;
SELECT amqp.publish(1, 'ex', 'rk', 'kept');
SAVEPOINT s;
SELECT amqp.publish(1, 'ex', 'rk', 'dropped');
ROLLBACK TO SAVEPOINT s;
COMMIT;
SELECT pg_temp.wakeups('10 s') AS after_savepoint;
-- A delayed message wakes it too, as "scheduled" (amqp.scheduled_message's trigger: it learns
-- when the message is due); a publish whose idempotency key was seen before wakes nothing.
SELECT amqp.publish_message(1, 'ex', 'later', 'x', deliver_after => '1 hour',
                            idempotency_key => 'once') > 0 AS scheduled;
SELECT pg_temp.wakeups('10 s') AS after_scheduled;
SELECT amqp.publish_message(1, 'ex', 'later', 'x', idempotency_key => 'once') > 0 AS seen;
SELECT pg_temp.wakeups('0.5 s') AS after_seen_key;
SELECT dblink_disconnect('relay') AS relay;
DELETE FROM amqp.message;
DELETE FROM amqp.scheduled_message;
DELETE FROM amqp.idempotency_key;

-- The rows have every column the extension fills: the producer key (this backend's pid, and
-- a start time the same for all its messages), created_at = now(), a UUIDv7 message_id, the
-- tags, the delivery state at its defaults.
SET amqp_outbox.system_id = 'shop';
SET amqp_outbox.host_id = 'host-1';
SET amqp_outbox.traceparent = '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01';
BEGIN;
SELECT amqp.publish(1, 'ex', 'a', 'plain');
SELECT amqp.publish_message(1, 'ex', 'b', 'tagged', '{"h": [1, "x", null]}', 1, 'text/plain',
                            'replies', 'corr', 'order', 'order-1',
                            '00-11111111111111111111111111111111-2222222222222222-00') > 0 AS published;
SELECT amqp.publish_bytes(1, 'ex', 'c', '\x00', deliver_after => '1 minute') > 0 AS published;
SELECT routing_key, producer_pid = pg_backend_pid() AS pid_is_mine,
       producer_started_at <= now() AS started_before, created_at = now() AS created_now,
       message_id ~ '^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$' AS uuid_v7,
       abs(extract(epoch FROM created_at) * 1000
           - ('x' || translate(left(message_id, 13), '-', ''))::bit(48)::bigint) < 5000 AS id_time_now,
       delivery_mode, content_type, reply_to, correlation_id, headers, business_type,
       business_key, traceparent, system_id, host_id, attempts, next_attempt_at, last_error,
       parked_at, resends
  FROM (SELECT * FROM amqp.message UNION ALL
        SELECT id, producer_pid, producer_started_at, broker_id, exchange, routing_key, body,
               delivery_mode, content_type, reply_to, correlation_id, headers, created_at,
               attempts, next_attempt_at, last_error, parked_at, message_id, business_type,
               business_key, traceparent, system_id, host_id, resends
          FROM amqp.scheduled_message) m
 ORDER BY id;
SELECT count(DISTINCT producer_started_at) AS one_producer_key,
       bool_and(producer_started_at = amqp._producer_started_at()) AS the_sessions
  FROM amqp.message;
ROLLBACK;
RESET amqp_outbox.system_id;
RESET amqp_outbox.host_id;
RESET amqp_outbox.traceparent;
-- Message ids are valid (amqp.message's CHECK) and increase with time (48 bits of milliseconds
-- first); direct INSERTs get one from the column's default.
BEGIN;
SELECT amqp.publish(1, 'ex', 'order', 'm1'), pg_sleep(0.002);
SELECT amqp.publish(1, 'ex', 'order', 'm2'), pg_sleep(0.002);
SELECT amqp.publish_message(1, 'ex', 'order', 'm3') > 0 AS published, pg_sleep(0.002);
SELECT amqp.publish_bytes(1, 'ex', 'order', 'm4') > 0 AS published, pg_sleep(0.002);
INSERT INTO amqp.message (broker_id, exchange, routing_key, body) VALUES (1, 'ex', 'order', 'direct');
SELECT count(*) AS messages, count(DISTINCT message_id) AS distinct_ids,
       bool_and(message_id ~ '^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$') AS all_v7,
       array_agg(id ORDER BY message_id) = array_agg(id ORDER BY id) AS in_time_order,
       bool_and(producer_started_at = amqp._producer_started_at()) AS one_producer_key
  FROM amqp.message;
ROLLBACK;

-- last_message_id() keeps a rolled-back publish's id, as the extension does.
BEGIN;
SELECT amqp.publish_message(1, 'ex', 'rk', 'gone') AS gone \gset
ROLLBACK;
SELECT amqp.last_message_id() = :gone AS kept_after_rollback;

-- Headers AMQP cannot carry, with the extension's messages: 22023, and 54000 over 64 KiB.
\set ON_ERROR_ROLLBACK on
BEGIN;
SELECT amqp.publish_message(1, 'ex', 'rk', 'b', '[1, 2]');
SELECT amqp.publish_message(1, 'ex', 'rk', 'b', 'null');
SELECT amqp.publish_message(1, 'ex', 'rk', 'b', 'true');
SELECT amqp.publish_message(1, 'ex', 'rk', 'b', '{"f": 1e400}');
SELECT amqp.publish_message(1, 'ex', 'rk', 'b', '{"t": [1e-400]}');
SELECT amqp.publish_message(1, 'ex', 'rk', 'b', '{"w": -12345678901234567890123}');
SELECT amqp.publish_message(1, 'ex', 'rk', 'b', ('{"d": ' || repeat('[', 127) || repeat(']', 127) || '}')::jsonb);
SELECT amqp.publish_message(1, 'ex', 'rk', 'b', jsonb_build_object('o', jsonb_build_object(repeat('né', 128), 1)));
SELECT amqp.publish_message(1, 'ex', 'rk', 'b', jsonb_build_object('big', repeat('x', 65524)));
-- The boundaries pass: 127 levels, a 255-byte name, 18446744073709551615 (a u64), 1e-310 (a
-- subnormal double), a table of exactly 65536 bytes (4 + 1 + 3 + 1 + 4 + 65523).
SELECT amqp.publish_message(1, 'ex', 'rk', 'b', ('{"d": ' || repeat('[', 126) || repeat(']', 126) || '}')::jsonb) > 0 AS ok;
SELECT amqp.publish_message(1, 'ex', 'rk', 'b', jsonb_build_object(repeat('n', 255), 1)) > 0 AS ok;
SELECT amqp.publish_message(1, 'ex', 'rk', 'b', '{"u": 18446744073709551615, "s": 1e-310, "l": -9223372036854775808}') > 0 AS ok;
SELECT amqp.publish_message(1, 'ex', 'rk', 'b', jsonb_build_object('big', repeat('x', 65523))) > 0 AS ok;
-- Tags and the traceparent setting.
SELECT amqp.publish_message(1, 'ex', 'rk', 'b', traceparent => '00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01');
SELECT amqp.publish_message(1, 'ex', 'rk', 'b', business_type => '');
SELECT amqp.publish_message(1, 'ex', 'rk', 'b', business_key => repeat('k', 1001));
SET amqp_outbox.traceparent = 'ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01';
SELECT amqp.publish(1, 'ex', 'rk', 'b');
RESET amqp_outbox.traceparent;
SELECT set_config('amqp_outbox.system_id', repeat('s', 256), false) IS NOT NULL AS set;
SELECT amqp.publish(1, 'ex', 'rk', 'b');
RESET amqp_outbox.system_id;
SELECT set_config('amqp_outbox.host_id', repeat('h', 256), false) IS NOT NULL AS set;
SELECT amqp.publish(1, 'ex', 'rk', 'b');
RESET amqp_outbox.host_id;
-- Settings are read as PostgreSQL reads them, with units; a bad one fails the publish.
SET amqp_outbox.max_message_size = '1kB';
SELECT amqp.publish(1, 'ex', 'rk', repeat('x', 1025));
SET amqp_outbox.max_message_size = '1.5kB';
SELECT amqp.publish(1, 'ex', 'rk', repeat('x', 1536));
SELECT amqp.publish(1, 'ex', 'rk', repeat('x', 1537));
SET amqp_outbox.max_message_size = '1 parsec';
SELECT amqp.publish(1, 'ex', 'rk', 'b');
SET amqp_outbox.max_message_size = '-1';
SELECT amqp.publish(1, 'ex', 'rk', 'b');
RESET amqp_outbox.max_message_size;
SELECT amqp.publish_message(1, 'ex', 'rk', 'first', idempotency_key => 'k1') AS k1 \gset
UPDATE amqp.idempotency_key SET published_at = now() - interval '2 hours';
SET amqp_outbox.idempotency_window = '3h';
SELECT amqp.publish_message(1, 'ex', 'rk', 'again', idempotency_key => 'k1') = :k1 AS seen_within_3h;
SET amqp_outbox.idempotency_window = '90min';
SELECT amqp.publish_message(1, 'ex', 'rk', 'again', idempotency_key => 'k1') = :k1 AS seen_within_90min;
SET amqp_outbox.idempotency_window = '0';
SELECT amqp.publish_message(1, 'ex', 'rk', 'again', idempotency_key => 'k1');
RESET amqp_outbox.idempotency_window;
-- pg_amqp's autonomous_publish() does not exist in an outbox.
SELECT amqp.autonomous_publish(1, 'ex', 'rk', 'b');
ROLLBACK;
\set ON_ERROR_ROLLBACK off

-- A publisher needs no right on the tables; the functions run as the install's owner.
CREATE ROLE hosted_publisher IN ROLE amqp_outbox_publisher;
SET ROLE hosted_publisher;
BEGIN;
SELECT amqp.publish(1, 'ex', 'rk', 'from a publisher');
SELECT amqp.publish_message(1, 'ex', 'rk', 'b', idempotency_key => 'p1', deliver_after => '1 day') = amqp.last_message_id() AS last_id;
SELECT count(*) FROM amqp.message;
ROLLBACK;
RESET ROLE;
SELECT count(*) AS messages FROM amqp.message;
DROP ROLE hosted_publisher;
DELETE FROM amqp.broker;
DROP EXTENSION dblink;
