//! Declarations the worker makes on each connection: exchanges (pg_amqp's
//! `amqp.exchange_declare`), queues and bindings. Recorded in tables, transactionally; the
//! worker re-reads them when a transaction that changed them commits.

use super::jsonb_arg::JsonbArg;
use crate::commit_wake;
use crate::error::{OrRaise, OutboxError};
use crate::headers::Unsendable;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;

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
    record(UPSERT_EXCHANGE_SQL, broker_id, &args);
    true
}

fn check_name(value: Option<&str>, what: &'static str) -> Result<(), OutboxError> {
    match value {
        None => Err(OutboxError::NullArgument(what)),
        Some("") => Err(OutboxError::EmptyName(what)),
        Some(v) if v.len() > 255 => Err(OutboxError::TooLong {
            what,
            bytes: v.len(),
        }),
        Some(_) => Ok(()),
    }
}

/// The arguments' jsonb text, checked as the worker will read them: a JSON object whose values
/// AMQP can carry (see `crate::headers`).
fn arguments_object(arguments: Option<JsonbArg>) -> Result<String, OutboxError> {
    let Some(JsonbArg(text)) = arguments else {
        return Ok("{}".into());
    };
    let map = crate::headers::parse_object(&text).map_err(|e| match e {
        Unsendable::NotObject(_) => OutboxError::InvalidArguments,
        other => OutboxError::InvalidArgumentValues(other.to_string()),
    })?;
    amqp_outbox_broker::header_table_size(&map).map_err(OutboxError::InvalidArgumentValues)?;
    Ok(text)
}

/// Runs an upsert that returns true, or nothing when the broker does not exist.
fn record(sql: &str, broker_id: i32, args: &[DatumWithOid]) {
    let done = Spi::connect_mut(|client| {
        let table = client.update(sql, None, args)?;
        // No row back means the broker does not exist (the upsert's WHERE EXISTS).
        if table.is_empty() {
            return Ok(None);
        }
        table.first().get_one::<bool>()
    });
    match done {
        Ok(Some(true)) => {}
        Ok(_) => OutboxError::UnknownBroker(broker_id).raise(),
        Err(e) => error!("amqp_outbox: could not record the declaration: {e}"),
    }
    commit_wake::reload_worker_at_commit();
}

const UPSERT_QUEUE_SQL: &str = "\
INSERT INTO amqp.queue (broker_id, queue, durable, auto_delete, arguments) \
SELECT $1, $2, $3, $4, $5::pg_catalog.jsonb \
 WHERE EXISTS (SELECT FROM amqp.broker b WHERE b.broker_id OPERATOR(pg_catalog.=) $1) \
ON CONFLICT (broker_id, queue) DO UPDATE \
   SET durable = excluded.durable, auto_delete = excluded.auto_delete, \
       arguments = excluded.arguments, declared_at = pg_catalog.now() \
RETURNING true";

/// Records a queue the worker declares on every connection to the broker. `arguments` are
/// queue arguments, e.g. `{"x-queue-type": "quorum"}` or `{"x-dead-letter-exchange": "dlx"}`.
#[pg_extern(volatile, parallel_unsafe)]
fn queue_declare(
    broker_id: Option<i32>,
    queue: Option<&str>,
    durable: default!(Option<bool>, "true"),
    auto_delete: default!(Option<bool>, "false"),
    arguments: default!(Option<JsonbArg>, "NULL"),
) -> bool {
    let broker_id = broker_id
        .ok_or(OutboxError::NullArgument("broker_id"))
        .or_raise();
    check_name(queue, "queue").or_raise();
    let arguments = arguments_object(arguments).or_raise();
    let args: [DatumWithOid; 5] = [
        broker_id.into(),
        queue.into(),
        durable.unwrap_or(true).into(),
        auto_delete.unwrap_or(false).into(),
        arguments.into(),
    ];
    record(UPSERT_QUEUE_SQL, broker_id, &args);
    true
}

const UPSERT_BINDING_SQL: &str = "\
INSERT INTO amqp.binding (broker_id, queue, exchange, routing_key, arguments) \
SELECT $1, $2, $3, $4, $5::pg_catalog.jsonb \
 WHERE EXISTS (SELECT FROM amqp.broker b WHERE b.broker_id OPERATOR(pg_catalog.=) $1) \
ON CONFLICT (broker_id, queue, exchange, routing_key) DO UPDATE \
   SET arguments = excluded.arguments, declared_at = pg_catalog.now() \
RETURNING true";

/// Records a binding of `queue` to `exchange` the worker declares on every connection.
#[pg_extern(volatile, parallel_unsafe)]
fn queue_bind(
    broker_id: Option<i32>,
    queue: Option<&str>,
    exchange: Option<&str>,
    routing_key: default!(Option<&str>, "''"),
    arguments: default!(Option<JsonbArg>, "NULL"),
) -> bool {
    let broker_id = broker_id
        .ok_or(OutboxError::NullArgument("broker_id"))
        .or_raise();
    check_name(queue, "queue").or_raise();
    check_name(exchange, "exchange").or_raise();
    let routing_key = routing_key.unwrap_or("");
    if routing_key.len() > 255 {
        OutboxError::TooLong {
            what: "routing_key",
            bytes: routing_key.len(),
        }
        .raise();
    }
    let arguments = arguments_object(arguments).or_raise();
    let args: [DatumWithOid; 5] = [
        broker_id.into(),
        queue.into(),
        exchange.into(),
        routing_key.into(),
        arguments.into(),
    ];
    record(UPSERT_BINDING_SQL, broker_id, &args);
    true
}
