//! The reconciliation monitor's schedule and its compensations, for every host (the
//! extension's monitor process through SPI, the relay over a connection of its own). About once
//! a second a round: passes of `amqp._monitor()` while a whole batch was due, within a time
//! budget; then the due compensations, within theirs; the counts `amqp.health()` reads every
//! few seconds, the production log's upkeep every ten. Each statement runs in a transaction of
//! its own with its error logged, never raised: nothing a user stores in a rule, a receipt or a
//! handler ends the monitor.
//!
//! A compensation runs as its handler's owner in a subtransaction that keeps its effects and
//! its "done" mark together, so it happens at most once and is retried with backoff until it
//! does. Each attempt is counted, and the next one set, in a transaction of its own before the
//! function runs. One whose consumer has answered ok since (or whose message completed) is
//! never run: the monitor's pass cancels it, and the statement that takes it checks again with
//! the row locked.

use crate::outbox::Caught;
use crate::telemetry::Level;
use amqp_outbox_broker::backoff::Backoff;
use std::time::{Duration, Instant};

/// A round about this often.
pub const ROUND_EVERY: Duration = Duration::from_secs(1);
/// Messages one pass looks at, at most (the number in [`PASS_SQL`]). Small: a pass is about
/// 50 µs of CPU a message and one modest commit, so the handlers, publishers and the delivery
/// beside it wait for no long burst (with 5,000, an unrelated subscription's handler p99 was
/// three times what it was with the same traffic unmonitored; with 250, about 12 ms bursts,
/// still twice).
const PASS_BATCH: i64 = 50;
/// One pass: how many messages it looked at. Its commit does not wait for its WAL to be
/// flushed (the handlers' commits waited behind that flush). A crash that loses a pass (its
/// states, counts, resent copies, queued compensations) loses no durable commit made after it,
/// and the next pass decides the same again; a copy already published carries the same
/// `message_id`, a duplicate consumers drop. A compensation's own commit is synchronous and
/// makes every pass before it durable. The pass's statements keep their generic plans: with
/// small passes, planning the classification again at every pass (its parameters make
/// PostgreSQL try custom plans) would cost about as much as the looks.
pub const PASS_SQL: &str = "SELECT amqp._monitor(50)::text \
    FROM pg_catalog.set_config('synchronous_commit', 'off', true) AS commit_mode, \
         pg_catalog.set_config('plan_cache_mode', 'force_generic_plan', true) AS plan_mode";
/// Passes follow one another while a whole batch was due, until this much of a round is used:
/// a backlog (after an upgrade or a long stop) is worked off without giving up the schedule.
const PASS_BUDGET: Duration = Duration::from_millis(500);
/// Between two passes of a round, the CPU and the WAL are left to the others (about as long
/// as a full pass takes: the monitor takes at most about half a core while it catches up).
const PASS_PAUSE: Duration = Duration::from_millis(2);
/// Compensations run per round at most, and the time after which no further one starts (a
/// slow function is bounded by `amqp_outbox.handler_timeout` on top).
const COMPENSATIONS_PER_ROUND: usize = 20;
const COMPENSATION_BUDGET: Duration = Duration::from_millis(300);
/// The counts `amqp.health()` reads read every open message (a few hundred milliseconds at
/// 200,000 of them): every 5 s, or less often so that counting takes at most a fiftieth of the
/// time, and at least every 30 s (`amqp.health()` warns after a minute without counts).
const SUMMARY_EVERY: Duration = Duration::from_secs(5);
const SUMMARY_SHARE: u32 = 50;
const SUMMARY_LONGEST: Duration = Duration::from_secs(30);
/// The counts `amqp.health()` reads.
pub const SUMMARY_SQL: &str = "SELECT 'counted'::text FROM amqp._summarize()";
const UPKEEP_EVERY: Duration = Duration::from_secs(10);
/// The production log's day partitions and retention.
pub const UPKEEP_SQL: &str = "SELECT amqp._reconcile_upkeep()";
/// The upkeep's partition DDL waits at most this long for its locks: the outbox's writes to the
/// production log would queue behind a waiting ALTER or DROP (a pg_dump holds every table) up
/// to their lock_timeout.
pub const UPKEEP_LOCK_WAIT: Duration = Duration::from_millis(200);

/// What makes a pending compensation `c` still due to run: the consumer's latest answer is not
/// ok (an ok since its failure cancels it) and its message did not complete.
macro_rules! still_due {
    () => {
        "c.state = 'pending' \
    AND coalesce((SELECT r.status FROM amqp.receipt r \
                   WHERE r.message_id = c.message_id AND r.message_at = c.message_at \
                     AND r.consumer = c.consumer \
                   ORDER BY r.received_at DESC LIMIT 1), 'failed') <> 'ok' \
    AND NOT EXISTS (SELECT FROM amqp.produced x \
                     WHERE x.message_id = c.message_id AND x.message_at = c.message_at \
                       AND x.outcome = 'complete')"
    };
}

/// The oldest due compensation, locked: message_id, consumer, attempts, the handler's
/// `schema.function` quoted by PostgreSQL, its oid, its owner's oid, the message's
/// `amqp.produced` row and the failed `amqp.receipt` row as text.
pub const NEXT_COMPENSATION_SQL: &str = concat!(
    "SELECT c.message_id, c.consumer, c.attempts, \
            quote_ident(n.nspname) || '.' || quote_ident(p.proname), p.oid, h.owner::oid, \
            (SELECT x::text FROM amqp.produced x \
              WHERE x.message_id = c.message_id AND x.message_at = c.message_at LIMIT 1), \
            (SELECT r::text FROM amqp.receipt r \
              WHERE r.message_id = c.message_id AND r.message_at = c.message_at \
                AND r.consumer = c.consumer AND r.status <> 'ok' \
              ORDER BY r.received_at DESC LIMIT 1) \
       FROM amqp.compensation c \
       JOIN amqp.compensation_handler h ON h.business_type = c.business_type \
       JOIN pg_proc p ON p.oid = to_regprocedure(h.handler) \
       JOIN pg_namespace n ON n.oid = p.pronamespace \
      WHERE c.next_attempt_at <= clock_timestamp() AND ",
    still_due!(),
    " ORDER BY c.next_attempt_at LIMIT 1 FOR UPDATE OF c SKIP LOCKED"
);

/// Counts the attempt of compensation ($1 message_id, $2 consumer) and sets the next one $3
/// microseconds from now.
pub const CLAIM_COMPENSATION_SQL: &str = "UPDATE amqp.compensation \
    SET attempts = attempts + 1, \
        next_attempt_at = clock_timestamp() + $3 * interval '1 microsecond' \
  WHERE message_id = $1 AND consumer = $2";

/// Whether the claimed compensation ($1, $2) is still due, locking it until the function's
/// transaction ends (a row: yes).
pub const STILL_DUE_SQL: &str = concat!(
    "SELECT true FROM amqp.compensation c WHERE c.message_id = $1 AND c.consumer = $2 AND ",
    still_due!(),
    " FOR UPDATE OF c"
);

/// The handler's arguments, bound as text: the message's `amqp.produced` row, the failed
/// `amqp.receipt` row.
pub const COMPENSATION_ARGS: &str = "$1::text::amqp.produced, $2::text::amqp.receipt";

/// In the compensation's subtransaction, after the handler returned: done, counted, and the
/// message looked at again by the next pass (it may be finished now).
pub const MARK_COMPENSATED_SQL: &str = "WITH c AS ( \
        UPDATE amqp.compensation \
           SET state = 'done', done_at = clock_timestamp() \
         WHERE message_id = $1 AND consumer = $2 \
        RETURNING message_id, message_at, business_type), \
     again AS ( \
        UPDATE amqp.produced p SET check_at = clock_timestamp() \
          FROM c WHERE p.message_id = c.message_id AND p.message_at = c.message_at \
           AND p.completed_at IS NULL) \
     SELECT amqp._count(amqp._day(message_at), business_type, 'compensated', 1) FROM c";

/// The function raised: its error kept ($3).
pub const COMPENSATION_FAILED_SQL: &str =
    "UPDATE amqp.compensation SET last_error = $3 WHERE message_id = $1 AND consumer = $2";

/// A compensation due now, as the monitor read it.
#[derive(Debug, Clone)]
pub struct Due {
    pub message_id: String,
    pub consumer: String,
    pub attempts: i32,
    /// `schema.function`, quoted by PostgreSQL.
    pub function: String,
    pub function_oid: u32,
    pub owner: u32,
    pub original: Option<String>,
    pub failure: Option<String>,
}

impl Due {
    /// `SELECT schema.function($1::text::amqp.produced, $2::text::amqp.receipt)`.
    pub fn call(&self) -> String {
        format!("SELECT {}({COMPENSATION_ARGS})", self.function)
    }
}

/// What the monitor needs of its host: each method one transaction of its own.
pub trait MonitorHost {
    /// `sql` (one statement returning at most one text value) alone in a transaction, its
    /// ERROR caught; `lock_wait`: the longest it waits for a lock.
    fn statement_alone(
        &mut self,
        what: &str,
        sql: &'static str,
        lock_wait: Option<Duration>,
    ) -> Result<Option<String>, Caught>;
    /// Takes the oldest due compensation ([`NEXT_COMPENSATION_SQL`]), its attempt counted and
    /// the next one set `delay(attempts)` from now ([`CLAIM_COMPENSATION_SQL`]), committed.
    fn claim_compensation(
        &mut self,
        delay: &dyn Fn(i32) -> Duration,
    ) -> Result<Option<Due>, String>;
    /// In a transaction: if still due ([`STILL_DUE_SQL`]), the handler as its owner bounded by
    /// `timeout`, then [`MARK_COMPENSATED_SQL`], in one subtransaction. `Ok(false)`: no longer
    /// due; `Err`: the function (or the mark) raised, everything it did undone.
    fn compensate(&mut self, due: &Due, timeout: Duration) -> Result<bool, Caught>;
    /// [`COMPENSATION_FAILED_SQL`], in a transaction.
    fn compensation_failed(&mut self, due: &Due, error: &str) -> Result<(), String>;
    fn log(&mut self, level: Level, text: &str);
    /// Waits `pause` between two passes; `false`: the host is stopping, the round ends.
    fn pause(&mut self, pause: Duration) -> bool;
}

/// When the periodic parts of a round are due next.
#[derive(Default)]
pub struct Schedule {
    summary_at: Option<Instant>,
    upkeep_at: Option<Instant>,
}

impl Schedule {
    /// One round: passes, compensations, and the counts and upkeep when due.
    pub fn round<H: MonitorHost>(
        &mut self,
        host: &mut H,
        backoff: &Backoff,
        handler_timeout: Duration,
    ) {
        let started = Instant::now();
        loop {
            match host.statement_alone("amqp_outbox monitor", PASS_SQL, None) {
                Ok(looked) => {
                    let full = looked
                        .and_then(|n| n.parse::<i64>().ok())
                        .is_some_and(|n| n >= PASS_BATCH);
                    if !full || started.elapsed() + PASS_PAUSE >= PASS_BUDGET {
                        break;
                    }
                    if !host.pause(PASS_PAUSE) {
                        return;
                    }
                }
                Err(e) => {
                    host.log(
                        Level::Warning,
                        &format!(
                            "monitor pass failed: {} (SQLSTATE {})",
                            e.message, e.sqlstate
                        ),
                    );
                    break;
                }
            }
        }
        let compensating = Instant::now();
        for _ in 0..COMPENSATIONS_PER_ROUND {
            if compensating.elapsed() >= COMPENSATION_BUDGET
                || !compensate_one(host, backoff, handler_timeout)
            {
                break;
            }
        }
        let now = Instant::now();
        if self.summary_at.is_none_or(|t| now >= t) {
            logged(host, "monitor counts", SUMMARY_SQL, None);
            let took = now.elapsed();
            self.summary_at = Some(Instant::now() + summary_gap(took));
        }
        let now = Instant::now();
        if self.upkeep_at.is_none_or(|t| now >= t) {
            self.upkeep_at = Some(now + UPKEEP_EVERY);
            logged(
                host,
                "reconciliation upkeep",
                UPKEEP_SQL,
                Some(UPKEEP_LOCK_WAIT),
            );
        }
    }
}

/// The time from the end of the counts to the next, when they took `took`.
fn summary_gap(took: Duration) -> Duration {
    took.saturating_mul(SUMMARY_SHARE)
        .clamp(SUMMARY_EVERY, SUMMARY_LONGEST)
}

/// SQLSTATE 55P03: the lock wait ran out.
const LOCK_NOT_AVAILABLE: &str = "55P03";

/// One statement alone, its error logged; with a lock wait, a lock not had in time only
/// postpones it (a debug line).
fn logged<H: MonitorHost>(
    host: &mut H,
    what: &str,
    sql: &'static str,
    lock_wait: Option<Duration>,
) {
    match host.statement_alone(what, sql, lock_wait) {
        Ok(Some(done)) if done.starts_with("made") => {
            host.log(Level::Log, &format!("production log: {done}"))
        }
        Ok(_) => {}
        Err(e) if lock_wait.is_some() && e.sqlstate == LOCK_NOT_AVAILABLE => {
            host.log(Level::Debug, &format!("{what} postponed: {}", e.message))
        }
        Err(e) => host.log(
            Level::Warning,
            &format!("{what} failed: {} (SQLSTATE {})", e.message, e.sqlstate),
        ),
    }
}

/// Runs the oldest due compensation, if any. Returns whether there was one.
fn compensate_one<H: MonitorHost>(
    host: &mut H,
    backoff: &Backoff,
    handler_timeout: Duration,
) -> bool {
    let delay = |attempts: i32| backoff.delay(u32::try_from(attempts).unwrap_or(0));
    let due = match host.claim_compensation(&delay) {
        Ok(Some(due)) => due,
        Ok(None) => return false,
        Err(e) => {
            host.log(
                Level::Warning,
                &format!("reading due compensations failed: {e}"),
            );
            return false;
        }
    };
    match host.compensate(&due, handler_timeout) {
        Ok(true) => host.log(
            Level::Log,
            &format!(
                "compensated message {} for consumer \"{}\"",
                due.message_id, due.consumer
            ),
        ),
        Ok(false) => {}
        Err(caught) => {
            host.log(
                Level::Warning,
                &format!(
                    "compensation of message {} for consumer \"{}\" failed (attempt {}), retried in {:.1} s: {} (SQLSTATE {})",
                    due.message_id,
                    due.consumer,
                    due.attempts + 1,
                    delay(due.attempts).as_secs_f64(),
                    caught.message,
                    caught.sqlstate
                ),
            );
            let text = format!("{} (SQLSTATE {})", caught.message, caught.sqlstate);
            if let Err(e) = host.compensation_failed(&due, &text) {
                host.log(
                    Level::Warning,
                    &format!("recording a compensation failed: {e}"),
                );
            }
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A host with `due` messages due, a pass looking at up to `PASS_BATCH` of them.
    struct Fake {
        due: i64,
        passes: usize,
        pauses: usize,
        stopping_after: Option<usize>,
    }

    impl MonitorHost for Fake {
        fn statement_alone(
            &mut self,
            _what: &str,
            sql: &'static str,
            _lock_wait: Option<Duration>,
        ) -> Result<Option<String>, Caught> {
            if sql != PASS_SQL {
                return Ok(None);
            }
            self.passes += 1;
            let looked = self.due.min(PASS_BATCH);
            self.due -= looked;
            Ok(Some(looked.to_string()))
        }
        fn claim_compensation(
            &mut self,
            _delay: &dyn Fn(i32) -> Duration,
        ) -> Result<Option<Due>, String> {
            Ok(None)
        }
        fn compensate(&mut self, _due: &Due, _timeout: Duration) -> Result<bool, Caught> {
            Ok(false)
        }
        fn compensation_failed(&mut self, _due: &Due, _error: &str) -> Result<(), String> {
            Ok(())
        }
        fn log(&mut self, _level: Level, _text: &str) {}
        fn pause(&mut self, pause: Duration) -> bool {
            self.pauses += 1;
            std::thread::sleep(pause);
            self.stopping_after.is_none_or(|n| self.pauses < n)
        }
    }

    fn fake(due: i64) -> Fake {
        Fake {
            due,
            passes: 0,
            pauses: 0,
            stopping_after: None,
        }
    }

    fn round(host: &mut Fake) {
        let backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(60));
        Schedule::default().round(host, &backoff, Duration::from_secs(1));
    }

    #[test]
    fn the_pass_statement_asks_for_a_batch() {
        assert!(PASS_SQL.contains(&format!("amqp._monitor({PASS_BATCH})")));
    }

    #[test]
    fn passes_follow_one_another_with_a_pause_while_whole_batches_are_due() {
        let mut host = fake(PASS_BATCH * 3 + 1);
        round(&mut host);
        assert_eq!(host.passes, 4);
        assert_eq!(host.pauses, 3);
        assert_eq!(host.due, 0);
    }

    #[test]
    fn a_pass_that_finds_less_than_a_batch_ends_the_passes_without_a_pause() {
        let mut host = fake(PASS_BATCH - 1);
        round(&mut host);
        assert_eq!((host.passes, host.pauses), (1, 0));
    }

    #[test]
    fn a_backlog_is_worked_off_within_the_budget_and_left_for_the_next_round() {
        let mut host = fake(i64::MAX);
        round(&mut host);
        // Each pause lasts at least PASS_PAUSE: the budget holds no more passes than this.
        let most = (PASS_BUDGET.as_millis() / PASS_PAUSE.as_millis()) as usize;
        assert!(host.passes <= most, "{}", host.passes);
        assert_eq!(host.pauses, host.passes - 1);
    }

    #[test]
    fn the_counts_take_at_most_a_fiftieth_of_the_time_within_their_bounds() {
        assert_eq!(summary_gap(Duration::from_millis(3)), SUMMARY_EVERY);
        assert_eq!(summary_gap(Duration::from_millis(100)), SUMMARY_EVERY);
        assert_eq!(
            summary_gap(Duration::from_millis(350)),
            Duration::from_millis(17_500)
        );
        assert_eq!(summary_gap(Duration::from_secs(2)), SUMMARY_LONGEST);
    }

    #[test]
    fn a_host_that_stops_ends_the_round_at_its_pause() {
        let mut host = fake(i64::MAX);
        host.stopping_after = Some(2);
        round(&mut host);
        assert_eq!((host.passes, host.pauses), (2, 2));
    }
}
