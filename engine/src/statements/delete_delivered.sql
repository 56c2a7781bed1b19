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
SELECT count(*) FROM d
