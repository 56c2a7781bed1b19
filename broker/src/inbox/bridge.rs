//! The inbox bridge's message types: the [`InboxCommand`]s the subscription worker sends to
//! its AMQP thread and the [`InboxEvent`]s it gets back. Plain owned data.

use crate::bridge::LogLevel;
use crate::config::BrokerConfig;
use crate::events::{EventSink, FatalEvent};

/// One subscription: a queue consumed on a connection of its own.
#[derive(Clone, Debug, PartialEq)]
pub struct SubscriptionConfig {
    /// The subscription's name, its unique key.
    pub subscription: String,
    /// Hosts (failover), TLS, heartbeat, connect timeout, reconnect backoff, host order. Its
    /// declarations, proof mode, acknowledgement queue and confirm timeout are not used.
    pub broker: BrokerConfig,
    /// The queue to consume. Never declared here: it must exist.
    pub queue: String,
    /// Unacknowledged deliveries at most (`basic.qos`); 0 means no limit.
    pub prefetch: u16,
}

#[derive(Debug)]
pub enum InboxCommand {
    /// The full set of active subscriptions. A subscription no longer listed: its consumer is
    /// cancelled and its connection closed (unacked deliveries go back to the queue). A
    /// subscription whose queue, prefetch, hosts or heartbeat changed is reconnected.
    Configure(Vec<SubscriptionConfig>),
    /// Acknowledge these deliveries (after their effect committed). Tags of an epoch that is no
    /// longer the subscription's current channel, and tags not delivered (or already
    /// acknowledged) on it, are dropped silently: the broker requeued the former when their
    /// channel closed, and acknowledging the latter would close the channel.
    Ack {
        subscription: String,
        epoch: u64,
        delivery_tags: Vec<u64>,
    },
    /// Close and reopen this subscription's connection.
    Reconnect {
        subscription: String,
    },
    Shutdown,
}

/// One message delivered to a subscription, not yet acknowledged.
#[derive(Clone, Debug, PartialEq)]
pub struct Delivery {
    pub subscription: String,
    /// The consumer channel it came on (see [`InboxEvent::Connected`]).
    pub epoch: u64,
    pub delivery_tag: u64,
    pub exchange: String,
    pub routing_key: String,
    pub redelivered: bool,
    pub body: Vec<u8>,
    pub message_id: Option<String>,
    pub content_type: Option<String>,
    pub correlation_id: Option<String>,
    pub reply_to: Option<String>,
    /// The AMQP `user_id` property, which RabbitMQ checks against the publishing connection's
    /// user (receipts carry it).
    pub user_id: Option<String>,
    /// The AMQP `timestamp` property: seconds since the Unix epoch, by convention.
    pub timestamp: Option<u64>,
    /// The AMQP headers as JSON (mapping documented in `inbox::headers`).
    pub headers: serde_json::Map<String, serde_json::Value>,
}

#[derive(Debug)]
pub enum InboxEvent {
    /// The subscription consumes on a new channel. `epoch` numbers the channels of a
    /// subscription from 1 and keeps growing for the thread's lifetime, even when the
    /// subscription is removed and configured again.
    Connected {
        subscription: String,
        host: String,
        epoch: u64,
    },
    /// Down (lost, refused, queue missing…), or not up yet; `error` never contains a password.
    /// Sent again only when the error changes. Deliveries of earlier epochs can no longer be
    /// acknowledged: the broker gives them again.
    Disconnected { subscription: String, error: String },
    /// What arrived, in order, up to 1000 per event.
    Deliveries(Vec<Delivery>),
    /// Messages ready in the queue (not counting those delivered and unacknowledged), and its
    /// consumers, every few seconds while connected.
    QueueDepth {
        subscription: String,
        ready: u32,
        consumers: u32,
    },
    /// Something worth a log line that is not a state change of a subscription.
    Log { level: LogLevel, message: String },
    /// The AMQP thread cannot go on (a task panicked, its runtime failed): restart the worker.
    Fatal(String),
}

impl FatalEvent for InboxEvent {
    fn fatal(text: String) -> Self {
        InboxEvent::Fatal(text)
    }
}

pub(crate) type InboxSink = EventSink<InboxEvent>;
