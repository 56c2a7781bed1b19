-- amqp_outbox: amqp.trace(), a message's story from every table that knows of it. CREATE OR
-- REPLACE, after every table it reads (amqp.scheduled_message included), so that the update
-- script can take this file as it is.
CREATE OR REPLACE FUNCTION @extschema@.trace(message_id text)
    RETURNS TABLE (at timestamptz, event text, detail text)
    -- Readable by operators (pg_monitor) without rights on the tables: a message's story, not
    -- its body.
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $trace$
    WITH p AS (
        SELECT * FROM @extschema@.produced p
         WHERE p.message_id = trace.message_id
           AND p.message_at = coalesce(@extschema@._uuid7_time(trace.message_id), p.message_at)
    )
    SELECT * FROM (
        SELECT created_at, 'produced',
               pg_catalog.format('%s / %s, business type %s, key %s, by pid %s on %s@%s', exchange, routing_key,
                                 business_type, coalesce(business_key, '-'), producer_pid, system_id, host_id)
          FROM p
        UNION ALL SELECT published_at, 'published',
               pg_catalog.format('broker %s, seq %s, %s failed or repeated attempt(s)', broker_id, seq, attempts)
          FROM p WHERE published_at IS NOT NULL
        UNION ALL SELECT confirmed_at, 'confirmed', 'by the broker' FROM p WHERE confirmed_at IS NOT NULL
        UNION ALL SELECT acknowledged_at, 'acknowledged', 'seen on the acknowledgement queue' FROM p WHERE acknowledged_at IS NOT NULL
        UNION ALL SELECT delivered_at, 'delivered', 'outbox row deleted' FROM p
        UNION ALL SELECT late_at, 'late', pg_catalog.format('no answer from every consumer in time (expected %s)', expected) FROM p WHERE late_at IS NOT NULL
        UNION ALL SELECT lost_at, 'lost', pg_catalog.format('expected %s', expected) FROM p WHERE lost_at IS NOT NULL
        UNION ALL SELECT last_resent_at, 'resent', pg_catalog.format('%s time(s), same message_id', resends) FROM p WHERE last_resent_at IS NOT NULL
        UNION ALL SELECT redelivered_at, 'delivered again', 'the latest resent copy reached the broker' FROM p WHERE redelivered_at IS NOT NULL
        UNION ALL SELECT r.received_at, CASE r.status WHEN 'ok' THEN 'consumed' ELSE r.status END,
               r.consumer OPERATOR(pg_catalog.||) coalesce(': ' OPERATOR(pg_catalog.||) r.error, '')
          FROM @extschema@.receipt r
         WHERE r.message_id = trace.message_id
           AND r.message_at = coalesce(@extschema@._uuid7_time(trace.message_id), r.message_at)
        UNION ALL SELECT coalesce(c.done_at, c.created_at),
               CASE c.state WHEN 'done' THEN 'compensated' WHEN 'cancelled' THEN 'compensation cancelled'
                            ELSE 'compensation pending' END,
               pg_catalog.format('%s, %s attempt(s)%s', c.consumer, c.attempts,
                                 coalesce(', last error: ' OPERATOR(pg_catalog.||) c.last_error, ''))
          FROM @extschema@.compensation c WHERE c.message_id = trace.message_id
        UNION ALL SELECT completed_at, 'finished', outcome FROM p WHERE completed_at IS NOT NULL
        UNION ALL SELECT m.created_at, CASE WHEN m.resends > 0 THEN 'resend waiting' ELSE 'produced' END,
               pg_catalog.format('in the outbox: %s / %s, %s attempt(s)%s', m.exchange, m.routing_key, m.attempts,
                                 coalesce(', last error: ' OPERATOR(pg_catalog.||) m.last_error, ''))
          FROM @extschema@.message m WHERE m.message_id = trace.message_id
        UNION ALL SELECT s.created_at, 'scheduled',
               pg_catalog.format('for %s: %s / %s%s', s.deliver_at, s.exchange, s.routing_key,
                                 coalesce(', last error: ' OPERATOR(pg_catalog.||) s.last_error, ''))
          FROM @extschema@.scheduled_message s WHERE s.message_id = trace.message_id
        UNION ALL SELECT m.parked_at, 'parked', m.last_error
          FROM @extschema@.message m WHERE m.message_id = trace.message_id AND m.parked_at IS NOT NULL
        UNION ALL SELECT d.discarded_at, 'discarded', pg_catalog.format('by %s: %s', d.discarded_by, coalesce(d.reason, '-'))
          FROM @extschema@.discarded d WHERE d.message_id = trace.message_id
    ) t (at, event, detail)
    ORDER BY at, event
$trace$;
COMMENT ON FUNCTION @extschema@.trace(text) IS
    'The life of one message in time order: produced, scheduled (published for later, not due yet), published, confirmed, acknowledged, delivered, late, lost, resent, delivered again, consumed or failed at each consumer, compensated or compensation cancelled, finished, parked, discarded.';

REVOKE ALL ON FUNCTION @extschema@.trace(text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.trace(text) TO pg_monitor;
GRANT EXECUTE ON FUNCTION @extschema@.trace(text) TO amqp_outbox_admin;
