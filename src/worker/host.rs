//! The engine's traits for the background worker: [`SpiOutbox`] runs the delivery's
//! statements through SPI ([`super::queries`] binds and runs the engine's texts),
//! [`WorkerTelemetry`] counts in shared memory and logs to the server log.

use super::flight::Proof;
use super::message::Origin;
use super::origin;
use super::queries::{self, Row};
use super::scan_floor::Probe;
use crate::shmem;
use amqp_outbox_engine::brokers::BrokerTables;
use amqp_outbox_engine::outbox::{Caught, Outbox, Recorded, RetryDelays};
use amqp_outbox_engine::telemetry::{Counter, Level, Telemetry};
use pgrx::prelude::*;
use pgrx::spi::{SpiClient, SpiError};

/// `amqp.message` through the worker's SPI connection, inside the transaction the worker opened.
pub struct SpiOutbox<'a, 'conn> {
    client: &'a mut SpiClient<'conn>,
}

impl<'a, 'conn> SpiOutbox<'a, 'conn> {
    pub fn new(client: &'a mut SpiClient<'conn>) -> Self {
        SpiOutbox { client }
    }
}

impl Outbox for SpiOutbox<'_, '_> {
    type Error = SpiError;

    /// This database's name and the server's host name, taken once per worker process.
    fn origin(&self) -> Origin<'_> {
        Origin {
            system_id: origin::system_id(),
            host_id: origin::host_id(),
        }
    }

    fn claim(
        &mut self,
        brokers: &[i32],
        limit: usize,
        skip: &[i64],
        max_bytes: usize,
        after: i64,
    ) -> Result<Vec<Row>, SpiError> {
        queries::claim(self.client, brokers, limit, skip, max_bytes, after)
    }

    fn claim_ids(&mut self, ids: &[i64]) -> Result<Vec<Row>, SpiError> {
        queries::claim_ids(self.client, ids)
    }

    fn probe(&mut self) -> Result<Option<Probe>, SpiError> {
        queries::probe(self.client)
    }

    fn delete_delivered(&mut self, proofs: &[Proof], keep_log: bool) -> Result<usize, SpiError> {
        let log = queries::LogSettings {
            enabled: keep_log,
            system_id: origin::system_id(),
            host_id: origin::host_id(),
        };
        queries::delete_delivered(self.client, proofs, &log)
    }

    fn set_lock_timeout(&mut self, timeout: &str) -> Result<(), SpiError> {
        queries::set_lock_timeout(self.client, timeout)
    }

    fn lock_free(&mut self, ids: &[i64]) -> Result<Vec<i64>, SpiError> {
        queries::lock_free(self.client, ids)
    }

    fn existing(&mut self, ids: &[i64]) -> Result<Vec<i64>, SpiError> {
        queries::existing(self.client, ids)
    }

    fn record_failure(
        &mut self,
        id: i64,
        error: &str,
        max_attempts: i32,
        delays: &RetryDelays,
    ) -> Result<Option<Recorded>, SpiError> {
        queries::record_failure(self.client, id, error, max_attempts, delays)
    }

    fn record_resend(
        &mut self,
        ids: &[i64],
        reason: &str,
        max_attempts: i32,
    ) -> Result<Vec<i64>, SpiError> {
        queries::record_resend(self.client, ids, reason, max_attempts)
    }

    fn park(&mut self, id: i64, error: &str) -> Result<bool, SpiError> {
        queries::park(self.client, id, error)
    }

    fn broker_tables(&mut self) -> Result<BrokerTables, SpiError> {
        queries::broker_tables(self.client)
    }

    fn park_orphans(&mut self) -> Result<usize, SpiError> {
        queries::park_orphans(self.client)
    }

    fn due_scheduled(&mut self, limit: i64) -> Result<Vec<i64>, SpiError> {
        queries::due_scheduled(self.client, limit)
    }

    fn move_scheduled(&mut self, ids: &[i64]) -> Result<usize, SpiError> {
        queries::move_scheduled(self.client, ids)
    }

    fn postpone_scheduled(&mut self, id: i64, error: &str) -> Result<(), SpiError> {
        queries::postpone_scheduled(self.client, id, error)
    }

    fn next_scheduled_ms(&mut self) -> Result<Option<f64>, SpiError> {
        queries::next_scheduled_ms(self.client)
    }

    fn expire_keys(&mut self, window_minutes: i32, limit: i64) -> Result<(), SpiError> {
        queries::expire_keys(self.client, window_minutes, limit)
    }

    /// A subtransaction of the worker's transaction ([`crate::subtransaction`]).
    fn subtransaction<R>(
        &mut self,
        work: impl FnOnce(&mut Self) -> Result<R, SpiError>,
    ) -> Result<Result<R, SpiError>, Caught> {
        crate::subtransaction::subtransaction(|| work(self))
    }
}

/// The worker's counters in shared memory (`amqp.outbox_status`), its lines in the server log.
#[derive(Default, Clone, Copy)]
pub struct WorkerTelemetry;

impl Telemetry for WorkerTelemetry {
    fn count(&self, counter: Counter, n: u64) {
        match counter {
            Counter::Published => shmem::count(|c| &c.published, n),
            Counter::Confirmed => shmem::count(|c| &c.confirmed, n),
            Counter::Acknowledged => shmem::count(|c| &c.acknowledged, n),
            Counter::Failed => shmem::count(|c| &c.failed, n),
            Counter::Parked => shmem::count(|c| &c.parked, n),
            Counter::ResentGap => shmem::count(|c| &c.resent_gap, n),
            Counter::ResentTimeout => shmem::count(|c| &c.resent_timeout, n),
        }
    }

    fn log(&self, level: Level, text: &str) {
        match level {
            Level::Debug => debug1!("{text}"),
            Level::Log => log!("{text}"),
            Level::Warning => warning!("{text}"),
        }
    }
}
