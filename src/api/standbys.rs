//! `amqp.wait_for_standbys()`: for an application that acknowledges to RabbitMQ itself (after
//! `consume_once()` and COMMIT, say), the same promise the subscription worker keeps with
//! `amqp_outbox.standby_names`: do not let the broker drop a message before the standbys have
//! the commit that applied it, or a failover loses the effect.

use crate::error::{OrRaise, OutboxError};
use crate::gucs;
use crate::wait_event::WaitEvent;
use crate::worker::standby_gate::Standbys;
use crate::worker::standbys;
use pgrx::datum::Interval;
use pgrx::prelude::*;
use std::time::{Duration, Instant};

/// How often the standbys' positions are read while the caller waits.
const LOOK_EVERY_MS: std::ffi::c_long = 1;

/// Waits until the standbys named by `amqp_outbox.standby_names` have flushed this session's
/// last commit; true when they have (at once when the setting is empty or the session has not
/// committed a write), false when `timeout` ran out first.
#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn wait_for_standbys(timeout: default!(Option<Interval>, "'10 seconds'")) -> bool {
    let timeout = timeout
        .ok_or(OutboxError::NullArgument("timeout"))
        .or_raise();
    if timeout.as_micros() < 0 {
        OutboxError::NegativeTimeout.raise();
    }
    let timeout = Duration::from_micros(u64::try_from(timeout.as_micros()).unwrap_or(u64::MAX));
    let standbys = Standbys::parse(
        &gucs::text(&gucs::STANDBY_NAMES).unwrap_or_default(),
        &standbys::own_name(),
    );
    // SAFETY: a backend global, written only by this backend's own commits.
    let target = unsafe { pg_sys::XactLastCommitEnd };
    if standbys.is_off() || target == 0 {
        return true;
    }
    // A commit with `synchronous_commit = off` is not on disk yet, and a walsender sends only
    // flushed WAL: flushed here rather than at the WAL writer's next round.
    standbys::flush_wal_to(target);
    // Its wait's name in pg_stat_activity (PostgreSQL 17 and later), once per session.
    crate::wait_event::register(&[WaitEvent::WaitForStandbys]);
    let started = Instant::now();
    let mut positions = standbys::StandbyPositions::default();
    loop {
        if standbys
            .flushed(&positions.read(standbys::names_by_pid))
            .is_some_and(|flushed| flushed >= target)
        {
            return true;
        }
        if started.elapsed() >= timeout {
            return false;
        }
        // SAFETY: this backend's own latch; the wait ends on it, the timeout or postmaster death.
        unsafe {
            pg_sys::WaitLatch(
                pg_sys::MyLatch,
                (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
                LOOK_EVERY_MS,
                WaitEvent::WaitForStandbys.info(),
            );
            pg_sys::ResetLatch(pg_sys::MyLatch);
        }
        check_for_interrupts!();
    }
}
