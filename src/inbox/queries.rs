//! The subscription worker's and the lanes' statements through SPI: the engine's texts
//! ([`amqp_outbox_engine::consume::statements`]) bound here, and the lanes' own. Values are
//! always bound parameters; the one statement with a name in its text (the handler call) takes
//! it from PostgreSQL's own quoting (`format('%I.%I')`), never from a value.

use crate::worker::queries::run_kept;
use amqp_outbox_engine::consume::book::BookRow;
use amqp_outbox_engine::consume::handling::FailedRecord;
use amqp_outbox_engine::consume::message::{Message, Ordering, Sub};
use amqp_outbox_engine::consume::statements as sql;
use amqp_outbox_engine::outbox::Caught;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::{SpiClient, SpiResult};

pub fn load_subscriptions(client: &SpiClient<'_>) -> SpiResult<Vec<Sub>> {
    let rows = client.select(sql::SUBSCRIPTIONS_SQL, None, &[])?;
    let mut out = Vec::new();
    for r in rows {
        let problem = r.get::<String>(10)?;
        let handler = match (r.get::<String>(8)?, r.get::<pg_sys::Oid>(9)?) {
            (Some(f), Some(oid)) if problem.is_none() => Some((f, oid.to_u32())),
            _ => None,
        };
        out.push(Sub {
            name: r.get::<String>(1)?.unwrap_or_default(),
            broker_id: r.get::<i32>(2)?.unwrap_or_default(),
            queue: r.get::<String>(3)?.unwrap_or_default(),
            prefetch: u16::try_from(r.get::<i32>(4)?.unwrap_or(100)).unwrap_or(100),
            max_attempts: r.get::<i32>(5)?.unwrap_or(10),
            dead_letter_exchange: r.get::<String>(6)?,
            owner: r.get::<pg_sys::Oid>(7)?.map_or(0, |o| o.to_u32()),
            handler,
            problem,
            parallelism: usize::try_from(r.get::<i32>(11)?.unwrap_or(1))
                .unwrap_or(1)
                .clamp(1, crate::shmem::MAX_LANES),
            ordering: Ordering::parse(r.get::<&str>(12)?.unwrap_or("none")),
        });
    }
    Ok(out)
}

/// The names of the subscriptions that exist now (paused ones included).
pub fn subscription_names(client: &SpiClient<'_>) -> SpiResult<Vec<String>> {
    client
        .select(sql::SUBSCRIPTION_NAMES_SQL, None, &[])?
        .map(|r| r.get::<String>(1).map(Option::unwrap_or_default))
        .collect()
}

/// Why the subscription's handler cannot run as its owner now, if it cannot (it was dropped, or
/// its owner was, or lost the right to execute it, since the subscription was last read).
pub fn runs_as_problem(client: &SpiClient<'_>, subscription: &str) -> SpiResult<Option<String>> {
    client
        .select(sql::RUNS_AS_PROBLEM_SQL, Some(1), &[subscription.into()])?
        .first()
        .get::<String>(1)
}

/// `consume_once(subscription, message_id)`: false for a duplicate.
pub fn consume_once(client: &mut SpiClient<'_>, sub: &str, message_id: &str) -> SpiResult<bool> {
    let consumer = sql::consumer_name(sub);
    let args: [DatumWithOid; 2] = [consumer.as_str().into(), message_id.into()];
    run_kept(client, sql::CONSUME_SQL, &args, true, |t| {
        Ok(t.first().get_one::<bool>()?.unwrap_or(false))
    })
}

/// The key of a message that came without a message_id: a digest of what it carries.
pub fn derived_message_id(client: &mut SpiClient<'_>, content: Vec<u8>) -> SpiResult<String> {
    let args: [DatumWithOid; 1] = [content.into()];
    run_kept(client, sql::DERIVED_MESSAGE_ID_SQL, &args, false, |t| {
        Ok(t.first().get_one::<String>()?.unwrap_or_default())
    })
}

/// A handled message is no longer failed (it may have been retried from the table, or a
/// redelivered copy got through).
pub fn resolve_failed(client: &mut SpiClient<'_>, sub: &str, message_id: &str) -> SpiResult<()> {
    let args: [DatumWithOid; 2] = [sub.into(), message_id.into()];
    run_kept(client, sql::RESOLVE_FAILED_SQL, &args, true, |_| Ok(()))
}

/// Which of these subscriptions have failed messages now (only their handled messages may need
/// [`resolve_failed`]).
pub fn with_failed(
    client: &mut SpiClient<'_>,
    subs: Vec<String>,
) -> SpiResult<std::collections::BTreeSet<String>> {
    let args: [DatumWithOid; 1] = [subs.into()];
    run_kept(client, sql::WITH_FAILED_SQL, &args, false, |t| {
        let mut out = std::collections::BTreeSet::new();
        for r in t {
            if let Some(s) = r.get::<String>(1)? {
                out.insert(s);
            }
        }
        Ok(out)
    })
}

/// Calls a subscription's handler (`call`, see [`Sub::call`]) from a kept plan, with the
/// message's values ([`sql::DELIVERY_ROW`]).
pub fn call_handler(
    client: &mut SpiClient<'_>,
    call: &str,
    m: &Message,
    message_id: &str,
) -> SpiResult<()> {
    let headers = pgrx::JsonB(serde_json::Value::Object(m.headers.clone()));
    let args: [DatumWithOid; 14] = [
        m.subscription.as_str().into(),
        message_id.into(),
        m.exchange.as_str().into(),
        m.routing_key.as_str().into(),
        m.body.as_slice().into(),
        headers.into(),
        m.content_type.as_deref().into(),
        m.correlation_id.as_deref().into(),
        m.reply_to.as_deref().into(),
        m.redelivered.into(),
        m.delivery.map(|(_, tag)| tag as i64).into(),
        m.timestamp.map(|t| t as f64).into(),
        m.attempt.into(),
        m.user_id.as_deref().into(),
    ];
    run_kept(client, call, &args, true, |_| Ok(()))
}

/// Records a failed handling ([`sql::RECORD_FAILURE_SQL`]).
pub fn record_failure(
    client: &mut SpiClient<'_>,
    m: &Message,
    message_id: &str,
    caught: &Caught,
    max_attempts: i32,
    delays: &[i64],
) -> SpiResult<FailedRecord> {
    let headers = pgrx::JsonB(serde_json::Value::Object(m.headers.clone()));
    let args: [DatumWithOid; 17] = [
        m.subscription.as_str().into(),
        message_id.into(),
        m.exchange.as_str().into(),
        m.routing_key.as_str().into(),
        m.body.as_slice().into(),
        headers.into(),
        m.content_type.as_deref().into(),
        m.correlation_id.as_deref().into(),
        m.reply_to.as_deref().into(),
        m.timestamp.map(|t| t as f64).into(),
        caught.message.as_str().into(),
        caught.sqlstate.as_str().into(),
        max_attempts.into(),
        delays.to_vec().into(),
        m.attempt.into(),
        m.user_id.as_deref().into(),
        m.key.as_deref().into(),
    ];
    let table = client.update(sql::RECORD_FAILURE_SQL, None, &args)?;
    let row = table.first();
    Ok(FailedRecord {
        attempts: row.get::<i32>(1)?.unwrap_or(1),
        dead: row.get::<bool>(2)?.unwrap_or(false),
    })
}

/// Publishes a dead message to the subscription's dead-letter exchange, through this
/// database's outbox: it leaves if and only if this transaction commits.
pub fn dead_letter(
    client: &mut SpiClient<'_>,
    sub: &Sub,
    exchange: &str,
    m: &Message,
    headers: serde_json::Map<String, serde_json::Value>,
) -> SpiResult<()> {
    let args: [DatumWithOid; 7] = [
        sub.broker_id.into(),
        exchange.into(),
        m.routing_key.as_str().into(),
        m.body.as_slice().into(),
        pgrx::JsonB(serde_json::Value::Object(headers)).into(),
        m.content_type.as_deref().into(),
        m.correlation_id.as_deref().into(),
    ];
    client.update(sql::DEAD_LETTER_SQL, None, &args)?;
    Ok(())
}

/// A receipt through the outbox (only called when amqp_outbox.receipts_exchange is set), with
/// the message's business type when it carried one, for the producer's statistics.
pub fn receipt(
    client: &mut SpiClient<'_>,
    sub: &Sub,
    message_id: &str,
    error: Option<&str>,
    business_type: Option<&str>,
) -> SpiResult<()> {
    let args: [DatumWithOid; 6] = [
        sub.broker_id.into(),
        sub.name.as_str().into(),
        message_id.into(),
        error.is_none().into(),
        error.into(),
        business_type.into(),
    ];
    run_kept(client, sql::RECEIPT_SQL, &args, true, |_| Ok(()))
}

/// Makes `traceparent` the session's `amqp_outbox.traceparent` until the current GUC nest
/// level closes (the handler's, see `guarded::as_owner`): what the handler publishes carries
/// the trace of the message it handles.
pub fn set_traceparent(client: &mut SpiClient<'_>, traceparent: &str) -> SpiResult<()> {
    let args: [DatumWithOid; 1] = [traceparent.into()];
    run_kept(client, sql::SET_TRACEPARENT_SQL, &args, true, |_| Ok(()))
}

/// Failed messages due for a retry, of these subscriptions, oldest due first.
pub fn due_retries(
    client: &SpiClient<'_>,
    subs: Vec<String>,
    limit: i64,
) -> SpiResult<Vec<Message>> {
    let args: [DatumWithOid; 2] = [subs.into(), limit.into()];
    let rows = client.select(sql::DUE_RETRIES_SQL, None, &args)?;
    let mut out = Vec::new();
    for r in rows {
        let headers = headers_of(r.get::<String>(6)?);
        out.push(Message {
            subscription: r.get::<String>(1)?.unwrap_or_default(),
            message_id: r.get::<String>(2)?,
            exchange: r.get::<String>(3)?.unwrap_or_default(),
            routing_key: r.get::<String>(4)?.unwrap_or_default(),
            body: r.get::<Vec<u8>>(5)?.unwrap_or_default(),
            headers,
            content_type: r.get::<String>(7)?,
            correlation_id: r.get::<String>(8)?,
            reply_to: r.get::<String>(9)?,
            user_id: r.get::<String>(12)?,
            timestamp: r.get::<f64>(10)?.map(|t| t.max(0.0) as u64),
            redelivered: true,
            delivery: None,
            attempt: r.get::<i32>(11)?.unwrap_or(0) + 1,
            retry: true,
            key: r.get::<String>(13)?,
            waiting_id: None,
        });
    }
    Ok(out)
}

/// The headers' JSON text, as an object (anything else: none).
fn headers_of(text: Option<String>) -> serde_json::Map<String, serde_json::Value> {
    text.and_then(|h| serde_json::from_str::<serde_json::Value>(&h).ok())
        .and_then(|v| match v {
            serde_json::Value::Object(m) => Some(m),
            _ => None,
        })
        .unwrap_or_default()
}

/// The first column of the first row, `None` when there is no row (`first()` of an empty
/// table is an error).
fn first_i64(t: pgrx::spi::SpiTupleTable<'_>) -> SpiResult<Option<i64>> {
    if t.is_empty() {
        return Ok(None);
    }
    t.first().get_one::<i64>()
}

/// Puts a delivery of a subscription with lanes into `amqp.inbox_waiting`; returns its row's
/// id: the row it already has when it was delivered again while it waits, `None` when that row
/// went meanwhile (its handling committed: this copy is a duplicate).
pub fn stage(client: &mut SpiClient<'_>, m: &Message, message_id: &str) -> SpiResult<Option<i64>> {
    let headers = pgrx::JsonB(serde_json::Value::Object(m.headers.clone()));
    let args: [DatumWithOid; 13] = [
        m.subscription.as_str().into(),
        message_id.into(),
        m.key.as_deref().into(),
        m.exchange.as_str().into(),
        m.routing_key.as_str().into(),
        m.body.as_slice().into(),
        headers.into(),
        m.content_type.as_deref().into(),
        m.correlation_id.as_deref().into(),
        m.reply_to.as_deref().into(),
        m.timestamp.map(|t| t as f64).into(),
        m.user_id.as_deref().into(),
        m.redelivered.into(),
    ];
    // DO NOTHING, not DO UPDATE: a lane may hold the row for as long as its handler runs, and
    // an update would wait for it.
    let inserted = run_kept(client, sql::STAGE_SQL, &args, true, |t| first_i64(t))?;
    if inserted.is_some() {
        return Ok(inserted);
    }
    let args: [DatumWithOid; 2] = [m.subscription.as_str().into(), message_id.into()];
    run_kept(client, sql::WAITING_ID_SQL, &args, false, |t| first_i64(t))
}

/// Which of these `amqp.inbox_waiting` rows are gone (handled, duplicates, failed).
pub fn gone_from_waiting(client: &mut SpiClient<'_>, ids: Vec<i64>) -> SpiResult<Vec<i64>> {
    let args: [DatumWithOid; 1] = [ids.into()];
    run_kept(client, sql::GONE_FROM_WAITING_SQL, &args, false, |t| {
        let mut out = Vec::new();
        for r in t {
            if let Some(id) = r.get::<i64>(1)? {
                out.push(id);
            }
        }
        Ok(out)
    })
}

/// How many waiting messages of these subscriptions may be handled now, those in progress in
/// other lanes included (at most their prefetch each).
pub fn claimable(client: &mut SpiClient<'_>, subs: Vec<String>) -> SpiResult<usize> {
    let args: [DatumWithOid; 1] = [subs.into()];
    run_kept(client, sql::CLAIMABLE_COUNT_SQL, &args, false, |t| {
        Ok(usize::try_from(t.first().get_one::<i64>()?.unwrap_or(0)).unwrap_or(0))
    })
}

/// Claims up to `limit` waiting messages of these subscriptions for a lane, oldest first: a
/// message with a key only when no earlier message with that key waits or is in progress (a
/// locked row is still there) and none has failed (not yet dead). Rows other lanes hold are
/// skipped. Returns them with whether their handler ended a lane before (see `ended`).
pub fn claim_waiting(
    client: &mut SpiClient<'_>,
    subs: Vec<String>,
    limit: i64,
) -> SpiResult<Vec<(Message, Option<i16>)>> {
    let args: [DatumWithOid; 2] = [subs.into(), limit.into()];
    run_kept(client, sql::CLAIM_WAITING_SQL, &args, true, |t| {
        let mut out = Vec::new();
        for r in t {
            let m = Message {
                subscription: r.get::<String>(2)?.unwrap_or_default(),
                message_id: r.get::<String>(3)?,
                exchange: r.get::<String>(4)?.unwrap_or_default(),
                routing_key: r.get::<String>(5)?.unwrap_or_default(),
                body: r.get::<Vec<u8>>(6)?.unwrap_or_default(),
                headers: headers_of(r.get::<String>(7)?),
                content_type: r.get::<String>(8)?,
                correlation_id: r.get::<String>(9)?,
                reply_to: r.get::<String>(10)?,
                timestamp: r.get::<f64>(11)?.map(|t| t.max(0.0) as u64),
                user_id: r.get::<String>(12)?,
                redelivered: r.get::<bool>(13)?.unwrap_or(false),
                delivery: None,
                attempt: 1,
                retry: false,
                key: r.get::<String>(14)?,
                waiting_id: r.get::<i64>(1)?,
            };
            out.push((m, r.get::<i16>(15)?));
        }
        Ok(out)
    })
}

/// Removes handled (or failed, or duplicate) messages from `amqp.inbox_waiting`.
pub fn done_waiting(client: &mut SpiClient<'_>, ids: Vec<i64>) -> SpiResult<()> {
    let args: [DatumWithOid; 1] = [ids.into()];
    run_kept(client, sql::DONE_WAITING_SQL, &args, true, |_| Ok(()))
}

/// The handler of this waiting message ended a lane (`ended`: 1 timeout, 2 terminated): the
/// next lane to take it records it as failed instead of running it again.
pub fn mark_ended(
    client: &mut SpiClient<'_>,
    sub: &str,
    message_id: &str,
    ended: i16,
) -> SpiResult<()> {
    let args: [DatumWithOid; 3] = [sub.into(), message_id.into(), ended.into()];
    run_kept(client, sql::MARK_ENDED_SQL, &args, true, |_| Ok(()))
}

/// How many lanes the subscriptions want: the largest parallelism of those with lanes, and one
/// while messages wait for a subscription that has none any more (its parallelism or ordering
/// was changed back).
pub fn lanes_wanted(client: &SpiClient<'_>) -> SpiResult<usize> {
    let n = client
        .select(sql::LANES_WANTED_SQL, None, &[])?
        .first()
        .get_one::<i32>()?
        .unwrap_or(0);
    Ok(usize::try_from(n).unwrap_or(0))
}

/// Seconds until the next failed message is due (None: none waiting).
pub fn next_retry_in(client: &mut SpiClient<'_>, subs: Vec<String>) -> SpiResult<Option<f64>> {
    let args: [DatumWithOid; 1] = [subs.into()];
    run_kept(client, sql::NEXT_RETRY_SQL, &args, false, |t| {
        t.first().get_one::<f64>()
    })
}

/// `SET CONSTRAINTS ALL IMMEDIATE` for the rest of the transaction.
pub fn constraints_immediate(client: &mut SpiClient<'_>) -> SpiResult<()> {
    run_kept(
        client,
        sql::CONSTRAINTS_IMMEDIATE_SQL,
        &[],
        true,
        |_| Ok(()),
    )
}

/// A dead message whose dead letter was refused says so in its last error.
pub fn note_dead_letter_refused(
    client: &mut SpiClient<'_>,
    sub: &str,
    message_id: &str,
    why: &str,
) -> SpiResult<()> {
    client
        .update(
            sql::NOTE_DEAD_LETTER_REFUSED_SQL,
            None,
            &[sub.into(), message_id.into(), why.into()],
        )
        .map(drop)
}

/// `lock_timeout` for the rest of the current transaction.
pub fn set_local_lock_timeout(
    client: &mut SpiClient<'_>,
    wait: std::time::Duration,
) -> SpiResult<()> {
    client
        .update(
            "SELECT pg_catalog.set_config('lock_timeout', $1, true)",
            None,
            &[format!("{}ms", wait.as_millis()).into()],
        )
        .map(drop)
}

/// Adds the counters and states noted in `book` to `amqp._subscription_state`.
pub fn write_book(
    client: &mut SpiClient<'_>,
    book: &mut amqp_outbox_engine::consume::book::Book,
) -> SpiResult<()> {
    for r in book.take() {
        write_book_row(client, r)?;
    }
    Ok(())
}

fn write_book_row(client: &mut SpiClient<'_>, r: BookRow) -> SpiResult<()> {
    let args: [DatumWithOid; 16] = [
        r.subscription.as_str().into(),
        r.delivered.into(),
        r.handled.into(),
        r.duplicates.into(),
        r.failed.into(),
        r.dead_lettered.into(),
        r.connection_changed.into(),
        r.connected.into(),
        r.host.into(),
        r.error_changed.into(),
        r.error.into(),
        r.queue_seen.into(),
        r.queue_ready.into(),
        r.queue_consumers.into(),
        r.handled_now.into(),
        r.caught_up.into(),
    ];
    run_kept(client, sql::BOOK_SQL, &args, true, |_| Ok(()))
}

/// At start: no consumer is connected yet, whatever the last run left.
pub fn reset_connections(client: &mut SpiClient<'_>) -> SpiResult<()> {
    client
        .update(sql::RESET_CONNECTIONS_SQL, None, &[])
        .map(drop)
}
