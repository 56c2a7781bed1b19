//! What the subscription worker tells `amqp.subscription_status`: counters (added up in the
//! same transaction as the work they count, so they match it) and the consumer's connection
//! state, kept in `amqp._subscription_state`.

use pgrx::datum::DatumWithOid;
use pgrx::spi::{SpiClient, SpiResult};
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

    /// Writes and clears everything noted so far.
    pub fn flush(&mut self, client: &mut SpiClient<'_>) -> SpiResult<()> {
        for (sub, e) in std::mem::take(&mut self.entries) {
            let (conn_changed, connected, host) = match e.connection {
                Some((c, h)) => (true, c, h),
                None => (false, false, None),
            };
            let (error_changed, error) = match e.error {
                Some(err) => (true, err),
                None => (false, None),
            };
            let (queue_seen, ready, consumers) = match e.queue {
                Some((r, c)) => (true, Some(r), Some(c)),
                None => (false, None, None),
            };
            // Seconds since the Unix epoch, for to_timestamp().
            let caught_up = e.caught_up.map(|t| {
                t.duration_since(UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64())
            });
            let args: [DatumWithOid; 16] = [
                sub.as_str().into(),
                e.delivered.into(),
                e.handled.into(),
                e.duplicates.into(),
                e.failed.into(),
                e.dead_lettered.into(),
                conn_changed.into(),
                connected.into(),
                host.into(),
                error_changed.into(),
                error.into(),
                queue_seen.into(),
                ready.into(),
                consumers.into(),
                e.handled_now.into(),
                caught_up.into(),
            ];
            client.update(
                "INSERT INTO amqp._subscription_state AS s \
                     (subscription, delivered, handled, duplicates, failed, dead_lettered, \
                      connected, host, last_error, last_error_at, queue_ready, queue_consumers, \
                      queue_seen_at, last_handled_at, caught_up_at) \
                 SELECT $1, $2, $3, $4, $5, $6, $8, $9, $11, \
                        CASE WHEN $11 IS NOT NULL THEN clock_timestamp() END, $13, $14, \
                        CASE WHEN $12 THEN clock_timestamp() END, \
                        CASE WHEN $15 THEN clock_timestamp() END, to_timestamp($16) \
                  WHERE EXISTS (SELECT FROM amqp.subscription WHERE subscription = $1) \
                 ON CONFLICT (subscription) DO UPDATE SET \
                     delivered = s.delivered + EXCLUDED.delivered, \
                     handled = s.handled + EXCLUDED.handled, \
                     duplicates = s.duplicates + EXCLUDED.duplicates, \
                     failed = s.failed + EXCLUDED.failed, \
                     dead_lettered = s.dead_lettered + EXCLUDED.dead_lettered, \
                     connected = CASE WHEN $7 THEN $8 ELSE s.connected END, \
                     host = CASE WHEN $7 THEN $9 ELSE s.host END, \
                     state_since = CASE WHEN $7 AND $8 IS DISTINCT FROM s.connected \
                                        THEN clock_timestamp() ELSE s.state_since END, \
                     last_error = CASE WHEN $10 THEN $11 ELSE s.last_error END, \
                     last_error_at = CASE WHEN $10 AND $11 IS NOT NULL THEN clock_timestamp() \
                                          ELSE s.last_error_at END, \
                     queue_ready = CASE WHEN $12 THEN $13 ELSE s.queue_ready END, \
                     queue_consumers = CASE WHEN $12 THEN $14 ELSE s.queue_consumers END, \
                     queue_seen_at = CASE WHEN $12 THEN clock_timestamp() ELSE s.queue_seen_at END, \
                     last_handled_at = CASE WHEN $15 THEN clock_timestamp() ELSE s.last_handled_at END, \
                     caught_up_at = greatest(s.caught_up_at, to_timestamp($16))",
                None,
                &args,
            )?;
        }
        Ok(())
    }
}

/// At start: no consumer is connected yet, whatever the last run left.
pub fn reset_connections(client: &mut SpiClient<'_>) -> SpiResult<()> {
    client.update(
        "UPDATE amqp._subscription_state SET connected = false, host = NULL, \
                state_since = clock_timestamp() WHERE connected",
        None,
        &[],
    )?;
    Ok(())
}
