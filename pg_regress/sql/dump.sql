-- What pg_dump keeps, and the stored message_id that makes a restored message the same message.
\set VERBOSITY terse
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS amqp_outbox;
RESET client_min_messages;
-- Exactly the user's tables and the sequences behind their ids are dumped, with all their rows.
SELECT x::regclass AS dumped, c.relkind
  FROM pg_extension e, unnest(e.extconfig) x JOIN pg_class c ON c.oid = x
 WHERE e.extname = 'amqp_outbox'
 ORDER BY x::regclass::text;
SELECT extcondition FROM pg_extension WHERE extname = 'amqp_outbox';
-- No table or sequence of the extension is left out (the list must grow with the schema), but
-- the four that hold the workers' state: _consumed_since (when each hot consumption table was
-- last emptied; a restore restarts it), _subscription_state (status counters),
-- _monitor_summary (the monitor's counts, made again every few seconds) and inbox_waiting
-- (deliveries waiting for a lane, still unacknowledged in their queue); and the parents of
-- the tables partitioned by day (the consumption archive, the production log, receipts), which
-- hold no rows: their day partitions are made at run time, so pg_dump dumps them as tables of
-- their own, rows included (their default partitions are the extension's, and dumped).
SELECT c.oid::regclass AS not_dumped
  FROM pg_class c
 WHERE c.relnamespace = 'amqp'::regnamespace AND c.relkind IN ('r', 'p', 'S')
   AND NOT (c.relispartition AND c.relname ~ '_[0-9]{8}$')
   AND c.oid <> ALL ((SELECT extconfig FROM pg_extension WHERE extname = 'amqp_outbox')::oid[])
 ORDER BY 1;
-- CREATE EXTENSION fills none of them, so nothing is dumped twice.
SELECT (SELECT count(*) FROM amqp.broker) + (SELECT count(*) FROM amqp.exchange)
     + (SELECT count(*) FROM amqp.queue) + (SELECT count(*) FROM amqp.binding)
     + (SELECT count(*) FROM amqp.message) + (SELECT count(*) FROM amqp.discarded)
     + (SELECT count(*) FROM amqp.subscription) + (SELECT count(*) FROM amqp.inbox_failed)
     + (SELECT count(*) FROM amqp._consumed_a) + (SELECT count(*) FROM amqp._consumed_b) AS rows_at_create;
BEGIN;
INSERT INTO amqp.broker (broker_id, host) VALUES (1, '127.0.0.1');
SELECT amqp.publish(1, 'orders', 'a', 'one'), amqp.publish(1, 'orders', 'b', 'two'),
       amqp.publish(1, 'orders', 'c', 'three');
-- Each message gets its own UUIDv7 when it is inserted, stored in the row.
SELECT count(DISTINCT message_id) AS distinct_ids,
       bool_and(message_id ~ '^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$')
           AS all_uuid_v7
  FROM amqp.message;
-- Its leading 48 bits are the time of the INSERT, in milliseconds.
SELECT bool_and(abs(('x' || lpad(replace(left(message_id, 13), '-', ''), 16, '0'))::bit(64)::bigint
                    - (extract(epoch FROM clock_timestamp()) * 1000)::bigint) < 60000)
           AS time_ordered
  FROM amqp.message;
-- The views show it.
SELECT count(*) AS shown FROM amqp.message_status s JOIN amqp.message m USING (message_id);
-- A direct INSERT gets one too, or keeps the one it brings (a key of the caller's choosing).
INSERT INTO amqp.message (broker_id, exchange, routing_key, body)
VALUES (1, 'orders', 'd', 'four');
INSERT INTO amqp.message (broker_id, exchange, routing_key, body, message_id)
VALUES (1, 'orders', 'e', 'five', 'order-42-created');
SELECT routing_key, length(message_id) FROM amqp.message WHERE routing_key IN ('d', 'e') ORDER BY 1;
-- What AMQP cannot carry is refused.
SAVEPOINT s;
INSERT INTO amqp.message (broker_id, exchange, routing_key, body, message_id)
VALUES (1, 'orders', 'f', 'six', '');
ROLLBACK TO s;
INSERT INTO amqp.message (broker_id, exchange, routing_key, body, message_id)
VALUES (1, 'orders', 'f', 'six', repeat('x', 256));
ROLLBACK TO s;
-- A discarded message keeps its message_id.
SELECT message_id AS discarded_id FROM amqp.message WHERE routing_key = 'a' \gset
UPDATE amqp.message SET parked_at = now() WHERE routing_key = 'a';
SELECT amqp.discard(id, 'test') FROM amqp.message WHERE routing_key = 'a';
SELECT message_id = :'discarded_id' AS same_id FROM amqp.discarded;
ROLLBACK;
-- pg_upgrade refuses a cluster whose tables have a column of these types (or of a domain, array
-- or row type built on one): the OIDs they hold are not kept across the upgrade. The extension
-- has none (a handler is kept by name), so a database with it can be upgraded.
CREATE TEMP VIEW refused_by_pg_upgrade AS
WITH RECURSIVE refused(oid) AS (
    SELECT t.oid FROM pg_type t
     WHERE t.typname IN ('regcollation', 'regconfig', 'regdictionary', 'regnamespace', 'regoper',
                         'regoperator', 'regproc', 'regprocedure')
       AND t.typnamespace = 'pg_catalog'::regnamespace
    UNION
    SELECT t.oid FROM pg_type t, refused r
     WHERE t.typbasetype = r.oid OR t.typelem = r.oid
        OR EXISTS (SELECT FROM pg_attribute a WHERE a.attrelid = t.typrelid
                      AND a.atttypid = r.oid AND NOT a.attisdropped)
)
SELECT c.relnamespace::regnamespace AS schema, c.oid::regclass AS relation, a.attname,
       a.atttypid::regtype AS type
  FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
 WHERE c.relkind IN ('r', 'p', 'm', 'i') AND a.atttypid IN (SELECT oid FROM refused);
-- The check finds such columns (a domain over an array, here)...
CREATE DOMAIN regress_handlers AS regprocedure[];
CREATE TABLE regress_upgrade_blocker (h regress_handlers, n regnamespace);
SELECT relation, attname, type FROM refused_by_pg_upgrade WHERE schema = 'public'::regnamespace ORDER BY 1, 2;
DROP TABLE regress_upgrade_blocker;
DROP DOMAIN regress_handlers;
-- ...and none in the extension's schema.
SELECT relation, attname, type FROM refused_by_pg_upgrade WHERE schema = 'amqp'::regnamespace ORDER BY 1, 2;
