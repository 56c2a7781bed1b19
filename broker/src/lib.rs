//! The AMQP side of amqp_outbox's worker. This crate does not depend on `pgrx`: it runs
//! on its own thread (tokio + lapin), and PostgreSQL's C API is single-threaded.
//!
//! The worker's main thread talks to it through [`BrokerHandle`]: it sends [`Command`]s and
//! receives [`Event`]s. Each batch of events is announced by a byte on a socket that the main
//! thread waits on (`WaitLatchOrSocket`), so a confirm wakes it at once without polling.
//!
//! Modules import only from layers below their own (`tests/layers.rs` checks it), bottom up:
//! 1. data and leaf helpers: `config`, `amqp_values`, `backoff`, `wake`, `exchange_probe`,
//!    `identity`;
//! 2. `bridge` (the Command and Event types), `ack` (acknowledgement records), `connection`
//!    (open and close one connection, TLS, error texts, redaction), `reconnect` (the one
//!    reconnect driver: host rounds, backoff, interruptions);
//! 3. `events` (the event sink, guarded tasks), `outbound` (a message as AMQP publishes it);
//! 4. `batch` (one publish on its way), `runtime_thread` (the frame of an AMQP thread: signals
//!    blocked, a current-thread runtime, panics reported);
//! 5. what runs on a connection: `publisher` (one publishing channel), `declare`, `listener`
//!    (the acknowledgement queue's consumer, a reconnect client);
//! 6. `session` (one broker's publishing connection, a reconnect client);
//! 7. `supervisor` (routes commands to brokers); 8. `thread` (the AMQP thread itself).
//!
//! [`inbox`], the consuming side ("subscriptions"), is a second AMQP thread with a bridge of
//! its own, built on the same lower layers (connection, reconnect driver, events); it sits in
//! layer 5, beside the other clients of a broker.

mod ack;
mod amqp_values;
pub mod backoff;
mod batch;
mod bridge;
mod config;
mod connection;
mod declare;
mod events;
mod exchange_probe;
pub mod identity;
pub mod inbox;
mod listener;
mod outbound;
mod publisher;
mod reconnect;
mod runtime_thread;
mod session;
mod supervisor;
mod thread;
pub mod wake;

pub use amqp_values::header_table_size;
pub use bridge::{Command, Event, Failure, LogLevel, OutboundMessage};
pub use config::{
    AckQueueConfig, BindingDecl, BrokerConfig, Endpoint, ExchangeDecl, ProofMode, QueueDecl,
    RecordWait, TlsOptions,
};
pub use connection::tls_client_config;
pub use runtime_thread::spawn_without_signals;
pub use thread::{spawn, BrokerHandle};
