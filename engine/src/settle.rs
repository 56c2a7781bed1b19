//! Writes what the AMQP thread's events mean for the rows: deletes the delivered ones, counts
//! failed attempts (scheduling the retry with the product's backoff, or parking), parks what can
//! never be sent.

use crate::flight::{Flight, Proof};
use crate::outbox::{Outbox, RetryDelays, DELETE_LOCK_WAIT, LOCK_NOT_AVAILABLE};
use crate::settings::WorkerSettings;
use crate::telemetry::{Counter, Level, Telemetry};
use amqp_outbox_broker::backoff::Backoff;
use std::collections::HashSet;
use std::time::{Duration, Instant};

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

    pub fn record<O: Outbox>(
        self,
        outbox: &mut O,
        telemetry: &impl Telemetry,
        settings: &WorkerSettings,
        flight: &mut Flight,
    ) -> Result<(), O::Error> {
        let backoff = settings.retry_backoff();
        for (id, error) in &self.rejected {
            let max_attempts = settings.max_attempts;
            record_rejection(
                outbox,
                telemetry,
                *id,
                error,
                max_attempts,
                &backoff,
                flight,
            )?;
        }
        for (id, error) in &self.unsendable {
            park_now(outbox, telemetry, *id, error, &backoff, flight)?;
        }
        for (ids, reason) in &self.resend {
            let parked = outbox.record_resend(ids, reason, settings.max_attempts)?;
            for id in parked {
                telemetry.count(Counter::Parked, 1);
                telemetry.log(
                    Level::Warning,
                    &format!("amqp_outbox: message {id} parked after amqp_outbox.max_attempts attempts: {reason}"),
                );
            }
        }
        Ok(())
    }
}

/// How often the host looks for messages in flight past `resend_after`.
const SWEEP_EVERY: Duration = Duration::from_millis(100);

/// The timeout sweep: what has been in flight past `resend_after` without proof of delivery is
/// taken back and published again.
pub struct Sweep {
    swept_at: Instant,
}

impl Default for Sweep {
    fn default() -> Self {
        Sweep {
            swept_at: Instant::now(),
        }
    }
}

impl Sweep {
    /// Every `SWEEP_EVERY`, adds the expired messages to `s` for a resend.
    pub fn run(
        &mut self,
        flight: &mut Flight,
        resend_after: Duration,
        telemetry: &impl Telemetry,
        s: &mut Settlement,
    ) {
        if self.swept_at.elapsed() < SWEEP_EVERY {
            return;
        }
        self.swept_at = Instant::now();
        let expired = flight.expire(resend_after);
        if expired.is_empty() {
            return;
        }
        telemetry.count(Counter::ResentTimeout, expired.len() as u64);
        telemetry.log(
            Level::Log,
            &format!(
                "amqp_outbox: {} message(s) without proof of delivery after amqp_outbox.resend_after, publishing again",
                expired.len()
            ),
        );
        s.resend.push((
            expired,
            "no proof of delivery within amqp_outbox.resend_after",
        ));
    }
}

/// Deletes delivered rows, writing the production log and the day's statistics. Returns the
/// rows another session keeps locked (an admin's open transaction): the worker does not wait
/// for them, it deletes them later. `locked_before`: some of these rows were locked at the last
/// try, so the rows no one holds are picked out at once instead of after a wait. `keep_log`:
/// the production log records them (`amqp_outbox.reconcile_window` is not 0).
pub fn delete_delivered<O: Outbox>(
    outbox: &mut O,
    delivered: Vec<Proof>,
    locked_before: bool,
    keep_log: bool,
) -> Result<Vec<Proof>, String> {
    if !locked_before {
        let tried = outbox.subtransaction(|outbox| -> Result<(), O::Error> {
            outbox.set_lock_timeout(DELETE_LOCK_WAIT)?;
            outbox.delete_delivered(&delivered, keep_log).map(|_| ())
        });
        match tried {
            Ok(done) => return done.map(|()| Vec::new()).map_err(|e| e.to_string()),
            Err(caught) if caught.sqlstate == LOCK_NOT_AVAILABLE => {}
            Err(caught) => return Err(format!("{} ({})", caught.message, caught.sqlstate)),
        }
    }
    delete_unlocked(outbox, delivered, keep_log).map_err(|e| e.to_string())
}

/// Deletes the rows no other session holds (locking them first, `SKIP LOCKED`); returns the
/// others that are still in the table.
fn delete_unlocked<O: Outbox>(
    outbox: &mut O,
    delivered: Vec<Proof>,
    keep_log: bool,
) -> Result<Vec<Proof>, O::Error> {
    let ids: Vec<i64> = delivered.iter().map(|p| p.id).collect();
    let free: HashSet<i64> = outbox.lock_free(&ids)?.into_iter().collect();
    let (now, held): (Vec<Proof>, Vec<Proof>) =
        delivered.into_iter().partition(|p| free.contains(&p.id));
    if !now.is_empty() {
        outbox.delete_delivered(&now, keep_log)?;
    }
    // The others are locked by another session, or gone (deleted by it).
    let held_ids: Vec<i64> = held.iter().map(|p| p.id).collect();
    let still: HashSet<i64> = outbox.existing(&held_ids)?.into_iter().collect();
    Ok(held.into_iter().filter(|p| still.contains(&p.id)).collect())
}

fn record_rejection<O: Outbox>(
    outbox: &mut O,
    telemetry: &impl Telemetry,
    id: i64,
    error: &str,
    max_attempts: i32,
    backoff: &Backoff,
    flight: &mut Flight,
) -> Result<(), O::Error> {
    // Drawn for each row, so rows refused together do not retry in step.
    let delays = RetryDelays::new(backoff);
    let Some(r) = outbox.record_failure(id, error, max_attempts, &delays)? else {
        // Gone, parked, or locked by another session: held back (if it is still there, it is
        // refused and recorded again once the lock is gone).
        flight.holds.hold(id, backoff);
        return Ok(());
    };
    if r.parked {
        telemetry.count(Counter::Parked, 1);
        telemetry.log(
            Level::Warning,
            &format!(
                "amqp_outbox: message {id} parked after {} failed attempts: {error}",
                r.attempts
            ),
        );
    } else {
        flight.holds.retry_at(Instant::now() + r.retry_in);
        telemetry.log(
            Level::Log,
            &format!(
                "amqp_outbox: message {id} refused (attempt {}), will retry in {:.2} s: {error}",
                r.attempts,
                r.retry_in.as_secs_f64()
            ),
        );
    }
    Ok(())
}

/// Parks a message that can never be published as it is (retrying cannot help), says so in the
/// log and counts it. A row locked by another session is held back and parked when claimed
/// again after the lock is gone.
pub fn park_now<O: Outbox>(
    outbox: &mut O,
    telemetry: &impl Telemetry,
    id: i64,
    why: &str,
    backoff: &Backoff,
    flight: &mut Flight,
) -> Result<(), O::Error> {
    if outbox.park(id, why)? {
        telemetry.log(
            Level::Warning,
            &format!("amqp_outbox: message {id} parked: {why}"),
        );
        telemetry.count(Counter::Parked, 1);
    } else {
        flight.holds.hold(id, backoff);
    }
    Ok(())
}
