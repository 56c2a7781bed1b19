//! The texts of the consuming side's statements, the same for every host (SPI in the
//! extension's subscription worker and lanes, a client connection in the relay). Values are
//! always bound parameters; the one text with a name in it (the handler's call, see
//! [`super::message::Sub::call`]) takes it from PostgreSQL's own quoting (`format('%I.%I')`).

/// Why a subscription's handler cannot run as its owner (`NULL`: it can), over `s`, a row of
/// `amqp.subscription`. The owner is checked before the function privilege, which would raise
/// for a role that is gone; CASE keeps the order. The handler is kept by name
/// (schema-qualified, see `amqp._handler_name()`): `to_regprocedure` finds it, or gives NULL
/// when no such function exists (any more).
macro_rules! runs_as_problem {
    () => {
        "CASE \
    WHEN NOT EXISTS (SELECT FROM pg_proc p WHERE p.oid = to_regprocedure(s.handler)) \
    THEN format('the handler function %s no longer exists: set another (UPDATE amqp.subscription SET handler = ...) or amqp.unsubscribe() it', s.handler) \
    WHEN NOT EXISTS (SELECT FROM pg_roles r WHERE r.oid = s.owner::oid) \
    THEN format('its owner (role oid %s) no longer exists: set another (UPDATE amqp.subscription SET owner = ...) or amqp.unsubscribe() it', s.owner::oid) \
    WHEN NOT has_function_privilege(s.owner::oid, to_regprocedure(s.handler)::oid, 'EXECUTE') \
    THEN format('its owner %s may not execute the handler %s', s.owner, s.handler) END"
    };
}

/// The active subscriptions: name, broker_id, queue, prefetch, max_attempts,
/// dead_letter_exchange, owner (oid), the handler's quoted name and oid, why it cannot run,
/// parallelism, ordering. Paused ones are left out (their consumers are closed).
pub const SUBSCRIPTIONS_SQL: &str = concat!(
    "SELECT s.subscription, s.broker_id, s.queue, s.prefetch, s.max_attempts, \
            s.dead_letter_exchange, s.owner::oid, \
            (SELECT format('%I.%I', n.nspname, p.proname) \
               FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace \
              WHERE p.oid = to_regprocedure(s.handler)), \
            to_regprocedure(s.handler)::oid, ",
    runs_as_problem!(),
    ", s.parallelism, s.ordering \
       FROM amqp.subscription s WHERE NOT s.paused ORDER BY s.subscription"
);

/// The names of the subscriptions that exist now (paused ones included).
pub const SUBSCRIPTION_NAMES_SQL: &str = "SELECT subscription FROM amqp.subscription";

/// Why the subscription `$1`'s handler cannot run as its owner now, if it cannot (dropped, its
/// owner dropped or without the right to execute it since the subscriptions were last read).
pub const RUNS_AS_PROBLEM_SQL: &str = concat!(
    "SELECT ",
    runs_as_problem!(),
    " FROM amqp.subscription s WHERE s.subscription = $1"
);

/// The record that makes a subscription's handling happen once: `amqp._consume('subscription:'
/// || name, message_id)`, false for a duplicate. (The subscriptions' own consumer names, which
/// `consume_once()` refuses to applications.)
pub const CONSUME_SQL: &str = "SELECT amqp._consume($1, $2)";

/// The consumer name a subscription's records are kept under.
pub fn consumer_name(subscription: &str) -> String {
    format!("subscription:{subscription}")
}

/// The key of a message that came without a message_id: a digest of what it carries
/// ([`super::message::Message::digest_input`]).
pub const DERIVED_MESSAGE_ID_SQL: &str = "SELECT 'sha256:' || encode(sha256($1), 'hex')";

/// A handled message is no longer failed (it may have been retried from the table, or a
/// redelivered copy got through).
pub const RESOLVE_FAILED_SQL: &str =
    "DELETE FROM amqp.inbox_failed WHERE subscription = $1 AND message_id = $2";

/// Which of these subscriptions (`$1`, text[]) have failed messages now.
pub const WITH_FAILED_SQL: &str =
    "SELECT DISTINCT subscription FROM amqp.inbox_failed WHERE subscription = ANY($1)";

/// The 14 values of a message as the handler's `amqp.delivery` argument: subscription,
/// message_id, exchange, routing_key, body, headers, content_type, correlation_id, reply_to,
/// redelivered, delivery_tag, timestamp (seconds since the epoch, float8), attempt, user_id.
pub const DELIVERY_ROW: &str = "ROW($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, \
     pg_catalog.to_timestamp($12), $13, $14)::amqp.delivery";

/// Records a failed handling: a new row on the first failure, one more attempt after that;
/// dead (no more automatic retries) at `max_attempts` ($13). `$14`: the backoff per attempt
/// count, in microseconds (int8[], [`super::handling::retry_delays`]). Returns the attempts
/// and whether it is dead.
pub const RECORD_FAILURE_SQL: &str = "INSERT INTO amqp.inbox_failed AS f \
         (subscription, message_id, exchange, routing_key, body, headers, content_type, \
          correlation_id, reply_to, \"timestamp\", last_error, last_sqlstate, attempts, \
          next_attempt_at, dead_lettered_at, user_id, ordering_key) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, to_timestamp($10), $11, $12, $15, \
             clock_timestamp() + $14[least($15, cardinality($14))] * interval '1 microsecond', \
             CASE WHEN $15 >= $13 THEN clock_timestamp() END, $16, $17) \
     ON CONFLICT (subscription, message_id) DO UPDATE \
        SET attempts = f.attempts + 1, \
            last_failed_at = clock_timestamp(), \
            last_error = EXCLUDED.last_error, \
            last_sqlstate = EXCLUDED.last_sqlstate, \
            next_attempt_at = clock_timestamp() \
                + $14[least(f.attempts + 1, cardinality($14))] * interval '1 microsecond', \
            dead_lettered_at = CASE WHEN f.attempts + 1 >= $13 THEN clock_timestamp() END \
     RETURNING attempts, dead_lettered_at IS NOT NULL";

/// A dead message to the subscription's dead-letter exchange, through this database's outbox
/// (it leaves if and only if the transaction commits): broker_id, exchange, routing_key, body,
/// headers ([`super::handling::dead_letter_headers`]), content_type, correlation_id.
pub const DEAD_LETTER_SQL: &str = "SELECT amqp.publish_bytes($1, $2, $3, $4, $5, 2, $6, NULL, $7)";

/// A receipt through the outbox: broker_id, consumer, message_id, ok, error, business_type.
pub const RECEIPT_SQL: &str = "SELECT amqp.send_receipt($1, $2, $3, $4, $5, $6)";

/// Makes `$1` the `amqp_outbox.traceparent` of the rest of the transaction (or of the GUC nest
/// level the handler runs in): what the handler publishes carries the trace of its message.
pub const SET_TRACEPARENT_SQL: &str =
    "SELECT pg_catalog.set_config('amqp_outbox.traceparent', $1, true)";

/// Failed messages due for a retry, of these subscriptions (`$1`), oldest due first, at most
/// `$2`: subscription, message_id, exchange, routing_key, body, headers (text), content_type,
/// correlation_id, reply_to, timestamp (epoch seconds), attempts, user_id, ordering_key.
pub const DUE_RETRIES_SQL: &str = "SELECT subscription, message_id, exchange, routing_key, body, \
            headers::text, content_type, correlation_id, reply_to, \
            extract(epoch FROM \"timestamp\")::float8, attempts, user_id, ordering_key \
       FROM amqp.inbox_failed \
      WHERE dead_lettered_at IS NULL AND next_attempt_at <= clock_timestamp() \
        AND subscription = ANY($1) \
      ORDER BY next_attempt_at, id LIMIT $2";

/// Seconds until the next failed message of these subscriptions is due (NULL: none waits;
/// greatest() would turn that into 0, a retry due now, and the loop would never sleep; the
/// caller clamps a past instant to now).
pub const NEXT_RETRY_SQL: &str =
    "SELECT extract(epoch FROM min(next_attempt_at) - clock_timestamp())::float8 \
       FROM amqp.inbox_failed \
      WHERE dead_lettered_at IS NULL AND subscription = ANY($1)";

/// Deferred constraints and constraint triggers a handler queues are checked at the end of its
/// statement, inside the message's subtransaction (as its owner): at the batch's COMMIT they
/// could not fire as the owner, and one failing there would undo every message of the batch.
pub const CONSTRAINTS_IMMEDIATE_SQL: &str = "SET CONSTRAINTS ALL IMMEDIATE";

/// A dead message whose dead letter was refused says so in its last error.
pub const NOTE_DEAD_LETTER_REFUSED_SQL: &str = "UPDATE amqp.inbox_failed \
        SET last_error = last_error || ' [not dead-lettered: ' || left($3, 1000) || ']' \
      WHERE subscription = $1 AND message_id = $2";

/// Adds one subscription's counters and states ([`super::book::BookRow`], $1 … $16 in its
/// field order) to `amqp._subscription_state`, unless the subscription is gone.
pub const BOOK_SQL: &str = "INSERT INTO amqp._subscription_state AS s \
    (subscription, delivered, handled, duplicates, failed, dead_lettered, \
    connected, host, last_error, last_error_at, queue_ready, queue_consumers, \
    queue_seen_at, last_handled_at, caught_up_at) \
    SELECT $1, $2, $3, $4, $5, $6, $8, $9, $11, \
    CASE WHEN $11 IS NOT NULL THEN clock_timestamp() END, $13, $14, \
    CASE WHEN $12 THEN clock_timestamp() END, \
    CASE WHEN $15 THEN clock_timestamp() END, to_timestamp($16) \
    WHERE EXISTS (SELECT FROM amqp.subscription WHERE subscription = $1) \
    ON CONFLICT (subscription) DO UPDATE SET \
    delivered = s.delivered + EXCLUDED.delivered, \
    handled = s.handled + EXCLUDED.handled, \
    duplicates = s.duplicates + EXCLUDED.duplicates, \
    failed = s.failed + EXCLUDED.failed, \
    dead_lettered = s.dead_lettered + EXCLUDED.dead_lettered, \
    connected = CASE WHEN $7 THEN $8 ELSE s.connected END, \
    host = CASE WHEN $7 THEN $9 ELSE s.host END, \
    state_since = CASE WHEN $7 AND $8 IS DISTINCT FROM s.connected \
    THEN clock_timestamp() ELSE s.state_since END, \
    last_error = CASE WHEN $10 THEN $11 ELSE s.last_error END, \
    last_error_at = CASE WHEN $10 AND $11 IS NOT NULL THEN clock_timestamp() \
    ELSE s.last_error_at END, \
    queue_ready = CASE WHEN $12 THEN $13 ELSE s.queue_ready END, \
    queue_consumers = CASE WHEN $12 THEN $14 ELSE s.queue_consumers END, \
    queue_seen_at = CASE WHEN $12 THEN clock_timestamp() ELSE s.queue_seen_at END, \
    last_handled_at = CASE WHEN $15 THEN clock_timestamp() ELSE s.last_handled_at END, \
    caught_up_at = greatest(s.caught_up_at, to_timestamp($16))";

/// At start: no consumer is connected yet, whatever the last run left.
pub const RESET_CONNECTIONS_SQL: &str = "UPDATE amqp._subscription_state \
        SET connected = false, host = NULL, state_since = clock_timestamp() WHERE connected";

/// The retention of consumption records (`amqp.rotate_consumption()`), run in a transaction of
/// its own with a short lock wait.
pub const ROTATE_SQL: &str = "SELECT amqp.rotate_consumption()";

/// Puts a delivery of a subscription with an ordering or a parallelism into
/// `amqp.inbox_waiting` (its values: subscription, message_id, ordering_key, exchange,
/// routing_key, body, headers, content_type, correlation_id, reply_to, timestamp as epoch
/// seconds, user_id, redelivered); returns its row's id. DO NOTHING, not DO UPDATE: a lane may
/// hold the row for as long as its handler runs, and an update would wait for it; a copy of a
/// waiting message finds its row with [`WAITING_ID_SQL`].
pub const STAGE_SQL: &str = "INSERT INTO amqp.inbox_waiting \
         (subscription, message_id, ordering_key, exchange, routing_key, body, headers, \
          content_type, correlation_id, reply_to, \"timestamp\", user_id, redelivered) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, to_timestamp($11), $12, $13) \
     ON CONFLICT (subscription, message_id) DO NOTHING \
     RETURNING id";

/// The waiting row of ($1 subscription, $2 message_id), if it is still there.
pub const WAITING_ID_SQL: &str =
    "SELECT id FROM amqp.inbox_waiting WHERE subscription = $1 AND message_id = $2";

/// Which of these `amqp.inbox_waiting` rows (`$1`, int8[]) are gone (handled, duplicates,
/// failed): their deliveries may be acknowledged.
pub const GONE_FROM_WAITING_SQL: &str = "SELECT x FROM unnest($1::int8[]) AS x \
      WHERE NOT EXISTS (SELECT FROM amqp.inbox_waiting w WHERE w.id = x)";

/// A waiting message `w` that may be handled now: no key, or no earlier message with its key
/// waiting or in progress, and none failed and not dead.
macro_rules! claimable {
    () => {
        "(w.ordering_key IS NULL \
     OR (NOT EXISTS (SELECT FROM amqp.inbox_waiting e \
                      WHERE e.subscription = w.subscription \
                        AND e.ordering_key = w.ordering_key AND e.id < w.id) \
         AND NOT EXISTS (SELECT FROM amqp.inbox_failed f \
                          WHERE f.subscription = w.subscription \
                            AND f.ordering_key = w.ordering_key \
                            AND f.dead_lettered_at IS NULL)))"
    };
}

/// How many waiting messages of these subscriptions (`$1`) may be handled now, those in
/// progress elsewhere included.
pub const CLAIMABLE_COUNT_SQL: &str = concat!(
    "SELECT count(*) FROM amqp.inbox_waiting w WHERE w.subscription = ANY($1) AND ",
    claimable!()
);

/// Claims up to `$2` waiting messages of these subscriptions (`$1`), oldest first, a message
/// with a key only when no earlier one with that key waits or is in progress (a locked row is
/// still there) and none has failed (not yet dead); rows others hold are skipped: id,
/// subscription, message_id, exchange, routing_key, body, headers (text), content_type,
/// correlation_id, reply_to, timestamp (epoch seconds), user_id, redelivered, ordering_key,
/// ended.
pub const CLAIM_WAITING_SQL: &str = concat!(
    "SELECT w.id, w.subscription, w.message_id, w.exchange, w.routing_key, w.body, \
            w.headers::text, w.content_type, w.correlation_id, w.reply_to, \
            extract(epoch FROM w.\"timestamp\")::float8, w.user_id, w.redelivered, \
            w.ordering_key, w.ended \
       FROM amqp.inbox_waiting w \
      WHERE w.subscription = ANY($1) AND ",
    claimable!(),
    " ORDER BY w.id LIMIT $2 FOR UPDATE OF w SKIP LOCKED"
);

/// Removes handled (or failed, or duplicate) messages (`$1`, int8[]) from
/// `amqp.inbox_waiting`.
pub const DONE_WAITING_SQL: &str = "DELETE FROM amqp.inbox_waiting WHERE id = ANY($1)";

/// The handler of this waiting message ($1 subscription, $2 message_id) ended a lane ($3: 1
/// timeout, 2 terminated): the next lane to take it records it as failed instead of running
/// it again.
pub const MARK_ENDED_SQL: &str =
    "UPDATE amqp.inbox_waiting SET ended = $3 WHERE subscription = $1 AND message_id = $2";

/// How many lanes the subscriptions want: the largest parallelism of those with lanes, and one
/// while messages wait for a subscription that has none any more.
pub const LANES_WANTED_SQL: &str = "SELECT greatest( \
         (SELECT max(parallelism) FROM amqp.subscription \
           WHERE NOT paused AND (parallelism > 1 OR ordering <> 'none')), \
         (SELECT 1 FROM amqp.inbox_waiting LIMIT 1))";
