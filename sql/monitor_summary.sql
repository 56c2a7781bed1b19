-- amqp_outbox: the counts amqp.health() reads (amqp._summarize()), in a file of its own so that
-- an update script can take it whole.

-- Fills amqp._monitor_summary from amqp._open: every open message is read, so the monitor runs
-- it every few seconds at most (less often when it takes long, see the engine's monitor). The
-- messages are counted per status first, then the four statuses get their rows (a join of every
-- open message with the statuses kept each one in memory, spilling to disk at 200,000).
CREATE OR REPLACE FUNCTION @extschema@._summarize() RETURNS void
    LANGUAGE sql SET search_path = pg_catalog, pg_temp AS $summarize$
    DELETE FROM @extschema@._monitor_summary;
    INSERT INTO @extschema@._monitor_summary (status, messages, recent, oldest, counted_at)
    SELECT s.status, coalesce(c.messages, 0), coalesce(c.recent, 0), c.oldest, now()
      FROM unnest(ARRAY['pending', 'late', 'lost', 'failed']) AS s(status)
      LEFT JOIN (SELECT o.status, count(*) AS messages,
                        count(*) FILTER (WHERE o.lost_at > now() - interval '1 hour') AS recent,
                        min(o.created_at) AS oldest
                   FROM @extschema@._open o
                  GROUP BY o.status) c ON c.status = s.status;
$summarize$;

REVOKE ALL ON FUNCTION @extschema@._summarize() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@._summarize() TO amqp_outbox_admin;
