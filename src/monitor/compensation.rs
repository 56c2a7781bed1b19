//! Compensations, each in its own transaction: the handler runs as its owner in a
//! subtransaction that keeps its effects and the "done" mark together, so a compensation
//! happens at most once and is retried with backoff until it does. One whose consumer has
//! answered ok since (or whose message completed) is never run: the monitor cancels it, and the
//! statement that takes it checks again with the row locked. Errors are caught and logged:
//! nothing a user stores in a handler ends the monitor.

use crate::inbox::guarded::{self, Caught};
use crate::worker::pg;
use amqp_outbox_broker::backoff::Backoff;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::{SpiClient, SpiResult};
use std::time::Duration;

/// A compensation due now, as the monitor read it.
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

/// Runs the oldest due compensation, if any. Returns whether there was one.
pub(super) fn compensate_one(backoff: &Backoff, handler_timeout: Duration) -> bool {
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
            AND coalesce((SELECT r.status FROM amqp.receipt r \
                           WHERE r.message_id = c.message_id AND r.message_at = c.message_at \
                             AND r.consumer = c.consumer \
                           ORDER BY r.received_at DESC LIMIT 1), 'failed') <> 'ok' \
            AND NOT EXISTS (SELECT FROM amqp.produced x \
                             WHERE x.message_id = c.message_id AND x.message_at = c.message_at \
                               AND x.outcome = 'complete') \
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

/// In the compensation's subtransaction, after the handler returned: done, counted, and the
/// message looked at again by the next pass (it may be finished now).
fn mark_done(client: &mut SpiClient<'_>, due: &Due) -> SpiResult<()> {
    let args: [DatumWithOid; 2] = [due.message_id.as_str().into(), due.consumer.as_str().into()];
    client.update(
        "WITH c AS ( \
            UPDATE amqp.compensation \
               SET state = 'done', done_at = clock_timestamp(), attempts = attempts + 1 \
             WHERE message_id = $1 AND consumer = $2 \
            RETURNING message_id, message_at, business_type), \
         again AS ( \
            UPDATE amqp.produced p SET check_at = clock_timestamp() \
              FROM c WHERE p.message_id = c.message_id AND p.message_at = c.message_at \
               AND p.completed_at IS NULL) \
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
