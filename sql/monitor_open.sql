-- amqp_outbox: the monitored messages as the monitor last classified them (amqp._open), in a
-- file of its own so that an update script can take it whole (CREATE OR REPLACE: its grants
-- are monitor.sql's, kept by a replace).

-- The monitored messages not finished, and those finished lost or failed, as the monitor last
-- classified them: pending (no answer missing yet), late, failed, lost. Late is a state of time,
-- read here as it comes: an answer missing late_after after the delivery (the latest resent
-- copy's) while no copy waits in the outbox, or late_at, which the monitor records at its first
-- look after that.
CREATE OR REPLACE VIEW @extschema@._open AS
    SELECT p.message_id, p.message_at, p.business_type, p.business_key, p.created_at,
           p.delivered_at, p.expected, p.resends, p.last_resent_at, p.late_at, p.lost_at,
           r.late_after, r.lost_after, r.action,
           coalesce(p.answered_ok, '{}') AS ok, coalesce(p.answered_failed, '{}') AS failed,
           ARRAY(SELECT c.c FROM pg_catalog.unnest(p.expected) AS c(c)
                  WHERE NOT c.c OPERATOR(pg_catalog.=) ANY (coalesce(p.answered_ok, '{}')
                                                            OPERATOR(pg_catalog.||) coalesce(p.answered_failed, '{}'))) AS silent,
           CASE WHEN p.outcome IS NOT NULL THEN p.outcome
                WHEN pg_catalog.cardinality(p.answered_failed) OPERATOR(pg_catalog.>) 0 THEN 'failed'
                WHEN p.late_at IS NOT NULL THEN 'late'
                -- (Cheap tests only: amqp._summarize() reads every open message. A consumer
                -- is silent when not every expected one answered ok: one that failed made the
                -- message 'failed' above.)
                WHEN (coalesce(p.redelivered_at, p.delivered_at) OPERATOR(pg_catalog.+) r.late_after)
                         OPERATOR(pg_catalog.<=) pg_catalog.now()
                     AND (p.resends OPERATOR(pg_catalog.=) 0
                          OR p.redelivered_at OPERATOR(pg_catalog.>=) p.last_resent_at)
                     AND coalesce(pg_catalog.cardinality(p.answered_ok), 0)
                         OPERATOR(pg_catalog.<) pg_catalog.cardinality(p.expected)
                     THEN 'late'
                ELSE 'pending' END AS status,
           p.check_at, p.outcome, p.completed_at
      FROM @extschema@.produced p
      LEFT JOIN @extschema@.monitor_rule r ON r.business_type OPERATOR(pg_catalog.=) p.business_type
     WHERE p.expected IS NOT NULL AND (p.completed_at IS NULL OR p.outcome IN ('lost', 'failed'));
