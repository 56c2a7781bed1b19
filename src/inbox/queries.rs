//! Every SQL statement of the subscription worker. Values are always bound parameters; the one
//! statement with a name in its text (the handler call) takes it from PostgreSQL's own quoting
//! (`format('%I.%I')`), never from a value.

use super::types::{Message, Sub};
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
                    {RUNS_AS_PROBLEM} \
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
    let args: [DatumWithOid; 16] = [
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
    ];
    let table = client.update(
        "INSERT INTO amqp.inbox_failed AS f \
             (subscription, message_id, exchange, routing_key, body, headers, content_type, \
              correlation_id, reply_to, \"timestamp\", last_error, last_sqlstate, attempts, \
              next_attempt_at, dead_lettered_at, user_id) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, to_timestamp($10), $11, $12, $15, \
                 clock_timestamp() + $14[least($15, cardinality($14))] * interval '1 microsecond', \
                 CASE WHEN $15 >= $13 THEN clock_timestamp() END, $16) \
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
                attempts, user_id \
           FROM amqp.inbox_failed \
          WHERE dead_lettered_at IS NULL AND next_attempt_at <= clock_timestamp() \
            AND subscription = ANY($1) \
          ORDER BY next_attempt_at LIMIT $2",
        None,
        &args,
    )?;
    let mut out = Vec::new();
    for r in rows {
        let headers = r
            .get::<String>(6)?
            .and_then(|h| serde_json::from_str::<serde_json::Value>(&h).ok())
            .and_then(|v| match v {
                serde_json::Value::Object(m) => Some(m),
                _ => None,
            })
            .unwrap_or_default();
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
        });
    }
    Ok(out)
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
