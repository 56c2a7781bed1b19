//! The consuming side's logic, shared by its hosts (the extension's subscription worker and
//! lanes through SPI, the relay over a client connection):
//!
//! - [`message`]: a subscription as handling needs it, and a message to handle.
//! - [`handling`]: a batch handled in one transaction, one subtransaction per message, what
//!   became of each; [`handling::InboxHost`] is what it needs of its host.
//! - [`events`]: what the consumers' AMQP thread reports, taken by the loop.
//! - [`lanes`]: which subscriptions' waiting messages each lane takes.
//! - [`subscriptions`]: the active subscriptions and what the AMQP thread is told of them.
//! - [`acks`]: the deliveries to acknowledge after the commit, and those waiting for lanes.
//! - [`book`]: the counters and states written to `amqp._subscription_state`.
//! - [`statements`]: the texts of every statement, for each host to run.

pub mod acks;
pub mod book;
pub mod events;
pub mod handling;
pub mod lanes;
pub mod message;
pub mod statements;
pub mod subscriptions;
