//! What the consuming side tells `amqp.subscription_status`: counters (added up in the same
//! transaction as the work they count, so they match it) and the consumer's connection state,
//! kept in `amqp._subscription_state` by [`super::statements::BOOK_SQL`].

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

#[derive(Default, Clone, Debug, PartialEq)]
pub struct Entry {
    pub delivered: i64,
    pub handled: i64,
    pub duplicates: i64,
    pub failed: i64,
    pub dead_lettered: i64,
    /// Connection state changed: `Some((connected, host))`.
    pub connection: Option<(bool, Option<String>)>,
    /// `Some(None)`: clear the last error (it connected); `Some(Some(e))`: a new one.
    pub error: Option<Option<String>>,
    pub queue: Option<(i64, i32)>,
    pub handled_now: bool,
    /// Everything its queue held until then is handled.
    pub caught_up: Option<SystemTime>,
}

#[derive(Default)]
pub struct Book {
    entries: BTreeMap<String, Entry>,
}

impl Book {
    pub fn entry(&mut self, sub: &str) -> &mut Entry {
        self.entries.entry(sub.to_string()).or_default()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Everything noted so far, as the rows of [`super::statements::BOOK_SQL`]; cleared.
    pub fn take(&mut self) -> Vec<BookRow> {
        std::mem::take(&mut self.entries)
            .into_iter()
            .map(|(subscription, e)| BookRow::new(subscription, e))
            .collect()
    }
}

/// One subscription's additions, as [`super::statements::BOOK_SQL`] binds them ($1 … $16 in
/// field order).
#[derive(Debug, PartialEq)]
pub struct BookRow {
    pub subscription: String,
    pub delivered: i64,
    pub handled: i64,
    pub duplicates: i64,
    pub failed: i64,
    pub dead_lettered: i64,
    pub connection_changed: bool,
    pub connected: bool,
    pub host: Option<String>,
    pub error_changed: bool,
    pub error: Option<String>,
    pub queue_seen: bool,
    pub queue_ready: Option<i64>,
    pub queue_consumers: Option<i32>,
    pub handled_now: bool,
    /// Seconds since the Unix epoch, for `to_timestamp()`.
    pub caught_up: Option<f64>,
}

impl BookRow {
    fn new(subscription: String, e: Entry) -> BookRow {
        let (connection_changed, connected, host) = match e.connection {
            Some((c, h)) => (true, c, h),
            None => (false, false, None),
        };
        let (error_changed, error) = match e.error {
            Some(err) => (true, err),
            None => (false, None),
        };
        let (queue_seen, queue_ready, queue_consumers) = match e.queue {
            Some((r, c)) => (true, Some(r), Some(c)),
            None => (false, None, None),
        };
        BookRow {
            subscription,
            delivered: e.delivered,
            handled: e.handled,
            duplicates: e.duplicates,
            failed: e.failed,
            dead_lettered: e.dead_lettered,
            connection_changed,
            connected,
            host,
            error_changed,
            error,
            queue_seen,
            queue_ready,
            queue_consumers,
            handled_now: e.handled_now,
            caught_up: e.caught_up.map(|t| {
                t.duration_since(UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64())
            }),
        }
    }
}
