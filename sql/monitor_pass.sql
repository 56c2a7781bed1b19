-- amqp_outbox: the monitor's pass (amqp._monitor()), in a file of its own so that an update
-- script can take it whole (CREATE OR REPLACE: its grants are monitor.sql's, kept by a replace).

-- The monitor's pass: (1) the receipts that came in are counted and their messages looked at
-- now; (2) at most max_messages due messages are classified from their answers and their rule,
-- set-based, each given its next look. Returns how many messages it looked at (max_messages:
-- more may be due).
--
-- A message is timed from its delivery to the broker (the latest resent copy's, after a
-- resend), never from its creation: an outage before delivery makes nothing late. It is late
-- when a consumer had not answered late_after after that: a state of time, shown by the views
-- as it comes (amqp._open), not a look of its own; the first look after it (an answer, or the
-- time it would be lost) records it (late_at: when it became late) and counts it. It is lost
-- when one has not answered lost_after after it and every receipt sent until then has been
-- collected (the subscriptions handled by amqp.record_receipt have seen their queue empty
-- since: a slow receipts queue makes nothing lost). Then: 'resend' sends it again (same
-- message_id) at most max_resends times, never while a copy waits in the outbox, and gives it
-- up as lost after that; 'compensate' records the silent consumers as failed ('lost' answers)
-- and compensates; 'report' gives it up as lost. Failures are compensated unless the rule says report (with a handler). Finished:
-- complete (every consumer answered ok), compensated, lost or failed; nothing changes a finished
-- message but its trace, and a compensation never runs for a consumer that answered ok.
CREATE OR REPLACE FUNCTION @extschema@._monitor(max_messages integer DEFAULT 5000) RETURNS integer
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $monitor$
DECLARE
    receipts_until timestamptz;
    looked integer;
BEGIN
    IF max_messages IS NULL OR max_messages < 1 THEN
        RAISE EXCEPTION 'amqp_outbox: max_messages must be at least 1' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- (1) Receipts of this database's messages, counted once per (message, consumer, status):
    -- a consumer answers a duplicate again. One that came before its message's record (the
    -- consumer was faster than the acknowledgement) is looked at again for an hour. Of a
    -- monitored message, only the answers of its expected consumers while it is not finished
    -- count: any other changes nothing but the trace.
    WITH c AS (
        UPDATE @extschema@.receipt x SET counted = true
          FROM @extschema@.produced p
         WHERE NOT x.counted AND x.received_at > now() - interval '1 hour'
           AND p.message_id = x.message_id AND p.message_at = x.message_at
        RETURNING x.message_id, x.message_at, x.consumer, x.status, p.business_type,
                  p.expected IS NULL
                  OR (x.consumer = ANY (p.expected) AND p.completed_at IS NULL) AS counts,
                  p.expected IS NOT NULL AND p.completed_at IS NULL AS open
    ), fresh AS (
        SELECT c.* FROM c
         WHERE c.counts AND NOT EXISTS (SELECT FROM @extschema@.receipt y
                            WHERE y.counted AND y.message_id = c.message_id AND y.message_at = c.message_at
                              AND y.consumer = c.consumer AND y.status = c.status)
    ), counted AS (
        INSERT INTO @extschema@._daily_stat AS s (day, business_type, part, consumed, failed)
        SELECT @extschema@._day(f.message_at), f.business_type, 1,
               count(DISTINCT (f.message_id, f.consumer)) FILTER (WHERE f.status = 'ok'),
               count(DISTINCT (f.message_id, f.consumer)) FILTER (WHERE f.status <> 'ok')
          FROM fresh f
         GROUP BY 1, 2
        ON CONFLICT ON CONSTRAINT _daily_stat_pkey
        DO UPDATE SET consumed = s.consumed + excluded.consumed, failed = s.failed + excluded.failed
    )
    UPDATE @extschema@.produced p SET check_at = now()
      FROM (SELECT DISTINCT c.message_id, c.message_at FROM c WHERE c.open) o
     WHERE p.message_id = o.message_id AND p.message_at = o.message_at AND p.completed_at IS NULL;

    -- How far receipts are collected: the earliest time since which every subscription that
    -- records them has seen its queue empty (none: all of them are, by definition).
    SELECT min(coalesce(st.caught_up_at, '-infinity'::timestamptz)) INTO receipts_until
      FROM @extschema@.subscription s
      LEFT JOIN @extschema@._subscription_state st ON st.subscription = s.subscription
     WHERE pg_catalog.to_regprocedure(s.handler) = '@extschema@.record_receipt(@extschema@.delivery)'::regprocedure;
    receipts_until := coalesce(receipts_until, now());

    -- (2) The due messages, oldest look first.
    WITH due AS (
        SELECT p.message_id, p.message_at, p.business_type, p.resends, p.late_at, p.lost_at,
               coalesce(p.redelivered_at, p.delivered_at) AS since,
               p.resends > 0 AND (p.redelivered_at IS NULL OR p.redelivered_at < p.last_resent_at) AS copy_waiting,
               p.body IS NOT NULL AS has_body,
               r.business_type IS NOT NULL AS ruled, r.late_after, r.lost_after, r.action, r.max_resends,
               EXISTS (SELECT FROM @extschema@.compensation_handler h
                        WHERE h.business_type = p.business_type) AS handler,
               a.ok, a.failed, a.silent, a.compensated, a.answered_by
          FROM @extschema@.produced p
          LEFT JOIN @extschema@.monitor_rule r ON r.business_type = p.business_type
          CROSS JOIN LATERAL (
              -- Each expected consumer's latest answer; one whose failure was compensated
              -- stays failed whatever it answers later.
              SELECT coalesce(array_agg(l.consumer) FILTER (WHERE l.status = 'ok' AND NOT l.done), '{}') AS ok,
                     coalesce(array_agg(l.consumer) FILTER (WHERE l.status <> 'ok' OR l.done), '{}') AS failed,
                     coalesce(array_agg(l.consumer) FILTER (WHERE l.status IS NULL AND NOT l.done), '{}') AS silent,
                     coalesce(array_agg(l.consumer) FILTER (WHERE l.done), '{}') AS compensated,
                     -- When the last of them first answered (now, while one is silent): late
                     -- if that is late_after or more after the delivery.
                     max(coalesce(l.first_at, now())) AS answered_by
                FROM (SELECT c.consumer, x.status, x.first_at,
                             EXISTS (SELECT FROM @extschema@.compensation k
                                      WHERE k.message_id = p.message_id AND k.consumer = c.consumer
                                        AND k.state = 'done') AS done
                        FROM unnest(p.expected) AS c(consumer)
                        -- The latest answer and the time of the first, in one read of its
                        -- receipts (the window's min is taken before the LIMIT).
                        LEFT JOIN LATERAL (
                            SELECT y.status, min(y.received_at) OVER () AS first_at
                              FROM @extschema@.receipt y
                             WHERE y.message_id = p.message_id AND y.message_at = p.message_at
                               AND y.consumer = c.consumer
                             ORDER BY y.received_at DESC LIMIT 1) x ON true) l
          ) a
         WHERE p.check_at <= now() AND p.completed_at IS NULL
         ORDER BY p.check_at
         LIMIT max_messages
    ), timed AS (
        SELECT due.*,
               -- An answer is missing, and the clock runs (no copy waits in the outbox).
               ruled AND cardinality(silent) > 0 AND NOT copy_waiting AS waiting,
               coalesce(action = 'resend' AND resends < max_resends AND has_body, false) AS may_resend,
               coalesce(action <> 'report' AND handler, false) AS compensable
          FROM due
    ), judged AS (
        SELECT timed.*,
               -- Late: an answer missing late_after after the delivery, or one that came later.
               ruled AND NOT copy_waiting AND answered_by >= since + late_after AS is_late,
               waiting AND now() >= since + lost_after AND receipts_until >= since + lost_after AS is_lost
          FROM timed
    ), acted AS (
        SELECT judged.*,
               is_lost AND may_resend AS resend,
               is_lost AND NOT may_resend AS give_up,
               is_lost AND NOT may_resend AND action = 'compensate' AS silent_fail
          FROM judged
    ), failures AS (
        SELECT acted.*,
               CASE WHEN silent_fail THEN failed || silent ELSE failed END AS all_failed
          FROM acted
    ), decided AS (
        SELECT failures.*,
               CASE WHEN NOT ruled THEN 'unmonitored'
                    WHEN cardinality(silent) = 0 AND cardinality(failed) = 0 THEN 'complete'
                    WHEN give_up AND NOT silent_fail THEN 'lost'
                    WHEN (cardinality(silent) = 0 OR silent_fail) AND NOT compensable THEN
                         CASE WHEN silent_fail THEN 'lost' ELSE 'failed' END
                    WHEN (cardinality(silent) = 0 OR silent_fail) AND all_failed <@ compensated
                         THEN 'compensated'
               END AS outcome
          FROM failures
    ), planned AS (
        SELECT decided.*,
               CASE WHEN outcome IS NOT NULL THEN NULL
                    -- Resent, or a copy waits in the outbox: its delivery brings the next look
                    -- (this one is a fallback).
                    WHEN resend OR copy_waiting THEN now() + lost_after
                    -- Waits for its compensations (each one done brings the next look).
                    WHEN cardinality(silent) = 0 OR silent_fail THEN NULL
                    WHEN now() < since + lost_after THEN since + lost_after
                    -- Due, but receipts are not collected that far yet: not before the
                    -- collection could have caught up (at least a second, at most lost_after
                    -- later), so that an outage does not have every such message looked at
                    -- every second.
                    WHEN receipts_until = '-infinity' THEN now() + lost_after
                    ELSE now() + least(greatest(since + lost_after - receipts_until, interval '1 second'),
                                       lost_after)
               END AS next_check
          FROM decided
    ), upd AS (
        UPDATE @extschema@.produced p
           SET check_at = n.next_check,
               answered_ok = n.ok,
               answered_failed = n.all_failed,
               late_at = CASE WHEN n.is_late AND p.late_at IS NULL THEN n.since + n.late_after ELSE p.late_at END,
               lost_at = CASE WHEN n.give_up AND p.lost_at IS NULL THEN now() ELSE p.lost_at END,
               resends = p.resends + CASE WHEN n.resend THEN 1 ELSE 0 END,
               last_resent_at = CASE WHEN n.resend THEN now() ELSE p.last_resent_at END,
               completed_at = CASE WHEN n.outcome IS NOT NULL THEN now() END,
               outcome = n.outcome
          FROM planned n
         WHERE p.message_id = n.message_id AND p.message_at = n.message_at
        RETURNING p.message_id, p.message_at, p.business_type, p.resends, n.lost_after,
                  n.is_late AND n.late_at IS NULL AS newly_late, n.give_up AND n.lost_at IS NULL AS newly_lost,
                  n.resend,
                  n.silent_fail, n.silent, n.ok, n.all_failed, n.compensable
    ), copies AS (
        INSERT INTO @extschema@.message (broker_id, exchange, routing_key, body, delivery_mode,
                                         content_type, reply_to, correlation_id, headers, created_at,
                                         message_id, business_type, business_key, traceparent,
                                         system_id, host_id, resends)
        SELECT q.broker_id, q.exchange, q.routing_key, q.body, coalesce(q.delivery_mode, 2),
               q.content_type, q.reply_to, q.correlation_id, q.headers, q.created_at,
               q.message_id, q.business_type, q.business_key, q.traceparent,
               q.system_id, q.host_id, u.resends
          FROM upd u
          JOIN @extschema@.produced q ON q.message_id = u.message_id AND q.message_at = u.message_at
         WHERE u.resend
    ), lost_answers AS (
        INSERT INTO @extschema@.receipt (message_id, message_at, consumer, status, error, business_type, counted)
        SELECT u.message_id, u.message_at, s.consumer, 'lost',
               format('no receipt within %s of its delivery', u.lost_after), u.business_type, true
          FROM upd u, unnest(u.silent) AS s(consumer)
         WHERE u.silent_fail
    ), queued AS (
        INSERT INTO @extschema@.compensation AS k (message_id, consumer, message_at, business_type)
        SELECT u.message_id, f.consumer, u.message_at, u.business_type
          FROM upd u, unnest(u.all_failed) AS f(consumer)
         WHERE u.compensable
        ON CONFLICT (message_id, consumer) DO UPDATE SET state = 'pending', done_at = NULL, next_attempt_at = now()
         WHERE k.state = 'cancelled'
    ), cancelled AS (
        -- Answered ok since its failure: its compensation, not run yet, never runs.
        UPDATE @extschema@.compensation k SET state = 'cancelled', done_at = now()
          FROM upd u, unnest(u.ok) AS o(consumer)
         WHERE k.message_id = u.message_id AND k.consumer = o.consumer AND k.state = 'pending'
    ), stats AS (
        INSERT INTO @extschema@._daily_stat AS s (day, business_type, part, late, lost, resent)
        SELECT @extschema@._day(u.message_at), u.business_type, 1,
               count(*) FILTER (WHERE u.newly_late), count(*) FILTER (WHERE u.newly_lost),
               count(*) FILTER (WHERE u.resend)
          FROM upd u
         WHERE u.newly_late OR u.newly_lost OR u.resend
         GROUP BY 1, 2
        ON CONFLICT ON CONSTRAINT _daily_stat_pkey
        DO UPDATE SET late = s.late + excluded.late, lost = s.lost + excluded.lost,
                      resent = s.resent + excluded.resent
    )
    SELECT count(*) INTO looked FROM upd;
    RETURN looked;
END
$monitor$;
