//! pg_amqp's other functions, with semantics that fit an outbox, and worker controls.

use crate::commit_wake;
use crate::error::{OrRaise, OutboxError};
use crate::shmem;
use pgrx::heap_tuple::{PgHeapTuple, PgHeapTupleError};
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;
use pgrx::AllocatedByPostgres;

/// pg_amqp closed the session's own connection. Sessions here have none (the worker publishes),
/// so this asks the worker to close and reopen its connection to the broker, for example after
/// the broker's configuration changed outside PostgreSQL.
#[pg_extern(volatile, parallel_unsafe)]
fn disconnect(broker_id: Option<i32>) {
    let broker_id = broker_id
        .ok_or(OutboxError::NullArgument("broker_id"))
        .or_raise();
    let known = Spi::get_one_with_args::<bool>(
        "SELECT EXISTS (SELECT FROM amqp.broker WHERE broker_id OPERATOR(pg_catalog.=) $1)",
        &[broker_id.into()],
    );
    if !matches!(known, Ok(Some(true))) {
        OutboxError::UnknownBroker(broker_id).raise();
    }
    shmem::request_disconnect(broker_id);
}

/// Wakes the worker now (it is woken at every commit that published anyway).
#[pg_extern(volatile, parallel_unsafe)]
fn wake() {
    shmem::wake_worker();
}

/// Trigger on the configuration tables: the worker re-reads them after the commit.
#[pg_trigger]
fn _config_changed<'a>(
    trigger: &'a pgrx::PgTrigger<'a>,
) -> Result<Option<PgHeapTuple<'a, AllocatedByPostgres>>, PgHeapTupleError> {
    commit_wake::reload_worker_at_commit();
    // Sessions keep the list of broker ids that publish() checks against (known_brokers).
    if let Ok(table) = trigger.relation() {
        super::known_brokers::invalidate(table.oid());
    }
    if trigger.table_name().is_ok_and(|t| t == "subscription") {
        commit_wake::subscriptions_written();
    }
    Ok(None)
}

/// Trigger on `amqp.scheduled_message`: whoever wrote it (a delayed publish, a restore, an
/// admin's UPDATE of `deliver_at`), the worker learns after the commit when the earliest is due.
#[pg_trigger]
fn _scheduled_changed<'a>(
    _trigger: &'a pgrx::PgTrigger<'a>,
) -> Result<Option<PgHeapTuple<'a, AllocatedByPostgres>>, PgHeapTupleError> {
    commit_wake::look_at_scheduled_at_commit();
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
