//! One publish on its way from the worker to a publishing channel. It is the one type that
//! travels from the router to the broker's task to the channel's task, and it answers for its
//! messages wherever it stops: dropped with messages still in it (broker not configured, not
//! connected, channel closed before their turn), it fails each of them as `Transient`, with the
//! reason the last hand that held it gave.

use crate::bridge::{Event, Failure, OutboundMessage};
use crate::events::EventSink;
use std::collections::VecDeque;

pub(crate) struct Batch {
    broker_id: i32,
    messages: VecDeque<OutboundMessage>,
    solo: bool,
    sink: EventSink,
    unsent: String,
}

impl Batch {
    pub(crate) fn new(
        broker_id: i32,
        messages: Vec<OutboundMessage>,
        solo: bool,
        sink: EventSink,
    ) -> Self {
        Batch {
            broker_id,
            messages: messages.into(),
            solo,
            sink,
            unsent: "publishing channel closed".to_string(),
        }
    }

    /// Why its messages were not sent, should it be dropped now.
    pub(crate) fn unsent_because(&mut self, why: impl Into<String>) {
        self.unsent = why.into();
    }

    /// Each message is published only after the previous one settled (see `Command::Publish`).
    pub(crate) fn solo(&self) -> bool {
        self.solo
    }

    /// The next message to publish; the caller answers for it from now on.
    pub(crate) fn take_next(&mut self) -> Option<OutboundMessage> {
        self.messages.pop_front()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        for m in self.messages.drain(..) {
            self.sink.send(Event::Failed {
                broker_id: self.broker_id,
                id: m.id,
                failure: Failure::Transient,
                error: self.unsent.clone(),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bridge::fixtures::message;

    #[test]
    fn a_dropped_batch_fails_what_it_still_holds_with_the_last_reason() {
        let (sink, rx, _wake) = EventSink::for_test();
        let mut batch = Batch::new(7, vec![message(1), message(2), message(3)], false, sink);
        let taken = batch.take_next().map(|m| m.id);
        assert_eq!(taken, Some(1));
        batch.unsent_because("broker 7 is not connected");
        drop(batch);
        let failed: Vec<(i64, String)> = rx
            .try_iter()
            .map(|e| match e {
                Event::Failed {
                    broker_id: 7,
                    id,
                    failure: Failure::Transient,
                    error,
                } => (id, error),
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(
            failed,
            vec![
                (2, "broker 7 is not connected".to_string()),
                (3, "broker 7 is not connected".to_string())
            ]
        );
    }
}
