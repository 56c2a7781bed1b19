//! Every SQL statement the worker runs. Each runs inside a short transaction opened by the
//! caller ([`super::pg::transaction`]); none waits on the broker.
//!
//! The texts of the delivery's statements (those the engine's `Outbox` runs) are the engine's
//! ([`amqp_outbox_engine::statements`]), so that a relay runs the very same ones.
//!
//! The worker pins its `search_path` to `pg_catalog, pg_temp` at start ([`super::pg::pin`]),
//! so these statements are plain SQL: no user's function or operator can be picked instead of
//! the built-in one. Only the extension's own tables are qualified (`amqp.`).

mod config;

pub use config::{broker_tables, load_brokers};

use super::flight::Proof;
use super::scan_floor::Probe;
use amqp_outbox_engine::outbox::{Recorded, RetryDelays};
use amqp_outbox_engine::statements;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::{SpiClient, SpiResult};

thread_local! {
    /// The workers' hot statements, planned once and kept (re-planned by PostgreSQL itself when
    /// the table changes). Cleared when the extension goes away.
    static PLANS: std::cell::RefCell<std::collections::HashMap<String, pgrx::spi::OwnedPreparedStatement>> =
        std::cell::RefCell::new(std::collections::HashMap::new());
}

/// Forgets the kept plans (the extension was dropped: they refer to dropped tables).
pub fn forget_plans() {
    PLANS.with_borrow_mut(|p| p.clear());
    ID_SEQUENCE.set(None);
}

/// Runs `sql` from a kept plan, preparing it on first use. (Also used by the subscription
/// worker, whose process has its own plans.)
pub(crate) fn run_kept<'conn, R>(
    client: &mut SpiClient<'conn>,
    sql: &str,
    args: &[DatumWithOid],
    mutating: bool,
    read: impl FnOnce(pgrx::spi::SpiTupleTable<'conn>) -> SpiResult<R>,
) -> SpiResult<R> {
    PLANS.with_borrow_mut(|plans| {
        // Looked up by the borrowed text: the key is copied only when the plan is made.
        let plan = match plans.get(sql) {
            Some(plan) => plan,
            None => {
                let oids: Vec<PgOid> = args.iter().map(|a| PgOid::from(a.oid())).collect();
                let prepared = if mutating {
                    client.prepare_mut(sql, &oids)?
                } else {
                    client.prepare(sql, &oids)?
                };
                plans.entry(sql.to_owned()).or_insert(prepared.keep())
            }
        };
        let table = if mutating {
            client.update(plan, None, args)?
        } else {
            client.select(plan, None, args)?
        };
        read(table)
    })
}

/// Microseconds from the Unix epoch to PostgreSQL's (2000-01-01).
const PG_EPOCH_OFFSET_MICROS: i64 = 946_684_800_000_000;

pub use amqp_outbox_engine::row::{Row, RowTags};

/// Whether the extension is installed; if so, also takes a share lock on `amqp.message` until
/// the end of the transaction, so a concurrent DROP EXTENSION waits for the worker's short
/// transaction instead of pulling the table from under its statements.
pub fn extension_exists() -> bool {
    installed_table().is_some()
}

/// As [`extension_exists`], returning `amqp.message`'s oid.
pub fn installed_table() -> Option<pg_sys::Oid> {
    crate::message_table::installed_table(pg_sys::AccessShareLock)
}

const VERSION_SQL: &str =
    "SELECT extversion FROM pg_catalog.pg_extension WHERE extname = 'amqp_outbox'";

/// The version of the SQL objects this library's statements are written for.
pub const LIBRARY_VERSION: &str = env!("CARGO_PKG_VERSION");

/// `Some(installed)` when the extension's SQL objects are at another version than this library
/// (the library was upgraded and `ALTER EXTENSION amqp_outbox UPDATE` has not run yet): the
/// tables may lack what the worker reads, so it waits instead of failing on every step.
pub fn version_mismatch() -> Option<String> {
    // A kept plan: the subscription worker asks at every step.
    let installed = Spi::connect_mut(|client| {
        run_kept(client, VERSION_SQL, &[], false, |t| {
            t.first().get_one::<String>()
        })
    });
    match installed {
        Ok(Some(v)) if v != LIBRARY_VERSION => Some(v),
        _ => None,
    }
}

fn unix_micros(ts: Option<TimestampWithTimeZone>) -> i64 {
    ts.map(|t| pg_sys::TimestampTz::from(t) + PG_EPOCH_OFFSET_MICROS)
        .unwrap_or(0)
}

fn rows_from(table: pgrx::spi::SpiTupleTable<'_>) -> SpiResult<Vec<Row>> {
    let mut rows = Vec::with_capacity(table.len());
    for r in table {
        rows.push(Row {
            id: r.get::<i64>(1)?.unwrap_or_default(),
            broker_id: r.get::<i32>(2)?.unwrap_or_default(),
            exchange: r.get::<String>(3)?.unwrap_or_default(),
            routing_key: r.get::<String>(4)?.unwrap_or_default(),
            body: r.get::<Vec<u8>>(5)?.unwrap_or_default(),
            delivery_mode: r.get::<i16>(6)?.unwrap_or(2),
            content_type: r.get::<String>(7)?,
            reply_to: r.get::<String>(8)?,
            correlation_id: r.get::<String>(9)?,
            headers: r.get::<String>(10)?,
            producer_pid: r.get::<i32>(11)?.unwrap_or_default(),
            producer_started_at: unix_micros(r.get::<TimestampWithTimeZone>(12)?),
            created_at: unix_micros(r.get::<TimestampWithTimeZone>(13)?),
            attempts: r.get::<i32>(14)?.unwrap_or_default(),
            message_id: r.get::<String>(15)?.unwrap_or_default(),
            tags: RowTags {
                business_type: r.get::<String>(16)?,
                business_key: r.get::<String>(17)?,
                traceparent: r.get::<String>(18)?,
                system_id: r.get::<String>(19)?,
                host_id: r.get::<String>(20)?,
            },
            writer: r
                .get::<i64>(21)?
                .and_then(|x| u32::try_from(x).ok())
                .unwrap_or(0),
        });
    }
    Ok(rows)
}

/// The first rows above `after`, in id order, that are not parked and are due, of these brokers.
/// `after` is the scan floor ([`super::scan_floor`]): never a plain high-water mark, since ids
/// are taken at INSERT and transactions commit in another order, so a mark would skip (or delay,
/// breaking each session's order) a row that committed late with a smaller id. `skip` (what is in flight or
/// held back) is left out by the statement itself, so `limit` counts only rows to publish now.
pub fn claim(
    client: &mut SpiClient<'_>,
    brokers: &[i32],
    limit: usize,
    skip: &[i64],
    max_bytes: usize,
    after: i64,
) -> SpiResult<Vec<Row>> {
    let args: [DatumWithOid; 5] = [
        brokers.to_vec().into(),
        (limit as i64).into(),
        skip.to_vec().into(),
        (max_bytes.min(i64::MAX as usize) as i64).into(),
        after.into(),
    ];
    run_kept(client, statements::CLAIM_SQL, &args, false, rows_from)
}

thread_local! {
    /// The oid of `amqp.message`'s id sequence: looked up once (the lookup scans pg_depend),
    /// again after a probe found no usable sequence, and after the extension was dropped.
    static ID_SEQUENCE: std::cell::Cell<Option<pg_sys::Oid>> = const { std::cell::Cell::new(None) };
}

pub fn probe(client: &mut SpiClient<'_>) -> SpiResult<Option<Probe>> {
    let seq = match ID_SEQUENCE.get() {
        Some(oid) => oid,
        None => {
            let oid = client
                .select(statements::ID_SEQUENCE_SQL, None, &[])?
                .first()
                .get_one::<pg_sys::Oid>()?;
            let Some(oid) = oid else {
                return Ok(None);
            };
            ID_SEQUENCE.set(Some(oid));
            oid
        }
    };
    let args: [DatumWithOid; 1] = [seq.into()];
    let probe = run_kept(client, statements::PROBE_SQL, &args, false, |t| {
        let Some(r) = t.into_iter().next() else {
            return Ok(None);
        };
        let (Some(xmin), Some(xmax), Some(running), Some(last_value)) = (
            r.get::<i64>(1)?,
            r.get::<i64>(2)?,
            r.get::<Vec<i64>>(3)?,
            r.get::<i64>(4)?,
        ) else {
            return Ok(None);
        };
        // SAFETY: reads shared memory under PostgreSQL's own lock; valid in any backend.
        let next_xid = unsafe { pg_sys::ReadNextFullTransactionId() }.value;
        Ok(Some(Probe {
            xmin: xmin.max(0) as u64,
            xmax: xmax.max(0) as u64,
            running: running.into_iter().map(|x| x.max(0) as u64).collect(),
            last_value,
            next_xid,
        }))
    })?;
    if probe.is_none() {
        ID_SEQUENCE.set(None);
    }
    Ok(probe)
}

/// How many bytes `amqp.message` (heap, TOAST, indexes) holds above its size when empty (no
/// heap page, one page per index), and its oid; no row while it has rows.
const EXCESS_SIZE_SQL: &str = "\
SELECT c.oid, pg_total_relation_size(c.oid) \
       - current_setting('block_size')::int8 * (SELECT count(*) FROM pg_index i \
                                                 WHERE i.indrelid IN (c.oid, c.reltoastrelid)) \
  FROM pg_class c \
 WHERE c.oid = 'amqp.message'::regclass \
   AND NOT EXISTS (SELECT FROM amqp.message)";

/// Truncates `amqp.message` if it holds more than `slack` bytes above its empty size, no row,
/// and no other session is using it (the exclusive lock is taken only if free at once). Returns
/// the bytes given back. Inside a subtransaction: an object a user added (a trigger, a foreign
/// key) may make TRUNCATE fail, and that must only leave the table as it is.
pub fn truncate_if_empty(client: &mut SpiClient<'_>, slack: i64) -> SpiResult<Option<i64>> {
    let (oid, excess) = {
        let t = client.select(EXCESS_SIZE_SQL, None, &[])?;
        if t.is_empty() {
            return Ok(None);
        }
        let r = t.first();
        (
            r.get::<pg_sys::Oid>(1)?.unwrap_or(pg_sys::InvalidOid),
            r.get::<i64>(2)?.unwrap_or(0),
        )
    };
    if excess <= slack || oid == pg_sys::InvalidOid {
        return Ok(None);
    }
    // SAFETY: inside the worker's transaction; the lock is released at its end.
    let locked = unsafe {
        pg_sys::ConditionalLockRelationOid(oid, pg_sys::AccessExclusiveLock as pg_sys::LOCKMODE)
    };
    if !locked {
        return Ok(None);
    }
    let done = crate::subtransaction::subtransaction(|| -> SpiResult<bool> {
        // `update` runs with a snapshot taken now, under the lock: rows committed since the
        // transaction began are seen.
        let empty = client
            .update("SELECT NOT EXISTS (SELECT FROM amqp.message)", None, &[])?
            .first()
            .get_one::<bool>()?
            .unwrap_or(false);
        if empty {
            client.update("TRUNCATE amqp.message", None, &[])?;
        }
        Ok(empty)
    });
    match done {
        Ok(Ok(true)) => Ok(Some(excess)),
        Ok(Ok(false)) => Ok(None),
        Ok(Err(e)) => Err(e),
        Err(caught) => {
            warning!(
                "amqp_outbox: could not truncate the empty amqp.message ({}): {}",
                caught.sqlstate,
                caught.message
            );
            Ok(None)
        }
    }
}

pub fn claim_ids(client: &SpiClient<'_>, ids: &[i64]) -> SpiResult<Vec<Row>> {
    let args: [DatumWithOid; 1] = [ids.to_vec().into()];
    rows_from(client.select(statements::CLAIM_BY_ID_SQL, None, &args)?)
}

/// What the production log records beside each delivered row.
pub struct LogSettings<'a> {
    /// `amqp_outbox.reconcile_window` is not 0.
    pub enabled: bool,
    pub system_id: &'a str,
    pub host_id: &'a str,
}

pub fn delete_delivered(
    client: &mut SpiClient<'_>,
    proofs: &[Proof],
    log: &LogSettings<'_>,
) -> SpiResult<usize> {
    let args: [DatumWithOid; 8] = [
        proofs.iter().map(|p| p.id).collect::<Vec<i64>>().into(),
        proofs
            .iter()
            .map(|p| p.published)
            .collect::<Vec<i64>>()
            .into(),
        proofs
            .iter()
            .map(|p| p.confirmed)
            .collect::<Vec<Option<i64>>>()
            .into(),
        proofs
            .iter()
            .map(|p| p.acknowledged)
            .collect::<Vec<Option<i64>>>()
            .into(),
        log.enabled.into(),
        log.system_id.into(),
        log.host_id.into(),
        proofs
            .iter()
            .map(|p| p.message_at)
            .collect::<Vec<i64>>()
            .into(),
    ];
    run_kept(client, statements::DELETE_DELIVERED_SQL, &args, true, |t| {
        Ok(t.first().get_one::<i64>()?.unwrap_or(0) as usize)
    })
}

/// Bounds the lock waits of the rest of the current (sub)transaction. A kept plan: it runs
/// before every DELETE of delivered rows.
pub fn set_lock_timeout(client: &mut SpiClient<'_>, timeout: &str) -> SpiResult<()> {
    run_kept(
        client,
        statements::SET_LOCK_TIMEOUT_SQL,
        &[timeout.into()],
        true,
        |_| Ok(()),
    )
}

/// Of these rows, the ones no other session holds, locked now for this transaction.
pub fn lock_free(client: &mut SpiClient<'_>, ids: &[i64]) -> SpiResult<Vec<i64>> {
    ids_of(client.update(statements::LOCK_FREE_SQL, None, &[ids.to_vec().into()])?)
}

/// Of these rows, the ones still in the table.
pub fn existing(client: &SpiClient<'_>, ids: &[i64]) -> SpiResult<Vec<i64>> {
    ids_of(client.select(statements::EXISTING_SQL, None, &[ids.to_vec().into()])?)
}

/// Ids of due delayed messages, locked ([`statements::DUE_SCHEDULED_SQL`]).
pub fn due_scheduled(client: &mut SpiClient<'_>, limit: i64) -> SpiResult<Vec<i64>> {
    ids_of(client.update(statements::DUE_SCHEDULED_SQL, None, &[limit.into()])?)
}

/// Moves delayed messages into the outbox; returns how many moved.
pub fn move_scheduled(client: &mut SpiClient<'_>, ids: &[i64]) -> SpiResult<usize> {
    Ok(client
        .update(statements::MOVE_SCHEDULED_SQL, None, &[ids.to_vec().into()])?
        .len())
}

/// A delayed message that could not move, tried again in a minute.
pub fn postpone_scheduled(client: &mut SpiClient<'_>, id: i64, error: &str) -> SpiResult<()> {
    client.update(
        statements::POSTPONE_SCHEDULED_SQL,
        None,
        &[id.into(), error.into()],
    )?;
    Ok(())
}

/// Milliseconds until the earliest delayed message is due.
pub fn next_scheduled_ms(client: &SpiClient<'_>) -> SpiResult<Option<f64>> {
    client
        .select(statements::NEXT_SCHEDULED_SQL, None, &[])?
        .first()
        .get_one::<f64>()
}

/// Deletes old idempotency keys.
pub fn expire_keys(client: &mut SpiClient<'_>, window_minutes: i32, limit: i64) -> SpiResult<()> {
    client.update(
        statements::EXPIRE_KEYS_SQL,
        None,
        &[window_minutes.into(), limit.into()],
    )?;
    Ok(())
}

fn ids_of(table: pgrx::spi::SpiTupleTable<'_>) -> SpiResult<Vec<i64>> {
    let mut ids = Vec::with_capacity(table.len());
    for r in table {
        ids.push(r.get::<i64>(1)?.unwrap_or_default());
    }
    Ok(ids)
}

/// A refused publish: count the attempt, keep the error, schedule the retry after the backoff
/// for the attempts made so far, or park the row once `max_attempts` is reached. `None` when the
/// row is gone, parked, or locked by another session: the worker never waits for a row lock
/// that a user's transaction holds (an admin's open transaction would stop every delivery, and
/// a multi-row `amqp.discard()` could deadlock with the worker); it tries again later.
pub fn record_failure(
    client: &mut SpiClient<'_>,
    id: i64,
    error: &str,
    max_attempts: i32,
    delays: &RetryDelays,
) -> SpiResult<Option<Recorded>> {
    let args: [DatumWithOid; 4] = [
        id.into(),
        error.into(),
        max_attempts.into(),
        delays.micros().into(),
    ];
    let table = client.update(statements::RECORD_FAILURE_SQL, None, &args)?;
    let mut out = None;
    for r in table {
        let attempts = r.get::<i32>(1)?.unwrap_or_default();
        out = Some(Recorded {
            attempts,
            parked: r.get::<bool>(2)?.unwrap_or(false),
            retry_in: delays.after(attempts),
        });
    }
    Ok(out)
}

/// Messages known lost (gap rule) or without proof past the timeout: count the attempt, keep
/// why, publish again at once, or park once `max_attempts` is reached. Returns the parked ids.
/// Rows locked by another session are left uncounted (see [`record_failure`]). The locked ids
/// are gathered once, then found by key (see [`statements::PARK_ORPHANS_SQL`]).
pub fn record_resend(
    client: &mut SpiClient<'_>,
    ids: &[i64],
    reason: &str,
    max_attempts: i32,
) -> SpiResult<Vec<i64>> {
    let args: [DatumWithOid; 3] = [ids.to_vec().into(), reason.into(), max_attempts.into()];
    let table = client.update(statements::RECORD_RESEND_SQL, None, &args)?;
    let mut parked = Vec::new();
    for r in table {
        if r.get::<bool>(2)?.unwrap_or(false) {
            parked.push(r.get::<i64>(1)?.unwrap_or_default());
        }
    }
    Ok(parked)
}

/// Parks a row at once (a row that can never be published as it is). `false`: the row is gone,
/// already parked, or locked by another session (see [`record_failure`]).
pub fn park(client: &mut SpiClient<'_>, id: i64, error: &str) -> SpiResult<bool> {
    let args: [DatumWithOid; 2] = [id.into(), error.into()];
    let table = client.update(statements::PARK_SQL, None, &args)?;
    Ok(table.len() == 1)
}

/// The backlog per broker, for `amqp_outbox.max_pending`: rows waiting to be taken by the
/// broker. Rows the broker refused (waiting for their retry, or parked) are left out: they say
/// nothing about how fast the broker takes messages, and must not turn publishers away.
pub fn count_pending(client: &SpiClient<'_>) -> SpiResult<std::collections::HashMap<i32, i64>> {
    let table = client.select(
        "SELECT broker_id, count(*) FROM amqp.message \
          WHERE parked_at IS NULL AND attempts = 0 \
          GROUP BY broker_id",
        None,
        &[],
    )?;
    let mut counts = std::collections::HashMap::new();
    for r in table {
        counts.insert(
            r.get::<i32>(1)?.unwrap_or_default(),
            r.get::<i64>(2)?.unwrap_or_default(),
        );
    }
    Ok(counts)
}

/// Parks the rows whose broker_id names no broker ([`statements::PARK_ORPHANS_SQL`]); returns
/// how many.
pub fn park_orphans(client: &mut SpiClient<'_>) -> SpiResult<usize> {
    let table = client.update(statements::PARK_ORPHANS_SQL, None, &[])?;
    Ok(table.len())
}
