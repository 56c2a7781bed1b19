//! Handling messages, several per transaction, each in its own subtransaction: record its
//! consumption (a duplicate stops there), run the handler as the subscription's owner, and
//! send a receipt through the outbox. A handler error rolls back that message's work only;
//! the message is then kept in `amqp.inbox_failed` (retried with backoff, dead-lettered after
//! `max_attempts`). Acknowledgements go to the broker only after the transaction committed.

use super::book::Book;
use super::guarded::{self, Caught};
use super::queries;
use super::types::{Message, Sub};
use crate::shmem::handler_trap::Ended;
use crate::watchdog;
use amqp_outbox_broker::backoff::Backoff;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::{SpiClient, SpiResult};
use std::time::Duration;

/// What the settings say about handling.
pub struct Rules {
    pub handler_timeout: Duration,
    pub receipts: bool,
    pub backoff: Backoff,
}

impl Rules {
    /// The rules now: the handler timeout and receipts exchange as set, the backoff of the
    /// worker's snapshot of the settings.
    pub fn from_settings(settings: &crate::gucs::WorkerSettings) -> Rules {
        use crate::gucs;
        Rules {
            handler_timeout: Duration::from_millis(gucs::HANDLER_TIMEOUT.get().max(0) as u64),
            receipts: gucs::RECEIPTS_EXCHANGE
                .get()
                .is_some_and(|e| !e.as_bytes().is_empty()),
            backoff: settings.retry_backoff(),
        }
    }
}

pub enum Outcome {
    Handled,
    Duplicate,
    /// Kept in amqp.inbox_failed (and dead-lettered at its last attempt).
    Failed,
    /// Its subscription is gone or paused: left unacknowledged (the broker gives it back).
    Dropped,
    /// Its handler cannot run as the subscription's owner any more (dropped function or role,
    /// revoked privilege): left unacknowledged like a dropped one, without using up an
    /// attempt; the subscriptions must be read again (it then stops, saying why).
    CannotRun,
}

/// The SQLSTATEs a handler call raises when the function or its owner is gone, or the owner
/// may not execute it: undefined_function, undefined_object (an owner role dropped: "invalid
/// role OID"), insufficient_privilege. A handler may raise them itself too; the subscription is
/// then checked to tell the two apart.
const MAYBE_CANNOT_RUN: [&str; 3] = ["42883", "42704", "42501"];

/// Handles `messages` in the current transaction. Returns, for each, what happened.
/// `left`: messages whose handler ended a previous worker or lane (see [`watchdog`]): each is
/// recorded as failed when it comes, without running its handler again.
pub fn handle_all(
    client: &mut SpiClient<'_>,
    subs: &std::collections::BTreeMap<String, Sub>,
    messages: &[Message],
    rules: &Rules,
    book: &mut Book,
    left: &mut Vec<(Ended, String, String)>,
) -> SpiResult<Vec<Outcome>> {
    let mut out = Vec::with_capacity(messages.len());
    // Deferred constraints and constraint triggers a handler queues are checked at the end of
    // its statement, inside the message's subtransaction (as its owner): at the batch's
    // COMMIT they could not fire (queued in a security-restricted operation), and one failing
    // there would undo every message of the batch.
    queries::constraints_immediate(client)?;
    // Handled messages leave amqp.inbox_failed; look there only for subscriptions that have
    // failed messages (and for retries, which come from it).
    let mut has_failed = queries::with_failed(client, subs.keys().cloned().collect())?;
    // Subscriptions removed by a handler of this batch (amqp.unsubscribe() on itself): their
    // other messages go back to the broker instead of being handled for a subscription that
    // is gone once the batch commits.
    let mut gone: Vec<String> = Vec::new();
    crate::commit_wake::take_subscriptions_written();
    for m in messages {
        // Asked to stop: the rest go back to the broker (or stay in amqp.inbox_failed).
        if crate::worker::pg::shutdown_requested() {
            out.push(Outcome::Dropped);
            continue;
        }
        if crate::commit_wake::take_subscriptions_written() {
            let now = queries::subscription_names(client)?;
            gone = subs.keys().filter(|s| !now.contains(*s)).cloned().collect();
        }
        let Some(sub) = subs
            .get(&m.subscription)
            .filter(|s| s.call.is_some() && !gone.contains(&s.name))
        else {
            out.push(Outcome::Dropped);
            continue;
        };
        let entry = book.entry(&sub.name);
        if m.delivery.is_some() {
            entry.delivered += 1;
        }
        let message_id = match &m.message_id {
            Some(id) => id.clone(),
            None => queries::derived_message_id(client, m.digest_input())?,
        };
        let resolve = m.retry || has_failed.contains(&sub.name);
        let trapped = left
            .iter()
            .position(|(_, s, id)| *s == sub.name && *id == message_id)
            .map(|i| left.remove(i));
        let outcome = match trapped {
            Some((ended, _, _)) => Err(Caught {
                sqlstate: "57014".into(),
                message: watchdog::reason(ended).into(),
            }),
            None => handle_one(sub, m, &message_id, rules, resolve),
        };
        let outcome = match outcome {
            Ok(true) => {
                let e = book.entry(&sub.name);
                e.handled += 1;
                e.handled_now = true;
                Outcome::Handled
            }
            Ok(false) => {
                book.entry(&sub.name).duplicates += 1;
                if m.retry {
                    // A retry whose message got through meanwhile (a redelivered copy).
                    queries::resolve_failed(client, &sub.name, &message_id)?;
                }
                // Answered again: a producer resends a message when it saw no receipt, and the
                // receipt may be what was lost.
                if rules.receipts && !m.is_receipt() {
                    send_receipt(sub, m, &message_id, None);
                }
                Outcome::Duplicate
            }
            Err(caught)
                if MAYBE_CANNOT_RUN.contains(&caught.sqlstate.as_str())
                    && queries::runs_as_problem(client, &sub.name)?.is_some() =>
            {
                Outcome::CannotRun
            }
            Err(caught) => {
                let text = format!("{} (SQLSTATE {})", caught.message, caught.sqlstate);
                let dead = record_failed(client, sub, m, &message_id, &caught, rules)?;
                has_failed.insert(sub.name.clone());
                let e = book.entry(&sub.name);
                e.failed += 1;
                e.error = Some(Some(format!("message {message_id}: {text}")));
                if dead {
                    e.dead_lettered += 1;
                }
                Outcome::Failed
            }
        };
        out.push(outcome);
    }
    Ok(out)
}

/// One message in its own subtransaction: `Ok(true)` handled, `Ok(false)` a duplicate.
fn handle_one(
    sub: &Sub,
    m: &Message,
    message_id: &str,
    rules: &Rules,
    resolve: bool,
) -> Result<bool, Caught> {
    let call = sub.call.as_deref().unwrap_or_default();
    guarded::subtransaction(|| {
        Spi::connect_mut(|client| -> SpiResult<bool> {
            if !queries::consume_once(client, &sub.name, message_id)? {
                return Ok(false);
            }
            let headers = pgrx::JsonB(serde_json::Value::Object(m.headers.clone()));
            let args: [DatumWithOid; 14] = [
                sub.name.as_str().into(),
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
            let traceparent = m.traceparent();
            let _watched = watchdog::Watched::handler(&sub.name, message_id, rules.handler_timeout);
            guarded::as_owner(sub.owner, rules.handler_timeout, || {
                if let Some(t) = traceparent {
                    queries::set_traceparent(client, t)?;
                }
                queries::call_handler(client, call, &args)
            })?;
            if resolve {
                queries::resolve_failed(client, &sub.name, message_id)?;
            }
            if rules.receipts && !m.is_receipt() {
                send_receipt(sub, m, message_id, None);
            }
            Ok(true)
        })
        // An SPI error (not an ERROR raised by PostgreSQL) fails the message like one.
        .unwrap_or_else(|e| pgrx::error!("amqp_outbox: {e}"))
    })
}

/// Keeps a failed message in `amqp.inbox_failed`; at its last attempt, dead-letters it (when
/// the subscription has a dead-letter exchange) and sends a "failed" receipt. Returns whether
/// it is dead.
fn record_failed(
    client: &mut SpiClient<'_>,
    sub: &Sub,
    m: &Message,
    message_id: &str,
    caught: &Caught,
    rules: &Rules,
) -> SpiResult<bool> {
    let delays: Vec<i64> = (0..32)
        .map(|n| rules.backoff.delay(n).as_micros().min(i64::MAX as u128) as i64)
        .collect();
    let rec = queries::record_failure(
        client,
        m,
        message_id,
        &caught.message,
        &caught.sqlstate,
        sub.max_attempts,
        delays,
    )?;
    if rec.dead {
        warning!(
            "amqp_outbox: subscription \"{}\": message {message_id} failed {} times and is dead-lettered: {}",
            sub.name,
            rec.attempts,
            caught.message
        );
        if let Some(dlx) = &sub.dead_letter_exchange {
            let refused = aside(|c| {
                queries::dead_letter(c, sub, dlx, m, message_id, &caught.message, rec.attempts)
            });
            if let Some(why) = refused {
                // It stays in amqp.inbox_failed, dead: nothing is lost, amqp.inbox_retry() or
                // a DELETE decide about it.
                warning!(
                    "amqp_outbox: subscription \"{}\": message {message_id} could not be dead-lettered to \"{dlx}\" and stays in amqp.inbox_failed: {why}",
                    sub.name
                );
                queries::note_dead_letter_refused(client, &sub.name, message_id, &why)?;
            }
        }
        if rules.receipts && !m.is_receipt() {
            send_receipt(sub, m, message_id, Some(&caught.message));
        }
    }
    Ok(rec.dead)
}

/// Runs `publish` (a receipt, a dead letter: an INSERT into the outbox) in a subtransaction of
/// its own. A refusal there (the outbox full at `amqp_outbox.max_pending`, a body or headers
/// over the limits, the broker row deleted) must neither undo the message's handling nor end
/// the batch's transaction, which would restart the worker into the same message again.
/// Returns why it was refused.
fn aside(publish: impl FnOnce(&mut SpiClient<'_>) -> SpiResult<()>) -> Option<String> {
    guarded::subtransaction(|| {
        Spi::connect_mut(publish).unwrap_or_else(|e| pgrx::error!("amqp_outbox: {e}"))
    })
    .err()
    .map(|c| format!("{} (SQLSTATE {})", c.message, c.sqlstate))
}

/// A receipt, aside: one that cannot be sent is logged, and the producer's monitor, seeing no
/// answer, resends the message, which is then answered again as a duplicate.
fn send_receipt(sub: &Sub, m: &Message, message_id: &str, error: Option<&str>) {
    let refused = aside(|c| {
        queries::receipt(
            c,
            sub.broker_id,
            &sub.name,
            message_id,
            error,
            m.business_type(),
        )
    });
    if let Some(why) = refused {
        warning!(
            "amqp_outbox: subscription \"{}\": no receipt for message {message_id}: {why}",
            sub.name
        );
    }
}
