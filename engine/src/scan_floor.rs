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
//! every transaction that drew an id ≤ `V` has a transaction id below `N`, and a transaction
//! whose id is `N` or above draws only ids above `V`.
//!
//! Once a later snapshot knows every transaction id below `N` (its `xmax` has reached `N`), each
//! of them has either ended, and its rows are visible to that snapshot (the claim that follows
//! reads them), or is listed as running. `V` is then *settled*: the floor may move up to it,
//! and only over rows a claim has actually read (taken, or skipped as in flight). The running
//! ones are remembered as *writers*, each with the last value read before its transaction id
//! was assigned: the ids it may still commit lie above that. The snapshot in which a writer is
//! seen to have ended lowers every floor to its bound, before the claim that uses that
//! snapshot, so its rows are read in id order with the rows committed after them (a session's
//! messages stay in order). A transaction left open for minutes (a writer) thus holds back
//! neither the floor nor the claims: they go on reading from near the newest rows, over none of
//! the index entries that VACUUM cannot remove meanwhile.
//!
//! What lowers it again (to zero, one claim from the lowest id): a message leaving flight without
//! proof (it will be published again), a retry or hold coming due, a change of brokers, the
//! sequence going back (the table was emptied or restored), and once a second in any case (less
//! often when that read is costly, see [`super::pacer`]), for rows the rule above does not
//! cover (inserted directly into `amqp.message` rather than through `amqp.publish()`, or
//! unparked by hand): those wait that long.

use crate::pacer::Pacer;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// How often the claim reads from the lowest id whatever happened, while that read is cheap.
pub const FULL_SCAN_EVERY: Duration = Duration::from_secs(1);

/// Probes kept to bound what ended writers may have written. Past this many, every other one
/// is dropped: a writer then gets an older (lower) bound, which only makes a read longer.
const HISTORY: usize = 4096;

/// What the probe read before a claim, from the snapshot the claim uses (its `xmin`, its `xmax`
/// and the transaction ids it sees running), then the sequence's last value (0 before the first
/// id), then the next transaction id to be assigned (full transaction ids).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Probe {
    pub xmin: u64,
    pub xmax: u64,
    /// Sorted.
    pub running: Vec<u64>,
    pub last_value: i64,
    pub next_xid: u64,
}

impl Probe {
    fn ended(&self, xid: u64) -> bool {
        xid < self.xmin || (xid < self.xmax && self.running.binary_search(&xid).is_err())
    }
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
    /// Last values with the next transaction id read after them, oldest first, not settled yet.
    pending: VecDeque<(i64, u64)>,
    /// Settled ones whose transaction ids are still above the `xmin` of the latest snapshot,
    /// oldest first, after `base`, the newest one below it: the bounds of new writers.
    history: VecDeque<(i64, u64)>,
    base: i64,
    /// No row with an id at or below this one can still appear, except from `writers`.
    settled: i64,
    /// Transactions running when their ids were settled: ids they commit lie above the value.
    writers: HashMap<u64, i64>,
    /// Reads from the lowest id.
    full: Pacer,
    /// [`super::flight::Flight::released`] when last looked at.
    released_seen: u64,
    /// The highest floor before a periodic reset in this claim's probe (0 otherwise, or after a
    /// reset for a known cause): rows the read from the lowest id finds at or below it were
    /// announced by nothing the worker saw (see [`ScanFloor::passed`]).
    before_reset: i64,
}

impl Default for ScanFloor {
    fn default() -> Self {
        ScanFloor {
            floors: HashMap::new(),
            pending: VecDeque::new(),
            history: VecDeque::new(),
            base: 0,
            settled: 0,
            writers: HashMap::new(),
            full: Pacer::new(FULL_SCAN_EVERY),
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
    }

    /// Messages that left flight without proof are due again, below the floors maybe.
    pub fn note_released(&mut self, released: u64) {
        if released != self.released_seen {
            self.released_seen = released;
            self.reset();
        }
    }

    /// Takes the probe run just before a claim, in the claim's snapshot; returns whether the
    /// floors were reset.
    pub fn observe(&mut self, probe: &Probe, now: Instant) -> bool {
        // What the last periodic read passed over was for that read's claim only: a writer that
        // ended since lowers the floors too, and its rows are expected there.
        self.before_reset = 0;
        if probe.last_value < self.settled {
            // The sequence went back: a new table, or a restore. Start over.
            *self = ScanFloor {
                released_seen: self.released_seen,
                full: self.full,
                ..ScanFloor::default()
            };
            self.observe(probe, now);
            return true;
        }
        // Writers this snapshot sees ended: their rows are visible to the claim, which reads
        // from below them.
        let mut lowest = None::<i64>;
        self.writers.retain(|xid, bound| {
            let ended = probe.ended(*xid);
            if ended {
                lowest = Some(lowest.map_or(*bound, |l| l.min(*bound)));
            }
            !ended
        });
        if let Some(bound) = lowest {
            for floor in self.floors.values_mut() {
                *floor = (*floor).min(bound);
            }
        }
        while let Some(&(v, next_xid)) = self.pending.front() {
            // Every transaction below `next_xid` has ended or is running in this snapshot.
            if next_xid > probe.xmax {
                break;
            }
            self.pending.pop_front();
            for &xid in probe.running.iter().take_while(|x| **x < next_xid) {
                if !self.writers.contains_key(&xid) {
                    let bound = self.bound_of(xid);
                    self.writers.insert(xid, bound);
                }
            }
            self.settled = self.settled.max(v);
            self.remember(v, next_xid);
        }
        while let Some(&(v, next_xid)) = self.history.front() {
            if next_xid > probe.xmin {
                break;
            }
            self.base = self.base.max(v);
            self.history.pop_front();
        }
        self.pending.push_back((probe.last_value, probe.next_xid));
        if self.full.due(now) {
            // Nothing announced rows below the floors: what this read finds there, it reports.
            let highest = self.floors.values().copied().max().unwrap_or(0);
            self.reset();
            self.before_reset = highest;
            return true;
        }
        false
    }

    /// The last value read before transaction `xid` was assigned (or a lower one): every id
    /// that transaction draws is above it.
    fn bound_of(&self, xid: u64) -> i64 {
        self.history
            .iter()
            .rev()
            .find(|(_, next_xid)| *next_xid <= xid)
            .map_or(self.base, |(v, _)| *v)
    }

    fn remember(&mut self, v: i64, next_xid: u64) {
        if self.history.len() >= HISTORY {
            let mut keep = false;
            self.history.retain(|_| {
                keep = !keep;
                keep
            });
        }
        self.history.push_back((v, next_xid));
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

    /// A claim for `brokers` that read from `from`, started at `at` and took `cost`, saw this
    /// far. Their floors move up to what it covered, no further than the settled id.
    pub fn covered(
        &mut self,
        brokers: &[i32],
        from: i64,
        reach: Reach,
        at: Instant,
        cost: Duration,
    ) {
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
        if from == 0 {
            self.full.ran(at, cost);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A snapshot seeing `running` still running (everything else below `xmax` ended), then
    /// the sequence at `last_value` and the next transaction id `next_xid`.
    fn snap(running: &[u64], xmax: u64, last_value: i64, next_xid: u64) -> Probe {
        Probe {
            xmin: running.first().copied().unwrap_or(xmax),
            xmax,
            running: running.to_vec(),
            last_value,
            next_xid,
        }
    }

    /// A claim from `from` that cost nothing.
    fn cover(f: &mut ScanFloor, brokers: &[i32], from: i64, reach: Reach) {
        f.covered(brokers, from, reach, Instant::now(), Duration::ZERO);
    }

    /// Probes whose every value settles at the next probe (no other transaction runs).
    fn quiet(f: &mut ScanFloor, last_value: i64, now: Instant) {
        for _ in 0..2 {
            f.observe(&snap(&[], 5, last_value, 5), now);
        }
    }

    #[test]
    fn a_last_value_settles_once_a_snapshot_knows_every_transaction_that_could_have_drawn_it() {
        let now = Instant::now();
        let mut f = ScanFloor::default();
        // 100 was read while transaction ids up to 11 were assigned.
        f.observe(&snap(&[], 12, 100, 12), now);
        cover(&mut f, &[1], 0, Reach::End);
        assert_eq!(f.from(&[1]), 0, "nothing settled yet");
        // This snapshot knows every transaction below 12, none running: 100 is settled.
        f.observe(&snap(&[], 12, 120, 15), now);
        cover(&mut f, &[1], 0, Reach::End);
        assert_eq!(f.from(&[1]), 100);
        // 120 (drawn below 15) is settled by a snapshot with xmax 16, in which 13 still runs.
        f.observe(&snap(&[13], 16, 140, 16), now);
        cover(&mut f, &[1], 100, Reach::End);
        assert_eq!(f.from(&[1]), 120, "settled, with 13 as a writer");
        // 13 ended: what it committed lies above 100 (read before 13 was assigned), and the claim
        // in the snapshot that sees it ended reads from there.
        f.observe(&snap(&[], 17, 140, 17), now);
        assert_eq!(f.from(&[1]), 100);
        cover(&mut f, &[1], 100, Reach::End);
        assert_eq!(f.from(&[1]), 140);
    }

    #[test]
    fn a_transaction_left_open_holds_back_neither_the_floor_nor_the_claims() {
        let now = Instant::now();
        let mut f = ScanFloor::default();
        quiet(&mut f, 50, now);
        cover(&mut f, &[1], 0, Reach::End);
        assert_eq!(f.from(&[1]), 50);
        // Transaction 7 begins (after 50 was read) and stays open while others publish.
        let mut v = 50;
        let mut next = 8;
        for _ in 0..100 {
            v += 10;
            next += 3;
            let from = f.from(&[1]);
            f.observe(&snap(&[7], next, v, next), now);
            assert!(f.from(&[1]) >= from, "no writer ended");
            let from = f.from(&[1]);
            cover(&mut f, &[1], from, Reach::End);
        }
        assert_eq!(f.from(&[1]), v - 10, "the floor follows the newest rows");
        // 7 commits: its rows lie above 50, where the next claim reads from, once.
        f.observe(&snap(&[], next + 1, v, next + 1), now);
        assert_eq!(f.from(&[1]), 50);
        cover(&mut f, &[1], 50, Reach::End);
        assert_eq!(f.from(&[1]), v);
    }

    #[test]
    fn a_writer_seen_running_is_not_taken_for_ended() {
        let p = snap(&[7, 9], 12, 0, 12);
        assert!(!p.ended(7) && !p.ended(9));
        assert!(p.ended(8) && p.ended(3));
        assert!(!p.ended(12), "at or above xmax: not known to have ended");
    }

    #[test]
    fn the_floor_stops_at_what_the_claim_saw() {
        let now = Instant::now();
        let mut f = ScanFloor::default();
        quiet(&mut f, 1000, now);
        cover(&mut f, &[1], 0, Reach::UpTo(400));
        assert_eq!(f.from(&[1]), 400);
        cover(&mut f, &[1], 400, Reach::UpTo(900));
        assert_eq!(f.from(&[1]), 900);
        cover(&mut f, &[1], 900, Reach::End);
        assert_eq!(f.from(&[1]), 1000);
    }

    #[test]
    fn brokers_not_in_the_claim_keep_their_floor() {
        let now = Instant::now();
        let mut f = ScanFloor::default();
        quiet(&mut f, 1000, now);
        cover(&mut f, &[1], 0, Reach::End);
        assert_eq!(f.from(&[1]), 1000);
        assert_eq!(f.from(&[2]), 0, "broker 2 was not read");
        assert_eq!(f.from(&[1, 2]), 0);
        cover(&mut f, &[1, 2], 0, Reach::UpTo(500));
        assert_eq!(f.from(&[1]), 1000);
        assert_eq!(f.from(&[2]), 500);
    }

    #[test]
    fn a_sequence_going_back_starts_over() {
        let now = Instant::now();
        let mut f = ScanFloor::default();
        quiet(&mut f, 1000, now);
        cover(&mut f, &[1], 0, Reach::End);
        assert_eq!(f.from(&[1]), 1000);
        assert!(f.observe(&snap(&[], 6, 3, 6), now));
        assert_eq!(f.from(&[1]), 0);
        cover(&mut f, &[1], 0, Reach::End);
        assert_eq!(f.from(&[1]), 0, "3 is not settled yet");
    }

    #[test]
    fn a_release_lowers_every_floor_once() {
        let now = Instant::now();
        let mut f = ScanFloor::default();
        quiet(&mut f, 1000, now);
        cover(&mut f, &[1], 0, Reach::End);
        f.note_released(0);
        assert_eq!(f.from(&[1]), 1000, "nothing released");
        f.note_released(2);
        assert_eq!(f.from(&[1]), 0);
        assert_eq!(f.passed(), 0, "released rows are expected below the floor");
        cover(&mut f, &[1], 0, Reach::End);
        f.note_released(2);
        assert_eq!(f.from(&[1]), 1000, "the same releases again");
    }

    #[test]
    fn reset_and_the_periodic_full_read_lower_every_floor() {
        let now = Instant::now();
        let mut f = ScanFloor::default();
        quiet(&mut f, 1000, now);
        cover(&mut f, &[1, 2], 0, Reach::End);
        f.reset();
        assert_eq!(f.from(&[1]), 0);
        cover(&mut f, &[1, 2], 0, Reach::End);
        assert_eq!(f.from(&[2]), 1000);
        assert!(!f.observe(&snap(&[], 5, 1000, 5), now + Duration::from_millis(10)));
        assert!(f.observe(&snap(&[], 5, 1000, 5), now + FULL_SCAN_EVERY * 2));
        assert_eq!(f.from(&[1, 2]), 0);
        assert_eq!(
            f.passed(),
            1000,
            "a row found now below 1000 was passed over"
        );
    }

    #[test]
    fn rows_of_a_writer_that_ended_after_a_periodic_read_are_not_called_passed_over() {
        let now = Instant::now();
        let mut f = ScanFloor::default();
        quiet(&mut f, 50, now);
        cover(&mut f, &[1], 0, Reach::End);
        // Transaction 7 begins and writes while the floor follows the newest rows.
        f.observe(&snap(&[7], 8, 60, 8), now);
        f.observe(&snap(&[7], 9, 3000, 9), now);
        cover(&mut f, &[1], 50, Reach::End);
        // The periodic read from the lowest id comes while 7 is still open: it sees none of 7's
        // rows (what it finds below 3000 would have been passed over).
        let later = now + FULL_SCAN_EVERY * 2;
        assert!(f.observe(&snap(&[7], 10, 3000, 10), later));
        assert_eq!(f.passed(), 60);
        f.covered(&[1], 0, Reach::End, later, Duration::ZERO);
        // 7 commits: its rows lie above 50, and finding them is expected.
        f.observe(&snap(&[], 11, 3000, 11), later + Duration::from_millis(10));
        assert_eq!(f.from(&[1]), 50);
        assert_eq!(f.passed(), 0, "the claim that reads them reports nothing");
    }

    #[test]
    fn a_costly_read_from_the_lowest_id_comes_less_often() {
        let t0 = Instant::now();
        let ms = Duration::from_millis(1);
        let mut f = ScanFloor::default();
        quiet(&mut f, 1000, t0);
        f.covered(&[1], 0, Reach::End, t0, 200 * ms);
        assert_eq!(f.from(&[1]), 1000);
        assert!(!f.observe(&snap(&[], 5, 1000, 5), t0 + FULL_SCAN_EVERY * 2));
        assert!(!f.observe(&snap(&[], 5, 1000, 5), t0 + 3999 * ms));
        assert!(
            f.observe(&snap(&[], 5, 1000, 5), t0 + 4000 * ms),
            "20 times its cost"
        );
        assert_eq!(f.from(&[1]), 0);
    }

    #[test]
    fn a_writer_of_long_ago_gets_a_bound_no_higher_than_its_own() {
        let now = Instant::now();
        let mut f = ScanFloor::default();
        quiet(&mut f, 10, now);
        cover(&mut f, &[1], 0, Reach::End);
        // Transaction 6 is assigned after 10 was read; then many probes while it stays open,
        // more than the history keeps.
        let mut v = 10;
        let mut next = 7;
        for _ in 0..(3 * HISTORY) {
            v += 1;
            next += 1;
            f.observe(&snap(&[6], next, v, next), now);
            let from = f.from(&[1]);
            cover(&mut f, &[1], from, Reach::End);
        }
        // A transaction assigned late in that run, seen running, then both end.
        f.observe(&snap(&[6, next], next + 1, v + 1, next + 1), now);
        f.observe(&snap(&[6, next], next + 2, v + 2, next + 2), now);
        let from = f.from(&[1]);
        cover(&mut f, &[1], from, Reach::End);
        f.observe(&snap(&[], next + 3, v + 2, next + 3), now);
        assert!(f.from(&[1]) <= 10, "6 may have drawn any id above 10");
    }
}
