//! The two message types between the worker's main thread and the AMQP thread: the
//! [`Command`]s it sends and the [`Event`]s it gets back, with what they carry.

use crate::config::BrokerConfig;

/// One row of `amqp.message`, as the worker publishes it.
#[derive(Clone, Debug, PartialEq)]
pub struct OutboundMessage {
    pub id: i64,
    pub exchange: String,
    pub routing_key: String,
    pub body: Vec<u8>,
    /// 1 = transient, 2 = persistent.
    pub delivery_mode: u8,
    pub content_type: Option<String>,
    pub reply_to: Option<String>,
    pub correlation_id: Option<String>,
    /// Stable across every resend of this row.
    pub message_id: String,
    /// Seconds since the Unix epoch (AMQP `timestamp` property).
    pub timestamp: u64,
    /// Headers to send: the caller's (a JSON object) merged with the producer headers.
    pub headers: serde_json::Map<String, serde_json::Value>,
    /// Fault injection for tests: behave as if this message and its acknowledgement record were
    /// lost in transit (nothing is sent, no confirm is awaited; it is registered as published
    /// on the current channel, so a later acknowledgement record reports it [`Event::Lost`]).
    /// In `Confirm` mode nothing ever reports it: only the worker's own timeout does.
    pub lose_in_transit: bool,
}

#[derive(Debug)]
pub enum Command {
    /// The full set of brokers. Brokers no longer listed are disconnected.
    Configure(Vec<BrokerConfig>),
    /// Publish these, in this order, on the broker's current channel. With `solo`, each message
    /// is published only after the previous one is settled, so an error is attributable to it.
    ///
    /// Every message gets exactly one answer: its id in one [`Event::Confirmed`], or one
    /// [`Event::Failed`] (at once with [`Failure::Transient`] when the broker is not connected
    /// or not configured), unless the thread reports [`Event::Fatal`].
    ///
    /// Exception: a message with `lose_in_transit` that reaches a live publishing channel gets
    /// neither; in `AckQueue` mode it is reported [`Event::Lost`] once a later record of that
    /// channel arrives, otherwise the worker's own timeout handles it. (If the channel is down
    /// or dies before its turn, it fails `Transient` like any other.)
    ///
    /// In `AckQueue` mode the messages are followed on the same channel by an acknowledgement
    /// record listing them: each message at once with `solo`, a command of many messages at
    /// once, small commands together within a few milliseconds. It goes to `ack_queue` (default
    /// exchange, mandatory, persistent, `application/json`):
    /// `{"v":1,"session":"<hex u64 per AMQP thread>","epoch":E,"seq":N,"ids":[…]}`, `seq`
    /// numbering the records of channel `E` from 1. The record's own confirm is not reported.
    Publish {
        broker_id: i32,
        messages: Vec<OutboundMessage>,
        solo: bool,
    },
    /// Close and reopen this broker's connection (for `amqp.disconnect()`).
    Reconnect {
        broker_id: i32,
    },
    Shutdown,
}

impl Command {
    /// How many messages it publishes.
    pub fn messages(&self) -> usize {
        match self {
            Command::Publish { messages, .. } => messages.len(),
            _ => 0,
        }
    }
}

/// How a publish failed, which decides what the worker does with the row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// Not the message's fault (connection lost, not connected, timeout): publish it again,
    /// without counting an attempt.
    Transient,
    /// The channel was closed by an error while this message was unconfirmed; the culprit may be
    /// another message. Publish it again alone (`solo`) to find out.
    Ambiguous,
    /// The broker nacked it: it could not take responsibility for it (an internal error, a
    /// queue refusing publishes while full or electing a leader). Not the message's fault:
    /// publish it again after a delay, without counting an attempt. After several nacks in a
    /// row the connection is replaced, since a channel can stay in that state.
    Nacked,
    /// This message was refused (returned as unroutable, channel error while it was the only
    /// one in flight): count an attempt, back off, park after the limit.
    Rejected,
    /// This message can never be published as it is (its properties do not fit in one frame
    /// of this connection, a property AMQP cannot carry): park it at once.
    Unsendable,
}

#[derive(Debug)]
pub enum Event {
    /// A connection and a confirm-mode channel are up. `epoch` grows with every new channel.
    Connected {
        broker_id: i32,
        host: String,
        epoch: u64,
    },
    /// The connection is down (or never came up); `error` never contains a password.
    Disconnected { broker_id: i32, error: String },
    /// The broker stopped (`true`) or resumed (`false`) reading this connection's publishes
    /// (a resource alarm). Sent after `Connected` while still blocked. Meanwhile confirms do
    /// not come, and a message waiting for one is not lost.
    Blocked { broker_id: i32, blocked: bool },
    /// Positively confirmed with no return: these rows are on the broker.
    Confirmed {
        broker_id: i32,
        epoch: u64,
        ids: Vec<i64>,
    },
    /// `AckQueue` mode: the listener saw the acknowledgement records of these messages, published
    /// on channel `epoch` of this process. (Records of another process are ignored.)
    Acked {
        broker_id: i32,
        epoch: u64,
        ids: Vec<i64>,
        /// How many records listed them (records arriving together become one event).
        records: usize,
    },
    /// `AckQueue` mode, the gap rule: these messages were published on channel `epoch` before a
    /// message whose acknowledgement record has arrived, and their own record did not arrive
    /// first. Records of one channel reach the queue in order, so they were lost in transit
    /// (unless confirmed, which proves the message itself arrived).
    Lost {
        broker_id: i32,
        epoch: u64,
        ids: Vec<i64>,
    },
    /// Not delivered.
    Failed {
        broker_id: i32,
        id: i64,
        failure: Failure,
        error: String,
    },
    /// Something worth a log line that is not a state change of a connection.
    Log { level: LogLevel, message: String },
    /// The AMQP thread cannot go on (its runtime failed); the worker should exit and restart.
    Fatal(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogLevel {
    Debug,
    Info,
    Warning,
}

/// Messages for unit tests.
#[cfg(test)]
pub(crate) mod fixtures {
    use super::*;

    /// A persistent message to the default exchange, routing key "k", with no properties.
    pub(crate) fn message(id: i64) -> OutboundMessage {
        OutboundMessage {
            id,
            exchange: String::new(),
            routing_key: "k".into(),
            body: vec![],
            delivery_mode: 2,
            content_type: None,
            reply_to: None,
            correlation_id: None,
            message_id: format!("m{id}"),
            timestamp: 0,
            headers: Default::default(),
            lose_in_transit: false,
        }
    }
}
