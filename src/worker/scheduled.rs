//! Delayed messages (`publish_message(..., deliver_after)`): the worker moves the due rows of
//! `amqp.scheduled_message` into `amqp.message`, same id and message_id, where they are claimed
//! like any other. It looks when the earliest one it knows of is due, when a transaction that
//! wrote the table committed (its statement trigger sets a flag that a commit callback hands
//! over, see `commit_wake`: a publish, a restore, an UPDATE by hand), and once a minute whatever
//! happened. Once a minute it also deletes
//! the idempotency keys older than `amqp_outbox.idempotency_window`.
//!
//! Why a table of their own: a million messages scheduled for next week in `amqp.message` would
//! be read (and skipped) by every claim that reads from the lowest id, counted as pending, and
//! held against `amqp_outbox.max_pending`. Here a look costs an index probe or two, and a
//! database that never publishes for later pays one a minute.
//!
//! A moved row keeps the id it was given when published, below the scan floor by then: the
//! caller lowers the floor when anything moved (see [`super::scan_floor`]).
//!
//! A row that cannot go into `amqp.message` (a trigger or a constraint a DBA added there) stays,
//! with the error in `last_error` and its `deliver_at` a minute later: it never holds back the
//! others, and is tried again.

use super::pacer::Pacer;
use crate::shmem;
use crate::subtransaction::subtransaction;
use pgrx::prelude::*;
use pgrx::spi::{SpiClient, SpiResult};
use std::time::{Duration, Instant};

/// Looks at least this often, whatever the worker knows.
const LOOK_EVERY: Duration = Duration::from_secs(60);
const EXPIRE_EVERY: Duration = Duration::from_secs(60);
/// Rows moved, or keys deleted, per statement: a backlog of due messages moves over several
/// steps, each a bounded transaction.
const BATCH: i64 = 5000;

/// Ids of due rows, oldest due first. SKIP LOCKED: a row `amqp.retry()` or `amqp.discard()` is
/// taking meanwhile is theirs.
const DUE_SQL: &str = "\
SELECT id FROM amqp.scheduled_message \
 WHERE deliver_at OPERATOR(pg_catalog.<=) pg_catalog.now() \
 ORDER BY deliver_at, id LIMIT $1 FOR UPDATE SKIP LOCKED";

/// Milliseconds until the earliest delayed message is due (negative: overdue); NULL: none.
const NEXT_DUE_SQL: &str = "\
SELECT (pg_catalog.date_part('epoch', pg_catalog.min(deliver_at)) \
        OPERATOR(pg_catalog.-) pg_catalog.date_part('epoch', pg_catalog.clock_timestamp())) \
       OPERATOR(pg_catalog.*) 1000 \
  FROM amqp.scheduled_message";

const POSTPONE_SQL: &str = "\
UPDATE amqp.scheduled_message \
   SET last_error = $2, \
       deliver_at = pg_catalog.now() OPERATOR(pg_catalog.+) '1 minute'::pg_catalog.interval \
 WHERE id OPERATOR(pg_catalog.=) $1";

/// SKIP LOCKED: a key a publishing transaction is taking again (its old row updated, not yet
/// committed) must not make the worker's transaction wait for that session.
const EXPIRE_SQL: &str = "\
DELETE FROM amqp.idempotency_key \
 WHERE key IN (SELECT key FROM amqp.idempotency_key \
                WHERE published_at OPERATOR(pg_catalog.<) \
                      (pg_catalog.now() OPERATOR(pg_catalog.-) $1) \
                LIMIT $2 FOR UPDATE SKIP LOCKED)";

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
    fn look_due(&self, now: Instant) -> bool {
        self.look.due(now) || self.next_due.is_some_and(|t| t <= now) || shmem::scheduled_noted()
    }

    /// Whether a look (or an expiry) is due now.
    pub fn due(&self) -> bool {
        let now = Instant::now();
        self.look_due(now) || self.expire.due(now)
    }

    /// How long until the next look or expiry.
    pub fn until_due(&self) -> Duration {
        let now = Instant::now();
        if shmem::scheduled_noted() {
            return Duration::ZERO;
        }
        let mut until = self.look.until_due(now).min(self.expire.until_due(now));
        if let Some(t) = self.next_due {
            until = until.min(t.saturating_duration_since(now));
        }
        until
    }

    /// Moves the due messages and expires old keys when their time has come; returns how many
    /// messages moved (the caller lowers its scan floor when any did).
    pub fn run_when_due(&mut self, client: &mut SpiClient<'_>) -> SpiResult<u64> {
        let started = Instant::now();
        let (look, expire) = (self.look_due(started), self.expire.due(started));
        if !look && !expire {
            return Ok(0);
        }
        // Taken before the statements: a commit after this sets it again, one before is seen.
        shmem::take_scheduled();
        // Before `ALTER EXTENSION amqp_outbox UPDATE` brought the tables, nothing to do.
        let present = crate::scheduled_move::tables_present();
        let mut moved = 0;
        if look {
            self.next_due = None;
            if present {
                moved = move_due(client)?;
                self.next_due = if moved >= BATCH as u64 {
                    // More are due: the next step goes on.
                    Some(Instant::now())
                } else {
                    client
                        .select(NEXT_DUE_SQL, None, &[])?
                        .first()
                        .get_one::<f64>()?
                        .map(|ms| Instant::now() + until_due(ms))
                };
            }
            self.look.ran(started, started.elapsed());
        }
        if expire {
            let at = Instant::now();
            if present {
                let window = pgrx::datum::Interval::from_minutes(
                    crate::gucs::IDEMPOTENCY_WINDOW.get().max(1),
                );
                client.update(EXPIRE_SQL, None, &[window.into(), BATCH.into()])?;
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
fn move_due(client: &mut SpiClient<'_>) -> SpiResult<u64> {
    let due: Vec<i64> = client
        .update(DUE_SQL, None, &[BATCH.into()])?
        .filter_map(|r| r.get::<i64>(1).ok().flatten())
        .collect();
    if due.is_empty() {
        return Ok(0);
    }
    let sql = crate::scheduled_move::move_sql();
    let all = subtransaction(|| {
        client
            .update(&sql, None, &[due.clone().into()])
            .map(|t| t.len())
    });
    match all {
        Ok(Ok(n)) => return Ok(n as u64),
        Ok(Err(e)) => return Err(e),
        Err(_) => {}
    }
    let mut moved = 0;
    for id in due {
        let one = subtransaction(|| {
            client
                .update(&sql, None, &[vec![id].into()])
                .map(|t| t.len())
        });
        match one {
            Ok(Ok(n)) => moved += n as u64,
            Ok(Err(e)) => return Err(e),
            Err(caught) => {
                let error = format!("{}: {}", caught.sqlstate, caught.message);
                warning!(
                    "amqp_outbox: delayed message {id} could not be moved into amqp.message ({error}); trying again in a minute"
                );
                client.update(POSTPONE_SQL, None, &[id.into(), error.into()])?;
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
