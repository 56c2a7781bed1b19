//! The ledger and the checker of the fault suite.
//!
//! Producers record every message they tried to publish, outside the database under test:
//! committed (COMMIT returned success), aborted (ROLLBACK, an error, a rolled-back savepoint),
//! or unknown (the connection broke during COMMIT; resolved later from the database). The
//! consumer records every delivery. The checker compares the two:
//!
//! - lost: committed but never delivered (must be 0),
//! - phantom: aborted but delivered (must be 0),
//! - duplicates: delivered more than once (bounded; all copies must share one `message_id`),
//! - order violations: a producer's messages whose first arrivals are not in the order the
//!   producer committed them,
//! - unexpected: delivered but never recorded (a test bug or a corrupted body).
//!
//! Messages are identified by a [`MessageKey`] carried in the body: `producer:seq` (anything
//! after a second `:` is ignored), e.g. `p3:17` or `p3:17:padding`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Mutex;

use std::time::Duration;

use crate::eventually;
use crate::rabbit::{Collector, Received};

/// Identifies one message of the test: the producer and its sequence number (the order in which
/// that producer published).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MessageKey {
    pub producer: String,
    pub seq: u64,
}

impl MessageKey {
    pub fn new(producer: &str, seq: u64) -> MessageKey {
        MessageKey {
            producer: producer.to_string(),
            seq,
        }
    }

    /// The body to publish for this key.
    pub fn body(&self) -> String {
        format!("{}:{}", self.producer, self.seq)
    }

    /// Parses `producer:seq[:rest]`.
    pub fn parse(body: &str) -> Option<MessageKey> {
        let mut parts = body.splitn(3, ':');
        let producer = parts.next()?;
        let seq = parts.next()?.parse().ok()?;
        if producer.is_empty() {
            return None;
        }
        Some(MessageKey::new(producer, seq))
    }

    /// The key a delivery carries: the `e2e-key` header if present, else the body.
    pub fn of(delivery: &Received) -> Option<MessageKey> {
        if let Some(serde_json::Value::String(s)) = delivery.headers.get("e2e-key") {
            if let Some(k) = MessageKey::parse(s) {
                return Some(k);
            }
        }
        MessageKey::parse(&delivery.text())
    }
}

impl fmt::Display for MessageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.producer, self.seq)
    }
}

/// `COMMIT_TOKENS`: the table in each test database where a producer's transaction inserts its
/// token, so that a COMMIT whose answer was lost can be resolved. Created by
/// [`crate::Producer::spawn`].
pub const CREATE_COMMIT_TOKENS: &str =
    "CREATE TABLE IF NOT EXISTS public.e2e_commit_token (token text PRIMARY KEY)";
pub const INSERT_COMMIT_TOKEN: &str = "INSERT INTO public.e2e_commit_token (token) VALUES ($1)";
const FIND_COMMIT_TOKEN: &str =
    "SELECT EXISTS (SELECT 1 FROM public.e2e_commit_token WHERE token = $1)";

/// What a producer knows about one message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Committed,
    Aborted,
    /// COMMIT's result never came back. Resolved once the fault has healed: the transaction
    /// also inserted `token` into `COMMIT_TOKENS`, so it committed if and only if that row
    /// exists (`xid`, from `pg_current_xact_id()`, only says whether it is still running: a
    /// crash can lose an unflushed transaction and hand its xid to a later one, whose status
    /// `pg_xact_status` would then report).
    Unknown {
        xid: Option<String>,
        token: Option<String>,
    },
}

/// Where producers write what they committed. Shared between threads (`&Ledger` is enough).
#[derive(Default)]
pub struct Ledger {
    entries: Mutex<BTreeMap<MessageKey, Outcome>>,
}

impl Ledger {
    pub fn new() -> Ledger {
        Ledger::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<MessageKey, Outcome>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records (or overwrites) the outcome of each key.
    pub fn record<'a>(&self, keys: impl IntoIterator<Item = &'a MessageKey>, outcome: Outcome) {
        let mut m = self.lock();
        for k in keys {
            m.insert(k.clone(), outcome.clone());
        }
    }

    pub fn committed<'a>(&self, keys: impl IntoIterator<Item = &'a MessageKey>) {
        self.record(keys, Outcome::Committed);
    }

    pub fn aborted<'a>(&self, keys: impl IntoIterator<Item = &'a MessageKey>) {
        self.record(keys, Outcome::Aborted);
    }

    /// `keys` of one transaction whose COMMIT got no answer; `token` is what it inserted into
    /// `COMMIT_TOKENS` (None: nothing to look up, it stays unknown).
    pub fn unknown<'a>(
        &self,
        keys: impl IntoIterator<Item = &'a MessageKey>,
        xid: Option<String>,
        token: Option<String>,
    ) {
        self.record(keys, Outcome::Unknown { xid, token });
    }

    pub fn outcome(&self, key: &MessageKey) -> Option<Outcome> {
        self.lock().get(key).cloned()
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn count(&self, pred: impl Fn(&Outcome) -> bool) -> usize {
        self.lock().values().filter(|o| pred(o)).count()
    }

    pub fn committed_count(&self) -> usize {
        self.count(|o| *o == Outcome::Committed)
    }

    /// `Ok` when every committed message has arrived at `collector` at least once. Cheap while
    /// the consumer has fewer deliveries than there are committed messages (large backlogs).
    pub fn all_arrived(&self, collector: &Collector) -> Result<(), String> {
        let committed = self.committed_count();
        let n = collector.len();
        if n < committed {
            return Err(format!("{n} deliveries, {committed} committed messages"));
        }
        let report = self.check(&collector.deliveries());
        if report.lost.is_empty() {
            return Ok(());
        }
        let examples: Vec<String> = report.lost.iter().take(10).map(|k| k.to_string()).collect();
        Err(format!(
            "{} of {} committed messages not arrived (e.g. {})",
            report.lost.len(),
            report.committed,
            examples.join(", ")
        ))
    }

    /// Waits until every committed message has arrived at `collector`.
    pub fn wait_all_arrived(&self, collector: &Collector, timeout: Duration) {
        eventually(timeout, "every committed message to arrive", || {
            self.all_arrived(collector)
        });
    }

    pub fn committed_keys(&self) -> BTreeSet<MessageKey> {
        self.lock()
            .iter()
            .filter(|(_, o)| **o == Outcome::Committed)
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Resolves every unknown outcome: committed when its token is in `COMMIT_TOKENS`,
    /// aborted when not, unless `pg_xact_status` says the transaction is still running (then it
    /// stays unknown). Call after the fault has healed.
    pub fn resolve_unknown(&self, client: &mut postgres::Client) -> Result<(), String> {
        let unknown: Vec<(MessageKey, Option<String>, Option<String>)> = self
            .lock()
            .iter()
            .filter_map(|(k, o)| match o {
                Outcome::Unknown { xid, token } => Some((k.clone(), xid.clone(), token.clone())),
                _ => None,
            })
            .collect();
        // One lookup per transaction (its keys share the token).
        let mut committed: BTreeMap<String, Option<bool>> = BTreeMap::new();
        for (_, xid, token) in &unknown {
            let Some(token) = token else { continue };
            if committed.contains_key(token) {
                continue;
            }
            let running = match xid {
                Some(x) => {
                    let status: Option<String> = client
                        .query_one("SELECT pg_catalog.pg_xact_status($1::text::xid8)", &[x])
                        .map_err(|e| format!("pg_xact_status({x}): {e}"))?
                        .get(0);
                    status.as_deref() == Some("in progress")
                }
                None => false,
            };
            let outcome = if running {
                None
            } else {
                let found: bool = client
                    .query_one(FIND_COMMIT_TOKEN, &[token])
                    .map_err(|e| format!("looking up commit token {token}: {e}"))?
                    .get(0);
                Some(found)
            };
            committed.insert(token.clone(), outcome);
        }
        let mut m = self.lock();
        for (k, _, token) in unknown {
            match token.and_then(|t| committed.get(&t).copied().flatten()) {
                Some(true) => {
                    m.insert(k, Outcome::Committed);
                }
                Some(false) => {
                    m.insert(k, Outcome::Aborted);
                }
                None => {}
            }
        }
        Ok(())
    }

    /// Compares the ledger with what arrived (in arrival order).
    pub fn check(&self, deliveries: &[Received]) -> Report {
        let entries = self.lock().clone();
        let mut arrivals: BTreeMap<MessageKey, Vec<usize>> = BTreeMap::new();
        let mut unexpected = Vec::new();
        for (i, d) in deliveries.iter().enumerate() {
            match MessageKey::of(d) {
                Some(k) if entries.contains_key(&k) => arrivals.entry(k).or_default().push(i),
                _ => unexpected.push(d.text()),
            }
        }
        let mut report = Report {
            committed: 0,
            aborted: 0,
            unknown: 0,
            delivered: deliveries.len(),
            lost: Vec::new(),
            phantom: Vec::new(),
            unknown_delivered: Vec::new(),
            duplicates: Vec::new(),
            order_violations: Vec::new(),
            unexpected,
        };
        for (k, outcome) in &entries {
            let got = arrivals.get(k);
            match outcome {
                Outcome::Committed => {
                    report.committed += 1;
                    if got.is_none() {
                        report.lost.push(k.clone());
                    }
                }
                Outcome::Aborted => {
                    report.aborted += 1;
                    if got.is_some() {
                        report.phantom.push(k.clone());
                    }
                }
                Outcome::Unknown { .. } => {
                    report.unknown += 1;
                    if got.is_some() {
                        report.unknown_delivered.push(k.clone());
                    }
                }
            }
            if let Some(idx) = got {
                if idx.len() > 1 {
                    let message_ids: BTreeSet<Option<String>> = idx
                        .iter()
                        .map(|&i| deliveries[i].message_id.clone())
                        .collect();
                    report.duplicates.push(Duplicate {
                        key: k.clone(),
                        copies: idx.len(),
                        message_ids,
                    });
                }
            }
        }
        // Per producer: the first arrivals must come in sequence order.
        let mut first: BTreeMap<&str, Vec<(usize, u64)>> = BTreeMap::new();
        for (k, idx) in &arrivals {
            first
                .entry(k.producer.as_str())
                .or_default()
                .push((idx[0], k.seq));
        }
        for (producer, mut seen) in first {
            seen.sort();
            // (seq, index of its first arrival) of the highest sequence number seen so far.
            let mut highest: Option<(u64, usize)> = None;
            for (pos, seq) in seen {
                if let Some((h, h_pos)) = highest {
                    if seq < h {
                        report.order_violations.push(OrderViolation {
                            producer: producer.to_string(),
                            seq,
                            after: h,
                            position: pos,
                            message_id: deliveries[pos].message_id.clone(),
                            after_message_id: deliveries[h_pos].message_id.clone(),
                        });
                        continue;
                    }
                }
                highest = Some((seq, pos));
            }
        }
        report
    }
}

/// A message that arrived more than once.
#[derive(Clone, Debug)]
pub struct Duplicate {
    pub key: MessageKey,
    pub copies: usize,
    /// The distinct `message_id`s of its copies (must be exactly one, not `None`).
    pub message_ids: BTreeSet<Option<String>>,
}

impl Duplicate {
    pub fn shares_one_message_id(&self) -> bool {
        self.message_ids.len() == 1 && !self.message_ids.contains(&None)
    }
}

/// A message whose first arrival came after a later message of the same producer.
#[derive(Clone, Debug)]
pub struct OrderViolation {
    pub producer: String,
    pub seq: u64,
    /// The highest sequence number of that producer that had arrived before it.
    pub after: u64,
    /// Its index in the arrival order.
    pub position: usize,
    pub message_id: Option<String>,
    pub after_message_id: Option<String>,
}

/// What [`Ledger::check`] found.
#[derive(Clone, Debug)]
pub struct Report {
    pub committed: usize,
    pub aborted: usize,
    pub unknown: usize,
    pub delivered: usize,
    pub lost: Vec<MessageKey>,
    pub phantom: Vec<MessageKey>,
    /// Unknown outcome (not resolved) but delivered: committed after all.
    pub unknown_delivered: Vec<MessageKey>,
    pub duplicates: Vec<Duplicate>,
    pub order_violations: Vec<OrderViolation>,
    /// Bodies that arrived but name no message of the ledger.
    pub unexpected: Vec<String>,
}

impl Report {
    /// Extra copies beyond the first, over all messages.
    pub fn extra_copies(&self) -> usize {
        self.duplicates.iter().map(|d| d.copies - 1).sum()
    }

    /// Duplicates whose copies carry different (or missing) `message_id`s.
    pub fn duplicates_with_differing_ids(&self) -> Vec<&Duplicate> {
        self.duplicates
            .iter()
            .filter(|d| !d.shares_one_message_id())
            .collect()
    }

    /// Panics (with this report) unless nothing was lost, nothing phantom, nothing unexpected,
    /// and every duplicate shares one message_id. Duplicates themselves are allowed (at least
    /// once) up to `max_extra_copies`.
    pub fn assert_at_least_once(&self, max_extra_copies: usize) {
        let ok = self.lost.is_empty()
            && self.phantom.is_empty()
            && self.unexpected.is_empty()
            && self.duplicates_with_differing_ids().is_empty()
            && self.extra_copies() <= max_extra_copies;
        assert!(
            ok,
            "delivery check failed (at most {max_extra_copies} extra copies allowed):\n{self}"
        );
    }

    /// [`assert_at_least_once`](Self::assert_at_least_once) with no duplicates allowed and no
    /// order violations: what a fault-free run must give.
    pub fn assert_exactly_once_in_order(&self) {
        let ok = self.lost.is_empty()
            && self.phantom.is_empty()
            && self.unexpected.is_empty()
            && self.duplicates.is_empty()
            && self.order_violations.is_empty();
        assert!(ok, "delivery check failed (fault-free run):\n{self}");
    }
}

fn list<T: fmt::Display>(items: &[T], max: usize) -> String {
    let mut s: Vec<String> = items.iter().take(max).map(|i| i.to_string()).collect();
    if items.len() > max {
        s.push(format!("… and {} more", items.len() - max));
    }
    s.join(", ")
}

/// One line of the report: `label (count): the first max items`.
fn line<T: fmt::Display>(
    f: &mut fmt::Formatter<'_>,
    label: &str,
    items: &[T],
    max: usize,
) -> fmt::Result {
    writeln!(f, "{label} ({}): {}", items.len(), list(items, max))
}

impl fmt::Display for Duplicate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ×{} (message_id ", self.key, self.copies)?;
        let ids: Vec<String> = self
            .message_ids
            .iter()
            .map(|m| m.clone().unwrap_or_else(|| "<none>".into()))
            .collect();
        write!(f, "{})", ids.join(" / "))
    }
}

impl fmt::Display for OrderViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let id = |m: &Option<String>| m.clone().unwrap_or_else(|| "<none>".into());
        write!(
            f,
            "{}:{} (message_id {}) arrived (#{}) after {}:{} (message_id {})",
            self.producer,
            self.seq,
            id(&self.message_id),
            self.position,
            self.producer,
            self.after,
            id(&self.after_message_id)
        )
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "ledger: {} committed, {} aborted, {} unknown; {} deliveries",
            self.committed, self.aborted, self.unknown, self.delivered
        )?;
        line(f, "lost", &self.lost, 30)?;
        line(f, "phantom", &self.phantom, 30)?;
        writeln!(
            f,
            "duplicates ({} messages, {} extra copies; {} with differing message_id): {}",
            self.duplicates.len(),
            self.extra_copies(),
            self.duplicates_with_differing_ids().len(),
            list(&self.duplicates, 30)
        )?;
        line(f, "order violations", &self.order_violations, 30)?;
        line(
            f,
            "unknown outcome but delivered",
            &self.unknown_delivered,
            30,
        )?;
        write!(
            f,
            "unexpected bodies ({}): {}",
            self.unexpected.len(),
            list(&self.unexpected, 10)
        )
    }
}
