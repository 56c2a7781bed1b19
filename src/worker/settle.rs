//! Writes what the AMQP thread's events mean for the rows: deletes the delivered ones, counts
//! failed attempts (scheduling the retry with the product's backoff, or parking), parks what can
//! never be sent.

use super::flight::{Flight, Proof};
use super::origin;
use super::queries::{self, RetryDelays};
use crate::gucs::WorkerSettings;
use crate::shmem;
use amqp_outbox_broker::backoff::Backoff;
use pgrx::prelude::*;
use pgrx::spi::{SpiClient, SpiResult};
use std::time::Instant;

/// What the events of one wake-up ask the database to do before the next claim (the delivered
/// rows are deleted after it, in batches: [`delete_delivered`]).
#[derive(Default)]
pub struct Settlement {
    pub rejected: Vec<(i64, String)>,
    /// Can never be published as it is: parked at once.
    pub unsendable: Vec<(i64, String)>,
    /// Lost (gap rule) or without proof past the timeout: publish again, counting an attempt.
    pub resend: Vec<(Vec<i64>, &'static str)>,
    /// A connection came or went, a broker's flow control changed, an attempt failed or the
    /// AMQP thread stopped: rows the last claim could not take may be due now. (Confirms and
    /// acknowledgements only prove deliveries.)
    pub reopened: bool,
}

impl Settlement {
    /// Whether a disabled worker may skip the transaction: nothing refused or to be resent.
    /// (Unsendable messages are not looked at: left unrecorded, they are claimed again once the
    /// worker is enabled, and refused again.)
    pub fn nothing_to_record(&self) -> bool {
        self.rejected.is_empty() && self.resend.is_empty()
    }

    /// Nothing at all to write: most steps.
    pub fn is_empty(&self) -> bool {
        self.nothing_to_record() && self.unsendable.is_empty()
    }

    pub fn record(
        self,
        client: &mut SpiClient<'_>,
        settings: &WorkerSettings,
        flight: &mut Flight,
    ) -> SpiResult<()> {
        let backoff = Backoff::new(settings.retry_backoff_min, settings.retry_backoff_max);
        for (id, error) in &self.rejected {
            // Drawn for each row, so rows refused together do not retry in step.
            let delays = RetryDelays::new(&backoff);
            record_rejection(client, *id, error, settings.max_attempts, &delays, flight)?;
        }
        for (id, error) in &self.unsendable {
            park_now(client, *id, error)?;
        }
        for (ids, reason) in &self.resend {
            let parked = queries::record_resend(client, ids, reason, settings.max_attempts)?;
            for id in parked {
                shmem::count(|c| &c.parked, 1);
                warning!("amqp_outbox: message {id} parked after amqp_outbox.max_attempts attempts: {reason}");
            }
        }
        Ok(())
    }
}

/// Deletes delivered rows, writing the production log and the day's statistics.
pub fn delete_delivered(client: &mut SpiClient<'_>, delivered: &[Proof]) -> SpiResult<()> {
    let log = queries::LogSettings {
        enabled: crate::gucs::RECONCILE_WINDOW.get() > 0,
        system_id: origin::system_id(),
        host_id: origin::host_id(),
    };
    queries::delete_delivered(client, delivered, &log).map(|_| ())
}

fn record_rejection(
    client: &mut SpiClient<'_>,
    id: i64,
    error: &str,
    max_attempts: i32,
    delays: &RetryDelays,
    flight: &mut Flight,
) -> SpiResult<()> {
    let Some(r) = queries::record_failure(client, id, error, max_attempts, delays)? else {
        return Ok(());
    };
    if r.parked {
        shmem::count(|c| &c.parked, 1);
        warning!(
            "amqp_outbox: message {id} parked after {} failed attempts: {error}",
            r.attempts
        );
    } else {
        flight.holds.retry_at(Instant::now() + r.retry_in);
        log!(
            "amqp_outbox: message {id} refused (attempt {}), will retry in {:.2} s: {error}",
            r.attempts,
            r.retry_in.as_secs_f64()
        );
    }
    Ok(())
}

/// Parks a message that can never be published as it is (retrying cannot help), says so in the
/// log and counts it.
pub fn park_now(client: &mut SpiClient<'_>, id: i64, why: &str) -> SpiResult<()> {
    warning!("amqp_outbox: message {id} parked: {why}");
    queries::park(client, id, why)?;
    shmem::count(|c| &c.parked, 1);
    Ok(())
}
