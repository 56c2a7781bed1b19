//! Compensations through SPI (the engine's [`amqp_outbox_engine::monitor`] decides when):
//! taken and counted in a transaction of their own, then run as the handler's owner in a
//! subtransaction with their "done" mark. A function that does not return ends the monitor at
//! its hard deadline (twice `handler_timeout`, see [`watchdog`]) and costs that compensation
//! one backoff.

use crate::inbox::guarded::{self, Caught};
use crate::watchdog;
use crate::worker::pg;
use amqp_outbox_engine::monitor::{
    Due, CLAIM_COMPENSATION_SQL, COMPENSATION_FAILED_SQL, MARK_COMPENSATED_SQL,
    NEXT_COMPENSATION_SQL, STILL_DUE_SQL,
};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::{SpiClient, SpiResult};
use std::time::Duration;

/// Takes the oldest due compensation: its attempt counted, its next one set after
/// `delay(attempts)`, committed.
pub(super) fn claim(delay: &dyn Fn(i32) -> Duration) -> Result<Option<Due>, String> {
    pg::transaction("amqp_outbox compensation", || {
        if !guarded::message_table_first() {
            return Ok(None);
        }
        guarded::subtransaction(|| {
            Spi::connect_mut(|c| take(c, delay))
                .unwrap_or_else(|e| pgrx::error!("amqp_outbox: {e}"))
        })
        .map_err(|e| e.message)
    })
}

fn take(client: &mut SpiClient<'_>, delay: &dyn Fn(i32) -> Duration) -> SpiResult<Option<Due>> {
    let Some(due) = next_due(client)? else {
        return Ok(None);
    };
    let micros = i64::try_from(delay(due.attempts).as_micros()).unwrap_or(i64::MAX);
    let args: [DatumWithOid; 3] = [
        due.message_id.as_str().into(),
        due.consumer.as_str().into(),
        micros.into(),
    ];
    client.update(CLAIM_COMPENSATION_SQL, None, &args)?;
    Ok(Some(due))
}

fn next_due(client: &mut SpiClient<'_>) -> SpiResult<Option<Due>> {
    let table = client.update(NEXT_COMPENSATION_SQL, None, &[])?;
    let mut out = None;
    for r in table {
        out = Some(Due {
            message_id: r.get::<String>(1)?.unwrap_or_default(),
            consumer: r.get::<String>(2)?.unwrap_or_default(),
            attempts: r.get::<i32>(3)?.unwrap_or_default(),
            function: r.get::<String>(4)?.unwrap_or_default(),
            function_oid: r.get::<pg_sys::Oid>(5)?.map_or(0, |o| o.to_u32()),
            owner: r.get::<pg_sys::Oid>(6)?.map_or(0, |o| o.to_u32()),
            original: r.get::<String>(7)?,
            failure: r.get::<String>(8)?,
        });
    }
    Ok(out)
}

/// Runs the compensation if it is still due; `Err` when its function (or the mark) raised.
pub(super) fn compensate(due: &Due, timeout: Duration) -> Result<bool, Caught> {
    pg::transaction("amqp_outbox compensation", || {
        if !guarded::message_table_first() {
            return Ok(false);
        }
        guarded::subtransaction(|| {
            Spi::connect_mut(|client| -> SpiResult<bool> {
                let key: [DatumWithOid; 2] =
                    [due.message_id.as_str().into(), due.consumer.as_str().into()];
                if client.update(STILL_DUE_SQL, None, &key)?.is_empty() {
                    return Ok(false);
                }
                let call = due.call();
                let args: [DatumWithOid; 2] = [
                    due.original.as_deref().into(),
                    due.failure.as_deref().into(),
                ];
                let _watched = watchdog::Watched::function(timeout);
                guarded::as_owner(pg_sys::Oid::from(due.owner), timeout, || {
                    client.update(&call, None, &args).map(|_| ())
                })?;
                let key: [DatumWithOid; 2] =
                    [due.message_id.as_str().into(), due.consumer.as_str().into()];
                client.update(MARK_COMPENSATED_SQL, None, &key)?;
                Ok(true)
            })
            .unwrap_or_else(|e| pgrx::error!("amqp_outbox: {e}"))
        })
    })
}

/// The function raised: its error kept (the attempt was counted, and the next one set, when it
/// was taken).
pub(super) fn failed(due: &Due, error: &str) -> Result<(), String> {
    pg::transaction("amqp_outbox compensation", || {
        let args: [DatumWithOid; 3] = [
            due.message_id.as_str().into(),
            due.consumer.as_str().into(),
            error.into(),
        ];
        Spi::connect_mut(|client| -> SpiResult<()> {
            client.update(COMPENSATION_FAILED_SQL, None, &args)?;
            Ok(())
        })
        .map_err(|e| e.to_string())
    })
}
