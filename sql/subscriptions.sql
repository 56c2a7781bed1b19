-- amqp_outbox: subscribing, changing and removing subscriptions, and their status view.
-- Written to be run again (CREATE OR REPLACE), so that the update script takes this file as it
-- is; included in the install script after inbox.sql.

CREATE OR REPLACE VIEW @extschema@.subscription_status AS
    SELECT s.subscription, s.broker_id, s.queue, s.handler, s.owner,
           CASE WHEN s.paused THEN 'paused'
                WHEN st.connected THEN 'consuming'
                WHEN st.last_error IS NOT NULL THEN 'error'
                ELSE 'connecting' END AS state,
           COALESCE(st.connected, false) AS consumer_connected,
           st.host, st.state_since,
           COALESCE(st.delivered, 0) AS delivered,
           COALESCE(st.handled, 0) AS handled,
           COALESCE(st.duplicates, 0) AS duplicates,
           COALESCE(st.failed, 0) AS failed,
           COALESCE(st.dead_lettered, 0) AS dead_lettered,
           (SELECT pg_catalog.count(*) FROM @extschema@.inbox_failed f
             WHERE f.subscription = s.subscription AND f.dead_lettered_at IS NULL) AS retrying,
           (SELECT pg_catalog.count(*) FROM @extschema@.inbox_failed f
             WHERE f.subscription = s.subscription AND f.dead_lettered_at IS NOT NULL) AS dead,
           st.last_error, st.last_error_at,
           st.queue_ready AS lag, st.queue_seen_at AS lag_seen_at,
           st.last_handled_at,
           s.parallelism, s.ordering,
           CASE WHEN s.parallelism > 1 OR s.ordering <> 'none' THEN
               (SELECT pg_catalog.count(*)::integer FROM pg_catalog.pg_stat_activity a
                 WHERE a.backend_type = 'amqp_outbox lane' AND a.datname = pg_catalog.current_database()
                   AND pg_catalog.substring(a.application_name, '^amqp_outbox lane ([0-9]+)$')::integer
                       <= s.parallelism)
           ELSE 0 END AS lanes,
           (SELECT pg_catalog.count(*) FROM @extschema@.inbox_waiting w
             WHERE w.subscription = s.subscription) AS waiting,
           (SELECT pg_catalog.min(w.received_at) FROM @extschema@.inbox_waiting w
             WHERE w.subscription = s.subscription) AS oldest_waiting_at,
           (SELECT pg_catalog.count(DISTINCT f.ordering_key) FROM @extschema@.inbox_failed f
             WHERE f.subscription = s.subscription AND f.ordering_key IS NOT NULL
               AND f.dead_lettered_at IS NULL) AS blocked_keys,
           (SELECT pg_catalog.min(f.first_failed_at) FROM @extschema@.inbox_failed f
             WHERE f.subscription = s.subscription AND f.ordering_key IS NOT NULL
               AND f.dead_lettered_at IS NULL) AS blocked_since
      FROM @extschema@.subscription s
      LEFT JOIN @extschema@._subscription_state st USING (subscription);
COMMENT ON VIEW @extschema@.subscription_status IS
    'Each subscription: state (consuming, connecting, error, paused), counters since it was made, messages retrying or dead-lettered, last error, lag (messages ready in the queue, as the broker last reported), and with lanes: lanes running, messages waiting for one, keys blocked by a failed message.';

CREATE OR REPLACE FUNCTION @extschema@.subscribe(
    subscription text, broker_id integer, queue text, handler regprocedure,
    prefetch integer DEFAULT 100, max_attempts integer DEFAULT 10,
    dead_letter_exchange text DEFAULT NULL,
    parallelism integer DEFAULT 1, ordering text DEFAULT 'none') RETURNS void
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $subscribe$
DECLARE
    h record;
BEGIN
    IF subscription IS NULL OR broker_id IS NULL OR queue IS NULL OR handler IS NULL
       OR prefetch IS NULL OR max_attempts IS NULL OR parallelism IS NULL OR ordering IS NULL THEN
        RAISE EXCEPTION 'amqp_outbox: % must not be NULL',
            CASE WHEN subscription IS NULL THEN 'subscription' WHEN broker_id IS NULL THEN 'broker_id'
                 WHEN queue IS NULL THEN 'queue' WHEN handler IS NULL THEN 'handler'
                 WHEN prefetch IS NULL THEN 'prefetch' WHEN max_attempts IS NULL THEN 'max_attempts'
                 WHEN parallelism IS NULL THEN 'parallelism' ELSE 'ordering' END
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    PERFORM @extschema@._check_lanes(parallelism, ordering);
    IF subscription = '' OR octet_length(subscription) > 200 THEN
        RAISE EXCEPTION 'amqp_outbox: a subscription name must have 1 to 200 bytes'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF queue = '' OR octet_length(queue) > 255 THEN
        RAISE EXCEPTION 'amqp_outbox: a queue name must have 1 to 255 bytes'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF dead_letter_exchange = '' OR octet_length(dead_letter_exchange) > 255 THEN
        RAISE EXCEPTION 'amqp_outbox: dead_letter_exchange must have 1 to 255 bytes (or be NULL for none)'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF prefetch NOT BETWEEN 1 AND 65535 THEN
        RAISE EXCEPTION 'amqp_outbox: prefetch must be between 1 and 65535, not %', prefetch
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF max_attempts NOT BETWEEN 1 AND 1000000 THEN
        RAISE EXCEPTION 'amqp_outbox: max_attempts must be between 1 and 1000000, not %', max_attempts
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NOT EXISTS (SELECT FROM @extschema@.broker b WHERE b.broker_id = subscribe.broker_id) THEN
        RAISE EXCEPTION 'amqp_outbox: broker % does not exist in amqp.broker', broker_id
            USING ERRCODE = 'undefined_object';
    END IF;
    SELECT p.prokind, p.prorettype, p.pronargs, p.proargtypes, p.proretset INTO h
      FROM pg_catalog.pg_proc p WHERE p.oid = handler;
    IF h.prokind <> 'f' OR h.pronargs <> 1 OR h.proargtypes[0] <> '@extschema@.delivery'::regtype
       OR h.prorettype <> 'void'::regtype OR h.proretset THEN
        RAISE EXCEPTION 'amqp_outbox: handler % must be a function (amqp.delivery) RETURNS void', handler
            USING ERRCODE = 'invalid_function_definition',
                  HINT = 'CREATE FUNCTION my_handler(d amqp.delivery) RETURNS void ...';
    END IF;
    IF NOT pg_catalog.has_function_privilege(handler, 'EXECUTE') THEN
        RAISE EXCEPTION 'amqp_outbox: permission denied to execute handler %', handler
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'The handler runs with the rights of the role that subscribes.';
    END IF;
    IF EXISTS (SELECT FROM @extschema@.subscription s WHERE s.subscription = subscribe.subscription) THEN
        RAISE EXCEPTION 'amqp_outbox: subscription "%" already exists', subscription
            USING ERRCODE = 'duplicate_object',
                  HINT = 'amqp.unsubscribe() it first, or choose another name.';
    END IF;
    INSERT INTO @extschema@.subscription
        (subscription, broker_id, queue, handler, prefetch, max_attempts, dead_letter_exchange, owner,
         parallelism, ordering)
    VALUES (subscribe.subscription, subscribe.broker_id, subscribe.queue, subscribe.handler,
            subscribe.prefetch, subscribe.max_attempts, subscribe.dead_letter_exchange,
            CURRENT_USER::regrole, subscribe.parallelism, subscribe.ordering);
END
$subscribe$;
COMMENT ON FUNCTION @extschema@.subscribe(text, integer, text, regprocedure, integer, integer, text, integer, text) IS
    'Consumes queue on broker_id: each message is handled once by handler(amqp.delivery), in a transaction with its consumption record, and acknowledged only after it committed. parallelism: messages in progress at once (lanes, 1 to 16); ordering: none, business_key or header:<name> (messages with one key handled in their order, one at a time).';

-- The checks of parallelism and ordering, shared by subscribe() and alter_subscription().
CREATE OR REPLACE FUNCTION @extschema@._check_lanes(parallelism integer, ordering text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $check$
BEGIN
    IF parallelism NOT BETWEEN 1 AND 16 THEN
        RAISE EXCEPTION 'amqp_outbox: parallelism must be between 1 and 16, not %', parallelism
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NOT (ordering IN ('none', 'business_key')
            OR (ordering LIKE 'header:%' AND octet_length(ordering) BETWEEN 8 AND 262)) THEN
        RAISE EXCEPTION 'amqp_outbox: ordering must be ''none'', ''business_key'' or ''header:<name>'' (a header name of 1 to 255 bytes), not %',
            quote_literal(left(ordering, 300))
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
END
$check$;

CREATE OR REPLACE FUNCTION @extschema@.alter_subscription(subscription text, parallelism integer DEFAULT NULL,
    ordering text DEFAULT NULL, prefetch integer DEFAULT NULL, max_attempts integer DEFAULT NULL)
    RETURNS void LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $alter$
DECLARE
    s record;
BEGIN
    PERFORM @extschema@._subscription_or_raise(subscription);
    SELECT * INTO s FROM @extschema@.subscription x WHERE x.subscription = alter_subscription.subscription;
    PERFORM @extschema@._check_lanes(coalesce(parallelism, s.parallelism), coalesce(ordering, s.ordering));
    IF prefetch NOT BETWEEN 1 AND 65535 THEN
        RAISE EXCEPTION 'amqp_outbox: prefetch must be between 1 and 65535, not %', prefetch
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF max_attempts NOT BETWEEN 1 AND 1000000 THEN
        RAISE EXCEPTION 'amqp_outbox: max_attempts must be between 1 and 1000000, not %', max_attempts
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE @extschema@.subscription x
       SET parallelism = coalesce(alter_subscription.parallelism, x.parallelism),
           ordering = coalesce(alter_subscription.ordering, x.ordering),
           prefetch = coalesce(alter_subscription.prefetch, x.prefetch),
           max_attempts = coalesce(alter_subscription.max_attempts, x.max_attempts)
     WHERE x.subscription = alter_subscription.subscription;
END
$alter$;
COMMENT ON FUNCTION @extschema@.alter_subscription(text, integer, text, integer, integer) IS
    'Changes a subscription''s parallelism, ordering, prefetch or max_attempts (NULL: unchanged). A new ordering applies to messages received from then on.';

CREATE OR REPLACE FUNCTION @extschema@.unsubscribe(subscription text) RETURNS void
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $unsubscribe$
BEGIN
    PERFORM @extschema@._subscription_or_raise(subscription);
    DELETE FROM @extschema@.subscription s WHERE s.subscription = unsubscribe.subscription;
    DELETE FROM @extschema@._subscription_state s WHERE s.subscription = unsubscribe.subscription;
    -- Still unacknowledged in the queue: they go back to it with the consumer.
    DELETE FROM @extschema@.inbox_waiting w WHERE w.subscription = unsubscribe.subscription;
END
$unsubscribe$;
COMMENT ON FUNCTION @extschema@.unsubscribe(text) IS
    'Stops consuming (unacknowledged messages go back to the queue) and removes the subscription; its failed messages stay in amqp.inbox_failed.';

REVOKE ALL ON FUNCTION
    @extschema@.subscribe(text, integer, text, regprocedure, integer, integer, text, integer, text),
    @extschema@.alter_subscription(text, integer, text, integer, integer),
    @extschema@._check_lanes(integer, text), @extschema@.unsubscribe(text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    @extschema@.subscribe(text, integer, text, regprocedure, integer, integer, text, integer, text),
    @extschema@.alter_subscription(text, integer, text, integer, integer),
    @extschema@._check_lanes(integer, text), @extschema@.unsubscribe(text)
    TO amqp_outbox_admin;
GRANT SELECT ON @extschema@.subscription_status TO amqp_outbox_admin, pg_monitor;
