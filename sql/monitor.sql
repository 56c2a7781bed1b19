-- amqp_outbox: the reconciliation monitor. Each monitored message of the production log keeps
-- its state (answers, late, lost, resends, outcome) and the time the monitor must look at it
-- next (check_at, indexed): a pass reads only what is due, so its cost follows what happens,
-- not how many messages are open. Run by the monitor process of each database about once a
-- second (see src/monitor/).
-- Included in the install script (after reconcile.sql) and, unchanged, in the update script
-- amqp_outbox--0.5.0--0.6.0.sql (frozen since 0.6.0 was released).

-- Makes the day partition of amqp.produced or amqp.receipt (UTC), moving in the rows the
-- default partition holds for it. Returns whether it made one.
CREATE OR REPLACE FUNCTION @extschema@._history_day(parent text, day date) RETURNS boolean
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $history_day$
DECLARE
    part text := parent || '_' || pg_catalog.to_char(day, 'YYYYMMDD');
    lo timestamptz := day::timestamp AT TIME ZONE 'UTC';
    hi timestamptz := (day + 1)::timestamp AT TIME ZONE 'UTC';
BEGIN
    IF parent NOT IN ('produced', 'receipt') THEN
        RAISE EXCEPTION 'amqp_outbox: no history table %', parent USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- No insert may be routing a row to the default partition while the day is attached (it
    -- would fail its partition check): writers wait for this short transaction. The lock also
    -- makes two callers take turns (the second finds the day made).
    EXECUTE pg_catalog.format('LOCK TABLE @extschema@.%I IN SHARE ROW EXCLUSIVE MODE', parent);
    IF pg_catalog.to_regclass('@extschema@.' OPERATOR(pg_catalog.||) pg_catalog.quote_ident(part)) IS NOT NULL THEN
        RETURN false;
    END IF;
    EXECUTE pg_catalog.format('CREATE TABLE @extschema@.%I (LIKE @extschema@.%I INCLUDING DEFAULTS INCLUDING CONSTRAINTS)',
                              part, parent);
    EXECUTE pg_catalog.format(
        'WITH moved AS (DELETE FROM @extschema@.%I WHERE message_at >= $1 AND message_at < $2 RETURNING *)
         INSERT INTO @extschema@.%I SELECT * FROM moved', parent || '_default', part) USING lo, hi;
    EXECUTE pg_catalog.format('ALTER TABLE @extschema@.%I ATTACH PARTITION @extschema@.%I FOR VALUES FROM (%L) TO (%L)',
                              parent, part, lo, hi);
    EXECUTE pg_catalog.format('CREATE INDEX %I ON @extschema@.%I (message_id)', part || '_message', part);
    IF parent = 'receipt' THEN
        EXECUTE pg_catalog.format('CREATE INDEX %I ON @extschema@.%I (received_at) WHERE NOT counted',
                                  part || '_uncounted', part);
    ELSE
        -- What the views list (monitored, not finished or finished badly), and what the
        -- monitor must look at (by time).
        EXECUTE pg_catalog.format(
            'CREATE INDEX %I ON @extschema@.%I (message_at) WHERE expected IS NOT NULL AND (completed_at IS NULL OR outcome IN (''lost'', ''failed''))',
            part || '_open', part);
        EXECUTE pg_catalog.format('CREATE INDEX %I ON @extschema@.%I (check_at) WHERE check_at IS NOT NULL',
                                  part || '_due', part);
    END IF;
    RETURN true;
END
$history_day$;

-- The monitor's pass, amqp._monitor(): monitor_pass.sql.

-- The monitored messages as the monitor last classified them, amqp._open: monitor_open.sql.

-- Every message in the window that needs attention or is under way: monitored ones after
-- delivery (not finished, or finished lost or failed), and every one still in the outbox.
CREATE VIEW @extschema@.reconciliation AS
    SELECT o.message_id, o.business_type, o.business_key, o.status, o.created_at,
           o.expected, o.ok AS answered_ok, o.failed AS failed_at, o.silent AS waiting_for,
           o.resends, k.compensation, 'delivered' AS outbox
      FROM @extschema@._open o
      LEFT JOIN LATERAL (
          SELECT pg_catalog.string_agg(c.consumer OPERATOR(pg_catalog.||) ': ' OPERATOR(pg_catalog.||) c.state
                     OPERATOR(pg_catalog.||) CASE WHEN c.last_error IS NULL THEN '' ELSE ' (' OPERATOR(pg_catalog.||) c.last_error OPERATOR(pg_catalog.||) ')' END,
                     ', ') AS compensation
            FROM @extschema@.compensation c WHERE c.message_id OPERATOR(pg_catalog.=) o.message_id) k ON true
    UNION ALL
    -- Not delivered yet: nothing is late before delivery (amqp.health() reports the outbox's age).
    SELECT m.message_id, coalesce(m.business_type, m.routing_key), m.business_key,
           CASE WHEN m.parked_at IS NOT NULL THEN 'parked' ELSE 'pending' END,
           m.created_at, r.consumers, '{}'::text[], NULL::text[], r.consumers, m.resends, NULL::text,
           CASE WHEN m.parked_at IS NOT NULL THEN 'parked' ELSE 'waiting' END
      FROM @extschema@.message m
      LEFT JOIN @extschema@.monitor_rule r
             ON r.business_type OPERATOR(pg_catalog.=) coalesce(m.business_type, m.routing_key)
     WHERE m.resends OPERATOR(pg_catalog.=) 0;
COMMENT ON VIEW @extschema@.reconciliation IS
    'One row per message in the window that is not finished, or finished lost or failed: status pending, late, lost, failed or parked; who answered ok, who failed, who is awaited; resends; compensation state; whether it is still in the outbox.';

CREATE VIEW @extschema@.reconciliation_summary AS
    SELECT business_type, status, pg_catalog.count(*) AS messages,
           pg_catalog.min(created_at) AS oldest_created_at,
           pg_catalog.now() OPERATOR(pg_catalog.-) pg_catalog.min(created_at) AS oldest_age
      FROM @extschema@.reconciliation
     GROUP BY business_type, status;
COMMENT ON VIEW @extschema@.reconciliation_summary IS
    'amqp.reconciliation counted per business type and status, with the oldest.';

-- What amqp.health() reports of the monitored messages, counted by the monitor every few
-- seconds (a probe never scans the production log). Not dumped: it is made again.
CREATE TABLE @extschema@._monitor_summary (
    status text PRIMARY KEY,
    messages bigint NOT NULL,
    -- Became lost in the last hour (lost only).
    recent bigint NOT NULL,
    oldest timestamptz,
    counted_at timestamptz NOT NULL
);

-- amqp._summarize(), which fills it: monitor_summary.sql.

CREATE OR REPLACE VIEW @extschema@.daily_stats AS
    SELECT day, business_type,
           pg_catalog.sum(produced)::bigint AS produced, pg_catalog.sum(delivered)::bigint AS delivered,
           pg_catalog.sum(consumed)::bigint AS consumed, pg_catalog.sum(late)::bigint AS late,
           pg_catalog.sum(lost)::bigint AS lost, pg_catalog.sum(resent)::bigint AS resent,
           pg_catalog.sum(compensated)::bigint AS compensated, pg_catalog.sum(parked)::bigint AS parked,
           pg_catalog.sum(failed)::bigint AS failed
      FROM (SELECT day, business_type, delivered AS produced, delivered, consumed, late, lost,
                   resent, compensated, 0 AS parked, failed
              FROM @extschema@._daily_stat
            UNION ALL
            -- Still in the outbox: produced, not delivered yet (or parked). The day of its
            -- creation (its message_id holds the same instant).
            SELECT @extschema@._day(created_at), coalesce(business_type, routing_key), 1, 0, 0, 0, 0, 0, 0,
                   CASE WHEN parked_at IS NULL THEN 0 ELSE 1 END, 0
              FROM @extschema@.message
             WHERE resends OPERATOR(pg_catalog.=) 0) s
     GROUP BY day, business_type;
COMMENT ON VIEW @extschema@.daily_stats IS
    'Per UTC day of creation and business type: messages produced, delivered (to the broker), consumed (ok receipts), late, lost (given up), resent, compensated, parked (now), failed (failed receipts). Kept for amqp_outbox.stats_retention.';

-- The life of one message, in time order.

-- Receipts, consumer side: the business type travels back so the producer can count it. A
-- receipt is itself of the business type amqp_outbox.receipt: never one a rule monitors (its
-- routing key, the consumer's name, may well be one).
CREATE OR REPLACE FUNCTION @extschema@.send_receipt(broker_id integer, consumer text, message_id text,
                                         ok boolean DEFAULT true, error text DEFAULT NULL,
                                         business_type text DEFAULT NULL)
    RETURNS boolean LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $receipt$
DECLARE
    exchange text := pg_catalog.current_setting('amqp_outbox.receipts_exchange', true);
BEGIN
    IF exchange IS NULL OR exchange = '' THEN
        RETURN false;
    END IF;
    IF consumer IS NULL OR message_id IS NULL OR ok IS NULL THEN
        RAISE EXCEPTION 'amqp_outbox: consumer, message_id and ok must not be NULL'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    PERFORM @extschema@.publish_message(
        broker_id, exchange, consumer,
        pg_catalog.jsonb_build_object('v', 1, 'message_id', message_id, 'consumer', consumer,
                                      'status', CASE WHEN ok THEN 'ok' ELSE 'failed' END,
                                      'error', error, 'at', pg_catalog.now(),
                                      'business_type', business_type)::text,
        pg_catalog.jsonb_build_object('x-amqp-outbox-receipt-for', message_id),
        2, 'application/json', business_type => 'amqp_outbox.receipt');
    RETURN true;
END
$receipt$;
COMMENT ON FUNCTION @extschema@.send_receipt(integer, text, text, boolean, text, text) IS
    'Publishes a receipt (message_id, consumer, ok or failed with error, when, business type) to amqp_outbox.receipts_exchange through the outbox: sent if and only if this transaction commits. false when no receipts exchange is set.';

REVOKE ALL ON FUNCTION @extschema@.send_receipt(integer, text, text, boolean, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.send_receipt(integer, text, text, boolean, text, text) TO amqp_outbox_consumer;
GRANT EXECUTE ON FUNCTION @extschema@.send_receipt(integer, text, text, boolean, text, text) TO amqp_outbox_admin;

REVOKE ALL ON @extschema@._monitor_summary FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@._history_day(text, date), @extschema@._monitor(integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@._history_day(text, date), @extschema@._monitor(integer) TO amqp_outbox_admin;
GRANT SELECT ON @extschema@.daily_stats, @extschema@.reconciliation,
    @extschema@.reconciliation_summary, @extschema@._open, @extschema@._monitor_summary TO pg_monitor;
GRANT SELECT ON @extschema@.daily_stats, @extschema@.reconciliation,
    @extschema@.reconciliation_summary, @extschema@._open, @extschema@._monitor_summary TO amqp_outbox_admin;
