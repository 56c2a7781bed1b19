//! Every SQL statement of the subscription worker. Values are always bound parameters; the one
//! statement with a name in its text (the handler call) takes it from PostgreSQL's own quoting
//! (`format('%I.%I')`), never from a value.

use super::types::{Message, Ordering, Sub};
use crate::worker::queries::run_kept;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::{SpiClient, SpiResult};

/// Why a subscription's handler cannot run as its owner (`NULL`: it can). The owner is checked
/// before the function privilege, which would raise for a role that is gone; CASE keeps the
/// order. The handler is kept by name (schema-qualified, see `amqp._handler_name()`):
/// `to_regprocedure` finds it, or gives NULL when no such function exists (any more).
const RUNS_AS_PROBLEM: &str = "CASE \
    WHEN NOT EXISTS (SELECT FROM pg_proc p WHERE p.oid = to_regprocedure(s.handler)) \
    THEN format('the handler function %s no longer exists: set another (UPDATE amqp.subscription SET handler = ...) or amqp.unsubscribe() it', s.handler) \
    WHEN NOT EXISTS (SELECT FROM pg_roles r WHERE r.oid = s.owner::oid) \
    THEN format('its owner (role oid %s) no longer exists: set another (UPDATE amqp.subscription SET owner = ...) or amqp.unsubscribe() it', s.owner::oid) \
    WHEN NOT has_function_privilege(s.owner::oid, to_regprocedure(s.handler)::oid, 'EXECUTE') \
    THEN format('its owner %s may not execute the handler %s', s.owner, s.handler) END";

pub fn load_subscriptions(client: &SpiClient<'_>) -> SpiResult<Vec<Sub>> {
    let rows = client.select(
        &format!(
            "SELECT s.subscription, s.broker_id, s.queue, s.prefetch, s.max_attempts, \
                    s.dead_letter_exchange, s.owner::oid, \
                    (SELECT format('%I.%I', n.nspname, p.proname) \
                       FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace \
                      WHERE p.oid = to_regprocedure(s.handler)), \
                    {RUNS_AS_PROBLEM}, s.parallelism, s.ordering \
               FROM amqp.subscription s WHERE NOT s.paused ORDER BY s.subscription"
        ),
        None,
        &[],
    )?;
    let mut out = Vec::new();
    for r in rows {
        let name = r.get::<String>(1)?.unwrap_or_default();
        let problem = r.get::<String>(9)?;
        out.push(Sub {
            name,
            broker_id: r.get::<i32>(2)?.unwrap_or_default(),
            queue: r.get::<String>(3)?.unwrap_or_default(),
            prefetch: u16::try_from(r.get::<i32>(4)?.unwrap_or(100)).unwrap_or(100),
            max_attempts: r.get::<i32>(5)?.unwrap_or(10),
            dead_letter_exchange: r.get::<String>(6)?,
            owner: r.get::<pg_sys::Oid>(7)?.unwrap_or(pg_sys::InvalidOid),
            call: r.get::<String>(8)?.filter(|_| problem.is_none()).map(|f| {
                format!(
                    "SELECT {f}(ROW($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, \
                     pg_catalog.to_timestamp($12), $13, $14)::amqp.delivery)"
                )
            }),
            problem,
            parallelism: usize::try_from(r.get::<i32>(10)?.unwrap_or(1))
                .unwrap_or(1)
                .clamp(1, crate::shmem::MAX_LANES),
            ordering: Ordering::parse(r.get::<&str>(11)?.unwrap_or("none")),
        });
    }
    Ok(out)
}

/// The names of the subscriptions that exist now (paused ones included).
pub fn subscription_names(client: &SpiClient<'_>) -> SpiResult<Vec<String>> {
    client
        .select("SELECT subscription FROM amqp.subscription", None, &[])?
        .map(|r| r.get::<String>(1).map(Option::unwrap_or_default))
        .collect()
}

/// Why the subscription's handler cannot run as its owner now, if it cannot (it was dropped, or
/// its owner was, or lost the right to execute it, since the subscription was last read).
pub fn runs_as_problem(client: &SpiClient<'_>, subscription: &str) -> SpiResult<Option<String>> {
    client
        .select(
            &format!("SELECT {RUNS_AS_PROBLEM} FROM amqp.subscription s WHERE s.subscription = $1"),
            Some(1),
            &[subscription.into()],
        )?
        .first()
        .get::<String>(1)
}

/// `consume_once(subscription, message_id)`: false for a duplicate.
pub fn consume_once(client: &mut SpiClient<'_>, sub: &str, message_id: &str) -> SpiResult<bool> {
    // The subscriptions' own names, which consume_once() refuses to applications.
    let consumer = format!("subscription:{sub}");
    let args: [DatumWithOid; 2] = [consumer.as_str().into(), message_id.into()];
    run_kept(client, "SELECT amqp._consume($1, $2)", &args, true, |t| {
        Ok(t.first().get_one::<bool>()?.unwrap_or(false))
    })
}

/// The key of a message that came without a message_id: a digest of what it carries.
pub fn derived_message_id(client: &SpiClient<'_>, content: Vec<u8>) -> SpiResult<String> {
    let args: [DatumWithOid; 1] = [content.into()];
    Ok(client
        .select("SELECT 'sha256:' || encode(sha256($1), 'hex')", None, &args)?
        .first()
        .get_one::<String>()?
        .unwrap_or_default())
}

/// A handled message is no longer failed (it may have been retried from the table, or a
/// redelivered copy got through).
pub fn resolve_failed(client: &mut SpiClient<'_>, sub: &str, message_id: &str) -> SpiResult<()> {
    let args: [DatumWithOid; 2] = [sub.into(), message_id.into()];
    run_kept(
        client,
        "DELETE FROM amqp.inbox_failed WHERE subscription = $1 AND message_id = $2",
        &args,
        true,
        |_| Ok(()),
    )
}

/// Which of these subscriptions have failed messages now (only their handled messages may need
/// [`resolve_failed`]).
pub fn with_failed(
    client: &mut SpiClient<'_>,
    subs: Vec<String>,
) -> SpiResult<std::collections::BTreeSet<String>> {
    let args: [DatumWithOid; 1] = [subs.into()];
    run_kept(
        client,
        "SELECT DISTINCT subscription FROM amqp.inbox_failed WHERE subscription = ANY($1)",
        &args,
        false,
        |t| {
            let mut out = std::collections::BTreeSet::new();
            for r in t {
                if let Some(s) = r.get::<String>(1)? {
                    out.insert(s);
                }
            }
            Ok(out)
        },
    )
}

/// Calls a subscription's handler (`call`, see [`Sub::call`]) from a kept plan.
pub fn call_handler(
    client: &mut SpiClient<'_>,
    call: &str,
    args: &[DatumWithOid],
) -> SpiResult<()> {
    run_kept(client, call, args, true, |_| Ok(()))
}

/// What a failure did to the message's record.
pub struct FailedRecord {
    pub attempts: i32,
    pub dead: bool,
}

/// Records a failed handling: a new row on the first failure, one more attempt after that; dead
/// (no more automatic retries) at `max_attempts`. `delays`: the backoff per attempt count, in
/// microseconds, drawn by the caller.
#[allow(clippy::too_many_arguments)]
pub fn record_failure(
    client: &mut SpiClient<'_>,
    m: &Message,
    message_id: &str,
    error: &str,
    sqlstate: &str,
    max_attempts: i32,
    delays: Vec<i64>,
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
        error.into(),
        sqlstate.into(),
        max_attempts.into(),
        delays.into(),
        m.attempt.into(),
        m.user_id.as_deref().into(),
        m.key.as_deref().into(),
    ];
    let table = client.update(
        "INSERT INTO amqp.inbox_failed AS f \
             (subscription, message_id, exchange, routing_key, body, headers, content_type, \
              correlation_id, reply_to, \"timestamp\", last_error, last_sqlstate, attempts, \
              next_attempt_at, dead_lettered_at, user_id, ordering_key) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, to_timestamp($10), $11, $12, $15, \
                 clock_timestamp() + $14[least($15, cardinality($14))] * interval '1 microsecond', \
                 CASE WHEN $15 >= $13 THEN clock_timestamp() END, $16, $17) \
         ON CONFLICT (subscription, message_id) DO UPDATE \
            SET attempts = f.attempts + 1, \
                last_failed_at = clock_timestamp(), \
                last_error = EXCLUDED.last_error, \
                last_sqlstate = EXCLUDED.last_sqlstate, \
                next_attempt_at = clock_timestamp() \
                    + $14[least(f.attempts + 1, cardinality($14))] * interval '1 microsecond', \
                dead_lettered_at = CASE WHEN f.attempts + 1 >= $13 THEN clock_timestamp() END \
         RETURNING attempts, dead_lettered_at IS NOT NULL",
        None,
        &args,
    )?;
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
    message_id: &str,
    error: &str,
    attempts: i32,
) -> SpiResult<()> {
    let mut headers = m.headers.clone();
    headers.insert(
        "x-amqp-outbox-original-message-id".into(),
        message_id.into(),
    );
    headers.insert(
        "x-amqp-outbox-subscription".into(),
        sub.name.as_str().into(),
    );
    headers.insert("x-amqp-outbox-error".into(), error.into());
    headers.insert("x-amqp-outbox-attempts".into(), attempts.into());
    headers.insert(
        "x-amqp-outbox-original-exchange".into(),
        m.exchange.as_str().into(),
    );
    let args: [DatumWithOid; 7] = [
        sub.broker_id.into(),
        exchange.into(),
        m.routing_key.as_str().into(),
        m.body.as_slice().into(),
        pgrx::JsonB(serde_json::Value::Object(headers)).into(),
        m.content_type.as_deref().into(),
        m.correlation_id.as_deref().into(),
    ];
    client.update(
        "SELECT amqp.publish_bytes($1, $2, $3, $4, $5, 2, $6, NULL, $7)",
        None,
        &args,
    )?;
    Ok(())
}

/// A receipt through the outbox (only called when amqp_outbox.receipts_exchange is set), with
/// the message's business type when it carried one, for the producer's statistics.
pub fn receipt(
    client: &mut SpiClient<'_>,
    broker_id: i32,
    sub: &str,
    message_id: &str,
    error: Option<&str>,
    business_type: Option<&str>,
) -> SpiResult<()> {
    let args: [DatumWithOid; 6] = [
        broker_id.into(),
        sub.into(),
        message_id.into(),
        error.is_none().into(),
        error.into(),
        business_type.into(),
    ];
    client.update(
        "SELECT amqp.send_receipt($1, $2, $3, $4, $5, $6)",
        None,
        &args,
    )?;
    Ok(())
}

/// Makes `traceparent` the session's `amqp_outbox.traceparent` until the current GUC nest
/// level closes (the handler's, see `guarded::as_owner`): what the handler publishes carries
/// the trace of the message it handles.
pub fn set_traceparent(client: &mut SpiClient<'_>, traceparent: &str) -> SpiResult<()> {
    let args: [DatumWithOid; 1] = [traceparent.into()];
    client.update(
        "SELECT pg_catalog.set_config('amqp_outbox.traceparent', $1, true)",
        None,
        &args,
    )?;
    Ok(())
}

/// Failed messages due for a retry, of these subscriptions, oldest due first.
pub fn due_retries(
    client: &SpiClient<'_>,
    subs: Vec<String>,
    limit: i64,
) -> SpiResult<Vec<Message>> {
    let args: [DatumWithOid; 2] = [subs.into(), limit.into()];
    let rows = client.select(
        "SELECT subscription, message_id, exchange, routing_key, body, headers::text, \
                content_type, correlation_id, reply_to, extract(epoch FROM \"timestamp\")::float8, \
                attempts, user_id, ordering_key \
           FROM amqp.inbox_failed \
          WHERE dead_lettered_at IS NULL AND next_attempt_at <= clock_timestamp() \
            AND subscription = ANY($1) \
          ORDER BY next_attempt_at, id LIMIT $2",
        None,
        &args,
    )?;
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
    let inserted = run_kept(
        client,
        "INSERT INTO amqp.inbox_waiting \
             (subscription, message_id, ordering_key, exchange, routing_key, body, headers, \
              content_type, correlation_id, reply_to, \"timestamp\", user_id, redelivered) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, to_timestamp($11), $12, $13) \
         ON CONFLICT (subscription, message_id) DO NOTHING \
         RETURNING id",
        &args,
        true,
        |t| first_i64(t),
    )?;
    if inserted.is_some() {
        return Ok(inserted);
    }
    let args: [DatumWithOid; 2] = [m.subscription.as_str().into(), message_id.into()];
    run_kept(
        client,
        "SELECT id FROM amqp.inbox_waiting WHERE subscription = $1 AND message_id = $2",
        &args,
        false,
        |t| first_i64(t),
    )
}

/// Which of these `amqp.inbox_waiting` rows are gone (handled, duplicates, failed).
pub fn gone_from_waiting(client: &mut SpiClient<'_>, ids: Vec<i64>) -> SpiResult<Vec<i64>> {
    let args: [DatumWithOid; 1] = [ids.into()];
    run_kept(
        client,
        "SELECT x FROM unnest($1::int8[]) AS x \
          WHERE NOT EXISTS (SELECT FROM amqp.inbox_waiting w WHERE w.id = x)",
        &args,
        false,
        |t| {
            let mut out = Vec::new();
            for r in t {
                if let Some(id) = r.get::<i64>(1)? {
                    out.push(id);
                }
            }
            Ok(out)
        },
    )
}

/// A message of these subscriptions that may be handled now (see [`claim_waiting`]), in SQL
/// over `w`: no key, or no earlier message with its key waiting or in progress, and none
/// failed and not dead.
const CLAIMABLE: &str = "(w.ordering_key IS NULL \
     OR (NOT EXISTS (SELECT FROM amqp.inbox_waiting e \
                      WHERE e.subscription = w.subscription \
                        AND e.ordering_key = w.ordering_key AND e.id < w.id) \
         AND NOT EXISTS (SELECT FROM amqp.inbox_failed f \
                          WHERE f.subscription = w.subscription \
                            AND f.ordering_key = w.ordering_key \
                            AND f.dead_lettered_at IS NULL)))";

/// How many waiting messages of these subscriptions may be handled now, those in progress in
/// other lanes included (at most their prefetch each).
pub fn claimable(client: &mut SpiClient<'_>, subs: Vec<String>) -> SpiResult<usize> {
    let args: [DatumWithOid; 1] = [subs.into()];
    run_kept(
        client,
        &format!(
            "SELECT count(*) FROM amqp.inbox_waiting w \
              WHERE w.subscription = ANY($1) AND {CLAIMABLE}"
        ),
        &args,
        false,
        |t| Ok(usize::try_from(t.first().get_one::<i64>()?.unwrap_or(0)).unwrap_or(0)),
    )
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
    run_kept(
        client,
        &format!(
            "SELECT w.id, w.subscription, w.message_id, w.exchange, w.routing_key, w.body, \
                w.headers::text, w.content_type, w.correlation_id, w.reply_to, \
                extract(epoch FROM w.\"timestamp\")::float8, w.user_id, w.redelivered, \
                w.ordering_key, w.ended \
           FROM amqp.inbox_waiting w \
          WHERE w.subscription = ANY($1) AND {CLAIMABLE} \
          ORDER BY w.id LIMIT $2 \
          FOR UPDATE OF w SKIP LOCKED"
        ),
        &args,
        true,
        |t| {
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
        },
    )
}

/// Removes handled (or failed, or duplicate) messages from `amqp.inbox_waiting`.
pub fn done_waiting(client: &mut SpiClient<'_>, ids: Vec<i64>) -> SpiResult<()> {
    let args: [DatumWithOid; 1] = [ids.into()];
    run_kept(
        client,
        "DELETE FROM amqp.inbox_waiting WHERE id = ANY($1)",
        &args,
        true,
        |_| Ok(()),
    )
}

/// The handler of this waiting message ended a lane (`ended`: 1 timeout, 2 terminated): the
/// next lane to take it records it as failed instead of running it again.
pub fn mark_ended(
    client: &mut SpiClient<'_>,
    sub: &str,
    message_id: &str,
    ended: i16,
) -> SpiResult<()> {
    client
        .update(
            "UPDATE amqp.inbox_waiting SET ended = $3 WHERE subscription = $1 AND message_id = $2",
            None,
            &[sub.into(), message_id.into(), ended.into()],
        )
        .map(drop)
}

/// How many lanes the subscriptions want: the largest parallelism of those with lanes, and one
/// while messages wait for a subscription that has none any more (its parallelism or ordering
/// was changed back).
pub fn lanes_wanted(client: &SpiClient<'_>) -> SpiResult<usize> {
    let n = client
        .select(
            "SELECT greatest( \
                 (SELECT max(parallelism) FROM amqp.subscription \
                   WHERE NOT paused AND (parallelism > 1 OR ordering <> 'none')), \
                 (SELECT 1 FROM amqp.inbox_waiting LIMIT 1))",
            None,
            &[],
        )?
        .first()
        .get_one::<i32>()?
        .unwrap_or(0);
    Ok(usize::try_from(n).unwrap_or(0))
}

/// Seconds until the next failed message is due (None: none waiting).
pub fn next_retry_in(client: &SpiClient<'_>, subs: Vec<String>) -> SpiResult<Option<f64>> {
    let args: [DatumWithOid; 1] = [subs.into()];
    client
        .select(
            // NULL when nothing waits (greatest() would turn that into 0: a retry due now, and
            // the worker would never sleep); the caller clamps a past instant to now.
            "SELECT extract(epoch FROM min(next_attempt_at) - clock_timestamp())::float8 \
               FROM amqp.inbox_failed \
              WHERE dead_lettered_at IS NULL AND subscription = ANY($1)",
            None,
            &args,
        )?
        .first()
        .get_one::<f64>()
}

/// `SET CONSTRAINTS ALL IMMEDIATE` for the rest of the transaction.
pub fn constraints_immediate(client: &mut SpiClient<'_>) -> SpiResult<()> {
    client
        .update("SET CONSTRAINTS ALL IMMEDIATE", None, &[])
        .map(drop)
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
            "UPDATE amqp.inbox_failed \
                SET last_error = last_error || ' [not dead-lettered: ' || left($3, 1000) || ']' \
              WHERE subscription = $1 AND message_id = $2",
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
