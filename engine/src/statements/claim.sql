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
 ORDER BY id
