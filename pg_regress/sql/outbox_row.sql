-- publish() writes its row with the table access method, not an INSERT statement
-- (src/api/outbox_row.rs). The row must be what the INSERT made, the table's indexes kept, its
-- unique key enforced, and anything a DBA adds to amqp.message (a trigger, a CHECK constraint,
-- a column with a default, a NOT NULL) honoured by falling back to an INSERT.
\set VERBOSITY terse
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS amqp_outbox;
RESET client_min_messages;
DELETE FROM amqp.message;
INSERT INTO amqp.broker (broker_id, host) VALUES (1, '127.0.0.1') ON CONFLICT DO NOTHING;
-- What the column defaults would have given: the transaction's now(), a UUIDv7 message_id
-- whose time is now (to the millisecond), no attempts, no resends; the id from the identity.
BEGIN;
SELECT amqp.publish(1, 'ex', 'rk', 'first');
SELECT created_at = now() AS created_at_is_now,
       message_id ~ '^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$' AS uuid7,
       abs(extract(epoch FROM amqp._uuid7_time(message_id) - clock_timestamp())) < 60 AS id_time_is_now,
       attempts, resends, next_attempt_at, last_error, parked_at,
       id = currval(pg_get_serial_sequence('amqp.message', 'id')) AS id_from_identity
  FROM amqp.message;
-- The row is visible to the next statement of the transaction, as after an INSERT.
SELECT amqp.publish(1, 'ex', 'rk', 'second');
SELECT count(*) FROM amqp.message;
COMMIT;
-- Through the primary key index, with sequential scans off.
SET enable_seqscan = off;
SET enable_bitmapscan = off;
SELECT convert_from(body, 'UTF8') AS body FROM amqp.message WHERE id = amqp.last_message_id();
RESET enable_seqscan;
RESET enable_bitmapscan;
-- A large body goes to TOAST and comes back whole.
SET amqp_outbox.max_message_size = 2000000;
SELECT amqp.publish(1, 'ex', 'rk', repeat('0123456789', 100000));
SELECT octet_length(body), md5(body) = md5(repeat('0123456789', 100000)) AS same,
       pg_column_size(body) < 100000 AS compressed
  FROM amqp.message WHERE id = amqp.last_message_id();
RESET amqp_outbox.max_message_size;
-- The id is unique: a sequence set back (a hostile or careless setval) gets the primary key's
-- error, 23505, and leaves nothing behind.
SELECT setval(pg_get_serial_sequence('amqp.message', 'id'), (SELECT min(id) FROM amqp.message) - 1);
CREATE FUNCTION pg_temp.sqlstate_of(stmt text) RETURNS text LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE stmt;
    RETURN 'no error';
EXCEPTION WHEN OTHERS THEN
    RETURN SQLSTATE;
END
$$;
SELECT pg_temp.sqlstate_of('SELECT amqp.publish(1, ''ex'', ''rk'', ''duplicate id'')') AS duplicate;
SELECT count(*) FROM amqp.message WHERE convert_from(body, 'UTF8') = 'duplicate id';
SELECT setval(pg_get_serial_sequence('amqp.message', 'id'), (SELECT max(id) FROM amqp.message));
-- A DBA's index is kept up to date.
CREATE INDEX message_business_key ON amqp.message (business_key);
SELECT amqp.publish_message(1, 'ex', 'rk', 'indexed', business_key => 'order-7') > 0 AS published;
SET enable_seqscan = off;
SET enable_bitmapscan = off;
SELECT convert_from(body, 'UTF8') AS body FROM amqp.message WHERE business_key = 'order-7';
RESET enable_seqscan;
RESET enable_bitmapscan;
DROP INDEX amqp.message_business_key;
-- A DBA's trigger fires (publish() falls back to an INSERT, and says why at DEBUG1).
CREATE FUNCTION pg_temp.audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE NOTICE 'audit: % %', TG_OP, convert_from(NEW.body, 'UTF8');
    RETURN NEW;
END
$$;
CREATE TRIGGER audit BEFORE INSERT ON amqp.message FOR EACH ROW EXECUTE FUNCTION pg_temp.audit();
SET client_min_messages = debug1;
SELECT amqp.publish(1, 'ex', 'rk', 'audited');
RESET client_min_messages;
SELECT amqp.publish(1, 'ex', 'rk', 'audited again');
-- With tags and an idempotency key (the id drawn before the row), through the INSERT as well;
-- a repeat publishes nothing.
SELECT amqp.publish_message(1, 'ex', 'rk', 'audited once', business_key => 'k-1',
                            idempotency_key => 'outbox-row-1') AS keyed \gset
SELECT amqp.publish_message(1, 'ex', 'rk', 'audited twice',
                            idempotency_key => 'outbox-row-1') = :keyed AS same_id;
SELECT convert_from(body, 'UTF8') AS body, business_key FROM amqp.message WHERE id = :keyed;
DELETE FROM amqp.idempotency_key;
DROP TRIGGER audit ON amqp.message;
SET client_min_messages = debug1;
SELECT amqp.publish(1, 'ex', 'rk', 'not audited');
RESET client_min_messages;
-- A DBA's CHECK constraint is enforced.
ALTER TABLE amqp.message ADD CONSTRAINT no_secrets CHECK (routing_key <> 'secret');
SELECT pg_temp.sqlstate_of('SELECT amqp.publish(1, ''ex'', ''secret'', ''x'')') AS dba_check;
SELECT amqp.publish(1, 'ex', 'public', 'allowed');
ALTER TABLE amqp.message DROP CONSTRAINT no_secrets;
-- A DBA's column gets its default.
ALTER TABLE amqp.message ADD COLUMN tenant text NOT NULL DEFAULT 'acme';
SELECT amqp.publish(1, 'ex', 'rk', 'with tenant');
SELECT tenant FROM amqp.message WHERE id = amqp.last_message_id();
ALTER TABLE amqp.message DROP COLUMN tenant;
-- A NOT NULL on a column publish() may leave empty is honoured.
BEGIN;
DELETE FROM amqp.message;
ALTER TABLE amqp.message ALTER COLUMN content_type SET NOT NULL;
SELECT pg_temp.sqlstate_of('SELECT amqp.publish(1, ''ex'', ''rk'', ''no content type'')') AS not_null;
SELECT amqp.publish(1, 'ex', 'rk', 'with content type', content_type => 'text/plain');
SELECT count(*) FROM amqp.message;
ROLLBACK;
-- Row security, even forced, does not apply to publish(): its rows are written for the
-- extension's owner, a superuser, whom no policy restricts (as when it ran an INSERT).
ALTER TABLE amqp.message ENABLE ROW LEVEL SECURITY;
ALTER TABLE amqp.message FORCE ROW LEVEL SECURITY;
CREATE POLICY only_rk ON amqp.message USING (true) WITH CHECK (routing_key = 'rk');
SELECT amqp.publish(1, 'ex', 'other', 'row security does not apply');
DROP POLICY only_rk ON amqp.message;
ALTER TABLE amqp.message NO FORCE ROW LEVEL SECURITY;
ALTER TABLE amqp.message DISABLE ROW LEVEL SECURITY;
-- Back to the extension's shape: the direct path again, and every row is there.
SET client_min_messages = debug1;
SELECT amqp.publish(1, 'ex', 'rk', 'last');
RESET client_min_messages;
SELECT convert_from(body, 'UTF8') AS body FROM amqp.message
 WHERE octet_length(body) < 100 ORDER BY id;
-- The statistics count every row publish() wrote (autovacuum's insert threshold reads them).
SELECT pg_stat_force_next_flush();
SELECT n_tup_ins >= 12 AS inserts_counted FROM pg_stat_user_tables
 WHERE schemaname = 'amqp' AND relname = 'message';
DELETE FROM amqp.message;
DELETE FROM amqp.broker WHERE broker_id = 1;
