//! Copies the worker's state to shared memory for the status views (`amqp.broker_status`,
//! `amqp.message_status`), and counts the backlog per broker for `amqp_outbox.max_pending`.

use super::flight::Flight;
use super::queries;
use crate::shmem;
use pgrx::spi::{SpiClient, SpiResult};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Messages in flight that are copied to the status views on every change.
const COPY_AT_ONCE: usize = 256;

/// Above that, the status views are refreshed at most this often while messages flow.
pub const STATUS_EVERY: Duration = Duration::from_millis(100);

/// How often the backlog is counted while `max_pending` is set.
const COUNT_PENDING_EVERY: Duration = Duration::from_secs(1);

pub struct Status {
    /// A connection or the configuration changed: publish the broker table to shared memory.
    changed: bool,
    reported_at: Option<Instant>,
    /// The flight's change count last copied.
    reported_changes: u64,
    /// Backlog per broker, counted while `max_pending` is set.
    pending: HashMap<i32, i64>,
    pending_counted_at: Option<Instant>,
}

impl Default for Status {
    fn default() -> Self {
        Status {
            changed: true,
            reported_at: None,
            reported_changes: 0,
            pending: HashMap::new(),
            pending_counted_at: None,
        }
    }
}

impl Status {
    /// Reported at the next call of [`Status::report`], whatever its throttle.
    pub fn mark_changed(&mut self) {
        self.changed = true;
    }

    /// Connection states at once when they change; in-flight counts and messages at most every
    /// `STATUS_EVERY` once the window is large. Returns false when a change is left to report
    /// later (throttled).
    pub fn report(&mut self, flight: &Flight) -> bool {
        let changes = flight.changes();
        if !self.changed && changes == self.reported_changes {
            return true;
        }
        // A small window is copied at once, so the views are never behind a state the tables
        // already show; a large one at most every STATUS_EVERY, to bound the copying.
        let due = flight.len() <= COPY_AT_ONCE
            || self.reported_at.is_none_or(|t| t.elapsed() >= STATUS_EVERY);
        if !self.changed && !due {
            return false;
        }
        self.reported_changes = changes;
        let mut reports: Vec<shmem::BrokerReport<'_>> = flight
            .brokers()
            .map(|(id, b)| shmem::BrokerReport {
                broker_id: *id,
                connected: b.connected,
                host: b.host.as_deref(),
                epoch: b.epoch,
                error: b.error.as_deref(),
                in_flight: b.in_flight,
                pending: self.pending.get(id).copied().unwrap_or(0),
            })
            .collect();
        reports.sort_by_key(|r| r.broker_id);
        shmem::report_brokers(&reports);
        shmem::report_in_flight(&flight.snapshot());
        self.changed = false;
        self.reported_at = Some(Instant::now());
        true
    }

    /// Whether [`Status::count_pending`] has anything to do now.
    pub fn count_due(&self, max_pending: i32) -> bool {
        if max_pending <= 0 {
            return !self.pending.is_empty();
        }
        self.pending_counted_at
            .is_none_or(|t| t.elapsed() >= COUNT_PENDING_EVERY)
    }

    /// Counts the backlog about once a second while `max_pending` is set (`<= 0`: not set).
    pub fn count_pending(&mut self, client: &SpiClient<'_>, max_pending: i32) -> SpiResult<()> {
        if !self.count_due(max_pending) {
            return Ok(());
        }
        if max_pending <= 0 {
            self.pending.clear();
            self.changed = true;
            return Ok(());
        }
        self.pending = queries::count_pending(client)?;
        self.pending_counted_at = Some(Instant::now());
        self.changed = true;
        Ok(())
    }
}

impl super::events::BrokerStatus for Status {
    fn mark_changed(&mut self) {
        Status::mark_changed(self);
    }
}
