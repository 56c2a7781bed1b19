//! Messages held back after a nack (or while their row is locked by another session), and the
//! instants at which a retry comes due (a hold ending, a refused message's `next_attempt_at`): the
//! worker wakes then instead of at its naptime, so retries keep to their backoff. Plain Rust, no
//! PostgreSQL calls.

use amqp_outbox_broker::backoff::Backoff;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::{Duration, Instant};

/// At most one log line about nacks this often.
const NACK_LOG_EVERY: Duration = Duration::from_secs(10);

#[derive(Default)]
pub struct Holds {
    /// Messages held back until the instant (nacked, or their row locked by another session),
    /// with how many holds each had.
    held: HashMap<i64, (Instant, u32)>,
    /// When held or refused messages are due again, earliest first.
    due: BinaryHeap<Reverse<Instant>>,
    nacked_since_log: u64,
    nack_logged_at: Option<Instant>,
}

impl Holds {
    /// A nacked message waits before it is published again, longer each time, without counting
    /// an attempt (a nack is the broker's trouble, not the message's). Returns `Some(n)` when it
    /// is time for a log line about the `n` messages nacked since the last one.
    pub fn hold_nacked(&mut self, id: i64, backoff: &Backoff) -> Option<u64> {
        self.hold(id, backoff);
        self.nacked_since_log += 1;
        if self
            .nack_logged_at
            .is_some_and(|t| t.elapsed() < NACK_LOG_EVERY)
        {
            return None;
        }
        self.nack_logged_at = Some(Instant::now());
        Some(std::mem::take(&mut self.nacked_since_log))
    }

    /// Holds a message back, longer each time it is held, without counting an attempt: after a
    /// nack, or when its row is locked by another session and the worker could not write what
    /// happened to it.
    pub fn hold(&mut self, id: i64, backoff: &Backoff) {
        let holds = self.held.get(&id).map_or(0, |h| h.1) + 1;
        let until = Instant::now() + backoff.delay(holds - 1);
        self.held.insert(id, (until, holds));
        self.retry_at(until);
    }

    /// Confirmed: its nack count starts again from zero.
    pub fn release(&mut self, id: i64) {
        self.held.remove(&id);
    }

    /// Wake up at `when` at the latest (a retry becomes due).
    pub fn retry_at(&mut self, when: Instant) {
        self.due.push(Reverse(when));
    }

    /// The ids held back now, which the claim must not read. Holds ended more than `forget_after`
    /// ago are forgotten (with their nack count), so the map stays as small as the recent nacks.
    pub fn held_now(&mut self, now: Instant, forget_after: Duration) -> Vec<i64> {
        self.held
            .retain(|_, (until, _)| now < *until + forget_after);
        self.held
            .iter()
            .filter(|(_, (until, _))| now < *until)
            .map(|(id, _)| *id)
            .collect()
    }

    /// How long the worker may sleep before a retry comes due: zero when one came due since
    /// the last call (the next claim takes it), `None` when none is pending.
    pub fn until_next_due(&mut self, now: Instant) -> Option<Duration> {
        let mut came_due = false;
        while self.due.peek().is_some_and(|due| due.0 <= now) {
            self.due.pop();
            came_due = true;
        }
        if came_due {
            return Some(Duration::ZERO);
        }
        self.due.peek().map(|due| due.0 - now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backoff() -> Backoff {
        Backoff::new(Duration::from_secs(100), Duration::from_secs(1000))
    }

    #[test]
    fn a_held_message_is_not_claimed_until_its_hold_ends() {
        let mut h = Holds::default();
        h.hold_nacked(7, &backoff());
        let now = Instant::now();
        assert_eq!(h.held_now(now, Duration::ZERO), vec![7]);
        let later = now + Duration::from_secs(101);
        assert!(h.held_now(later, Duration::from_secs(1000)).is_empty());
        h.release(7);
        assert!(h.held.is_empty());
    }

    #[test]
    fn each_nack_holds_longer_and_ended_holds_are_forgotten() {
        let mut h = Holds::default();
        h.hold_nacked(7, &backoff());
        let first = h.held[&7].0;
        h.hold_nacked(7, &backoff());
        let (second, nacks) = h.held[&7];
        assert_eq!(nacks, 2);
        // The second delay is at least min·2/2 = 100 s, drawn later than the first (exactly 100 s).
        assert!(second >= first);
        let far = Instant::now() + Duration::from_secs(5000);
        assert!(h.held_now(far, Duration::from_secs(1)).is_empty());
        assert!(h.held.is_empty(), "forgotten, nack count included");
    }

    #[test]
    fn nacks_are_logged_at_most_every_ten_seconds_with_their_count() {
        let mut h = Holds::default();
        assert_eq!(h.hold_nacked(1, &backoff()), Some(1));
        assert_eq!(h.hold_nacked(2, &backoff()), None);
        assert_eq!(h.hold_nacked(3, &backoff()), None);
        h.nack_logged_at = Some(Instant::now() - NACK_LOG_EVERY);
        assert_eq!(h.hold_nacked(4, &backoff()), Some(3));
    }

    #[test]
    fn the_worker_wakes_when_a_retry_comes_due() {
        let mut h = Holds::default();
        let now = Instant::now();
        assert_eq!(h.until_next_due(now), None);
        h.retry_at(now + Duration::from_secs(5));
        h.retry_at(now + Duration::from_secs(2));
        assert_eq!(h.until_next_due(now), Some(Duration::from_secs(2)));
        let then = now + Duration::from_secs(3);
        assert_eq!(h.until_next_due(then), Some(Duration::ZERO), "one came due");
        assert_eq!(h.until_next_due(then), Some(Duration::from_secs(2)));
    }
}
