//! What the consumers' AMQP thread reports, taken by the consuming side's loop: deliveries
//! queued for handling, connection states and queue depths noted for the status view, log
//! lines passed on; and when a subscription has handled everything its queue held.

use super::book::Book;
use super::message::Message;
use crate::telemetry::Level;
use amqp_outbox_broker::inbox::InboxEvent;
use amqp_outbox_broker::LogLevel;
use std::collections::{BTreeMap, VecDeque};
use std::time::SystemTime;

/// What a loop keeps of the events between its steps.
#[derive(Default)]
pub struct Taken {
    /// Deliveries not handled yet, in arrival order.
    pub pending: VecDeque<Message>,
    /// Per subscription: when its queue was last reported empty, not yet known to be handled
    /// up to then (see [`Taken::note_caught_up`]).
    empty_at: BTreeMap<String, SystemTime>,
}

/// The AMQP thread cannot go on (restart the loop): why.
pub struct Fatal(pub String);

impl Taken {
    /// Takes `events`; log lines go to `log`.
    pub fn take(
        &mut self,
        events: Vec<InboxEvent>,
        book: &mut Book,
        log: &mut dyn FnMut(Level, &str),
    ) -> Result<(), Fatal> {
        for event in events {
            match event {
                InboxEvent::Deliveries(ds) => {
                    self.pending.extend(ds.into_iter().map(Message::from));
                }
                // The AMQP thread logs the connection itself (host, queue, prefetch, channel).
                InboxEvent::Connected {
                    subscription, host, ..
                } => {
                    let e = book.entry(&subscription);
                    e.connection = Some((true, Some(host)));
                    e.error = Some(None);
                }
                InboxEvent::Disconnected {
                    subscription,
                    error,
                } => {
                    log(
                        Level::Log,
                        &format!("subscription \"{subscription}\" not consuming: {error}"),
                    );
                    let e = book.entry(&subscription);
                    e.connection = Some((false, None));
                    e.error = Some(Some(error));
                }
                InboxEvent::QueueDepth {
                    subscription,
                    ready,
                    consumers,
                } => {
                    if ready == 0 {
                        self.empty_at
                            .entry(subscription.clone())
                            .or_insert_with(SystemTime::now);
                    }
                    book.entry(&subscription).queue = Some((
                        i64::from(ready),
                        i32::try_from(consumers).unwrap_or(i32::MAX),
                    ));
                }
                InboxEvent::Log { level, message } => log(
                    match level {
                        LogLevel::Debug => Level::Debug,
                        LogLevel::Info => Level::Log,
                        LogLevel::Warning => Level::Warning,
                    },
                    &message,
                ),
                InboxEvent::Fatal(why) => return Err(Fatal(why)),
            }
        }
        Ok(())
    }

    /// A subscription whose queue was seen empty at `t`, with none of the deliveries that came
    /// before that report still waiting (here, or where `waiting` says), has handled
    /// (committed, in earlier steps) everything its queue held until `t`: the monitor may
    /// decide that an answer sent until then is missing, not late. (Deliveries come through
    /// the same ordered channel as the depth reports; a failed one is kept in
    /// amqp.inbox_failed, handled too.)
    pub fn note_caught_up(&mut self, book: &mut Book, waiting: impl Fn(&str) -> bool) {
        let pending = &self.pending;
        self.empty_at.retain(|sub, at| {
            if pending.iter().any(|m| &m.subscription == sub) || waiting(sub) {
                return true;
            }
            book.entry(sub).caught_up = Some(*at);
            false
        });
    }
}
