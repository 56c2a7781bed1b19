//! What DBAs query to watch the worker (through the views in sql/finish.sql).

use crate::shmem;
use pgrx::prelude::*;
use std::sync::atomic::{AtomicU64, Ordering};

/// The databases `amqp_outbox.database` lists (each has an outbox and a subscription worker).
#[pg_extern(stable, parallel_safe, name = "_served_databases")]
fn served_databases() -> Vec<String> {
    crate::gucs::database_names()
}

#[allow(clippy::type_complexity)]
/// The worker's process id, its counters since server start (zeros when not preloaded), the
/// name of this database's acknowledgement queue, and how often the worker stepped and was woken
/// by a commit.
#[pg_extern(volatile, parallel_safe, name = "_worker_status")]
fn worker_status() -> TableIterator<
    'static,
    (
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
    ),
> {
    let load = |f: fn(&shmem::Counters) -> &AtomicU64| {
        shmem::counters().map_or(0, |c| f(c).load(Ordering::Relaxed) as i64)
    };
    TableIterator::once((
        shmem::worker_pid(shmem::WorkerKind::Outbox),
        load(|c| &c.published),
        load(|c| &c.confirmed),
        load(|c| &c.acknowledged),
        load(|c| &c.resent_gap),
        load(|c| &c.resent_timeout),
        load(|c| &c.failed),
        load(|c| &c.parked),
        crate::ack_queue::name(),
        load(|c| &c.steps),
        load(|c| &c.commit_wakeups),
        shmem::worker_pid(shmem::WorkerKind::Inbox),
    ))
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
