//! The worker's memory of what it has handed to the AMQP thread: per broker, the connection
//! state, and per message in flight what is known of its delivery (confirmed? acknowledged?).
//! Plain Rust, no PostgreSQL calls. Bounded by `max_in_flight` messages and
//! `max_in_flight_bytes` of unconfirmed bodies per broker. Also what is held back after a nack
//! and when retries come due ([`Holds`]).

mod holds;

pub use holds::Holds;

use amqp_outbox_broker::ProofMode;
use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

// Delivered rows are deleted in batches, not in every step: the DELETE (with the production
// log and the day's statistics in the same statement) costs about as much for 3 rows as for
// 300, and at a steady 2,000 msg/s steps come every 1–2 ms with a few messages each. A row
// waiting for its DELETE is skipped by the claim like a row in flight; only a crash between
// delivery and DELETE publishes it again (at least once), as for any row in flight.
/// Delete once this many rows are delivered...
pub const DELETE_AT: usize = 1000;
/// ...or once the oldest was delivered this long ago.
pub const DELETE_AFTER: Duration = Duration::from_millis(20);
/// Delivered rows another session kept locked at their DELETE are tried again this often.
pub const LOCKED_RETRY: Duration = Duration::from_secs(1);

pub struct Entry {
    pub broker_id: i32,
    pub sent_at: Instant,
    /// Wall-clock times (Unix microseconds) for the production log.
    pub sent_unix: i64,
    /// When the message was made (Unix µs): the production log's day.
    pub message_at: i64,
    pub confirmed_unix: Option<i64>,
    pub acked_unix: Option<i64>,
    /// Body size: counted against the broker's unconfirmed bytes until the confirm.
    pub bytes: usize,
    /// A positive confirm without a return arrived.
    pub confirmed: bool,
    /// Its acknowledgement record was seen on the acknowledgement queue.
    pub acked: bool,
    /// Claimed, waiting for the standbys (`amqp_outbox.standby_names`): not sent yet, so not
    /// timed out either.
    pub held: bool,
}

pub struct BrokerFlight {
    pub connected: bool,
    pub host: Option<String>,
    pub epoch: u64,
    pub proof: ProofMode,
    /// Why the connection is down or paused, if it is.
    pub error: Option<String>,
    /// The broker is not reading publishes (resource alarm): confirms are held back, nothing
    /// in flight is lost for waiting.
    pub blocked: bool,
    /// When publishing last resumed after a block: the timeout sweep counts from here at the
    /// earliest, as the AMQP thread's confirm timeout does.
    pub resumed_at: Option<Instant>,
    pub in_flight: usize,
    /// Messages in flight the broker has not confirmed yet (the others wait for their
    /// acknowledgement record only).
    pub unconfirmed: usize,
    /// Bodies handed over and not confirmed yet: what the worker's process may still hold.
    pub unconfirmed_bytes: usize,
    /// Ids whose last publish ended in an ambiguous channel error: they are published one at a
    /// time, with nothing else in flight, so an error names its cause.
    pub suspects: BTreeSet<i64>,
}

impl Default for BrokerFlight {
    fn default() -> Self {
        BrokerFlight {
            connected: false,
            host: None,
            epoch: 0,
            proof: ProofMode::AckQueue,
            error: None,
            blocked: false,
            resumed_at: None,
            in_flight: 0,
            unconfirmed: 0,
            unconfirmed_bytes: 0,
            suspects: BTreeSet::new(),
        }
    }
}

impl BrokerFlight {
    pub fn isolating(&self) -> bool {
        !self.suspects.is_empty()
    }
}

/// When a delivered message was last published, confirmed and acknowledged (Unix
/// microseconds): what the production log records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Proof {
    pub id: i64,
    /// Unix µs, see [`super::message::message_at`].
    pub message_at: i64,
    pub published: i64,
    pub confirmed: Option<i64>,
    pub acknowledged: Option<i64>,
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// What a delivery event means for a row.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Proven delivered: delete the row.
    Delivered,
    /// Known lost: publish it again now.
    Resend,
    /// Wait for the rest of the proof.
    Wait,
    /// Not (or no longer) in flight: nothing to do.
    Unknown,
}

/// What a broker may take in one claim.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
pub struct Room {
    pub broker_id: i32,
    pub messages: usize,
    pub bytes: usize,
    /// Nothing unconfirmed: one message goes even if it is larger than `bytes`.
    pub take_one_anyway: bool,
}

impl Room {
    /// Takes a message of `size` bytes if it fits.
    pub fn take(&mut self, size: usize) -> bool {
        if self.messages == 0 || (size > self.bytes && !self.take_one_anyway) {
            return false;
        }
        self.messages -= 1;
        self.bytes = self.bytes.saturating_sub(size);
        self.take_one_anyway = false;
        true
    }
}

#[derive(Default)]
pub struct Flight {
    brokers: HashMap<i32, BrokerFlight>,
    entries: HashMap<i64, Entry>,
    /// Grows with every change of an entry, so the status views know when to refresh.
    changes: u64,
    /// Out of flight, but not to be claimed yet, or due at a known instant.
    pub holds: Holds,
    /// Delivered since the last [`Flight::take_proven`]: their rows are still in the table.
    proven: Vec<Proof>,
    /// When the oldest of `proven` was delivered.
    proven_since: Option<Instant>,
    /// Delivered rows that another session kept locked at their DELETE, and when they are tried
    /// again ([`LOCKED_RETRY`]). Skipped by the claim like `proven`.
    locked: Vec<Proof>,
    locked_retry_at: Option<Instant>,
    /// How long delivered rows wait for their DELETE; `None`: [`DELETE_AFTER`] (only the test
    /// builds' `amqp_outbox.test_delete_after` sets another).
    delete_after: Option<Duration>,
    /// Grows with every message that leaves flight without proof: it is due again, maybe below
    /// where the claim reads from ([`super::scan_floor`]).
    released: u64,
}

impl Flight {
    pub fn broker(&mut self, broker_id: i32) -> &mut BrokerFlight {
        self.brokers.entry(broker_id).or_default()
    }

    pub fn brokers(&self) -> impl Iterator<Item = (&i32, &BrokerFlight)> {
        self.brokers.iter()
    }

    /// Keeps only these brokers (the others were removed from amqp.broker).
    pub fn retain_brokers(&mut self, ids: &[i32]) {
        self.brokers.retain(|id, _| ids.contains(id));
        let before = self.entries.len();
        self.entries.retain(|_, e| ids.contains(&e.broker_id));
        self.released += (before - self.entries.len()) as u64;
        self.recount();
    }

    fn recount(&mut self) {
        for b in self.brokers.values_mut() {
            b.in_flight = 0;
            b.unconfirmed = 0;
            b.unconfirmed_bytes = 0;
        }
        for e in self.entries.values() {
            if let Some(b) = self.brokers.get_mut(&e.broker_id) {
                b.in_flight += 1;
                if !e.confirmed {
                    b.unconfirmed += 1;
                    b.unconfirmed_bytes += e.bytes;
                }
            }
        }
    }

    #[cfg(test)]
    pub fn is_in_flight(&self, id: i64) -> bool {
        self.entries.contains_key(&id)
    }

    pub fn mark_sent(&mut self, broker_id: i32, id: i64, bytes: usize, message_at: i64) {
        let entry = Entry {
            broker_id,
            sent_at: Instant::now(),
            sent_unix: unix_now(),
            message_at,
            confirmed_unix: None,
            acked_unix: None,
            bytes,
            confirmed: false,
            acked: false,
            held: false,
        };
        self.changes += 1;
        match self.entries.insert(id, entry) {
            None => {
                let b = self.broker(broker_id);
                b.in_flight += 1;
                b.unconfirmed += 1;
                b.unconfirmed_bytes += bytes;
            }
            // Sent again while still tracked (a resend): its old counts go.
            Some(_) => self.recount(),
        }
    }

    /// These claimed messages wait for the standbys before they are sent.
    pub fn hold(&mut self, ids: impl IntoIterator<Item = i64>) {
        for id in ids {
            if let Some(e) = self.entries.get_mut(&id) {
                e.held = true;
            }
        }
    }

    /// These held messages go to the broker now: their time in flight starts.
    pub fn send_held(&mut self, ids: impl IntoIterator<Item = i64>) {
        let (now, unix) = (Instant::now(), unix_now());
        for id in ids {
            if let Some(e) = self.entries.get_mut(&id) {
                if e.held {
                    e.held = false;
                    e.sent_at = now;
                    e.sent_unix = unix;
                }
            }
        }
    }

    /// Delivered: keeps its times for the production log, then settles it.
    fn deliver(&mut self, id: i64) {
        if let Some(e) = self.entries.get(&id) {
            self.proven_since.get_or_insert_with(Instant::now);
            self.proven.push(Proof {
                id,
                message_at: e.message_at,
                published: e.sent_unix,
                confirmed: e.confirmed_unix,
                acknowledged: e.acked_unix,
            });
        }
        self.remove(id);
    }

    /// What was delivered since the last time, once it is worth a DELETE: [`DELETE_AT`] rows,
    /// or the oldest delivered [`DELETE_AFTER`] ago, or `all`.
    pub fn take_proven(&mut self, now: Instant, all: bool) -> Vec<Proof> {
        if !all && self.proven_due_in(now).is_none_or(|d| !d.is_zero()) {
            return Vec::new();
        }
        self.proven_since = None;
        std::mem::take(&mut self.proven)
    }

    /// How long until the delivered rows are due for their DELETE (zero: now).
    pub fn proven_due_in(&self, now: Instant) -> Option<Duration> {
        let locked = self
            .locked_retry_at
            .map(|at| at.saturating_duration_since(now));
        let Some(since) = self.proven_since else {
            return locked;
        };
        if self.proven.len() >= DELETE_AT {
            return Some(Duration::ZERO);
        }
        let after = self.delete_after.unwrap_or(DELETE_AFTER);
        let proven = after.saturating_sub(now.saturating_duration_since(since));
        Some(locked.map_or(proven, |l| l.min(proven)))
    }

    /// Delivered rows whose DELETE found them locked by another session: tried again after
    /// [`LOCKED_RETRY`], skipped by the claim until then.
    pub fn keep_locked(&mut self, proofs: Vec<Proof>, now: Instant) {
        if proofs.is_empty() {
            return;
        }
        self.locked.extend(proofs);
        self.locked_retry_at = Some(now + LOCKED_RETRY);
    }

    /// The rows [`Flight::keep_locked`] kept, once they are due again (or `all`).
    pub fn take_locked(&mut self, now: Instant, all: bool) -> Vec<Proof> {
        if !all && self.locked_retry_at.is_none_or(|at| now < at) {
            return Vec::new();
        }
        self.locked_retry_at = None;
        std::mem::take(&mut self.locked)
    }

    /// The delivered rows due for their DELETE now ([`Flight::take_proven`]; `all`: every one),
    /// with those a session kept locked at the last try once they are due again, and whether
    /// there were such (the DELETE then picks out the rows no one holds at once).
    pub fn take_deletable(&mut self, now: Instant, all: bool) -> (Vec<Proof>, bool) {
        let locked = self.take_locked(now, all);
        let locked_before = !locked.is_empty();
        let mut delivered = self.take_proven(now, all);
        delivered.extend(locked);
        (delivered, locked_before)
    }

    #[cfg(feature = "fault-injection")]
    pub fn set_delete_after(&mut self, after: Option<Duration>) {
        self.delete_after = after;
    }

    /// The row leaves the worker's hands without proof (refused, or to be claimed again).
    pub fn settle(&mut self, id: i64) {
        if self.remove(id) {
            self.released += 1;
        }
    }

    /// How many messages left flight without proof so far.
    pub fn released(&self) -> u64 {
        self.released
    }

    fn remove(&mut self, id: i64) -> bool {
        let Some(e) = self.entries.remove(&id) else {
            return false;
        };
        self.changes += 1;
        if let Some(b) = self.brokers.get_mut(&e.broker_id) {
            b.in_flight = b.in_flight.saturating_sub(1);
            if !e.confirmed {
                b.unconfirmed = b.unconfirmed.saturating_sub(1);
                b.unconfirmed_bytes = b.unconfirmed_bytes.saturating_sub(e.bytes);
            }
        }
        true
    }

    fn proof(&self, broker_id: i32) -> ProofMode {
        self.brokers
            .get(&broker_id)
            .map_or(ProofMode::AckQueue, |b| b.proof)
    }

    /// A positive confirm without a return.
    pub fn confirmed(&mut self, id: i64) -> Verdict {
        let proof_mode = match self.entries.get(&id) {
            Some(e) => self.proof(e.broker_id),
            None => return Verdict::Unknown,
        };
        let Some(e) = self.entries.get_mut(&id) else {
            return Verdict::Unknown;
        };
        if !e.confirmed {
            e.confirmed = true;
            e.confirmed_unix = Some(unix_now());
            let (broker_id, bytes) = (e.broker_id, e.bytes);
            if let Some(b) = self.brokers.get_mut(&broker_id) {
                b.unconfirmed = b.unconfirmed.saturating_sub(1);
                b.unconfirmed_bytes = b.unconfirmed_bytes.saturating_sub(bytes);
                // Confirmed, it did not close the channel: no longer a suspect. Left in the
                // set, it would be claimed again until its row is deleted.
                b.suspects.remove(&id);
            }
        }
        self.changes += 1;
        let Some(e) = self.entries.get(&id) else {
            return Verdict::Unknown;
        };
        let done = e.acked || proof_mode == ProofMode::Confirm;
        if done {
            self.deliver(id);
            Verdict::Delivered
        } else {
            Verdict::Wait
        }
    }

    /// The acknowledgement record was seen.
    pub fn acked(&mut self, id: i64) -> Verdict {
        let Some(e) = self.entries.get_mut(&id) else {
            return Verdict::Unknown;
        };
        e.acked = true;
        e.acked_unix = Some(unix_now());
        self.changes += 1;
        if e.confirmed {
            self.deliver(id);
            Verdict::Delivered
        } else {
            Verdict::Wait
        }
    }

    /// The gap rule found its record missing: a confirm still proves the message arrived;
    /// without one it was lost.
    pub fn lost(&mut self, id: i64) -> Verdict {
        let Some(e) = self.entries.get(&id) else {
            return Verdict::Unknown;
        };
        if e.confirmed {
            self.deliver(id);
            return Verdict::Delivered;
        }
        self.settle(id);
        Verdict::Resend
    }

    /// The publishing connection of a broker went down or got a new channel: messages not yet
    /// confirmed on the old one will be published again (the AMQP thread also fails each of
    /// them). Confirmed ones keep waiting for their acknowledgement record, which the listener
    /// still receives.
    pub fn forget_unconfirmed(&mut self, broker_id: i32) {
        let b = self.broker(broker_id);
        if b.blocked {
            b.blocked = false;
            b.error = None;
        }
        let gone: Vec<i64> = self
            .entries
            .iter()
            .filter(|(_, e)| e.broker_id == broker_id && !e.confirmed)
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.settle(id);
        }
    }

    /// The broker paused or resumed reading this connection's publishes.
    pub fn set_blocked(&mut self, broker_id: i32, blocked: bool) {
        let b = self.broker(broker_id);
        if b.blocked == blocked {
            return;
        }
        b.blocked = blocked;
        if blocked {
            b.error = Some("publishing paused by the broker (resource alarm)".into());
        } else {
            b.error = None;
            b.resumed_at = Some(Instant::now());
        }
    }

    /// Messages in flight for longer than `after` without proof of delivery: taken back, to be
    /// published again. Time spent while their broker blocked publishing does not count: the
    /// messages are queued on a live connection and a second copy would only be a duplicate.
    pub fn expire(&mut self, after: Duration) -> Vec<i64> {
        let now = Instant::now();
        let brokers = &self.brokers;
        let expired: Vec<i64> = self
            .entries
            .iter()
            .filter(|(_, e)| {
                if e.held {
                    return false;
                }
                let broker = brokers.get(&e.broker_id);
                if broker.is_some_and(|b| b.blocked) {
                    return false;
                }
                let since = match broker.and_then(|b| b.resumed_at) {
                    Some(resumed) => e.sent_at.max(resumed),
                    None => e.sent_at,
                };
                now.duration_since(since) >= after
            })
            .map(|(id, _)| *id)
            .collect();
        for id in &expired {
            self.settle(*id);
        }
        expired
    }

    /// Brokers that may take new (non-suspect) messages now, with how many messages and how
    /// many body bytes each may take. A broker with nothing unconfirmed takes at least one
    /// message however large.
    pub fn open_brokers(&self, max_in_flight: usize, max_bytes: usize) -> Vec<Room> {
        let mut open: Vec<Room> = self
            .brokers
            .iter()
            .filter(|(_, b)| {
                b.connected
                    && !b.isolating()
                    && b.in_flight < max_in_flight
                    && (b.unconfirmed_bytes == 0 || b.unconfirmed_bytes < max_bytes)
            })
            .map(|(id, b)| Room {
                broker_id: *id,
                messages: max_in_flight - b.in_flight,
                bytes: max_bytes.saturating_sub(b.unconfirmed_bytes),
                take_one_anyway: b.unconfirmed_bytes == 0,
            })
            .collect();
        open.sort_unstable_by_key(|r| r.broker_id);
        open
    }

    /// Ids in flight, and delivered ones whose rows are not deleted yet: the claim skips them.
    pub fn ids(&self) -> impl Iterator<Item = i64> + '_ {
        self.entries
            .keys()
            .copied()
            .chain(self.proven.iter().chain(&self.locked).map(|p| p.id))
    }

    /// Brokers with a connection.
    pub fn connected_brokers(&self) -> usize {
        self.brokers.values().filter(|b| b.connected).count()
    }

    /// Some broker publishes its suspects one at a time: each confirm lets the next one go.
    pub fn any_isolating(&self) -> bool {
        self.brokers.values().any(|b| b.isolating())
    }

    /// Brokers whose suspects can be published now: connected, nothing else unconfirmed. A
    /// confirmed message cannot close the channel any more, and one whose acknowledgement
    /// record was lost with a channel would otherwise hold every suspect (and so every other
    /// message of the broker) back until the timeout sweep.
    pub fn isolation_ready(&self) -> Vec<(i32, Vec<i64>)> {
        self.brokers
            .iter()
            .filter(|(_, b)| b.connected && b.isolating() && b.unconfirmed == 0)
            .map(|(id, b)| (*id, b.suspects.iter().copied().collect()))
            .collect()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// Ids in flight and what is known of each, for `amqp.message_status` (a delivered row
    /// waiting for its DELETE is confirmed).
    pub fn snapshot(&self) -> Vec<(i64, bool)> {
        self.entries
            .iter()
            .map(|(id, e)| (*id, e.confirmed))
            .chain(self.proven.iter().chain(&self.locked).map(|p| (p.id, true)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flight(proof: ProofMode) -> Flight {
        let mut f = Flight::default();
        let b = f.broker(1);
        b.proof = proof;
        b.connected = true;
        f
    }

    #[test]
    fn delivered_rows_are_deleted_in_batches_and_skipped_until_then() {
        let mut f = flight(ProofMode::Confirm);
        let start = Instant::now();
        assert_eq!(
            f.proven_due_in(start),
            None,
            "nothing delivered, nothing due"
        );
        f.mark_sent(1, 5, 10, 0);
        f.mark_sent(1, 6, 10, 0);
        assert_eq!(f.confirmed(5), Verdict::Delivered);
        let now = Instant::now();
        let due = f.proven_due_in(now).unwrap();
        assert!(due > Duration::ZERO && due <= DELETE_AFTER, "{due:?}");
        assert!(f.take_proven(now, false).is_empty(), "not due yet");
        let mut ids: Vec<i64> = f.ids().collect();
        ids.sort_unstable();
        assert_eq!(ids, vec![5, 6], "the claim still skips the delivered row");
        assert!(f.snapshot().contains(&(5, true)));
        let later = now + DELETE_AFTER;
        assert_eq!(f.proven_due_in(later), Some(Duration::ZERO));
        let taken = f.take_proven(later, false);
        assert_eq!(taken.iter().map(|p| p.id).collect::<Vec<_>>(), vec![5]);
        assert_eq!(f.ids().collect::<Vec<_>>(), vec![6]);
        assert_eq!(f.proven_due_in(later), None);

        // A full batch is due at once.
        for id in 100..100 + DELETE_AT as i64 {
            f.mark_sent(1, id, 10, 0);
            f.confirmed(id);
        }
        assert_eq!(f.proven_due_in(Instant::now()), Some(Duration::ZERO));
        assert_eq!(f.take_proven(Instant::now(), false).len(), DELETE_AT);
    }

    #[test]
    fn delivered_rows_kept_locked_by_another_session_wait_skipped_and_come_due_again() {
        let mut f = flight(ProofMode::Confirm);
        f.mark_sent(1, 5, 10, 0);
        f.confirmed(5);
        let now = Instant::now();
        let taken = f.take_proven(now + DELETE_AFTER, false);
        f.keep_locked(taken, now);
        assert_eq!(f.ids().collect::<Vec<_>>(), vec![5], "the claim skips it");
        assert!(f.snapshot().contains(&(5, true)), "shown as delivered");
        assert_eq!(f.proven_due_in(now), Some(LOCKED_RETRY));
        assert!(f.take_locked(now, false).is_empty(), "not due yet");
        assert!(
            f.take_proven(now + LOCKED_RETRY, false).is_empty(),
            "not in the next ordinary batch"
        );
        // A new delivery keeps its own, shorter wait.
        f.mark_sent(1, 6, 10, 0);
        f.confirmed(6);
        let due = f.proven_due_in(Instant::now()).unwrap();
        assert!(due <= DELETE_AFTER, "{due:?}");
        let again = f.take_locked(now + LOCKED_RETRY, false);
        assert_eq!(again.iter().map(|p| p.id).collect::<Vec<_>>(), vec![5]);
        assert_eq!(f.ids().collect::<Vec<_>>(), vec![6]);
        assert!(
            f.take_locked(now + LOCKED_RETRY, true).is_empty(),
            "taken once"
        );
    }

    #[test]
    fn delivered_messages_keep_their_publish_confirm_and_ack_times() {
        let mut f = flight(ProofMode::AckQueue);
        f.mark_sent(1, 7, 10, 0);
        f.mark_sent(1, 8, 10, 0);
        assert_eq!(f.confirmed(7), Verdict::Wait);
        assert!(
            f.take_proven(Instant::now(), true).is_empty(),
            "a confirm alone proves nothing in ack_queue mode"
        );
        assert_eq!(f.acked(7), Verdict::Delivered);
        assert_eq!(f.lost(8), Verdict::Resend);
        let proven = f.take_proven(Instant::now(), true);
        assert_eq!(proven.len(), 1, "the lost one is not delivered");
        let p = proven[0];
        assert_eq!(p.id, 7);
        let (c, a) = (p.confirmed.unwrap(), p.acknowledged.unwrap());
        assert!(
            p.published > 1_600_000_000_000_000 && p.published <= c && c <= a,
            "{p:?}"
        );
        assert!(f.take_proven(Instant::now(), true).is_empty(), "taken once");

        let mut f = flight(ProofMode::Confirm);
        f.mark_sent(1, 9, 10, 0);
        assert_eq!(f.confirmed(9), Verdict::Delivered);
        let p = f.take_proven(Instant::now(), true)[0];
        assert_eq!((p.id, p.acknowledged), (9, None));
        assert!(p.confirmed.is_some());
    }

    #[test]
    fn confirm_mode_delivers_on_the_confirm() {
        let mut f = flight(ProofMode::Confirm);
        f.mark_sent(1, 10, 100, 0);
        assert_eq!(f.confirmed(10), Verdict::Delivered);
        assert!(!f.is_in_flight(10));
        assert_eq!(f.broker(1).in_flight, 0);
    }

    #[test]
    fn ack_queue_mode_needs_confirm_and_record_in_either_order() {
        let mut f = flight(ProofMode::AckQueue);
        f.mark_sent(1, 10, 100, 0);
        f.mark_sent(1, 11, 100, 0);
        assert_eq!(f.confirmed(10), Verdict::Wait);
        assert_eq!(f.acked(10), Verdict::Delivered);
        assert_eq!(f.acked(11), Verdict::Wait);
        assert_eq!(f.confirmed(11), Verdict::Delivered);
        let mut shown = f.snapshot();
        shown.sort_unstable();
        assert_eq!(
            shown,
            vec![(10, true), (11, true)],
            "delivered, not deleted yet"
        );
        assert_eq!(f.take_proven(Instant::now(), true).len(), 2);
        assert!(f.snapshot().is_empty());
    }

    #[test]
    fn lost_without_confirm_is_resent_and_with_confirm_is_delivered() {
        let mut f = flight(ProofMode::AckQueue);
        f.mark_sent(1, 10, 100, 0);
        f.mark_sent(1, 11, 100, 0);
        f.confirmed(11);
        assert_eq!(f.lost(10), Verdict::Resend);
        assert_eq!(f.lost(11), Verdict::Delivered);
        assert_eq!(f.lost(12), Verdict::Unknown);
        assert_eq!(f.broker(1).in_flight, 0);
    }

    #[test]
    fn every_state_change_is_counted_for_the_views() {
        let mut f = flight(ProofMode::AckQueue);
        f.mark_sent(1, 10, 100, 0);
        let before = f.changes();
        f.confirmed(10);
        assert!(
            f.changes() > before,
            "in_flight -> awaiting_ack must refresh the view"
        );
    }

    #[test]
    fn only_messages_leaving_without_proof_count_as_released() {
        let mut f = flight(ProofMode::Confirm);
        f.mark_sent(1, 10, 1, 0);
        f.mark_sent(1, 11, 1, 0);
        f.mark_sent(1, 12, 1, 0);
        assert_eq!(f.confirmed(10), Verdict::Delivered);
        assert_eq!(f.released(), 0, "a delivery is not a release");
        f.settle(11);
        f.settle(11);
        assert_eq!(f.released(), 1, "once per message that was in flight");
        assert_eq!(f.expire(Duration::ZERO), vec![12]);
        assert_eq!(f.released(), 2);
    }

    #[test]
    fn events_for_unknown_ids_change_nothing() {
        let mut f = flight(ProofMode::AckQueue);
        f.mark_sent(1, 10, 100, 0);
        assert_eq!(f.confirmed(99), Verdict::Unknown);
        assert_eq!(f.acked(99), Verdict::Unknown);
        f.settle(99);
        assert_eq!(f.broker(1).in_flight, 1);
    }

    #[test]
    fn a_lost_connection_forgets_only_unconfirmed_messages() {
        let mut f = flight(ProofMode::AckQueue);
        f.mark_sent(1, 10, 100, 0);
        f.mark_sent(1, 11, 100, 0);
        f.confirmed(11);
        f.forget_unconfirmed(1);
        assert!(!f.is_in_flight(10));
        assert!(f.is_in_flight(11), "confirmed, still awaiting its record");
        assert_eq!(f.broker(1).in_flight, 1);
    }

    #[test]
    fn expire_takes_back_what_waited_too_long() {
        let mut f = flight(ProofMode::AckQueue);
        f.mark_sent(1, 10, 100, 0);
        assert!(f.expire(Duration::from_secs(3600)).is_empty());
        assert_eq!(f.expire(Duration::ZERO), vec![10]);
        assert!(!f.is_in_flight(10));
    }

    #[test]
    fn expire_waits_while_the_broker_blocks_publishing_and_counts_from_the_resume() {
        let mut f = flight(ProofMode::AckQueue);
        f.mark_sent(1, 10, 100, 0);
        f.set_blocked(1, true);
        assert!(
            f.broker(1).error.is_some(),
            "the view says why nothing moves"
        );
        assert!(f.expire(Duration::ZERO).is_empty(), "blocked: not lost");
        std::thread::sleep(Duration::from_millis(30));
        f.set_blocked(1, false);
        assert!(f.broker(1).error.is_none());
        // Sent more than 30 ms ago, but resumed just now.
        assert!(f.expire(Duration::from_millis(25)).is_empty());
        assert_eq!(f.expire(Duration::ZERO), vec![10]);
    }

    #[test]
    fn a_new_connection_is_not_blocked() {
        let mut f = flight(ProofMode::AckQueue);
        f.set_blocked(1, true);
        f.forget_unconfirmed(1);
        assert!(!f.broker(1).blocked);
        assert!(f.broker(1).error.is_none());
    }

    #[test]
    fn the_window_and_isolation_close_a_broker() {
        let mut f = flight(ProofMode::Confirm);
        f.mark_sent(1, 10, 100, 0);
        assert_eq!(
            f.open_brokers(2, 1000),
            vec![Room {
                broker_id: 1,
                messages: 1,
                bytes: 900,
                take_one_anyway: false
            }]
        );
        f.mark_sent(1, 11, 100, 0);
        assert!(f.open_brokers(2, 1000).is_empty(), "window full");
        f.confirmed(10);
        f.confirmed(11);
        f.broker(1).suspects.insert(12);
        assert!(
            f.open_brokers(2, 1000).is_empty(),
            "suspects are published alone first"
        );
        assert_eq!(f.isolation_ready(), vec![(1, vec![12])]);
        f.mark_sent(1, 12, 100, 0);
        assert!(f.isolation_ready().is_empty(), "one suspect at a time");
    }

    #[test]
    fn a_confirmed_suspect_is_no_longer_one_and_the_next_goes() {
        let mut f = flight(ProofMode::AckQueue);
        f.broker(1).suspects.extend([12, 13]);
        assert_eq!(f.isolation_ready(), vec![(1, vec![12, 13])]);
        f.mark_sent(1, 12, 100, 0);
        assert!(f.isolation_ready().is_empty(), "12 is unconfirmed");
        assert_eq!(f.confirmed(12), Verdict::Wait);
        assert_eq!(
            f.isolation_ready(),
            vec![(1, vec![13])],
            "12 was confirmed: it neither holds 13 back nor is published again"
        );
        assert_eq!(f.acked(12), Verdict::Delivered);
        assert_eq!(f.isolation_ready(), vec![(1, vec![13])]);
    }

    #[test]
    fn messages_waiting_for_their_record_do_not_hold_suspects_back() {
        let mut f = flight(ProofMode::AckQueue);
        f.mark_sent(1, 10, 100, 0);
        f.broker(1).suspects.insert(11);
        assert!(f.isolation_ready().is_empty(), "10 is unconfirmed");
        // Its record may have been lost with its channel: only the sweep would end the wait.
        assert_eq!(f.confirmed(10), Verdict::Wait);
        assert_eq!(f.isolation_ready(), vec![(1, vec![11])]);
        assert!(
            f.open_brokers(10, 1000).is_empty(),
            "suspects still go first"
        );
    }

    #[test]
    fn removed_brokers_drop_their_messages() {
        let mut f = flight(ProofMode::Confirm);
        f.broker(2).connected = true;
        f.mark_sent(1, 10, 100, 0);
        f.mark_sent(2, 20, 100, 0);
        f.retain_brokers(&[2]);
        assert!(!f.is_in_flight(10));
        assert!(f.is_in_flight(20));
        assert_eq!(f.ids().collect::<Vec<_>>(), vec![20]);
    }

    #[test]
    fn unconfirmed_bytes_close_a_broker_until_confirms_free_them() {
        let mut f = flight(ProofMode::AckQueue);
        f.mark_sent(1, 10, 600, 0);
        f.mark_sent(1, 11, 500, 0);
        assert_eq!(f.broker(1).unconfirmed_bytes, 1100);
        assert!(f.open_brokers(100, 1000).is_empty(), "over the byte cap");
        // Confirmed but not acknowledged: still in flight, no longer held in memory.
        assert_eq!(f.confirmed(10), Verdict::Wait);
        assert_eq!(
            f.confirmed(10),
            Verdict::Wait,
            "a second confirm counts nothing"
        );
        assert_eq!(f.broker(1).unconfirmed_bytes, 500);
        let room = f.open_brokers(100, 1000);
        assert_eq!(room[0].messages, 98);
        assert_eq!(room[0].bytes, 500);
        // Settling an unconfirmed message frees its bytes; a confirmed one's are gone already.
        f.settle(11);
        f.settle(10);
        assert_eq!(f.broker(1).unconfirmed_bytes, 0);
        // A resend of a tracked id is not counted twice.
        f.mark_sent(1, 12, 300, 0);
        f.mark_sent(1, 12, 300, 0);
        assert_eq!(f.broker(1).unconfirmed_bytes, 300);
        assert_eq!(f.broker(1).in_flight, 1);
    }

    #[test]
    fn a_room_takes_what_fits_and_one_large_message_when_nothing_is_unconfirmed() {
        let mut empty = Room {
            broker_id: 1,
            messages: 3,
            bytes: 1000,
            take_one_anyway: true,
        };
        assert!(
            empty.take(5000),
            "one message larger than the cap still goes"
        );
        assert!(!empty.take(1), "but only one");
        let mut r = Room {
            broker_id: 1,
            messages: 2,
            bytes: 1000,
            take_one_anyway: false,
        };
        assert!(r.take(600));
        assert!(!r.take(600), "over the bytes left");
        assert!(r.take(400));
        assert!(!r.take(0), "no message left");
    }
}
