-- amqp_outbox: amqp.health(), for probes and exporters: one row per check. CREATE OR REPLACE,
-- so that the update script can take this file as it is.
CREATE OR REPLACE FUNCTION @extschema@.health()
    RETURNS TABLE (component text, status text, detail text)
    -- For probes and exporters that run as pg_monitor: counts and states, no message content.
    LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $health$
DECLARE
    w record;
    b record;
    oldest interval;
    n bigint;
    shown text;
    counted timestamptz;
    names text[];
    lag bigint;
BEGIN
    SELECT * INTO w FROM @extschema@.worker_status s WHERE s.database = pg_catalog.current_database() LIMIT 1;
    component := 'worker';
    IF w IS NULL OR w.worker_pid IS NULL THEN
        status := 'critical';
        detail := pg_catalog.format('no outbox worker runs for this database (%s)', coalesce(w.state, 'not served'));
    ELSIF w.state NOT IN ('running', 'starting') THEN
        status := 'warning';
        detail := pg_catalog.format('outbox worker pid %s is %s', w.worker_pid, w.state);
    ELSE
        status := 'ok';
        detail := pg_catalog.format('outbox worker pid %s', w.worker_pid);
    END IF;
    RETURN NEXT;
    component := 'subscription worker';
    IF w IS NULL OR w.subscription_worker_pid IS NULL THEN
        status := 'critical';
        detail := 'no subscription worker runs for this database: subscriptions and reconciliation wait';
    ELSE
        status := 'ok';
        detail := pg_catalog.format('subscription worker pid %s', w.subscription_worker_pid);
    END IF;
    RETURN NEXT;
    -- The launcher starts a worker that stopped again; without it the next stop is for good.
    SELECT pg_catalog.min(a.pid) INTO n FROM pg_catalog.pg_stat_activity a
     WHERE a.backend_type OPERATOR(pg_catalog.=) 'amqp_outbox launcher';
    component := 'launcher';
    IF n IS NULL THEN
        status := 'critical';
        detail := 'no launcher runs: a worker that stops is not started again';
    ELSE
        status := 'ok';
        detail := pg_catalog.format('launcher pid %s', n);
    END IF;
    RETURN NEXT;
    FOR b IN SELECT * FROM @extschema@.broker_status ORDER BY broker_id LOOP
        component := 'broker ' OPERATOR(pg_catalog.||) b.broker_id;
        IF NOT b.connected THEN
            status := 'critical';
            detail := coalesce(b.last_error, 'not connected');
        ELSIF b.last_error IS NOT NULL THEN
            status := 'warning';
            detail := pg_catalog.format('connected to %s: %s', b.host, b.last_error);
        ELSE
            status := 'ok';
            detail := pg_catalog.format('connected to %s, %s in flight', b.host, b.in_flight);
        END IF;
        RETURN NEXT;
    END LOOP;
    -- amqp_outbox.standby_names: messages and acknowledgements leave only once these standbys
    -- have the commits; one that is gone or behind holds them back.
    -- (Not this server's own cluster_name: after a promotion the list it inherited names it.)
    SELECT pg_catalog.array_agg(pg_catalog.btrim(x))
           FILTER (WHERE pg_catalog.btrim(x) <> ''
                     AND pg_catalog.btrim(x) IS DISTINCT FROM pg_catalog.current_setting('cluster_name')) INTO names
      FROM pg_catalog.unnest(pg_catalog.string_to_array(
               coalesce(pg_catalog.current_setting('amqp_outbox.standby_names', true), ''), ',')) AS x;
    IF names IS NOT NULL AND NOT pg_catalog.pg_is_in_recovery() THEN
        IF '*' = ANY (names) THEN
            SELECT pg_catalog.array_agg(r.application_name ORDER BY r.application_name) INTO names
              FROM pg_catalog.pg_stat_replication r WHERE r.flush_lsn IS NOT NULL;
            IF names IS NULL THEN
                component := 'standbys';
                status := 'critical';
                detail := 'amqp_outbox.standby_names is * and no standby is connected: nothing leaves the database';
                RETURN NEXT;
            END IF;
        END IF;
        FOR b IN SELECT n.n AS name, r.flush_lsn, r.flush_lag
                   FROM pg_catalog.unnest(names) AS n(n)
                   LEFT JOIN pg_catalog.pg_stat_replication r
                          ON r.application_name OPERATOR(pg_catalog.=) n.n AND r.flush_lsn IS NOT NULL
        LOOP
            component := 'standby ' OPERATOR(pg_catalog.||) b.name;
            IF b.flush_lsn IS NULL THEN
                status := 'critical';
                detail := pg_catalog.format('%s is not connected: messages and acknowledgements wait for it (amqp_outbox.standby_names)', b.name);
            ELSE
                lag := pg_catalog.pg_wal_lsn_diff(pg_catalog.pg_current_wal_lsn(), b.flush_lsn)::bigint;
                status := CASE WHEN coalesce(b.flush_lag, '0') > interval '5 seconds' OR lag > 16777216
                               THEN 'warning' ELSE 'ok' END;
                detail := pg_catalog.format('%s flushed, %s bytes behind, flush lag %s', b.name, lag,
                                            coalesce(b.flush_lag::text, '0'));
            END IF;
            RETURN NEXT;
        END LOOP;
    END IF;
    -- Reads at most 10,001 outbox rows and the oldest by the primary key, so that a probe stays
    -- cheap with millions of messages pending (beyond 10,000: the planner's estimate).
    SELECT pg_catalog.count(*) INTO n
      FROM (SELECT FROM @extschema@.message m WHERE m.parked_at IS NULL LIMIT 10001) s;
    IF n > 10000 THEN
        SELECT greatest(c.reltuples::bigint, 10001) INTO n FROM pg_catalog.pg_class c
         WHERE c.oid OPERATOR(pg_catalog.=) '@extschema@.message'::pg_catalog.regclass;
        shown := 'about ' OPERATOR(pg_catalog.||) n;
    ELSE
        shown := n::text;
    END IF;
    SELECT pg_catalog.now() OPERATOR(pg_catalog.-) m.created_at INTO oldest
      FROM @extschema@.message m WHERE m.parked_at IS NULL ORDER BY m.id LIMIT 1;
    component := 'outbox';
    status := CASE WHEN oldest IS NULL OR oldest < '1 minute' THEN 'ok'
                   WHEN oldest < '5 minutes' THEN 'warning' ELSE 'critical' END;
    detail := pg_catalog.format('%s pending, oldest %s', shown, coalesce(pg_catalog.date_trunc('second', oldest)::text, '-'));
    RETURN NEXT;
    SELECT pg_catalog.count(*) INTO n FROM @extschema@.message m WHERE m.parked_at IS NOT NULL;
    component := 'parked';
    status := CASE WHEN n = 0 THEN 'ok' ELSE 'warning' END;
    detail := pg_catalog.format('%s parked message(s)', n);
    RETURN NEXT;
    -- Keys of ordered subscriptions that wait for a failed message (amqp.inbox_failed): warned
    -- about once the oldest waits longer than amqp_outbox.blocked_key_warning.
    FOR b IN SELECT f.subscription AS sub, pg_catalog.count(DISTINCT f.ordering_key) AS keys,
                    pg_catalog.min(f.first_failed_at) AS since
               FROM @extschema@.inbox_failed f
              WHERE f.ordering_key IS NOT NULL AND f.dead_lettered_at IS NULL
              GROUP BY f.subscription ORDER BY f.subscription
    LOOP
        component := 'blocked keys ' OPERATOR(pg_catalog.||) b.sub;
        status := CASE WHEN pg_catalog.now() OPERATOR(pg_catalog.-) b.since
                            >= coalesce(pg_catalog.current_setting('amqp_outbox.blocked_key_warning', true),
                                        '5min')::interval
                       THEN 'warning' ELSE 'ok' END;
        detail := pg_catalog.format('%s key(s) wait for a failed message (amqp.inbox_failed), the oldest since %s',
                                    b.keys, pg_catalog.date_trunc('second', b.since));
        RETURN NEXT;
    END LOOP;
    -- The monitored messages, as the monitor last counted them (amqp._monitor_summary).
    SELECT pg_catalog.max(s.counted_at) INTO counted FROM @extschema@._monitor_summary s;
    component := 'monitor';
    IF w IS NULL OR w.monitor_pid IS NULL THEN
        status := 'critical';
        detail := 'no monitor runs for this database: messages are not classified, resent or compensated';
    ELSIF counted IS NULL OR counted < pg_catalog.now() - interval '1 minute' THEN
        status := 'warning';
        detail := pg_catalog.format('monitor pid %s has not counted since %s', w.monitor_pid, coalesce(counted::text, 'it started'));
    ELSE
        status := 'ok';
        detail := pg_catalog.format('monitor pid %s', w.monitor_pid);
    END IF;
    RETURN NEXT;
    FOR b IN
        SELECT s.s AS st, coalesce(m.messages, 0) AS n, coalesce(m.recent, 0) AS recent
          FROM pg_catalog.unnest(ARRAY['late', 'lost', 'failed']) AS s(s)
          LEFT JOIN @extschema@._monitor_summary m ON m.status = s.s
         ORDER BY pg_catalog.array_position(ARRAY['late', 'lost', 'failed'], s.s)
    LOOP
        component := b.st;
        -- A loss is critical for an hour, then a warning until the window forgets it.
        status := CASE WHEN b.n = 0 THEN 'ok' WHEN b.st = 'lost' AND b.recent > 0 THEN 'critical' ELSE 'warning' END;
        detail := CASE WHEN b.st = 'lost'
                       THEN pg_catalog.format('%s lost message(s), %s in the last hour (amqp.reconciliation)', b.n, b.recent)
                       ELSE pg_catalog.format('%s %s message(s) (amqp.reconciliation)', b.n, b.st) END;
        RETURN NEXT;
    END LOOP;
END
$health$;
COMMENT ON FUNCTION @extschema@.health() IS
    'One row per check (outbox worker, subscription worker, launcher, each broker, each standby named by amqp_outbox.standby_names, outbox age, parked, keys of ordered subscriptions blocked by a failed message, monitor, late, lost, failed) with status ok, warning or critical, for probes and exporters. Cheap at any size: it reads no more than 10,001 outbox rows and the monitor''s counts.';

REVOKE ALL ON FUNCTION @extschema@.health() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.health() TO pg_monitor;
GRANT EXECUTE ON FUNCTION @extschema@.health() TO amqp_outbox_admin;
