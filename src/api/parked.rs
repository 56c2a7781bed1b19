//! What an operator does with parked messages: retry them, or discard them on purpose (kept in
//! `amqp.discarded`, never silently). The same for delayed messages not due yet: retry sends
//! one now, discard cancels it.

use super::run_as::{current_role_name, extension_owner, RunAs};
use crate::commit_wake;
use crate::error::{OrRaise, OutboxError};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;

const RETRY_SQL: &str = "\
UPDATE amqp.message SET parked_at = NULL, attempts = 0, next_attempt_at = NULL \
 WHERE parked_at IS NOT NULL AND id OPERATOR(pg_catalog.=) $1 \
RETURNING id";

const RETRY_BROKER_SQL: &str = "\
UPDATE amqp.message SET parked_at = NULL, attempts = 0, next_attempt_at = NULL \
 WHERE parked_at IS NOT NULL AND broker_id OPERATOR(pg_catalog.=) $1 \
RETURNING id";

/// Removes a message for good from `table` (`message`: only a parked one; `scheduled_message`:
/// a delayed one not due yet) and records it in `amqp.discarded` with who, when and why. Built
/// from constants only; the values are parameters.
fn discard_sql(table: &str, condition: &str) -> String {
    let columns = crate::scheduled_move::COLUMNS;
    format!(
        "WITH gone AS (DELETE FROM amqp.{table} \
                        WHERE {condition} id OPERATOR(pg_catalog.=) $1 RETURNING *) \
         INSERT INTO amqp.discarded ({columns}, discarded_at, discarded_by, reason) \
         SELECT {columns}, pg_catalog.now(), $3::pg_catalog.name, $2 FROM gone \
         RETURNING id"
    )
}

/// Moves a delayed message into the outbox now: 1 when it was scheduled, 0 when not. As the
/// extension's owner: admins may not insert into `amqp.message` themselves.
fn send_scheduled_now(id: i64) -> usize {
    if !crate::scheduled_move::tables_present() {
        return 0;
    }
    let _as_owner = RunAs::new(extension_owner());
    run(crate::scheduled_move::move_sql(), &[vec![id].into()])
}

fn run(sql: &str, args: &[DatumWithOid]) -> usize {
    match Spi::connect_mut(|client| client.update(sql, None, args).map(|t| t.len())) {
        Ok(n) => n,
        Err(e) => error!("amqp_outbox: {e}"),
    }
}

/// Makes a parked message eligible again (attempts back to 0), or a delayed one due now; it
/// goes out after commit.
#[pg_extern(volatile, parallel_unsafe)]
fn retry(message_id: Option<i64>) -> bool {
    let id = message_id
        .ok_or(OutboxError::NullArgument("message_id"))
        .or_raise();
    if run(RETRY_SQL, &[id.into()]) == 0 && send_scheduled_now(id) == 0 {
        OutboxError::NotParked(id).raise();
    }
    commit_wake::wake_worker_at_commit();
    true
}

/// Retries every parked message of a broker; returns how many.
#[pg_extern(volatile, parallel_unsafe)]
fn retry_all(broker_id: Option<i32>) -> i64 {
    let broker_id = broker_id
        .ok_or(OutboxError::NullArgument("broker_id"))
        .or_raise();
    let n = run(RETRY_BROKER_SQL, &[broker_id.into()]);
    commit_wake::wake_worker_at_commit();
    n as i64
}

/// Removes a parked message for good, or cancels a delayed one, recording it in `amqp.discarded`
/// with who, when and why.
#[pg_extern(volatile, parallel_unsafe)]
fn discard(message_id: Option<i64>, reason: default!(Option<&str>, "NULL")) -> bool {
    let id = message_id
        .ok_or(OutboxError::NullArgument("message_id"))
        .or_raise();
    // Admins may discard without any right on amqp.discarded (they must not forge its rows):
    // the one fixed statement runs as the extension's owner, recording the caller.
    let by = current_role_name();
    let discarded = {
        let _as_owner = RunAs::new(extension_owner());
        let args = [id.into(), reason.into(), by.into()];
        match run(&discard_sql("message", "parked_at IS NOT NULL AND"), &args) {
            0 if crate::scheduled_move::tables_present() => {
                run(&discard_sql("scheduled_message", ""), &args)
            }
            n => n,
        }
    };
    if discarded == 0 {
        OutboxError::NotParked(id).raise();
    }
    true
}
