//! The consuming side ("subscriptions"): a separate AMQP thread for the subscription worker,
//! with a bridge of its own. The worker sends [`InboxCommand`]s through [`InboxHandle`] and
//! receives [`InboxEvent`]s, announced on the handle's wake socket.
//!
//! Files, bottom up: `bridge` (the message types), `headers` (AMQP headers → JSON), `acks`
//! (which acknowledgement frames to send), `depth` (the queue depth probe), `consumer` (one
//! subscription, a reconnect client on a connection of its own), `router` (one consumer per
//! subscription), `thread` (the thread and the worker's handle).

mod acks;
mod bridge;
mod consumer;
mod depth;
mod headers;
mod router;
mod thread;

pub use bridge::{Delivery, InboxCommand, InboxEvent, SubscriptionConfig};
pub use thread::{spawn, InboxHandle};
