//! Handling messages, several per transaction, each in its own subtransaction: record its
//! consumption (a duplicate stops there), run the handler as the subscription's owner, and
//! send a receipt through the outbox. A handler error rolls back that message's work only;
//! the message is then kept in `amqp.inbox_failed` (retried with backoff, dead-lettered after
//! `max_attempts`). Acknowledgements go to the broker only after the transaction committed:
//! that is the caller's, which gets an [`Outcome`] per message.
//!
//! The same code for every host: what differs (SPI or a client connection, how a handler is
//! made to run as its owner) is behind [`InboxHost`].

use super::book::Book;
use super::message::{Message, Sub};
use crate::outbox::Caught;
use amqp_outbox_broker::backoff::Backoff;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// What the settings say about handling.
pub struct Rules {
    /// A handler running longer is cancelled (57014) and its message failed; zero: no bound.
    pub handler_timeout: Duration,
    /// `amqp_outbox.receipts_exchange` is set: handled and dead messages are answered.
    pub receipts: bool,
    pub backoff: Backoff,
}

/// What became of a message.
#[derive(Debug, PartialEq)]
pub enum Outcome {
    Handled,
    Duplicate,
    /// Kept in amqp.inbox_failed (and dead-lettered at its last attempt).
    Failed,
    /// Its subscription is gone or paused, or the host is stopping: left unacknowledged (the
    /// broker gives it back).
    Dropped,
    /// Its handler cannot run as the subscription's owner any more (dropped function or role,
    /// revoked privilege): left unacknowledged like a dropped one, without using up an
    /// attempt; the subscriptions must be read again (it then stops, saying why).
    CannotRun,
}

impl Outcome {
    /// Whether the broker may forget the message once the transaction committed.
    pub fn acknowledged(&self) -> bool {
        !matches!(self, Outcome::Dropped | Outcome::CannotRun)
    }
}

/// The SQLSTATEs a handler call raises when the function or its owner is gone, or the owner
/// may not execute it: undefined_function, undefined_object (an owner role dropped: "invalid
/// role OID"), insufficient_privilege. A handler may raise them itself too; the subscription is
/// then checked to tell the two apart.
const MAYBE_CANNOT_RUN: [&str; 3] = ["42883", "42704", "42501"];

/// SQLSTATE 57014 (query_canceled): what a handler that ended its worker is recorded with.
pub const QUERY_CANCELED: &str = "57014";

/// What a failure did to the message's record.
pub struct FailedRecord {
    pub attempts: i32,
    pub dead: bool,
}

/// What handling needs of its host. Every method runs inside the transaction the host opened.
pub trait InboxHost {
    type Error: std::fmt::Display;

    /// [`super::statements::CONSTRAINTS_IMMEDIATE_SQL`].
    fn constraints_immediate(&mut self) -> Result<(), Self::Error>;
    /// Which of these subscriptions have failed messages now.
    fn with_failed(&mut self, subs: &[String]) -> Result<BTreeSet<String>, Self::Error>;
    /// The host is asked to stop: the rest of the batch goes back to the broker.
    fn stop_requested(&self) -> bool;
    /// Whether `amqp.subscription` was written in this transaction since the last call (a
    /// handler that unsubscribed); a host that cannot tell says true.
    fn subscriptions_written(&mut self) -> bool;
    fn subscription_names(&mut self) -> Result<Vec<String>, Self::Error>;
    fn derived_message_id(&mut self, content: Vec<u8>) -> Result<String, Self::Error>;
    /// A message whose handler ended an earlier process of this host (a timeout the handler
    /// ignored, a kill): taken from the host's memory, recorded as failed without running it.
    fn left_behind(&mut self, subscription: &str, message_id: &str) -> Option<Caught>;
    /// [`super::statements::CONSUME_SQL`]: false for a duplicate.
    fn consume(&mut self, subscription: &str, message_id: &str) -> Result<bool, Self::Error>;
    /// Runs the subscription's handler on the message, as the subscription's owner, bounded by
    /// `timeout`, with the message's trace context; its settings changes undone afterwards.
    fn call_handler(
        &mut self,
        sub: &Sub,
        m: &Message,
        message_id: &str,
        timeout: Duration,
    ) -> Result<(), Self::Error>;
    fn resolve_failed(&mut self, subscription: &str, message_id: &str) -> Result<(), Self::Error>;
    fn runs_as_problem(&mut self, subscription: &str) -> Result<Option<String>, Self::Error>;
    fn record_failure(
        &mut self,
        m: &Message,
        message_id: &str,
        caught: &Caught,
        max_attempts: i32,
        delays: &[i64],
    ) -> Result<FailedRecord, Self::Error>;
    fn dead_letter(
        &mut self,
        sub: &Sub,
        exchange: &str,
        m: &Message,
        headers: serde_json::Map<String, serde_json::Value>,
    ) -> Result<(), Self::Error>;
    fn receipt(
        &mut self,
        sub: &Sub,
        message_id: &str,
        error: Option<&str>,
        business_type: Option<&str>,
    ) -> Result<(), Self::Error>;
    fn note_dead_letter_refused(
        &mut self,
        subscription: &str,
        message_id: &str,
        why: &str,
    ) -> Result<(), Self::Error>;
    fn warning(&mut self, text: &str);
    /// Runs `work` so that an error inside undoes only what it did (a subtransaction, a
    /// SAVEPOINT), as [`crate::outbox::Outbox::subtransaction`].
    fn subtransaction<R>(
        &mut self,
        work: impl FnOnce(&mut Self) -> Result<R, Self::Error>,
    ) -> Result<Result<R, Self::Error>, Caught>;
}

/// The backoff per attempt count, in microseconds, for [`InboxHost::record_failure`].
pub fn retry_delays(backoff: &Backoff) -> Vec<i64> {
    (0..32)
        .map(|n| backoff.delay(n).as_micros().min(i64::MAX as u128) as i64)
        .collect()
}

/// The headers of a dead letter: the message's, and where it came from and why it died.
pub fn dead_letter_headers(
    sub: &Sub,
    m: &Message,
    message_id: &str,
    error: &str,
    attempts: i32,
) -> serde_json::Map<String, serde_json::Value> {
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
    headers
}

/// Handles `messages` in the current transaction. Returns, for each, what happened; updates
/// the counters in `book`.
pub fn handle_all<H: InboxHost>(
    host: &mut H,
    subs: &BTreeMap<String, Sub>,
    messages: &[Message],
    rules: &Rules,
    book: &mut Book,
) -> Result<Vec<Outcome>, H::Error> {
    let mut out = Vec::with_capacity(messages.len());
    host.constraints_immediate()?;
    // Handled messages leave amqp.inbox_failed; look there only for subscriptions that have
    // failed messages (and for retries, which come from it).
    let names: Vec<String> = subs.keys().cloned().collect();
    let mut has_failed = host.with_failed(&names)?;
    // Subscriptions removed by a handler of this batch (amqp.unsubscribe() on itself): their
    // other messages go back to the broker instead of being handled for a subscription that
    // is gone once the batch commits.
    let mut gone: Vec<String> = Vec::new();
    host.subscriptions_written();
    for m in messages {
        if host.stop_requested() {
            out.push(Outcome::Dropped);
            continue;
        }
        if host.subscriptions_written() {
            let now = host.subscription_names()?;
            gone = subs.keys().filter(|s| !now.contains(*s)).cloned().collect();
        }
        let Some(sub) = subs
            .get(&m.subscription)
            .filter(|s| s.handler.is_some() && !gone.contains(&s.name))
        else {
            out.push(Outcome::Dropped);
            continue;
        };
        if m.delivery.is_some() {
            book.entry(&sub.name).delivered += 1;
        }
        let message_id = match &m.message_id {
            Some(id) => id.clone(),
            None => host.derived_message_id(m.digest_input())?,
        };
        let resolve = m.retry || has_failed.contains(&sub.name);
        let outcome = match host.left_behind(&sub.name, &message_id) {
            Some(caught) => Err(caught),
            None => handle_one(host, sub, m, &message_id, rules, resolve),
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
                    host.resolve_failed(&sub.name, &message_id)?;
                }
                // Answered again: a producer resends a message when it saw no receipt, and the
                // receipt may be what was lost.
                if rules.receipts && !m.is_receipt() {
                    send_receipt(host, sub, m, &message_id, None);
                }
                Outcome::Duplicate
            }
            Err(caught)
                if MAYBE_CANNOT_RUN.contains(&caught.sqlstate.as_str())
                    && host.runs_as_problem(&sub.name)?.is_some() =>
            {
                Outcome::CannotRun
            }
            Err(caught) => {
                let text = format!("{} (SQLSTATE {})", caught.message, caught.sqlstate);
                let dead = record_failed(host, sub, m, &message_id, &caught, rules)?;
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

/// One message in its own subtransaction: `Ok(true)` handled, `Ok(false)` a duplicate. A
/// host error inside (not an ERROR the handler raised) fails the message like one.
fn handle_one<H: InboxHost>(
    host: &mut H,
    sub: &Sub,
    m: &Message,
    message_id: &str,
    rules: &Rules,
    resolve: bool,
) -> Result<bool, Caught> {
    let done = host.subtransaction(|h| {
        if !h.consume(&sub.name, message_id)? {
            return Ok(false);
        }
        h.call_handler(sub, m, message_id, rules.handler_timeout)?;
        if resolve {
            h.resolve_failed(&sub.name, message_id)?;
        }
        if rules.receipts && !m.is_receipt() {
            send_receipt(h, sub, m, message_id, None);
        }
        Ok(true)
    })?;
    done.map_err(|e| Caught {
        sqlstate: "XX000".into(),
        message: e.to_string(),
    })
}

/// Keeps a failed message in `amqp.inbox_failed`; at its last attempt, dead-letters it (when
/// the subscription has a dead-letter exchange) and sends a "failed" receipt. Returns whether
/// it is dead.
fn record_failed<H: InboxHost>(
    host: &mut H,
    sub: &Sub,
    m: &Message,
    message_id: &str,
    caught: &Caught,
    rules: &Rules,
) -> Result<bool, H::Error> {
    let delays = retry_delays(&rules.backoff);
    let rec = host.record_failure(m, message_id, caught, sub.max_attempts, &delays)?;
    if rec.dead {
        host.warning(&format!(
            "subscription \"{}\": message {message_id} failed {} times and is dead-lettered: {}",
            sub.name, rec.attempts, caught.message
        ));
        if let Some(dlx) = &sub.dead_letter_exchange {
            let headers = dead_letter_headers(sub, m, message_id, &caught.message, rec.attempts);
            let refused = aside(host, |h| h.dead_letter(sub, dlx, m, headers));
            if let Some(why) = refused {
                // It stays in amqp.inbox_failed, dead: nothing is lost, amqp.inbox_retry() or
                // a DELETE decide about it.
                host.warning(&format!(
                    "subscription \"{}\": message {message_id} could not be dead-lettered to \"{dlx}\" and stays in amqp.inbox_failed: {why}",
                    sub.name
                ));
                host.note_dead_letter_refused(&sub.name, message_id, &why)?;
            }
        }
        if rules.receipts && !m.is_receipt() {
            send_receipt(host, sub, m, message_id, Some(&caught.message));
        }
    }
    Ok(rec.dead)
}

/// Runs `publish` (a receipt, a dead letter: an INSERT into the outbox) in a subtransaction of
/// its own. A refusal there (the outbox full at `amqp_outbox.max_pending`, a body or headers
/// over the limits, the broker row deleted) must neither undo the message's handling nor end
/// the batch's transaction, which would start the host again into the same message. Returns
/// why it was refused.
fn aside<H: InboxHost>(
    host: &mut H,
    publish: impl FnOnce(&mut H) -> Result<(), H::Error>,
) -> Option<String> {
    match host.subtransaction(publish) {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e.to_string()),
        Err(c) => Some(format!("{} (SQLSTATE {})", c.message, c.sqlstate)),
    }
}

/// A receipt, aside: one that cannot be sent is logged, and the producer's monitor, seeing no
/// answer, resends the message, which is then answered again as a duplicate.
fn send_receipt<H: InboxHost>(
    host: &mut H,
    sub: &Sub,
    m: &Message,
    message_id: &str,
    error: Option<&str>,
) {
    let refused = aside(host, |h| {
        h.receipt(sub, message_id, error, m.business_type())
    });
    if let Some(why) = refused {
        host.warning(&format!(
            "subscription \"{}\": no receipt for message {message_id}: {why}",
            sub.name
        ));
    }
}
