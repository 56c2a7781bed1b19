//! The monitor's schedule: a round about once a second (passes of `amqp._monitor()` while a
//! full batch was due, within a time budget; then due compensations, within theirs), the counts
//! for `amqp.health()` every few seconds, the production log's upkeep every ten. Each statement
//! runs in a transaction of its own with its error logged, never raised: nothing a user stores
//! in a rule, a receipt or a handler ends the monitor.

use super::compensation;
use crate::gucs::{self, WorkerSettings};
use crate::inbox::guarded;
use crate::worker::pg;
use crate::worker::queries as outbox_queries;
use pgrx::prelude::*;
use std::time::{Duration, Instant};

const ROUND_EVERY: Duration = Duration::from_secs(1);
/// Messages one pass looks at, at most (the number in [`PASS_SQL`]).
const PASS_BATCH: i64 = 5000;
const PASS_SQL: &str = "SELECT amqp._monitor(5000)::text";
/// Passes run back to back while a whole batch was due, until this much of a round is used:
/// a backlog (after an upgrade or a long stop) is worked off without giving up the schedule.
const PASS_BUDGET: Duration = Duration::from_millis(500);
/// Compensations run per round at most, and the time after which no further one starts (a
/// slow function is bounded by `amqp_outbox.handler_timeout` on top).
const COMPENSATIONS_PER_ROUND: usize = 20;
const COMPENSATION_BUDGET: Duration = Duration::from_millis(300);
const SUMMARY_EVERY: Duration = Duration::from_secs(5);
const UPKEEP_EVERY: Duration = Duration::from_secs(10);
/// The upkeep's partition DDL waits at most this long for its locks: the outbox worker's
/// writes to the production log would queue behind a waiting ALTER or DROP (a pg_dump holds
/// every table) up to their lock_timeout.
const UPKEEP_LOCK_WAIT: Duration = Duration::from_millis(200);

enum Presence {
    Ready,
    /// Installed at another version than the library's: the monitor waits for the update.
    Mismatch(String),
    Missing,
}

#[derive(Default)]
pub struct Monitor {
    summary_at: Option<Instant>,
    upkeep_at: Option<Instant>,
    /// The version mismatch last logged (once per distinct one).
    mismatch_logged: Option<String>,
}

impl Monitor {
    pub fn run(mut self) -> ! {
        let mut settings = gucs::worker_settings();
        loop {
            if pg::shutdown_requested() {
                log!("amqp_outbox: monitor shutting down");
                // SAFETY: the main thread, between transactions; never returns. The launcher
                // starts it again unless its database is going away.
                unsafe { crate::pg_compat::proc_exit(0) };
            }
            if pg::reload_config_if_requested() {
                settings = gucs::worker_settings();
            }
            let started = Instant::now();
            match presence() {
                Presence::Ready => {
                    self.mismatch_logged = None;
                    self.round(&settings);
                }
                Presence::Mismatch(why) => {
                    if self.mismatch_logged.as_ref() != Some(&why) {
                        log!("amqp_outbox: monitor waits: {why}");
                        self.mismatch_logged = Some(why);
                    }
                }
                Presence::Missing => {
                    log!(
                        "amqp_outbox: extension not installed in this database; the monitor exits"
                    );
                    // SAFETY: as above.
                    unsafe { crate::pg_compat::proc_exit(0) };
                }
            }
            let rest = ROUND_EVERY.saturating_sub(started.elapsed());
            if !rest.is_zero() {
                pg::wait(None, rest, pg::WaitEvent::MonitorMain);
            }
        }
    }

    fn round(&mut self, settings: &WorkerSettings) {
        let started = Instant::now();
        loop {
            match guarded::statement_alone("amqp_outbox monitor", PASS_SQL, None) {
                Ok(looked) => {
                    let full = looked
                        .and_then(|n| n.parse::<i64>().ok())
                        .is_some_and(|n| n >= PASS_BATCH);
                    if !full || started.elapsed() >= PASS_BUDGET {
                        break;
                    }
                }
                Err(e) => {
                    warning!(
                        "amqp_outbox: monitor pass failed: {} (SQLSTATE {})",
                        e.message,
                        e.sqlstate
                    );
                    break;
                }
            }
        }
        let backoff = settings.retry_backoff();
        let handler_timeout = Duration::from_millis(gucs::HANDLER_TIMEOUT.get().max(0) as u64);
        let compensating = Instant::now();
        for _ in 0..COMPENSATIONS_PER_ROUND {
            if compensating.elapsed() >= COMPENSATION_BUDGET
                || !compensation::compensate_one(&backoff, handler_timeout)
            {
                break;
            }
        }
        let now = Instant::now();
        if self.summary_at.is_none_or(|t| now >= t) {
            self.summary_at = Some(now + SUMMARY_EVERY);
            logged(
                "amqp_outbox monitor counts",
                "SELECT 'counted'::text FROM amqp._summarize()",
                None,
            );
        }
        if self.upkeep_at.is_none_or(|t| now >= t) {
            self.upkeep_at = Some(now + UPKEEP_EVERY);
            logged(
                "amqp_outbox reconciliation upkeep",
                "SELECT amqp._reconcile_upkeep()",
                Some(UPKEEP_LOCK_WAIT),
            );
        }
    }
}

fn presence() -> Presence {
    pg::transaction("amqp_outbox monitor", || {
        if !outbox_queries::extension_exists() {
            Presence::Missing
        } else if let Some(why) = outbox_queries::version_mismatch() {
            Presence::Mismatch(why)
        } else {
            Presence::Ready
        }
    })
}

/// One statement alone, its error logged; `lock_wait`: the longest it waits for a lock (then it
/// is left for its next turn, with a debug line).
fn logged(what: &str, sql: &'static str, lock_wait: Option<Duration>) {
    match guarded::statement_alone(what, sql, lock_wait) {
        Ok(Some(done)) if done.starts_with("made") => {
            log!("amqp_outbox: production log: {done}")
        }
        Ok(_) => {}
        Err(e) if lock_wait.is_some() && e.sqlstate == guarded::LOCK_NOT_AVAILABLE => {
            debug1!("amqp_outbox: {what} postponed: {}", e.message)
        }
        Err(e) => warning!(
            "amqp_outbox: {what} failed: {} (SQLSTATE {})",
            e.message,
            e.sqlstate
        ),
    }
}
