//! Writes what the AMQP thread's events mean for the rows: deletes the delivered ones, counts
//! failed attempts (scheduling the retry with the product's backoff, or parking), parks what can
//! never be sent.

use super::flight::{Flight, Proof};
use super::origin;
use super::queries::{self, RetryDelays};
use crate::gucs::WorkerSettings;
use crate::shmem;
use crate::subtransaction::subtransaction;
use amqp_outbox_broker::backoff::Backoff;
use pgrx::prelude::*;
use pgrx::spi::{SpiClient, SpiResult};
use std::collections::HashSet;
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
        let backoff = settings.retry_backoff();
        for (id, error) in &self.rejected {
            // Drawn for each row, so rows refused together do not retry in step.
            let delays = RetryDelays::new(&backoff);
            let max_attempts = settings.max_attempts;
            record_rejection(client, *id, error, max_attempts, &delays, &backoff, flight)?;
        }
        for (id, error) in &self.unsendable {
            park_now(client, *id, error, &backoff, flight)?;
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

/// Deletes delivered rows, writing the production log and the day's statistics. Returns the
/// rows another session keeps locked (an admin's open transaction): the worker does not wait
/// for them, it deletes them later. `locked_before`: some of these rows were locked at the last
/// try, so the rows no one holds are picked out at once instead of after a wait.
pub fn delete_delivered(
    client: &mut SpiClient<'_>,
    delivered: Vec<Proof>,
    locked_before: bool,
) -> Result<Vec<Proof>, String> {
    let log = queries::LogSettings {
        enabled: crate::gucs::RECONCILE_WINDOW.get() > 0,
        system_id: origin::system_id(),
        host_id: origin::host_id(),
    };
    if !locked_before {
        let tried = subtransaction(|| -> SpiResult<()> {
            queries::set_lock_timeout(client, queries::DELETE_LOCK_WAIT)?;
            queries::delete_delivered(client, &delivered, &log).map(|_| ())
        });
        match tried {
            Ok(done) => return done.map(|()| Vec::new()).map_err(|e| e.to_string()),
            Err(caught) if caught.sqlstate == LOCK_NOT_AVAILABLE => {}
            Err(caught) => return Err(format!("{} ({})", caught.message, caught.sqlstate)),
        }
    }
    delete_unlocked(client, delivered, &log).map_err(|e| e.to_string())
}

/// Deletes the rows no other session holds (locking them first, `SKIP LOCKED`); returns the
/// others that are still in the table.
fn delete_unlocked(
    client: &mut SpiClient<'_>,
    delivered: Vec<Proof>,
    log: &queries::LogSettings<'_>,
) -> SpiResult<Vec<Proof>> {
    let ids: Vec<i64> = delivered.iter().map(|p| p.id).collect();
    let free: HashSet<i64> = queries::lock_free(client, &ids)?.into_iter().collect();
    let (now, held): (Vec<Proof>, Vec<Proof>) =
        delivered.into_iter().partition(|p| free.contains(&p.id));
    if !now.is_empty() {
        queries::delete_delivered(client, &now, log)?;
    }
    // The others are locked by another session, or gone (deleted by it).
    let held_ids: Vec<i64> = held.iter().map(|p| p.id).collect();
    let still: HashSet<i64> = queries::existing(client, &held_ids)?.into_iter().collect();
    Ok(held.into_iter().filter(|p| still.contains(&p.id)).collect())
}

/// SQLSTATE 55P03: `lock_timeout` ran out.
const LOCK_NOT_AVAILABLE: &str = "55P03";

fn record_rejection(
    client: &mut SpiClient<'_>,
    id: i64,
    error: &str,
    max_attempts: i32,
    delays: &RetryDelays,
    backoff: &Backoff,
    flight: &mut Flight,
) -> SpiResult<()> {
    let Some(r) = queries::record_failure(client, id, error, max_attempts, delays)? else {
        // Gone, parked, or locked by another session: held back (if it is still there, it is
        // refused and recorded again once the lock is gone).
        flight.holds.hold(id, backoff);
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
/// log and counts it. A row locked by another session is held back and parked when claimed
/// again after the lock is gone.
pub fn park_now(
    client: &mut SpiClient<'_>,
    id: i64,
    why: &str,
    backoff: &Backoff,
    flight: &mut Flight,
) -> SpiResult<()> {
    if queries::park(client, id, why)? {
        warning!("amqp_outbox: message {id} parked: {why}");
        shmem::count(|c| &c.parked, 1);
    } else {
        flight.holds.hold(id, backoff);
    }
    Ok(())
}
