//! Where the claim may start reading `amqp.message`: per broker, an id at or below which every
//! row that is, or will ever be, due is already in the worker's hands (in flight, delivered,
//! held back, parked). Plain Rust, no PostgreSQL calls.
//!
//! Why: reading from the lowest id every time walks over every row in flight and every index
//! entry of the rows deleted since the last VACUUM. Under a steady load, or late in a large
//! backlog, that walk costs milliseconds per claim, and it grows with the backlog.
//!
//! Why it is safe: ids are drawn from a sequence when a row is inserted, and transactions commit
//! in another order, so a row with a small id can become visible after rows with larger ones.
//! `amqp.publish()` takes its transaction id before it draws a message id. So when the worker
//! reads the sequence's last value `V` and then takes a snapshot whose `xmax` is `X`, every
//! transaction that drew an id ≤ `V` has a transaction id below `X`. Once a later snapshot's
//! `xmin` reaches `X`, all of them have ended, and no row with an id ≤ `V` can appear any more:
//! `V` is *settled*. The floor only moves up to a settled id, and only over rows a claim has
//! actually read (taken, or skipped as in flight).
//!
//! What lowers it again (to zero, one claim from the lowest id): a message leaving flight without
//! proof (it will be published again), a retry or hold coming due, a change of brokers, the
//! sequence going back (the table was emptied or restored), and once a second in any case, for
//! rows the statement above does not cover (inserted directly into `amqp.message` rather than
//! through `amqp.publish()`, or unparked by hand): those wait at most that long.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// How often the claim reads from the lowest id whatever happened.
pub const FULL_SCAN_EVERY: Duration = Duration::from_secs(1);

/// What the probe statement read before a claim: the sequence's last value (0 before the first
/// id), then from one snapshot its `xmin` and `xmax` (full transaction ids).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Probe {
    pub last_value: i64,
    pub xmin: u64,
    pub xmax: u64,
}

/// How far a claim that read from `from` saw every due row of its brokers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reach {
    /// It returned every due row above `from` (fewer than its limit, no byte cut) and the
    /// worker took them all.
    End,
    /// Every due row above `from` up to and including this id was taken or is in flight.
    UpTo(i64),
}

pub struct ScanFloor {
    /// Per broker: rows with an id at or below this one need no reading.
    floors: HashMap<i32, i64>,
    /// The previous probe's last value, waiting for a later snapshot's `xmax` to bound the
    /// transactions that drew its ids.
    unbounded: Option<i64>,
    /// Last values with that bound, oldest first.
    pending: VecDeque<(i64, u64)>,
    /// No row with an id at or below this one can still appear.
    settled: i64,
    reset_at: Instant,
    /// [`super::flight::Flight::released`] when last looked at.
    released_seen: u64,
}

impl Default for ScanFloor {
    fn default() -> Self {
        ScanFloor {
            floors: HashMap::new(),
            unbounded: None,
            pending: VecDeque::new(),
            settled: 0,
            reset_at: Instant::now(),
            released_seen: 0,
        }
    }
}

impl ScanFloor {
    /// Every broker's next claim reads from the lowest id.
    pub fn reset(&mut self) {
        self.floors.clear();
        self.reset_at = Instant::now();
    }

    /// Messages that left flight without proof are due again, below the floors maybe.
    pub fn note_released(&mut self, released: u64) {
        if released != self.released_seen {
            self.released_seen = released;
            self.reset();
        }
    }

    /// Takes the probe run just before a claim; returns whether the floors were reset.
    pub fn observe(&mut self, probe: Probe, now: Instant) -> bool {
        if probe.last_value < self.settled {
            // The sequence went back: a new table, or a restore. Start over.
            *self = ScanFloor {
                released_seen: self.released_seen,
                ..ScanFloor::default()
            };
            self.observe(probe, now);
            return true;
        }
        if let Some(v) = self.unbounded.take() {
            // This snapshot was taken after `v` was read: its xmax bounds the drawers of `v`.
            self.pending.push_back((v, probe.xmax));
        }
        self.unbounded = Some(probe.last_value);
        while let Some(&(v, xmax)) = self.pending.front() {
            if xmax > probe.xmin {
                break;
            }
            self.settled = self.settled.max(v);
            self.pending.pop_front();
        }
        if now.duration_since(self.reset_at) >= FULL_SCAN_EVERY {
            self.reset();
            return true;
        }
        false
    }

    /// Where a claim for these brokers starts: after the lowest of their floors.
    pub fn from(&self, brokers: &[i32]) -> i64 {
        brokers
            .iter()
            .map(|b| self.floors.get(b).copied().unwrap_or(0))
            .min()
            .unwrap_or(0)
    }

    /// A claim for `brokers` that read from `from` saw this far. Their floors move up to what
    /// it covered, no further than the settled id.
    pub fn covered(&mut self, brokers: &[i32], from: i64, reach: Reach) {
        let upto = match reach {
            Reach::End => self.settled,
            Reach::UpTo(id) => id.min(self.settled),
        };
        for b in brokers {
            let floor = self.floors.entry(*b).or_insert(0);
            // A broker whose floor is above `from` had that range covered already; one below it
            // was not read from its floor (cannot happen: `from` is the lowest) and stays.
            if *floor >= from {
                *floor = (*floor).max(upto);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(last_value: i64, xmin: u64, xmax: u64) -> Probe {
        Probe {
            last_value,
            xmin,
            xmax,
        }
    }

    #[test]
    fn a_last_value_settles_once_every_transaction_that_could_have_drawn_it_ended() {
        let now = Instant::now();
        let mut f = ScanFloor::default();
        f.observe(probe(100, 10, 12), now);
        // 100 now has a bound (xmax 15); transaction 10 still runs.
        f.observe(probe(120, 10, 15), now);
        f.covered(&[1], 0, Reach::End);
        assert_eq!(f.from(&[1]), 0, "nothing settled yet");
        // xmin 15: every transaction below 15 ended, so no id <= 100 can appear any more.
        f.observe(probe(130, 15, 16), now);
        f.covered(&[1], 0, Reach::End);
        assert_eq!(f.from(&[1]), 100);
        // 120 (bounded by xmax 16) settles at xmin 16; 130, bounded by this probe's xmax 17,
        // waits for a snapshot whose xmin is 17 (and 140 with it: bounded by that one's xmax).
        f.observe(probe(140, 16, 17), now);
        f.covered(&[1], 100, Reach::End);
        assert_eq!(f.from(&[1]), 120);
        f.observe(probe(140, 17, 17), now);
        f.covered(&[1], 120, Reach::End);
        assert_eq!(f.from(&[1]), 140);
    }

    #[test]
    fn the_floor_stops_at_what_the_claim_saw() {
        let now = Instant::now();
        let mut f = ScanFloor::default();
        for _ in 0..3 {
            f.observe(probe(1000, 5, 5), now);
        }
        f.covered(&[1], 0, Reach::UpTo(400));
        assert_eq!(f.from(&[1]), 400);
        f.covered(&[1], 400, Reach::UpTo(900));
        assert_eq!(f.from(&[1]), 900);
        f.covered(&[1], 900, Reach::End);
        assert_eq!(f.from(&[1]), 1000);
    }

    #[test]
    fn brokers_not_in_the_claim_keep_their_floor() {
        let now = Instant::now();
        let mut f = ScanFloor::default();
        for _ in 0..3 {
            f.observe(probe(1000, 5, 5), now);
        }
        f.covered(&[1], 0, Reach::End);
        assert_eq!(f.from(&[1]), 1000);
        assert_eq!(f.from(&[2]), 0, "broker 2 was not read");
        assert_eq!(f.from(&[1, 2]), 0);
        f.covered(&[1, 2], 0, Reach::UpTo(500));
        assert_eq!(f.from(&[1]), 1000);
        assert_eq!(f.from(&[2]), 500);
    }

    #[test]
    fn a_sequence_going_back_starts_over() {
        let now = Instant::now();
        let mut f = ScanFloor::default();
        for _ in 0..3 {
            f.observe(probe(1000, 5, 5), now);
        }
        f.covered(&[1], 0, Reach::End);
        assert_eq!(f.from(&[1]), 1000);
        assert!(f.observe(probe(3, 6, 6), now));
        assert_eq!(f.from(&[1]), 0);
        f.covered(&[1], 0, Reach::End);
        assert_eq!(f.from(&[1]), 0, "3 is not settled yet");
    }

    #[test]
    fn a_release_lowers_every_floor_once() {
        let now = Instant::now();
        let mut f = ScanFloor::default();
        for _ in 0..3 {
            f.observe(probe(1000, 5, 5), now);
        }
        f.covered(&[1], 0, Reach::End);
        f.note_released(0);
        assert_eq!(f.from(&[1]), 1000, "nothing released");
        f.note_released(2);
        assert_eq!(f.from(&[1]), 0);
        f.covered(&[1], 0, Reach::End);
        f.note_released(2);
        assert_eq!(f.from(&[1]), 1000, "the same releases again");
    }

    #[test]
    fn reset_and_the_periodic_full_read_lower_every_floor() {
        let now = Instant::now();
        let mut f = ScanFloor::default();
        for _ in 0..3 {
            f.observe(probe(1000, 5, 5), now);
        }
        f.covered(&[1, 2], 0, Reach::End);
        f.reset();
        assert_eq!(f.from(&[1]), 0);
        f.covered(&[1, 2], 0, Reach::End);
        assert_eq!(f.from(&[2]), 1000);
        assert!(!f.observe(probe(1000, 5, 5), now + Duration::from_millis(10)));
        assert!(f.observe(probe(1000, 5, 5), now + FULL_SCAN_EVERY * 2));
        assert_eq!(f.from(&[1, 2]), 0);
    }
}
