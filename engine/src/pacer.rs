//! Spaces out the worker's periodic statements by what they cost. Plain Rust, no PostgreSQL
//! calls.
//!
//! Why: a statement that reads every row of `amqp.message`, or every index entry from the lowest
//! id, costs in proportion to the dead rows the table holds. While a long transaction (or a
//! `REPEATABLE READ` snapshot, a replication slot's `xmin`) keeps VACUUM from removing them, every
//! delivered row stays behind as a dead one, and such a statement grows from a fraction of a
//! millisecond to seconds. Run at a fixed period it would end up taking all of the worker's time
//! and delivery would stop. Spaced by its own cost, it never takes more than `1 / SHARE` of it:
//! the worker slows down by a bounded amount, and what the statement is for (rows inserted by
//! hand, rows naming no broker, an empty table to truncate) waits longer.

use std::time::{Duration, Instant};

/// A periodic statement starts no sooner than this many times its last cost after that start:
/// at most 1/20 of the worker's time goes to it.
const SHARE: u32 = 20;

#[derive(Clone, Copy, Debug)]
pub struct Pacer {
    /// The period while the statement is cheap.
    every: Duration,
    /// When it last started, and what it cost.
    last: Option<(Instant, Duration)>,
}

impl Pacer {
    pub const fn new(every: Duration) -> Self {
        Pacer { every, last: None }
    }

    /// Whether the statement may run now.
    pub fn due(&self, now: Instant) -> bool {
        self.last
            .is_none_or(|(at, cost)| now.saturating_duration_since(at) >= self.gap(cost))
    }

    /// How long until [`Pacer::due`] says yes (zero when it does).
    pub fn until_due(&self, now: Instant) -> Duration {
        self.last.map_or(Duration::ZERO, |(at, cost)| {
            (at + self.gap(cost)).saturating_duration_since(now)
        })
    }

    /// The statement started at `at` and took `cost`.
    pub fn ran(&mut self, at: Instant, cost: Duration) {
        self.last = Some((at, cost));
    }

    /// The next call of [`Pacer::due`] says yes (something changed that the statement must
    /// see soon: a new broker configuration).
    pub fn hurry(&mut self) {
        self.last = None;
    }

    /// Time from one start to the next: the period, or longer when the statement is costly.
    fn gap(&self, cost: Duration) -> Duration {
        self.every.max(cost.saturating_mul(SHARE))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_cheap_statement_keeps_its_period() {
        let t0 = Instant::now();
        let mut p = Pacer::new(1000 * MS);
        assert!(p.due(t0), "never ran");
        p.ran(t0, 2 * MS);
        assert!(!p.due(t0 + 999 * MS));
        assert!(p.due(t0 + 1000 * MS));
    }

    #[test]
    fn a_costly_statement_takes_at_most_its_share_of_the_time() {
        let t0 = Instant::now();
        let mut p = Pacer::new(1000 * MS);
        p.ran(t0, 700 * MS);
        assert_eq!(p.gap(700 * MS), 700 * MS * SHARE);
        assert!(!p.due(t0 + 13_999 * MS));
        assert!(p.due(t0 + 14_000 * MS));
        // Cheaper again: back to its period.
        p.ran(t0 + 14_000 * MS, MS);
        assert!(p.due(t0 + 15_000 * MS));
    }

    #[test]
    fn hurry_makes_it_due_at_once() {
        let t0 = Instant::now();
        let mut p = Pacer::new(10_000 * MS);
        p.ran(t0, 5_000 * MS);
        assert!(!p.due(t0 + MS));
        p.hurry();
        assert!(p.due(t0 + MS));
    }
}
