//! What an operator does with parked messages: retry them, or discard them on purpose (kept in
//! `amqp.discarded`, never silently).

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

const DISCARD_SQL: &str = "\
WITH gone AS (DELETE FROM amqp.message \
               WHERE parked_at IS NOT NULL AND id OPERATOR(pg_catalog.=) $1 RETURNING *) \
INSERT INTO amqp.discarded SELECT gone.*, pg_catalog.now(), CURRENT_USER, $2 FROM gone \
RETURNING id";

fn run(sql: &str, args: &[DatumWithOid]) -> usize {
    match Spi::connect_mut(|client| client.update(sql, None, args).map(|t| t.len())) {
        Ok(n) => n,
        Err(e) => error!("amqp_outbox: {e}"),
    }
}

/// Makes a parked message eligible again (attempts back to 0); it goes out after commit.
#[pg_extern(volatile, parallel_unsafe)]
fn retry(message_id: Option<i64>) -> bool {
    let id = message_id
        .ok_or(OutboxError::NullArgument("message_id"))
        .or_raise();
    if run(RETRY_SQL, &[id.into()]) == 0 {
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

/// Removes a parked message for good, recording it in `amqp.discarded` with who, when and why.
#[pg_extern(volatile, parallel_unsafe)]
fn discard(message_id: Option<i64>, reason: default!(Option<&str>, "NULL")) -> bool {
    let id = message_id
        .ok_or(OutboxError::NullArgument("message_id"))
        .or_raise();
    if run(DISCARD_SQL, &[id.into(), reason.into()]) == 0 {
        OutboxError::NotParked(id).raise();
    }
    true
}
