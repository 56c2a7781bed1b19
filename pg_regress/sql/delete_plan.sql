-- The plan of the worker's DELETE of delivered rows. The statement below is the text of
-- engine/src/statements/delete_delivered.sql, which the worker runs (a unit test checks that this file
-- holds it unchanged). It must read amqp.message only through the ids it is given, whatever
-- the table's statistics say when the worker plans it: a plan made from an empty table's
-- statistics that scanned the whole index once per deleted row cost seconds per statement once
-- a long transaction kept the deleted rows' index entries. The worker is off (regress.conf).
\set VERBOSITY terse
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS amqp_outbox;
RESET client_min_messages;
BEGIN;
-- As the worker runs it: its search_path and planner settings are pinned at start
-- (src/worker/mod.rs).
SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL enable_bitmapscan = off;
SET LOCAL enable_sort = off;
SET LOCAL enable_seqscan = off;
SET LOCAL jit = off;
-- The statistics of an empty table, as autovacuum or the worker's truncation leave them (the
-- tests before this one left pages behind).
TRUNCATE amqp.message;
ANALYZE amqp.message;
SELECT relpages, reltuples FROM pg_class WHERE oid = 'amqp.message'::regclass;
PREPARE delete_delivered(bigint[], bigint[], bigint[], bigint[], boolean, text, text, bigint[]) AS
WITH t AS (
    SELECT * FROM unnest($1::int8[], $2::int8[], $3::int8[], $4::int8[], $8::int8[])
        AS t (id, published, confirmed, acknowledged, message_at)
), d AS (
    DELETE FROM amqp.message m USING t
     WHERE m.id = ANY ($1) AND m.id = t.id
    RETURNING m.id, m.message_id, m.broker_id, m.exchange, m.routing_key, m.system_id,
              m.host_id, m.business_key, m.traceparent, m.producer_pid, m.producer_started_at,
              m.created_at, m.attempts, m.resends, t.published, t.confirmed, t.acknowledged,
              -- float8, not numeric: numeric becomes float8 through text (same values).
              to_timestamp(t.message_at / 1e6::float8) AS message_at,
              coalesce(m.business_type, m.routing_key) AS kind,
              -- The first EXISTS runs once per statement: without rules, no lookup per row.
              CASE WHEN EXISTS (SELECT FROM amqp.monitor_rule)
                         AND EXISTS (SELECT FROM amqp.monitor_rule k
                                      WHERE k.business_type = coalesce(m.business_type, m.routing_key))
                   THEN m END AS kept
), p AS (
    INSERT INTO amqp.produced (message_id, message_at, seq, broker_id, exchange, routing_key,
        system_id, host_id, business_type, business_key, traceparent, producer_pid,
        producer_started_at, created_at, published_at, confirmed_at, acknowledged_at, attempts,
        expected, body, headers, delivery_mode, content_type, reply_to, correlation_id, check_at)
    SELECT d.message_id, d.message_at, d.id, d.broker_id, d.exchange, d.routing_key,
           coalesce(d.system_id, $6), coalesce(d.host_id, $7), d.kind, d.business_key,
           d.traceparent, d.producer_pid, d.producer_started_at, d.created_at,
           to_timestamp(d.published / 1e6::float8), to_timestamp(d.confirmed / 1e6::float8),
           to_timestamp(d.acknowledged / 1e6::float8), d.attempts, r.consumers,
           (d.kept).body, (d.kept).headers, (d.kept).delivery_mode, (d.kept).content_type,
           (d.kept).reply_to, (d.kept).correlation_id,
           -- The monitor's first look: when it would be lost (a receipt brings it sooner;
           -- being late needs no look).
           now() + r.lost_after
      FROM d LEFT JOIN amqp.monitor_rule r ON r.business_type = d.kind
     WHERE $5 AND d.resends = 0
), again AS (
    -- A copy the monitor resent reached the broker: the message's clock starts again.
    UPDATE amqp.produced x
       SET redelivered_at = now(),
           check_at = CASE WHEN x.completed_at IS NULL THEN now() ELSE x.check_at END
      FROM d
     WHERE $5 AND d.resends > 0 AND x.message_id = d.message_id AND x.message_at = d.message_at
), s AS (
    INSERT INTO amqp._daily_stat AS s (day, business_type, part, delivered)
    SELECT (d.message_at AT TIME ZONE 'UTC')::date, d.kind, 0, count(*) FROM d
     WHERE d.resends = 0
     GROUP BY 1, 2
    ON CONFLICT (day, business_type, part) DO UPDATE SET delivered = s.delivered + excluded.delivered
)
SELECT count(*) FROM d;
-- Kept prepared, the worker's statement ends up with a generic plan: amqp.message is read
-- through `id = ANY ($1)` and nowhere else (no second scan of the table).
SET LOCAL plan_cache_mode = force_generic_plan;
EXPLAIN (COSTS OFF) EXECUTE delete_delivered('{1,2}', '{1,2}', '{1,2}', '{1,2}', true, 's', 'h', '{1,2}');
RESET plan_cache_mode;
-- What it does: deletes the proven rows, logs them with their times, keeps the body and
-- properties of monitored business types only, and counts them in the day's statistics.
INSERT INTO amqp.broker (broker_id, host) VALUES (1, '127.0.0.1');
INSERT INTO amqp.monitor_rule (business_type, consumers) VALUES ('watched', '{billing}');
INSERT INTO amqp.message (producer_started_at, broker_id, exchange, routing_key, body,
                          content_type, headers, business_type)
SELECT now(), 1, 'ex', CASE WHEN i <= 2 THEN 'watched' ELSE 'other' END,
       convert_to('body ' || i, 'UTF8'), 'text/plain', '{"h": 1}', NULL
  FROM generate_series(1, 5) AS i;
-- One row stays: only the ids given go.
SELECT array_agg(id ORDER BY id) FILTER (WHERE n <= 4) AS ids,
       array_agg(1000000 * n ORDER BY id) FILTER (WHERE n <= 4) AS times
  FROM (SELECT id, row_number() OVER (ORDER BY id) AS n FROM amqp.message) m \gset
EXECUTE delete_delivered(:'ids', :'times', :'times', NULL, true, 'sys', 'host', :'times');
SELECT count(*) AS left_in_outbox FROM amqp.message;
SELECT routing_key, business_type, system_id, host_id, expected,
       convert_from(body, 'UTF8') AS body, headers, content_type,
       extract(epoch FROM published_at) AS published, acknowledged_at,
       check_at - now() AS first_look_in
  FROM amqp.produced ORDER BY seq;
-- A copy the monitor resent reaches the broker: its record is stamped and due at once; the
-- copy is not logged or counted again.
INSERT INTO amqp.message (producer_started_at, broker_id, exchange, routing_key, body, message_id, resends)
SELECT now(), 1, 'ex', 'watched', 'copy', p.message_id, 1 FROM amqp.produced p ORDER BY seq LIMIT 1;
SELECT array_agg(id) AS ids, array_agg(1000000 * extract(epoch FROM p.message_at)::bigint) AS times
  FROM amqp.message m JOIN amqp.produced p USING (message_id) WHERE m.resends = 1 \gset
EXECUTE delete_delivered(:'ids', :'times', :'times', NULL, true, 'sys', 'host', :'times');
SELECT redelivered_at = now() AS redelivered, check_at = now() AS due_now,
       (SELECT count(*) FROM amqp.produced q WHERE q.message_id = p.message_id) AS records
  FROM amqp.produced p WHERE redelivered_at IS NOT NULL;
SELECT business_type, delivered FROM amqp._daily_stat WHERE part = 0 ORDER BY business_type;
-- With the production log off ($5), rows still go and are counted, but not logged.
SELECT array_agg(id) AS ids, array_agg(5000000::bigint) AS times FROM amqp.message \gset
EXECUTE delete_delivered(:'ids', :'times', :'times', :'times', false, 'sys', 'host', :'times');
SELECT count(*) AS left_in_outbox, (SELECT count(*) FROM amqp.produced) AS logged
  FROM amqp.message;
SELECT business_type, delivered FROM amqp._daily_stat WHERE part = 0 ORDER BY business_type;
ROLLBACK;
