//! The statements the delivery runs on `amqp.message` (those of [`crate::outbox::Outbox`]), as
//! text with bound parameters, so that every host runs the very same ones: the background
//! worker through SPI (its `queries.rs`, which keeps each hot one as a prepared plan), a relay
//! over its connection. They are written for a `search_path` of `pg_catalog, pg_temp`: only the
//! extension's own tables are qualified (`amqp.`), so no user's function or operator can be
//! picked instead of the built-in one.

/// The next rows to publish, in id order: not in flight or held back (`$3`), and no more body
/// bytes than `$4` (the first row always: it may be larger). `octet_length` reads a toasted
/// body's size from its pointer, so rows past the budget cost no detoasting. Kept in its own
/// file so that pg_regress/sql/claim_plan.sql and the bench explain this very text.
pub const CLAIM_SQL: &str = include_str!("statements/claim.sql");

/// These rows (`$1`), in id order, unless parked or gone: the suspects, published alone.
pub const CLAIM_BY_ID_SQL: &str = "\
SELECT id, broker_id, exchange, routing_key, body, delivery_mode, content_type, reply_to, \
       correlation_id, headers::text, producer_pid, producer_started_at, created_at, \
       attempts, message_id, business_type, business_key, traceparent, system_id, host_id, \
       xmin::text::int8 AS writer \
  FROM amqp.message \
 WHERE id = ANY ($1) AND parked_at IS NULL \
 ORDER BY id";

/// The text of [`PROBE_SQL`], for the statements made from it.
macro_rules! probe {
    () => {
        "\
SELECT pg_snapshot_xmin(c.snap)::text::int8 AS xmin, \
       pg_snapshot_xmax(c.snap)::text::int8 AS xmax, \
       ARRAY(SELECT x::text::int8 FROM pg_snapshot_xip(c.snap) AS x ORDER BY 1) AS running, \
       coalesce(pg_sequence_last_value(s.seqrelid), 0) AS last_value \
  FROM pg_sequence s, pg_current_snapshot() AS c (snap) \
 WHERE s.seqrelid = $1 AND s.seqcache = 1 AND NOT s.seqcycle"
    };
}

/// The claim's snapshot (its xmin, its xmax and the transaction ids it sees running) and the
/// sequence's last value, for the scan floor; the next transaction id is read once the
/// statement has returned, so after the last value. `None` when the floor cannot be trusted:
/// the sequence caches values per session (they are drawn out of order), or cycles, or is gone.
pub const PROBE_SQL: &str = probe!();

/// [`PROBE_SQL`] for a client, whose next transaction id is a transaction id of its own (see
/// the relay's `ClientOutbox::probe`), taken in the same statement once the probe's row is
/// made: the materialized CTE makes the row, last value included, before the outer projection
/// runs. The id is NULL when the transaction had one before (assigned before the probe, it may
/// be below others') or does not keep its snapshot (READ COMMITTED: the claim would not see the
/// probe's). One round trip instead of two.
pub const PROBE_WITH_XID_SQL: &str = concat!(
    "WITH p AS MATERIALIZED (",
    probe!(),
    ") \
SELECT p.xmin, p.xmax, p.running, p.last_value, \
       CASE WHEN current_setting('transaction_isolation') \
                 IN ('repeatable read', 'serializable') \
             AND pg_current_xact_id_if_assigned() IS NULL \
            THEN pg_current_xact_id()::text::int8 END \
  FROM p"
);

/// Deletes rows whose delivery is proven, in one statement that also keeps their record in
/// the production log (`$5`: `amqp_outbox.reconcile_window` is not 0) and counts them in the
/// day's statistics. Resends of the monitor (`resends > 0`) are in the log already. The
/// statistics rows written here (`part` 0) are this worker's alone, so it never waits on the
/// subscription worker's counting. Returns how many rows existed.
///
/// The DELETE returns the body and properties (the whole row, `kept`) only for monitored
/// business types: copying every body costs the drain. It reads `amqp.message` once, through
/// the ids: a second read of the table joined to the deleted rows was planned, from the
/// statistics of an empty table, as a full index scan per deleted row, which a long transaction
/// (dead rows that stay) turned into seconds per statement (pg_regress/sql/delete_plan.sql).
/// The message's time comes from the worker (`$8`, [`crate::message::message_at`]), not from a
/// function per row. Kept in its own file so that the plan test explains this very text.
pub const DELETE_DELIVERED_SQL: &str = include_str!("statements/delete_delivered.sql");

/// The oid of `amqp.message`'s id sequence (NULL when it has none).
pub const ID_SEQUENCE_SQL: &str =
    "SELECT pg_get_serial_sequence('amqp.message', 'id')::regclass::oid";

/// Bounds the lock waits of the rest of the current (sub)transaction (`$1`: as `lock_timeout`
/// takes it). Ended with the (sub)transaction: `is_local`.
pub const SET_LOCK_TIMEOUT_SQL: &str = "SELECT pg_catalog.set_config('lock_timeout', $1, true)";

/// Of these rows (`$1`), the ones no other session holds, locked now for this transaction.
pub const LOCK_FREE_SQL: &str =
    "SELECT id FROM amqp.message WHERE id = ANY ($1) FOR UPDATE SKIP LOCKED";

/// Of these rows (`$1`), the ones still in the table.
pub const EXISTING_SQL: &str = "SELECT id FROM amqp.message WHERE id = ANY ($1)";

/// A refused publish (see [`crate::outbox::Outbox::record_failure`]): `$1` the id, `$2` the
/// error, `$3` max_attempts, `$4` the retry delays in microseconds ([`crate::outbox::RetryDelays`]).
/// Returns the attempts and whether the row is parked now; no row when it is gone, parked or
/// locked by another session.
pub const RECORD_FAILURE_SQL: &str = "UPDATE amqp.message \
            SET attempts = attempts + 1, \
                last_error = $2, \
                next_attempt_at = clock_timestamp() \
                    + $4[least(greatest(attempts, 0), cardinality($4) - 1) + 1] \
                      * interval '1 microsecond', \
                parked_at = CASE WHEN attempts + 1 >= $3 THEN clock_timestamp() END \
          WHERE id = (SELECT id FROM amqp.message \
                       WHERE id = $1 AND parked_at IS NULL FOR UPDATE SKIP LOCKED) \
      RETURNING attempts, parked_at IS NOT NULL";

/// Messages to publish again (see [`crate::outbox::Outbox::record_resend`]): `$1` the ids, `$2`
/// why, `$3` max_attempts. Returns each counted row's id and whether it is parked now.
pub const RECORD_RESEND_SQL: &str = "UPDATE amqp.message \
            SET attempts = attempts + 1, last_error = $2, next_attempt_at = NULL, \
                parked_at = CASE WHEN attempts + 1 >= $3 THEN clock_timestamp() END \
          WHERE id = ANY (ARRAY(SELECT id FROM amqp.message \
                                 WHERE id = ANY ($1) AND parked_at IS NULL \
                                 FOR UPDATE SKIP LOCKED)) \
      RETURNING id, parked_at IS NOT NULL";

/// Parks a row at once (`$1` the id, `$2` why); no row changed when it is gone, already parked
/// or locked by another session.
pub const PARK_SQL: &str = "UPDATE amqp.message SET attempts = attempts + 1, last_error = $2, \
                parked_at = clock_timestamp() \
          WHERE id = (SELECT id FROM amqp.message \
                       WHERE id = $1 AND parked_at IS NULL FOR UPDATE SKIP LOCKED)";

/// `amqp.broker`, hosts grouped by broker_id in a stable order
/// ([`crate::brokers::HostRow`]'s fields in order).
pub const BROKER_HOSTS_SQL: &str = "\
SELECT broker_id, host, port, vhost, username, password, proof, \
       tls, tls_ca_file, tls_cert_file, tls_key_file, tls_server_name \
  FROM amqp.broker ORDER BY broker_id, host, port";

/// `amqp.exchange` ([`crate::brokers::ExchangeRow`]).
pub const EXCHANGES_SQL: &str = "\
SELECT broker_id, exchange, exchange_type, passive, durable, auto_delete \
  FROM amqp.exchange ORDER BY broker_id, exchange";

/// `amqp.queue` ([`crate::brokers::QueueRow`]).
pub const QUEUES_SQL: &str = "\
SELECT broker_id, queue, durable, auto_delete, arguments::text FROM amqp.queue \
 ORDER BY broker_id, queue";

/// `amqp.binding` ([`crate::brokers::BindingRow`]).
pub const BINDINGS_SQL: &str = "\
SELECT broker_id, queue, exchange, routing_key, arguments::text FROM amqp.binding \
 ORDER BY broker_id, queue, exchange, routing_key";

/// Parks the rows whose broker_id names no broker (inserted directly, or the broker was
/// removed): they could never be published, and must not wait unseen. One statement, so the
/// check and the update see the same brokers. Rows locked by another session wait for the
/// next check. Returns the parked ids.
///
/// The ids are gathered once (`ARRAY(...)`: an InitPlan) and the rows then found by primary
/// key. Written as `id IN (subquery)`, a plan made while the table's statistics said "empty"
/// (what autovacuum leaves after a drain) was a nested loop that ran the locking subquery
/// again for every row: quadratic in a backlog, the worker stuck in it for minutes.
pub const PARK_ORPHANS_SQL: &str = "\
UPDATE amqp.message m \
   SET attempts = m.attempts + 1, parked_at = clock_timestamp(), \
       last_error = 'broker ' || m.broker_id::text || ' does not exist in amqp.broker' \
 WHERE m.id = ANY (ARRAY(SELECT o.id FROM amqp.message o \
                          WHERE o.parked_at IS NULL \
                            AND NOT EXISTS (SELECT FROM amqp.broker b \
                                             WHERE b.broker_id = o.broker_id) \
                            FOR UPDATE OF o SKIP LOCKED)) \
RETURNING m.id";

/// The columns `amqp.scheduled_message` and `amqp.message` share (`amqp.discarded`'s first
/// ones too), as a literal for [`MOVE_SCHEDULED_SQL`].
macro_rules! scheduled_columns {
    () => {
        "id, producer_pid, producer_started_at, broker_id, exchange, routing_key, body, \
         delivery_mode, content_type, reply_to, correlation_id, headers, created_at, attempts, \
         next_attempt_at, last_error, parked_at, message_id, business_type, business_key, \
         traceparent, system_id, host_id, resends"
    };
}

/// The columns `amqp.scheduled_message` and `amqp.message` share.
pub const SCHEDULED_COLUMNS: &str = scheduled_columns!();

/// Moves the delayed messages whose ids `$1` (bigint[]) lists into `amqp.message`, same id and
/// message_id; its row count is the number moved.
pub const MOVE_SCHEDULED_SQL: &str = concat!(
    "WITH due AS (DELETE FROM amqp.scheduled_message \
                   WHERE id OPERATOR(pg_catalog.=) ANY ($1) RETURNING *) \
     INSERT INTO amqp.message (",
    scheduled_columns!(),
    ") SELECT ",
    scheduled_columns!(),
    " FROM due"
);

/// Ids of due delayed messages (at most `$1`), oldest due first. SKIP LOCKED: a row
/// `amqp.retry()` or `amqp.discard()` is taking meanwhile is theirs.
pub const DUE_SCHEDULED_SQL: &str = "\
SELECT id FROM amqp.scheduled_message \
 WHERE deliver_at OPERATOR(pg_catalog.<=) pg_catalog.now() \
 ORDER BY deliver_at, id LIMIT $1 FOR UPDATE SKIP LOCKED";

/// Milliseconds until the earliest delayed message is due (negative: overdue); NULL: none.
pub const NEXT_SCHEDULED_SQL: &str = "\
SELECT (pg_catalog.date_part('epoch', pg_catalog.min(deliver_at)) \
        OPERATOR(pg_catalog.-) pg_catalog.date_part('epoch', pg_catalog.clock_timestamp())) \
       OPERATOR(pg_catalog.*) 1000 \
  FROM amqp.scheduled_message";

/// A delayed message that could not move (`$1` its id, `$2` why): tried again in a minute.
pub const POSTPONE_SCHEDULED_SQL: &str = "\
UPDATE amqp.scheduled_message \
   SET last_error = $2, \
       deliver_at = pg_catalog.now() OPERATOR(pg_catalog.+) '1 minute'::pg_catalog.interval \
 WHERE id OPERATOR(pg_catalog.=) $1";

/// Deletes idempotency keys older than `$1` minutes, at most `$2`. SKIP LOCKED: a key a
/// publishing transaction is taking again (its old row updated, not yet committed) must not
/// make the worker's transaction wait for that session.
pub const EXPIRE_KEYS_SQL: &str = "\
DELETE FROM amqp.idempotency_key \
 WHERE key IN (SELECT key FROM amqp.idempotency_key \
                WHERE published_at OPERATOR(pg_catalog.<) \
                      (pg_catalog.now() OPERATOR(pg_catalog.-) pg_catalog.make_interval(mins => $1)) \
                LIMIT $2 FOR UPDATE SKIP LOCKED)";

/// The settings a delivery session runs with, for its whole life: the worker pins them at its
/// start, a relay sets them on each connection (its statements are these texts, written for
/// them).
///
/// - `search_path`: the statements resolve functions and operators in `pg_catalog` only,
///   whatever a user creates elsewhere.
/// - `synchronous_commit` off: losing the delivery's own commits in a crash only means
///   publishing again (at least once); waiting for each WAL flush would cap the drain rate.
/// - `lock_timeout`: the statements are short; a lock wait must not hold a transaction open.
/// - No bitmap scans, sorts or sequential scans: the claim must walk the primary key from the
///   scan floor and stop after its batch, and the DELETE find its rows by id. Planned while the
///   table was empty, just truncated or never analyzed, those look cheaper, and the plan would
///   then sort the whole backlog on every claim, or read the whole table on every DELETE (the
///   relay's first measurements: three times the worker's CPU per message). Statements with no
///   index to use (the periodic checks) still scan.
/// - `jit` off: those scans carry the disabled-path cost, far above `jit_above_cost`; each would
///   be compiled to machine code (tens of ms) to read a few rows.
/// - Generic plans: every statement is prepared once and kept, and each is written for one plan
///   whatever its parameters. Left to choose, the plan cache may settle on planning the claim
///   again at every step (half of the worker's PostgreSQL time at 2,000 msg/s, measured after an
///   ANALYZE of the empty table), and switches between the two as statistics change.
pub const SESSION_SETTINGS: &[(&str, &str)] = &[
    ("search_path", "pg_catalog, pg_temp"),
    ("synchronous_commit", "off"),
    ("lock_timeout", "10s"),
    ("enable_bitmapscan", "off"),
    ("enable_sort", "off"),
    ("enable_seqscan", "off"),
    ("jit", "off"),
    ("plan_cache_mode", "force_generic_plan"),
];

#[cfg(test)]
mod tests {
    use super::*;

    /// A plan test must PREPARE the very statement the worker runs.
    fn assert_prepares(regress: &str, sql: &str, what: &str) {
        let prepared = format!("AS\n{};\n", sql.trim_end());
        assert!(regress.contains(&prepared), "{what}");
    }

    #[test]
    fn the_move_names_the_shared_columns_on_both_sides() {
        assert_eq!(MOVE_SCHEDULED_SQL.matches(SCHEDULED_COLUMNS).count(), 2);
    }

    #[test]
    fn the_claim_plan_test_explains_the_workers_own_claim() {
        assert_prepares(
            include_str!("../../pg_regress/sql/claim_plan.sql"),
            CLAIM_SQL,
            "pg_regress/sql/claim_plan.sql must PREPARE the text of engine/src/statements/claim.sql",
        );
    }

    #[test]
    fn the_delete_plan_test_explains_the_workers_own_delete() {
        assert_prepares(
            include_str!("../../pg_regress/sql/delete_plan.sql"),
            DELETE_DELIVERED_SQL,
            "pg_regress/sql/delete_plan.sql must PREPARE the text of engine/src/statements/delete_delivered.sql",
        );
    }
}
