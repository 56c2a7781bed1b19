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
    SELECT pg_catalog.now() OPERATOR(pg_catalog.-) pg_catalog.min(m.created_at), pg_catalog.count(*) INTO oldest, n
      FROM @extschema@.message m WHERE m.parked_at IS NULL;
    component := 'outbox';
    status := CASE WHEN oldest IS NULL OR oldest < '1 minute' THEN 'ok'
                   WHEN oldest < '5 minutes' THEN 'warning' ELSE 'critical' END;
    detail := pg_catalog.format('%s pending, oldest %s', n, coalesce(pg_catalog.date_trunc('second', oldest)::text, '-'));
    RETURN NEXT;
    SELECT pg_catalog.count(*) INTO n FROM @extschema@.message m WHERE m.parked_at IS NOT NULL;
    component := 'parked';
    status := CASE WHEN n = 0 THEN 'ok' ELSE 'warning' END;
    detail := pg_catalog.format('%s parked message(s)', n);
    RETURN NEXT;
    FOR b IN
        SELECT s.s AS st, pg_catalog.count(r.status) AS n
          FROM pg_catalog.unnest(ARRAY['late', 'lost', 'failed']) AS s(s)
          LEFT JOIN @extschema@.reconciliation r ON r.status = s.s
         GROUP BY s.s ORDER BY pg_catalog.array_position(ARRAY['late', 'lost', 'failed'], s.s)
    LOOP
        component := b.st;
        status := CASE WHEN b.n = 0 THEN 'ok' WHEN b.st = 'lost' THEN 'critical' ELSE 'warning' END;
        detail := pg_catalog.format('%s %s message(s) (amqp.reconciliation)', b.n, b.st);
        RETURN NEXT;
    END LOOP;
END
$health$;
COMMENT ON FUNCTION @extschema@.health() IS
    'One row per check (outbox worker, subscription worker, launcher, each broker, outbox age, parked, late, lost, failed) with status ok, warning or critical, for probes and exporters.';

REVOKE ALL ON FUNCTION @extschema@.health() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.health() TO pg_monitor;
GRANT EXECUTE ON FUNCTION @extschema@.health() TO amqp_outbox_admin;
