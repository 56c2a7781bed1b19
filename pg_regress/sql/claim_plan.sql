-- The plan of the worker's claim. The statement below is the text of engine/src/statements/claim.sql,
-- which the worker runs (a unit test checks that this file holds it unchanged). On a backlog it
-- must read amqp.message from its lowest id through the primary key and stop after LIMIT rows:
-- an index scan, never a Sort of the whole table. The worker is off (regress.conf): rows stay.
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
INSERT INTO amqp.broker (broker_id, host) VALUES (1, '127.0.0.1'), (2, '127.0.0.1');
-- A backlog of 20,000 rows for two brokers, a few refused (waiting for a retry) or parked.
INSERT INTO amqp.message (producer_started_at, broker_id, exchange, routing_key, body,
                          attempts, next_attempt_at, parked_at)
SELECT now(), 1 + i % 2, 'ex', 'rk', convert_to(repeat('x', 200), 'UTF8'),
       CASE WHEN i % 100 = 0 THEN 1 ELSE 0 END,
       CASE WHEN i % 100 = 0 THEN now() + interval '1 minute' END,
       CASE WHEN i % 1000 = 0 THEN now() END
  FROM generate_series(1, 20000) AS i;
PREPARE claim(integer[], bigint, bigint[], bigint, bigint) AS
SELECT id, broker_id, exchange, routing_key, body, delivery_mode, content_type, reply_to,
       correlation_id, headers::text, producer_pid, producer_started_at, created_at,
       attempts, message_id, business_type, business_key, traceparent, system_id, host_id,
       xmin::text::int8 AS writer
  FROM (SELECT id, broker_id, exchange, routing_key, body, delivery_mode, content_type,
               reply_to, correlation_id, headers, producer_pid, producer_started_at, created_at,
               attempts, message_id, business_type, business_key, traceparent, system_id,
               host_id, xmin, octet_length(body) AS size,
               sum(octet_length(body)) OVER (ORDER BY id) AS upto
          FROM amqp.message
         WHERE id > $5
           AND broker_id = ANY ($1)
           AND parked_at IS NULL
           AND (next_attempt_at IS NULL OR next_attempt_at <= now())
           -- Hashed once per run; `id <> ALL ($3)` compared each row with every id in flight.
           AND id NOT IN (SELECT unnest($3::int8[]))
         ORDER BY id
         LIMIT $2) candidates
 WHERE upto - size < $4
 ORDER BY id;
-- The worker's parameters: its connected brokers, batch_size (500), the ids it has in flight
-- or holds back, the byte budget (max_in_flight_bytes), and the scan floor (src/worker/
-- scan_floor.rs): the index scan starts there, past the rows in flight and the index entries
-- of deleted rows.
-- Planned before the table's statistics know of the backlog (a kept plan made while the table
-- was empty or just truncated): still the index, never a sort of the whole table.
EXPLAIN (COSTS OFF) EXECUTE claim('{1,2}', 500, '{1,2,3}', 33554432, 0);
ANALYZE amqp.message;
EXPLAIN (COSTS OFF) EXECUTE claim('{1,2}', 500, '{1,2,3}', 33554432, 0);
-- The worker keeps the statement prepared: after a few executions PostgreSQL may switch to a
-- generic plan, which must read the same way.
SET LOCAL plan_cache_mode = force_generic_plan;
EXPLAIN (COSTS OFF) EXECUTE claim('{1,2}', 500, '{1,2,3}', 33554432, 10000);
-- And it takes the first due rows in id order, up to the byte budget (five bodies of 200 bytes
-- start below 1000).
RESET plan_cache_mode;
CREATE TEMP TABLE claimed ON COMMIT DROP AS EXECUTE claim('{1,2}', 500, '{}', 1000, 0);
SELECT count(*) AS claimed, min(id) = (SELECT min(id) FROM amqp.message) AS from_the_lowest
  FROM claimed;
-- From a floor, the first rows above it.
SELECT min(id) + 10 AS floor FROM amqp.message \gset
CREATE TEMP TABLE claimed_above ON COMMIT DROP AS EXECUTE claim('{1,2}', 3, '{}', 33554432, :floor);
SELECT array_agg(id - (SELECT min(id) FROM amqp.message) ORDER BY id) AS above_the_floor
  FROM claimed_above;
-- The probe the worker runs before each claim, in the claim's snapshot, to move the floor: the
-- snapshot's xmin, xmax and running transaction ids, and the sequence's last value; one row while
-- the sequence hands out ids in order (cache 1, no cycle). (The worker binds the sequence's oid
-- and reads the next transaction id after it.)
SELECT last_value >= (SELECT max(id) FROM amqp.message) AS last_value_covers_the_rows,
       xmin <= xmax AS xmin_is_a_lower_bound,
       running = ARRAY(SELECT x FROM unnest(running) AS x ORDER BY 1) AS running_sorted
  FROM (SELECT pg_snapshot_xmin(c.snap)::text::int8 AS xmin,
               pg_snapshot_xmax(c.snap)::text::int8 AS xmax,
               ARRAY(SELECT x::text::int8 FROM pg_snapshot_xip(c.snap) AS x ORDER BY 1) AS running,
               coalesce(pg_sequence_last_value(s.seqrelid), 0) AS last_value
          FROM pg_sequence s, pg_current_snapshot() AS c (snap)
         WHERE s.seqrelid = pg_get_serial_sequence('amqp.message', 'id')::regclass
           AND s.seqcache = 1 AND NOT s.seqcycle) probe;
ROLLBACK;
