//! What DBAs query to watch the worker (through the views in sql/finish.sql).

use crate::shmem;
use pgrx::prelude::*;
use std::sync::atomic::{AtomicU64, Ordering};

/// Whether `amqp_outbox.database` allows this database (the install script warns if not).
#[pg_extern(stable, parallel_safe, name = "_serves_this_database")]
fn serves_this_database() -> bool {
    // SAFETY: MyDatabaseId is set in a connected backend; get_database_name returns a palloc'd
    // copy of its name, or NULL when it no longer exists.
    let name = unsafe {
        let p = pg_sys::get_database_name(pg_sys::MyDatabaseId);
        if p.is_null() {
            return false;
        }
        std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
    };
    crate::gucs::database_filter().allows(&name)
}

type StatusRow = (
    pg_sys::Oid,
    String,
    Option<i32>,
    i64,
    i64,
    i64,
    i64,
    i64,
    i64,
    i64,
    String,
    i64,
    i64,
    Option<i32>,
    Option<i32>,
);

fn status_row(
    oid: u32,
    state: &str,
    slot: Option<(&shmem::Counters, (i32, i32, i32))>,
) -> StatusRow {
    let load = |f: fn(&shmem::Counters) -> &AtomicU64| {
        slot.map_or(0, |(c, _)| f(c).load(Ordering::Relaxed) as i64)
    };
    let pid = |p: i32| (p != 0).then_some(p);
    (
        pg_sys::Oid::from(oid),
        state.to_string(),
        slot.and_then(|(_, p)| pid(p.0)),
        load(|c| &c.published),
        load(|c| &c.confirmed),
        load(|c| &c.acknowledged),
        load(|c| &c.resent_gap),
        load(|c| &c.resent_timeout),
        load(|c| &c.failed),
        load(|c| &c.parked),
        crate::ack_queue::name_for(oid),
        load(|c| &c.steps),
        load(|c| &c.commit_wakeups),
        slot.and_then(|(_, p)| pid(p.1)),
        slot.and_then(|(_, p)| pid(p.2)),
    )
}

#[allow(clippy::type_complexity)]
/// One row per database the launcher serves or could not serve, and one for this database in
/// any case: its state, the workers' pids, their counters since the slot was given to it.
#[pg_extern(volatile, parallel_safe, name = "_worker_status")]
fn worker_status() -> TableIterator<
    'static,
    (
        name!(database_oid, pg_sys::Oid),
        name!(state, String),
        name!(worker_pid, Option<i32>),
        name!(published, i64),
        name!(confirmed, i64),
        name!(acknowledged, i64),
        name!(resent_lost, i64),
        name!(resent_timeout, i64),
        name!(failed, i64),
        name!(parked, i64),
        name!(ack_queue, String),
        name!(steps, i64),
        name!(commit_wakeups, i64),
        name!(subscription_worker_pid, Option<i32>),
        name!(monitor_pid, Option<i32>),
    ),
> {
    // SAFETY: MyDatabaseId is a plain global of a connected backend.
    let here = unsafe { pg_sys::MyDatabaseId }.to_u32();
    let mut rows: Vec<StatusRow> = Vec::new();
    if !shmem::ready() {
        rows.push(status_row(here, "not preloaded", None));
        return TableIterator::new(rows);
    }
    for (oid, state, counters, pids) in shmem::launch::served() {
        rows.push(status_row(oid, state, Some((counters, pids))));
    }
    for (oid, why) in shmem::launch::unserved() {
        if !rows.iter().any(|r| r.0.to_u32() == oid) {
            rows.push(status_row(oid, why.text(), None));
        }
    }
    if !rows.iter().any(|r| r.0.to_u32() == here) {
        let state = if serves_this_database() {
            if shmem::launch::launcher_pid().is_some() {
                "starting"
            } else {
                "no launcher"
            }
        } else {
            "not served: excluded by amqp_outbox.database"
        };
        rows.push(status_row(here, state, None));
    }
    TableIterator::new(rows)
}

#[allow(clippy::type_complexity)]
/// Each broker's connection as the worker last reported it.
#[pg_extern(volatile, parallel_safe, name = "_broker_status")]
fn broker_status() -> TableIterator<
    'static,
    (
        name!(broker_id, i32),
        name!(connected, bool),
        name!(host, Option<String>),
        name!(channel, i64),
        name!(since, TimestampWithTimeZone),
        name!(in_flight, i32),
        name!(pending, Option<i64>),
        name!(last_error, Option<String>),
    ),
> {
    let rows: Vec<_> = shmem::broker_states()
        .into_iter()
        .map(|s| {
            let text = |t: &str| (!t.is_empty()).then(|| t.to_string());
            (
                s.broker_id,
                s.connected,
                text(s.host()),
                s.epoch as i64,
                TimestampWithTimeZone::try_from(s.since)
                    .unwrap_or_else(|_| TimestampWithTimeZone::negative_infinity()),
                s.in_flight.min(i32::MAX as u32) as i32,
                (crate::gucs::MAX_PENDING.get() > 0).then_some(s.pending),
                text(s.error()),
            )
        })
        .collect();
    TableIterator::new(rows)
}

/// The messages the worker has in flight: `confirmed` means delivered and awaiting the
/// acknowledgement record (ack_queue mode).
#[pg_extern(volatile, parallel_safe, name = "_in_flight")]
fn in_flight() -> TableIterator<'static, (name!(id, i64), name!(confirmed, bool))> {
    TableIterator::new(shmem::in_flight())
}
