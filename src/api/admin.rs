//! pg_amqp's other functions, with semantics that fit an outbox, and worker controls.

use crate::commit_wake;
use crate::error::{OrRaise, OutboxError};
use crate::shmem;
use pgrx::datum::DatumWithOid;
use pgrx::heap_tuple::{PgHeapTuple, PgHeapTupleError};
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;
use pgrx::AllocatedByPostgres;

const EXCHANGE_TYPES: [&str; 4] = ["direct", "fanout", "topic", "headers"];

const UPSERT_EXCHANGE_SQL: &str = "\
INSERT INTO amqp.exchange (broker_id, exchange, exchange_type, passive, durable, auto_delete) \
SELECT $1, $2, $3, $4, $5, $6 \
 WHERE EXISTS (SELECT FROM amqp.broker b WHERE b.broker_id OPERATOR(pg_catalog.=) $1) \
ON CONFLICT (broker_id, exchange) DO UPDATE \
   SET exchange_type = excluded.exchange_type, passive = excluded.passive, \
       durable = excluded.durable, auto_delete = excluded.auto_delete, \
       declared_at = pg_catalog.now() \
RETURNING true";

/// pg_amqp's signature. Records the declaration in `amqp.exchange` (transactionally: it counts
/// only if the caller commits); the worker declares it on every connection to that broker,
/// before it publishes there.
#[pg_extern(volatile, parallel_unsafe)]
fn exchange_declare(
    broker_id: Option<i32>,
    exchange: Option<&str>,
    exchange_type: Option<&str>,
    passive: Option<bool>,
    durable: Option<bool>,
    auto_delete: default!(Option<bool>, "false"),
) -> bool {
    let broker_id = broker_id
        .ok_or(OutboxError::NullArgument("broker_id"))
        .or_raise();
    let exchange = exchange
        .ok_or(OutboxError::NullArgument("exchange"))
        .or_raise();
    let exchange_type = exchange_type.unwrap_or("direct");
    if exchange.is_empty() {
        OutboxError::EmptyExchangeName.raise();
    }
    if exchange.len() > 255 {
        OutboxError::TooLong {
            what: "exchange",
            bytes: exchange.len(),
        }
        .raise();
    }
    if !EXCHANGE_TYPES.contains(&exchange_type) {
        OutboxError::InvalidExchangeType(exchange_type.to_string()).raise();
    }
    let args: [DatumWithOid; 6] = [
        broker_id.into(),
        exchange.into(),
        exchange_type.into(),
        passive.unwrap_or(false).into(),
        durable.unwrap_or(true).into(),
        auto_delete.unwrap_or(false).into(),
    ];
    let done = Spi::connect_mut(|client| {
        client
            .update(UPSERT_EXCHANGE_SQL, None, &args)?
            .first()
            .get_one::<bool>()
    });
    match done {
        Ok(Some(true)) => {}
        Ok(_) => OutboxError::UnknownBroker(broker_id).raise(),
        Err(e) => error!("amqp_outbox: could not record the exchange declaration: {e}"),
    }
    commit_wake::reload_worker_at_commit();
    true
}

/// pg_amqp closed the session's own connection. Sessions here have none (the worker publishes),
/// so this asks the worker to close and reopen its connection to the broker, for example after
/// the broker's configuration changed outside PostgreSQL.
#[pg_extern(volatile, parallel_unsafe)]
fn disconnect(broker_id: Option<i32>) {
    let broker_id = broker_id
        .ok_or(OutboxError::NullArgument("broker_id"))
        .or_raise();
    shmem::request_disconnect(broker_id);
}

/// Wakes the worker now (it is woken at every commit that published anyway).
#[pg_extern(volatile, parallel_unsafe)]
fn wake() {
    shmem::wake_worker();
}

/// Trigger on amqp.broker and amqp.exchange: the worker re-reads them after the commit.
#[pg_trigger]
fn _config_changed<'a>(
    _trigger: &'a pgrx::PgTrigger<'a>,
) -> Result<Option<PgHeapTuple<'a, AllocatedByPostgres>>, PgHeapTupleError> {
    commit_wake::reload_worker_at_commit();
    Ok(None)
}

/// pg_amqp sent this at once, outside the caller's transaction, and lost it when the broker was
/// unreachable. An outbox has no such path: a message that must survive the caller's rollback
/// needs its own transaction, and backends never talk to the broker here.
#[pg_extern(volatile, parallel_unsafe)]
#[allow(clippy::too_many_arguments, unused_variables)]
fn autonomous_publish(
    broker_id: Option<i32>,
    exchange: Option<&str>,
    routing_key: Option<&str>,
    message: Option<&str>,
    delivery_mode: default!(Option<i32>, "NULL"),
    content_type: default!(Option<&str>, "NULL"),
    reply_to: default!(Option<&str>, "NULL"),
    correlation_id: default!(Option<&str>, "NULL"),
) -> bool {
    ErrorReport::new(
        PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
        "amqp_outbox: amqp.autonomous_publish() is not supported",
        "amqp_outbox",
    )
    .set_hint(
        "Use amqp.publish(): the message is delivered when your transaction commits. To send \
         whatever the outcome, publish in a transaction of its own.",
    )
    .report(PgLogLevel::ERROR);
    false
}
