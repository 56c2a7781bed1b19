//! Delayed messages (`publish_message(..., deliver_after)`): the due rows of
//! `amqp.scheduled_message` move into `amqp.message`, same id and message_id, where they are
//! claimed like any other. A look happens when the earliest delayed message known is due, when
//! the host was told that a transaction wrote the table (`noted`: the extension's statement
//! trigger and commit callback, a relay's NOTIFY 'scheduled'), and once a minute whatever
//! happened. Once a minute the idempotency keys older than the window are deleted too.
//!
//! Why a table of their own: a million messages scheduled for next week in `amqp.message` would
//! be read (and skipped) by every claim that reads from the lowest id, counted as pending, and
//! held against `amqp_outbox.max_pending`. Here a look costs an index probe or two, and a
//! database that never publishes for later pays one a minute.
//!
//! A moved row keeps the id it was given when published, below the scan floor by then: the
//! caller lowers the floor when anything moved ([`crate::scan_floor`]).
//!
//! A row that cannot go into `amqp.message` (a trigger or a constraint a DBA added there) stays,
//! with the error in `last_error` and its `deliver_at` a minute later: it never holds back the
//! others, and is tried again.

use crate::outbox::Outbox;
use crate::pacer::Pacer;
use crate::telemetry::{Level, Telemetry};
use std::time::{Duration, Instant};

/// Looks at least this often, whatever the host knows.
const LOOK_EVERY: Duration = Duration::from_secs(60);
const EXPIRE_EVERY: Duration = Duration::from_secs(60);
/// Rows moved, or keys deleted, per statement: a backlog of due messages moves over several
/// steps, each a bounded transaction.
const BATCH: i64 = 5000;

pub struct Scheduled {
    look: Pacer,
    expire: Pacer,
    /// When the earliest delayed message the last look saw is due.
    next_due: Option<Instant>,
}

impl Default for Scheduled {
    fn default() -> Self {
        Scheduled {
            look: Pacer::new(LOOK_EVERY),
            expire: Pacer::new(EXPIRE_EVERY),
            next_due: None,
        }
    }
}

impl Scheduled {
    fn look_due(&self, now: Instant, noted: bool) -> bool {
        noted || self.look.due(now) || self.next_due.is_some_and(|t| t <= now)
    }

    /// Whether a look (or an expiry) is due now; `noted`: the table was written since the host
    /// last took that news.
    pub fn due(&self, noted: bool) -> bool {
        let now = Instant::now();
        self.look_due(now, noted) || self.expire.due(now)
    }

    /// How long until the next look or expiry.
    pub fn until_due(&self, noted: bool) -> Duration {
        let now = Instant::now();
        if noted {
            return Duration::ZERO;
        }
        let mut until = self.look.until_due(now).min(self.expire.until_due(now));
        if let Some(t) = self.next_due {
            until = until.min(t.saturating_duration_since(now));
        }
        until
    }

    /// Moves the due messages and expires old keys when their time has come; returns how many
    /// messages moved (the caller lowers its scan floor when any did). The host takes its
    /// `noted` news *before* this call: a commit after it is noted again, one before is seen.
    /// `present`: the tables exist (an extension not yet updated to 0.8.0 has neither).
    pub fn run_when_due<O: Outbox>(
        &mut self,
        outbox: &mut O,
        telemetry: &impl Telemetry,
        noted: bool,
        present: bool,
        window_minutes: i32,
    ) -> Result<u64, O::Error> {
        let started = Instant::now();
        let (look, expire) = (self.look_due(started, noted), self.expire.due(started));
        let mut moved = 0;
        if look {
            self.next_due = None;
            if present {
                moved = move_due(outbox, telemetry)?;
                self.next_due = if moved >= BATCH as u64 {
                    // More are due: the next step goes on.
                    Some(Instant::now())
                } else {
                    outbox
                        .next_scheduled_ms()?
                        .map(|ms| Instant::now() + until_due(ms))
                };
            }
            self.look.ran(started, started.elapsed());
        }
        if expire {
            let at = Instant::now();
            if present {
                outbox.expire_keys(window_minutes.max(1), BATCH)?;
            }
            self.expire.ran(at, at.elapsed());
        }
        Ok(moved)
    }
}

/// The wait for a message due in `ms` milliseconds: none when overdue, at most [`LOOK_EVERY`]
/// (the look that follows learns again), and any value a row may hold is safe.
fn until_due(ms: f64) -> Duration {
    let limit = LOOK_EVERY.as_secs_f64() * 1000.0;
    let ms = if ms.is_nan() {
        0.0
    } else {
        ms.clamp(0.0, limit)
    };
    Duration::from_secs_f64(ms / 1000.0)
}

/// Moves up to [`BATCH`] due rows: all at once, or one by one when that fails, so that a row
/// that cannot move holds back no other.
fn move_due<O: Outbox>(outbox: &mut O, telemetry: &impl Telemetry) -> Result<u64, O::Error> {
    let due = outbox.due_scheduled(BATCH)?;
    if due.is_empty() {
        return Ok(0);
    }
    match outbox.subtransaction(|o| o.move_scheduled(&due)) {
        Ok(Ok(n)) => return Ok(n as u64),
        Ok(Err(e)) => return Err(e),
        Err(_) => {}
    }
    let mut moved = 0;
    for id in due {
        match outbox.subtransaction(|o| o.move_scheduled(&[id])) {
            Ok(Ok(n)) => moved += n as u64,
            Ok(Err(e)) => return Err(e),
            Err(caught) => {
                let error = format!("{}: {}", caught.sqlstate, caught.message);
                telemetry.log(
                    Level::Warning,
                    &format!("amqp_outbox: delayed message {id} could not be moved into amqp.message ({error}); trying again in a minute"),
                );
                outbox.postpone_scheduled(id, &error)?;
            }
        }
    }
    Ok(moved)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_distance_to_the_next_due_message_is_a_bounded_wait() {
        assert_eq!(until_due(-5.0), Duration::ZERO);
        assert_eq!(until_due(f64::NAN), Duration::ZERO);
        assert_eq!(until_due(f64::NEG_INFINITY), Duration::ZERO);
        assert_eq!(until_due(f64::INFINITY), LOOK_EVERY);
        assert_eq!(until_due(1e300), LOOK_EVERY);
        assert_eq!(until_due(1500.0), Duration::from_millis(1500));
    }
}
