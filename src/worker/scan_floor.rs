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
//! reads the sequence's last value `V` and then the next transaction id to be assigned `N`,
//! every transaction that drew an id ≤ `V` has a transaction id below `N`. Once a later
//! snapshot's `xmin` (the oldest transaction still running) reaches `N`, all of them have
//! ended, and no row with an id ≤ `V` can appear any more: `V` is *settled*. The floor only
//! moves up to a settled id, and only over rows a claim has actually read (taken, or skipped as
//! in flight).
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

/// What the probe read before a claim: the `xmin` of its snapshot (taken no later than the
/// claim's), the sequence's last value (0 before the first id), and then the next transaction
/// id to be assigned (full transaction ids).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Probe {
    pub xmin: u64,
    pub last_value: i64,
    pub next_xid: u64,
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
    /// Last values with the next transaction id read after them, oldest first.
    pending: VecDeque<(i64, u64)>,
    /// No row with an id at or below this one can still appear.
    settled: i64,
    reset_at: Instant,
    /// [`super::flight::Flight::released`] when last looked at.
    released_seen: u64,
    /// The highest floor before the last periodic reset (0 after a reset for a known cause):
    /// rows the read from the lowest id finds at or below it were announced by nothing the
    /// worker saw (see [`ScanFloor::passed`]).
    before_reset: i64,
}

impl Default for ScanFloor {
    fn default() -> Self {
        ScanFloor {
            floors: HashMap::new(),
            pending: VecDeque::new(),
            settled: 0,
            reset_at: Instant::now(),
            released_seen: 0,
            before_reset: 0,
        }
    }
}

impl ScanFloor {
    /// Every broker's next claim reads from the lowest id: something the worker saw made
    /// older rows due again, so finding them is expected (nothing to report).
    pub fn reset(&mut self) {
        self.before_reset = 0;
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
        while let Some(&(v, next_xid)) = self.pending.front() {
            // Every transaction below `next_xid` has ended: all that drew an id <= v.
            if next_xid > probe.xmin {
                break;
            }
            self.settled = self.settled.max(v);
            self.pending.pop_front();
        }
        self.pending.push_back((probe.last_value, probe.next_xid));
        if now.duration_since(self.reset_at) >= FULL_SCAN_EVERY {
            // Nothing announced rows below the floors: what this read finds there, it reports.
            let highest = self.floors.values().copied().max().unwrap_or(0);
            self.reset();
            self.before_reset = highest;
            return true;
        }
        false
    }

    /// The highest floor before the last periodic reset: what the read from the lowest id then
    /// finds at or below it had been passed over (0: nothing to report).
    pub fn passed(&self) -> i64 {
        self.before_reset
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

    fn probe(xmin: u64, last_value: i64, next_xid: u64) -> Probe {
        Probe {
            xmin,
            last_value,
            next_xid,
        }
    }

    /// Probes whose every value settles at the next probe (no other transaction runs).
    fn quiet(f: &mut ScanFloor, last_value: i64, now: Instant) {
        for _ in 0..2 {
            f.observe(probe(5, last_value, 5), now);
        }
    }

    #[test]
    fn a_last_value_settles_once_every_transaction_that_could_have_drawn_it_ended() {
        let now = Instant::now();
        let mut f = ScanFloor::default();
        // 100 was read while transaction ids up to 11 were assigned; 10 still runs.
        f.observe(probe(10, 100, 12), now);
        f.observe(probe(10, 120, 15), now);
        f.covered(&[1], 0, Reach::End);
        assert_eq!(f.from(&[1]), 0, "nothing settled yet");
        // xmin 12: every transaction below 12 ended, so no id <= 100 can appear any more.
        f.observe(probe(12, 130, 16), now);
        f.covered(&[1], 0, Reach::End);
        assert_eq!(f.from(&[1]), 100);
        // 120 (drawn below 15) waits for xmin 15; 130 (below 16) for xmin 16.
        f.observe(probe(15, 140, 17), now);
        f.covered(&[1], 100, Reach::End);
        assert_eq!(f.from(&[1]), 120);
        f.observe(probe(17, 140, 17), now);
        f.covered(&[1], 120, Reach::End);
        assert_eq!(f.from(&[1]), 140);
    }

    #[test]
    fn the_floor_stops_at_what_the_claim_saw() {
        let now = Instant::now();
        let mut f = ScanFloor::default();
        quiet(&mut f, 1000, now);
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
        quiet(&mut f, 1000, now);
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
        quiet(&mut f, 1000, now);
        f.covered(&[1], 0, Reach::End);
        assert_eq!(f.from(&[1]), 1000);
        assert!(f.observe(probe(6, 3, 6), now));
        assert_eq!(f.from(&[1]), 0);
        f.covered(&[1], 0, Reach::End);
        assert_eq!(f.from(&[1]), 0, "3 is not settled yet");
    }

    #[test]
    fn a_release_lowers_every_floor_once() {
        let now = Instant::now();
        let mut f = ScanFloor::default();
        quiet(&mut f, 1000, now);
        f.covered(&[1], 0, Reach::End);
        f.note_released(0);
        assert_eq!(f.from(&[1]), 1000, "nothing released");
        f.note_released(2);
        assert_eq!(f.from(&[1]), 0);
        assert_eq!(f.passed(), 0, "released rows are expected below the floor");
        f.covered(&[1], 0, Reach::End);
        f.note_released(2);
        assert_eq!(f.from(&[1]), 1000, "the same releases again");
    }

    #[test]
    fn reset_and_the_periodic_full_read_lower_every_floor() {
        let now = Instant::now();
        let mut f = ScanFloor::default();
        quiet(&mut f, 1000, now);
        f.covered(&[1, 2], 0, Reach::End);
        f.reset();
        assert_eq!(f.from(&[1]), 0);
        f.covered(&[1, 2], 0, Reach::End);
        assert_eq!(f.from(&[2]), 1000);
        assert!(!f.observe(probe(5, 1000, 5), now + Duration::from_millis(10)));
        assert!(f.observe(probe(5, 1000, 5), now + FULL_SCAN_EVERY * 2));
        assert_eq!(f.from(&[1, 2]), 0);
        assert_eq!(
            f.passed(),
            1000,
            "a row found now below 1000 was passed over"
        );
    }
}
