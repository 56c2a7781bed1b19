//! Compensations, each in its own transaction: the handler runs as its owner in a
//! subtransaction that keeps its effects and the "done" mark together, so a compensation
//! happens at most once and is retried with backoff until it does. Each attempt is counted, and
//! the next one set, before the function runs; a function that does not return ends the monitor
//! at its hard deadline (twice `handler_timeout`), and costs that compensation one backoff. One whose consumer has
//! answered ok since (or whose message completed) is never run: the monitor cancels it, and the
//! statement that takes it checks again with the row locked. Errors are caught and logged:
//! nothing a user stores in a handler ends the monitor.

use crate::inbox::guarded::{self, Caught};
use crate::watchdog;
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

/// What makes a pending compensation still due to run: the consumer's latest answer is not ok
/// (an ok since its failure cancels it) and its message did not complete. Checked when it is
/// taken and again, with it locked, right before its function runs.
const STILL_DUE: &str = "c.state = 'pending' \
    AND coalesce((SELECT r.status FROM amqp.receipt r \
                   WHERE r.message_id = c.message_id AND r.message_at = c.message_at \
                     AND r.consumer = c.consumer \
                   ORDER BY r.received_at DESC LIMIT 1), 'failed') <> 'ok' \
    AND NOT EXISTS (SELECT FROM amqp.produced x \
                     WHERE x.message_id = c.message_id AND x.message_at = c.message_at \
                       AND x.outcome = 'complete')";

/// Runs the oldest due compensation, if any. Returns whether there was one.
pub(super) fn compensate_one(backoff: &Backoff, handler_timeout: Duration) -> bool {
    // The attempt is counted, and the next one set, in a transaction of its own before the
    // function runs: a function that never returns (the monitor is then ended at its hard
    // deadline) or a crash during it costs that compensation one backoff, not every round.
    let claimed = pg::transaction("amqp_outbox compensation", || {
        if !guarded::message_table_first() {
            return Ok(None);
        }
        guarded::subtransaction(|| {
            Spi::connect_mut(|c| claim(c, backoff))
                .unwrap_or_else(|e| pgrx::error!("amqp_outbox: {e}"))
        })
    });
    let (due, delay) = match claimed {
        Ok(Some(claimed)) => claimed,
        Ok(None) => return false,
        Err(e) => {
            warning!(
                "amqp_outbox: reading due compensations failed: {}",
                e.message
            );
            return false;
        }
    };
    pg::transaction("amqp_outbox compensation", || {
        if !guarded::message_table_first() {
            return;
        }
        let outcome = guarded::subtransaction(|| {
            Spi::connect_mut(|client| -> SpiResult<bool> {
                if !still_due(client, &due)? {
                    return Ok(false);
                }
                let call = format!(
                    "SELECT {}($1::text::amqp.produced, $2::text::amqp.receipt)",
                    due.function
                );
                let args: [DatumWithOid; 2] = [
                    due.original.as_deref().into(),
                    due.failure.as_deref().into(),
                ];
                let _watched = watchdog::Watched::function(handler_timeout);
                guarded::as_owner(due.owner, handler_timeout, || {
                    client.update(&call, None, &args).map(|_| ())
                })?;
                mark_done(client, &due)?;
                Ok(true)
            })
            .unwrap_or_else(|e| pgrx::error!("amqp_outbox: {e}"))
        });
        let recorded = match outcome {
            Ok(true) => {
                log!(
                    "amqp_outbox: compensated message {} for consumer \"{}\"",
                    due.message_id,
                    due.consumer
                );
                Ok(())
            }
            Ok(false) => Ok(()),
            Err(caught) => record_failure(&due, &caught, delay),
        };
        if let Err(e) = recorded {
            warning!("amqp_outbox: recording a compensation failed: {e}");
        }
    });
    true
}

/// Takes the oldest due compensation: its attempt counted, its next one set after the
/// backoff. Returns it with that delay.
fn claim(client: &mut SpiClient<'_>, backoff: &Backoff) -> SpiResult<Option<(Due, Duration)>> {
    let Some(due) = next_due(client)? else {
        return Ok(None);
    };
    let delay = backoff.delay(u32::try_from(due.attempts).unwrap_or(0));
    let args: [DatumWithOid; 3] = [
        due.message_id.as_str().into(),
        due.consumer.as_str().into(),
        i64::try_from(delay.as_micros()).unwrap_or(i64::MAX).into(),
    ];
    client.update(
        "UPDATE amqp.compensation \
            SET attempts = attempts + 1, \
                next_attempt_at = clock_timestamp() + $3 * interval '1 microsecond' \
          WHERE message_id = $1 AND consumer = $2",
        None,
        &args,
    )?;
    Ok(Some((due, delay)))
}

/// Whether the claimed compensation is still due (not cancelled meanwhile), locking it until
/// the function's transaction ends.
fn still_due(client: &mut SpiClient<'_>, due: &Due) -> SpiResult<bool> {
    let args: [DatumWithOid; 2] = [due.message_id.as_str().into(), due.consumer.as_str().into()];
    let sql = format!(
        "SELECT true FROM amqp.compensation c \
          WHERE c.message_id = $1 AND c.consumer = $2 AND {STILL_DUE} \
            FOR UPDATE OF c"
    );
    Ok(!client.update(&sql, None, &args)?.is_empty())
}

fn next_due(client: &mut SpiClient<'_>) -> SpiResult<Option<Due>> {
    let sql = format!(
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
           JOIN pg_proc p ON p.oid = to_regprocedure(h.handler) \
           JOIN pg_namespace n ON n.oid = p.pronamespace \
          WHERE c.next_attempt_at <= clock_timestamp() AND {STILL_DUE} \
          ORDER BY c.next_attempt_at \
          LIMIT 1 \
            FOR UPDATE OF c SKIP LOCKED"
    );
    let table = client.update(&sql, None, &[])?;
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
               SET state = 'done', done_at = clock_timestamp() \
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

/// The function raised: the error kept (the attempt was counted, and the next one set, when it
/// was taken).
fn record_failure(due: &Due, caught: &Caught, delay: Duration) -> Result<(), String> {
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
    let args: [DatumWithOid; 3] = [
        due.message_id.as_str().into(),
        due.consumer.as_str().into(),
        text.as_str().into(),
    ];
    Spi::connect_mut(|client| -> SpiResult<()> {
        client.update(
            "UPDATE amqp.compensation SET last_error = $3 WHERE message_id = $1 AND consumer = $2",
            None,
            &args,
        )?;
        Ok(())
    })
    .map_err(|e| e.to_string())
}
