//! Acknowledgement records (`AckQueue` mode): their format, and the tracker that turns an
//! arriving record into `Acked` and `Lost` ids.
//!
//! After business messages, the publisher sends one small record listing them to the
//! acknowledgement queue on the same channel: after each solo message and each command of many
//! messages at once, and for small commands once a few milliseconds have gathered several of
//! them (`publisher.rs`, `RECORD_MIN_IDS`). RabbitMQ handles one channel's publishes in order
//! and keeps their order into one queue, so when record N of a channel arrives, every message
//! published before it was routed (or returned, which the confirm tells), and any earlier record
//! of that channel that has not arrived by then never will: its messages were lost in transit.

use crate::config::{AckQueueConfig, BrokerConfig, ProofMode};
use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A closed channel's records are forgotten once nothing arrived for it for this long (the
/// worker's own timeout republishes whatever they covered).
const CLOSED_EPOCH_TTL: Duration = Duration::from_secs(600);
/// Records kept per channel; past this the oldest are forgotten (the ack queue is probably
/// missing or refusing, and the worker's timeout covers them).
const MAX_RECORDS_PER_EPOCH: usize = 100_000;
/// Sweep closed epochs at most this often.
const GC_EVERY: Duration = Duration::from_secs(10);

/// Record format version, the `v` field.
pub(crate) const RECORD_VERSION: u64 = 1;

/// The per-process identity of this AMQP thread's records: a random u64 in hex. Records of
/// another session (a previous worker process) are ignored.
pub(crate) fn new_session() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// The record body: `{"v":1,"session":"…","epoch":E,"seq":N,"ids":[…]}`. `seq` numbers the
/// records of one channel epoch (1, 2, …) so an arriving record is matched exactly even when a
/// message id appears in two records of the same channel (a retry).
pub(crate) fn record_body(session: &str, epoch: u64, seq: u64, ids: &[i64]) -> Vec<u8> {
    let ids: Vec<String> = ids.iter().map(i64::to_string).collect();
    format!(
        "{{\"v\":{RECORD_VERSION},\"session\":\"{session}\",\"epoch\":{epoch},\"seq\":{seq},\"ids\":[{}]}}",
        ids.join(",")
    )
    .into_bytes()
}

/// The `message_id` of a record, so a return of it can be told from a business message's.
pub(crate) fn record_message_id(session: &str, epoch: u64, seq: u64) -> String {
    format!("amqp_outbox-ack:{session}:{epoch}:{seq}")
}

/// A parsed record.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) session: String,
    pub(crate) epoch: u64,
    pub(crate) seq: u64,
    pub(crate) ids: Vec<i64>,
}

/// Parses a record body; the error says what is wrong (for a log line).
pub(crate) fn parse_record(body: &[u8]) -> Result<Record, String> {
    let value: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    let obj = value.as_object().ok_or("not a JSON object")?;
    match obj.get("v").and_then(Value::as_u64) {
        Some(RECORD_VERSION) => {}
        other => return Err(format!("unknown version {other:?}")),
    }
    let session = obj
        .get("session")
        .and_then(Value::as_str)
        .ok_or("no session")?
        .to_string();
    let epoch = obj.get("epoch").and_then(Value::as_u64).ok_or("no epoch")?;
    let seq = obj.get("seq").and_then(Value::as_u64).ok_or("no seq")?;
    let ids = obj
        .get("ids")
        .and_then(Value::as_array)
        .ok_or("no ids")?
        .iter()
        .map(|v| v.as_i64().ok_or("an id is not an integer"))
        .collect::<Result<Vec<i64>, _>>()?;
    Ok(Record {
        session,
        epoch,
        seq,
        ids,
    })
}

/// `x-queue-type = quorum` when asked; the same arguments wherever the ack queue is declared.
pub(crate) fn ack_queue_arguments(cfg: &AckQueueConfig) -> serde_json::Map<String, Value> {
    let mut args = serde_json::Map::new();
    if cfg.quorum {
        args.insert("x-queue-type".into(), Value::String("quorum".into()));
    }
    args
}

/// Usable as a queue name and a routing key: not empty (an empty name would make the broker
/// invent a queue) and at most 255 bytes.
pub(crate) fn valid_queue_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 255
}

/// The acknowledgement queue, when records are to be published (`AckQueue` mode with a usable
/// queue name).
pub(crate) fn queue_in_use(cfg: &BrokerConfig) -> Option<&AckQueueConfig> {
    (cfg.proof == ProofMode::AckQueue && valid_queue_name(&cfg.ack_queue.name))
        .then_some(&cfg.ack_queue)
}

struct EpochLog {
    broker_id: i32,
    /// Published records not yet seen, in publish order: (seq, ids).
    records: VecDeque<(u64, Vec<i64>)>,
    closed: bool,
    /// Last registration or arrival.
    touched: Instant,
}

/// What an arriving record of this session means.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Seen {
    pub(crate) broker_id: i32,
    /// The ids of the record itself.
    pub(crate) acked: Vec<i64>,
    /// The ids of earlier records of the same epoch that never arrived.
    pub(crate) lost: Vec<i64>,
}

/// Per channel epoch, the records published and not yet seen. One per AMQP thread, shared by
/// every broker's publishers and listeners: epochs are unique in the process, so a record tells
/// its broker by its epoch even if two brokers were (mis)configured with one ack queue.
#[derive(Default)]
pub(crate) struct Tracker {
    epochs: HashMap<u64, EpochLog>,
    /// The latest record each message was registered in. An id whose latest record is another
    /// one was published again since, so its earlier record going missing means nothing.
    latest: HashMap<(i32, i64), (u64, u64)>,
    last_gc: Option<Instant>,
}

pub(crate) type SharedTracker = Arc<Mutex<Tracker>>;

/// Locks the tracker; a panic elsewhere while it was held leaves consistent data (every method
/// is a few collection operations), so a poisoned lock is used anyway.
pub(crate) fn lock(t: &SharedTracker) -> MutexGuard<'_, Tracker> {
    t.lock().unwrap_or_else(|p| p.into_inner())
}

impl Tracker {
    /// Registers a record before it is published (so the listener can never see an unknown one).
    /// A message published again supersedes its earlier publishes: its id leaves their records,
    /// so an earlier record that never arrives cannot report the new publish as lost.
    pub(crate) fn register(&mut self, broker_id: i32, epoch: u64, seq: u64, ids: Vec<i64>) {
        let now = Instant::now();
        self.gc(now);
        for id in &ids {
            self.latest.insert((broker_id, *id), (epoch, seq));
        }
        let log = self.epochs.entry(epoch).or_insert_with(|| EpochLog {
            broker_id,
            records: VecDeque::new(),
            closed: false,
            touched: now,
        });
        log.touched = now;
        log.records.push_back((seq, ids));
        while log.records.len() > MAX_RECORDS_PER_EPOCH {
            if let Some((old_seq, old_ids)) = log.records.pop_front() {
                for id in old_ids {
                    if self.latest.get(&(broker_id, id)) == Some(&(epoch, old_seq)) {
                        self.latest.remove(&(broker_id, id));
                    }
                }
            }
        }
    }

    /// The channel of `epoch` is gone: no more records will be registered for it.
    pub(crate) fn close(&mut self, epoch: u64) {
        if let Some(log) = self.epochs.get_mut(&epoch) {
            log.closed = true;
            if log.records.is_empty() {
                self.epochs.remove(&epoch);
            }
        }
    }

    /// A record of this session arrived. None when its epoch is unknown (forgotten, or of an
    /// earlier broker task): without the epoch the broker is unknown, and the worker's timeout
    /// covers it.
    pub(crate) fn seen(&mut self, record: &Record) -> Option<Seen> {
        let now = Instant::now();
        self.gc(now);
        let log = self.epochs.get_mut(&record.epoch)?;
        log.touched = now;
        let mut seen = Seen {
            broker_id: log.broker_id,
            acked: record.ids.clone(),
            lost: Vec::new(),
        };
        // Records arrive in seq order: everything before this one that is still listed was
        // skipped. A seq not listed (already popped as lost, or forgotten past the cap) pops
        // nothing; its ids are still acknowledged, since the record did arrive.
        let broker_id = log.broker_id;
        let mut popped = Vec::new();
        if log.records.iter().any(|(s, _)| *s == record.seq) {
            while let Some((s, ids)) = log.records.pop_front() {
                if s == record.seq {
                    popped.push((s, ids, false));
                    break;
                }
                popped.push((s, ids, true));
            }
        }
        if log.closed && log.records.is_empty() {
            self.epochs.remove(&record.epoch);
        }
        for (s, ids, missing) in popped {
            for id in ids {
                let key = (broker_id, id);
                if self.latest.get(&key) == Some(&(record.epoch, s)) {
                    self.latest.remove(&key);
                    if missing {
                        seen.lost.push(id);
                    }
                }
            }
        }
        Some(seen)
    }

    fn gc(&mut self, now: Instant) {
        if self
            .last_gc
            .is_some_and(|t| now.saturating_duration_since(t) < GC_EVERY)
        {
            return;
        }
        self.last_gc = Some(now);
        self.epochs.retain(|_, log| {
            !(log.closed && now.saturating_duration_since(log.touched) >= CLOSED_EPOCH_TTL)
        });
        let epochs = &self.epochs;
        self.latest
            .retain(|_, (epoch, _)| epochs.contains_key(epoch));
    }

    #[cfg(test)]
    fn pending(&self, epoch: u64) -> Option<usize> {
        self.epochs.get(&epoch).map(|l| l.records.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(epoch: u64, seq: u64, ids: &[i64]) -> Record {
        Record {
            session: "s".into(),
            epoch,
            seq,
            ids: ids.to_vec(),
        }
    }

    #[test]
    fn record_round_trip() {
        let body = record_body("00ff", 7, 3, &[1, -2, 9_000_000_000]);
        assert_eq!(
            std::str::from_utf8(&body).unwrap(),
            r#"{"v":1,"session":"00ff","epoch":7,"seq":3,"ids":[1,-2,9000000000]}"#
        );
        let r = parse_record(&body).unwrap();
        assert_eq!(
            r,
            Record {
                session: "00ff".into(),
                epoch: 7,
                seq: 3,
                ids: vec![1, -2, 9_000_000_000]
            }
        );
        assert!(parse_record(&record_body("x", 1, 1, &[]))
            .unwrap()
            .ids
            .is_empty());
    }

    #[test]
    fn malformed_records_are_errors_not_panics() {
        for bad in [
            &b""[..],
            b"\xff\xfe",
            b"[]",
            b"{}",
            br#"{"v":2,"session":"s","epoch":1,"seq":1,"ids":[]}"#,
            br#"{"v":1,"epoch":1,"seq":1,"ids":[]}"#,
            br#"{"v":1,"session":"s","epoch":-1,"seq":1,"ids":[]}"#,
            br#"{"v":1,"session":"s","epoch":1,"ids":[]}"#,
            br#"{"v":1,"session":"s","epoch":1,"seq":1,"ids":["1"]}"#,
            br#"{"v":1,"session":"s","epoch":1,"seq":1,"ids":[1.5]}"#,
        ] {
            assert!(
                parse_record(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn in_order_records_are_acked_and_skipped_ones_lost() {
        let mut t = Tracker::default();
        t.register(4, 10, 1, vec![1, 2]);
        t.register(4, 10, 2, vec![3]);
        t.register(4, 10, 3, vec![4, 5]);
        t.register(4, 11, 1, vec![6]);
        let s = t.seen(&rec(10, 1, &[1, 2])).unwrap();
        assert_eq!((s.broker_id, s.acked, s.lost), (4, vec![1, 2], vec![]));
        // Record 2 skipped: lost when 3 arrives.
        let s = t.seen(&rec(10, 3, &[4, 5])).unwrap();
        assert_eq!((s.acked, s.lost), (vec![4, 5], vec![3]));
        assert_eq!(t.pending(10), Some(0));
        // Another epoch is untouched by the gap rule.
        assert_eq!(t.pending(11), Some(1));
        // A late duplicate is still an ack, never a loss.
        let s = t.seen(&rec(10, 2, &[3])).unwrap();
        assert_eq!((s.acked, s.lost), (vec![3], vec![]));
        // Unknown epoch: nothing to say.
        assert!(t.seen(&rec(99, 1, &[1])).is_none());
    }

    #[test]
    fn a_message_published_again_is_not_reported_lost_by_its_earlier_record() {
        let mut t = Tracker::default();
        t.register(1, 7, 1, vec![10, 11]);
        // 10 is taken back (say by the timeout) and published again in record 2.
        t.register(1, 7, 2, vec![10]);
        let seen = t.seen(&rec(7, 2, &[10])).expect("known epoch");
        assert_eq!(seen.acked, vec![10]);
        assert_eq!(
            seen.lost,
            vec![11],
            "only the publish that is really missing"
        );
    }

    #[test]
    fn closed_epochs_are_dropped_when_drained() {
        let mut t = Tracker::default();
        t.register(1, 5, 1, vec![1]);
        t.register(1, 5, 2, vec![2]);
        t.close(5);
        assert_eq!(t.pending(5), Some(2));
        let s = t.seen(&rec(5, 2, &[2])).unwrap();
        assert_eq!(s.lost, vec![1]);
        assert_eq!(t.pending(5), None);
        // Closing an epoch with nothing outstanding forgets it at once.
        t.register(1, 6, 1, vec![3]);
        t.seen(&rec(6, 1, &[3]));
        t.close(6);
        assert_eq!(t.pending(6), None);
    }

    #[test]
    fn per_epoch_cap_forgets_the_oldest() {
        let mut t = Tracker::default();
        for seq in 1..=(MAX_RECORDS_PER_EPOCH as u64 + 5) {
            t.register(1, 1, seq, vec![seq as i64]);
        }
        assert_eq!(t.pending(1), Some(MAX_RECORDS_PER_EPOCH));
        let s = t.seen(&rec(1, 7, &[7])).unwrap();
        assert_eq!(s.lost, vec![6]);
    }

    #[test]
    fn quorum_arguments() {
        let q = AckQueueConfig {
            name: "a".into(),
            quorum: true,
            record_wait: Default::default(),
        };
        assert_eq!(ack_queue_arguments(&q)["x-queue-type"], "quorum");
        let c = AckQueueConfig {
            name: "a".into(),
            quorum: false,
            record_wait: Default::default(),
        };
        assert!(ack_queue_arguments(&c).is_empty());
        assert!(!valid_queue_name(""));
        assert!(!valid_queue_name(&"q".repeat(256)));
        assert!(valid_queue_name("q"));
    }
}
