//! What DBAs query to see the worker: its pid and its counters since the server started.

use crate::shmem;
use pgrx::prelude::*;
use std::sync::atomic::Ordering;

/// The worker's process id and counters since server start (zeros when not preloaded).
#[pg_extern(volatile, parallel_safe)]
fn worker_status() -> TableIterator<
    'static,
    (
        name!(worker_pid, Option<i32>),
        name!(published, i64),
        name!(confirmed, i64),
        name!(failed, i64),
        name!(parked, i64),
    ),
> {
    let load = |f: fn(&shmem::Counters) -> &std::sync::atomic::AtomicU64| {
        shmem::counters().map_or(0, |c| f(c).load(Ordering::Relaxed) as i64)
    };
    TableIterator::once((
        shmem::worker_pid(),
        load(|c| &c.published),
        load(|c| &c.confirmed),
        load(|c| &c.failed),
        load(|c| &c.parked),
    ))
}
