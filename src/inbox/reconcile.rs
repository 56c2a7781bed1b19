//! The subscription worker's reconciliation duties: the production log's day partitions and
//! retention (every ten seconds), the monitor (once a second: late, lost, resends, compensations to
//! make), and the compensations themselves — each in its own transaction, in a subtransaction
//! that keeps the handler's effects and the "done" mark together, so a compensation happens at
//! most once and is retried with backoff until it does. Errors are caught and logged: nothing a
//! user stores in a rule or a handler ends the worker.

use super::guarded::{self, Caught};
use crate::worker::pg;
use amqp_outbox_broker::backoff::Backoff;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::{SpiClient, SpiResult};
use std::time::{Duration, Instant};

const UPKEEP_EVERY: Duration = Duration::from_secs(10);
const UPKEEP_LOCK_WAIT: Duration = Duration::from_millis(200);
const MONITOR_EVERY: Duration = Duration::from_secs(1);
/// Compensations run per wake-up at most, and the time after which no further one starts: the
/// subscriptions of this worker wait meanwhile (a slow function is bounded by
/// `amqp_outbox.handler_timeout` on top).
const COMPENSATIONS_PER_TICK: usize = 20;
const COMPENSATION_BUDGET: Duration = Duration::from_millis(500);

#[derive(Default)]
pub struct Reconciler {
    upkeep_at: Option<Instant>,
    monitor_at: Option<Instant>,
}

/// A compensation due now, as the worker read it.
struct Due {
    message_id: String,
    consumer: String,
    attempts: i32,
    /// `schema.function`, quoted by PostgreSQL.
    function: String,
    owner: pg_sys::Oid,
    original: Option<String>,
    failure: Option<String>,
}

impl Reconciler {
    /// Whether a duty is due (the loop sleeps at most until then).
    pub fn due(&self) -> bool {
        let now = Instant::now();
        self.upkeep_at.is_none_or(|t| now >= t) || self.monitor_at.is_none_or(|t| now >= t)
    }

    /// Runs what is due. Call between transactions, with the extension present and current.
    pub fn run(&mut self, backoff: &Backoff, handler_timeout: Duration) {
        let now = Instant::now();
        if self.upkeep_at.is_none_or(|t| now >= t) {
            self.upkeep_at = Some(now + UPKEEP_EVERY);
            // Its partition DDL waits at most UPKEEP_LOCK_WAIT for its locks: the outbox
            // worker's writes to the production log queue behind a waiting ALTER or DROP (a
            // pg_dump holds every table), and would wait with it up to their lock_timeout.
            guarded_statement(
                "amqp_outbox reconciliation upkeep",
                "SELECT amqp._reconcile_upkeep()",
                Some(UPKEEP_LOCK_WAIT),
            );
        }
        if self.monitor_at.is_none_or(|t| now >= t) {
            self.monitor_at = Some(now + MONITOR_EVERY);
            guarded_statement("amqp_outbox monitor", "SELECT amqp._monitor()::text", None);
            let started = Instant::now();
            for _ in 0..COMPENSATIONS_PER_TICK {
                if started.elapsed() >= COMPENSATION_BUDGET
                    || !compensate_one(backoff, handler_timeout)
                {
                    break;
                }
            }
        }
    }
}

/// One statement in its own transaction, its error logged instead of raised; `lock_wait`: the
/// longest it waits for a lock (then it is left for its next turn, with a debug line).
fn guarded_statement(what: &str, sql: &'static str, lock_wait: Option<Duration>) {
    match guarded::statement_alone(what, sql, lock_wait) {
        Ok(Some(done)) if done.starts_with("made") => {
            log!("amqp_outbox: production log: {done}")
        }
        Ok(_) => {}
        Err(e) if lock_wait.is_some() && e.sqlstate == guarded::LOCK_NOT_AVAILABLE => {
            debug1!("amqp_outbox: {what} postponed: {}", e.message)
        }
        Err(e) => warning!(
            "amqp_outbox: {what} failed: {} (SQLSTATE {})",
            e.message,
            e.sqlstate
        ),
    }
}

/// Runs the oldest due compensation, if any. Returns whether there was one.
fn compensate_one(backoff: &Backoff, handler_timeout: Duration) -> bool {
    pg::transaction("amqp_outbox compensation", || {
        let due = guarded::subtransaction(|| {
            Spi::connect_mut(next_due).unwrap_or_else(|e| pgrx::error!("amqp_outbox: {e}"))
        });
        let due = match due {
            Ok(Some(due)) => due,
            Ok(None) => return false,
            Err(e) => {
                warning!(
                    "amqp_outbox: reading due compensations failed: {}",
                    e.message
                );
                return false;
            }
        };
        let outcome = guarded::subtransaction(|| {
            Spi::connect_mut(|client| -> SpiResult<()> {
                let call = format!(
                    "SELECT {}($1::text::amqp.produced, $2::text::amqp.receipt)",
                    due.function
                );
                let args: [DatumWithOid; 2] = [
                    due.original.as_deref().into(),
                    due.failure.as_deref().into(),
                ];
                guarded::as_owner(due.owner, handler_timeout, || {
                    client.update(&call, None, &args).map(|_| ())
                })?;
                mark_done(client, &due)
            })
            .unwrap_or_else(|e| pgrx::error!("amqp_outbox: {e}"))
        });
        let recorded = match outcome {
            Ok(()) => {
                log!(
                    "amqp_outbox: compensated message {} for consumer \"{}\"",
                    due.message_id,
                    due.consumer
                );
                Ok(())
            }
            Err(caught) => record_failure(&due, &caught, backoff),
        };
        if let Err(e) = recorded {
            warning!("amqp_outbox: recording a compensation failed: {e}");
        }
        true
    })
}

fn next_due(client: &mut SpiClient<'_>) -> SpiResult<Option<Due>> {
    let table = client.update(
        "SELECT c.message_id, c.consumer, c.attempts, \
                quote_ident(n.nspname) || '.' || quote_ident(p.proname), h.owner::oid, \
                (SELECT x::text FROM amqp.produced x \
                  WHERE x.message_id = c.message_id AND x.message_at = c.message_at LIMIT 1), \
                (SELECT r::text FROM amqp.receipt r \
                  WHERE r.message_id = c.message_id AND r.message_at = c.message_at \
                    AND r.consumer = c.consumer AND r.status <> 'ok' \
                  ORDER BY r.received_at DESC LIMIT 1) \
           FROM amqp.compensation c \
           JOIN amqp.compensation_handler h ON h.business_type = c.business_type \
           JOIN pg_proc p ON p.oid = h.handler \
           JOIN pg_namespace n ON n.oid = p.pronamespace \
          WHERE c.state = 'pending' AND c.next_attempt_at <= clock_timestamp() \
          ORDER BY c.next_attempt_at \
          LIMIT 1 \
            FOR UPDATE OF c SKIP LOCKED",
        None,
        &[],
    )?;
    let mut out = None;
    for r in table {
        out = Some(Due {
            message_id: r.get::<String>(1)?.unwrap_or_default(),
            consumer: r.get::<String>(2)?.unwrap_or_default(),
            attempts: r.get::<i32>(3)?.unwrap_or_default(),
            function: r.get::<String>(4)?.unwrap_or_default(),
            owner: r.get::<pg_sys::Oid>(5)?.unwrap_or(pg_sys::InvalidOid),
            original: r.get::<String>(6)?,
            failure: r.get::<String>(7)?,
        });
    }
    Ok(out)
}

/// In the compensation's subtransaction, after the handler returned: done, counted.
fn mark_done(client: &mut SpiClient<'_>, due: &Due) -> SpiResult<()> {
    let args: [DatumWithOid; 2] = [due.message_id.as_str().into(), due.consumer.as_str().into()];
    client.update(
        "WITH c AS ( \
            UPDATE amqp.compensation \
               SET state = 'done', done_at = clock_timestamp(), attempts = attempts + 1 \
             WHERE message_id = $1 AND consumer = $2 \
            RETURNING message_at, business_type) \
         SELECT amqp._count(amqp._day(message_at), business_type, 'compensated', 1) FROM c",
        None,
        &args,
    )?;
    Ok(())
}

/// The handler raised: one more attempt, the error kept, the next try after the backoff.
fn record_failure(due: &Due, caught: &Caught, backoff: &Backoff) -> Result<(), String> {
    let delay = backoff.delay(u32::try_from(due.attempts).unwrap_or(0));
    warning!(
        "amqp_outbox: compensation of message {} for consumer \"{}\" failed (attempt {}), retried in {:.1} s: {} (SQLSTATE {})",
        due.message_id,
        due.consumer,
        due.attempts + 1,
        delay.as_secs_f64(),
        caught.message,
        caught.sqlstate
    );
    let text = format!("{} (SQLSTATE {})", caught.message, caught.sqlstate);
    let args: [DatumWithOid; 4] = [
        due.message_id.as_str().into(),
        due.consumer.as_str().into(),
        text.as_str().into(),
        i64::try_from(delay.as_micros()).unwrap_or(i64::MAX).into(),
    ];
    Spi::connect_mut(|client| -> SpiResult<()> {
        client.update(
            "UPDATE amqp.compensation \
                SET attempts = attempts + 1, last_error = $3, \
                    next_attempt_at = clock_timestamp() + $4 * interval '1 microsecond' \
              WHERE message_id = $1 AND consumer = $2",
            None,
            &args,
        )?;
        Ok(())
    })
    .map_err(|e| e.to_string())
}
