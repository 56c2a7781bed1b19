//! The relay: amqp_outbox's delivery for hosted PostgreSQL, where no library can be loaded (the
//! plain-SQL install, `sql/hosted/`). It shares the delivery engine (`amqp_outbox_engine`) with
//! the extension's background worker and reaches the database over client connections.
//!
//! - [`config`]: the databases and settings, from a file, the environment and the command line.
//! - [`database`]: one thread per database: its [`lease`] (the advisory lock that makes one
//!   relay the active one, and the LISTEN for commits) and, while it is held, the [`delivery`].
//! - [`delivery`]: the engine's claim, events and settling in the worker's order; [`doorbell`]:
//!   whether publishers notify it (only while it sleeps);
//!   [`client_outbox`]: the engine's `Outbox` over a `postgres` connection, running the very
//!   statements the worker runs through SPI; [`report`]: the counters and connections the
//!   status views show.
//! - [`consume`]: the subscriptions' consumers and the engine's handling of their messages,
//!   on a thread and connection of their own; [`client_inbox`]: the engine's `InboxHost` over
//!   a `postgres` connection, handlers run as their owners; [`lanes`]: more threads for
//!   subscriptions with a parallelism.
//! - [`monitor`]: the reconciliation monitor's rounds and compensations.
//! - [`runners`]: users' code (handlers, compensations) run as its owner.
//! - [`savepoint`]: a subtransaction over a client connection, for both hosts.
//! - [`cli`]: the command; [`connect`], [`tls`], [`log`], [`stop`]: connections (TLS with
//!   libpq's `sslmode`), log lines on stderr, SIGTERM.
//!
//! Nothing here may depend on pgrx (`make lint` checks): it never runs inside PostgreSQL.

pub mod cli;
pub mod client_inbox;
pub mod client_outbox;
pub mod config;
pub mod connect;
pub mod consume;
pub mod database;
pub mod delivery;
pub mod doorbell;
pub mod lanes;
pub mod lease;
pub mod leased;
pub mod log;
pub mod monitor;
pub mod report;
pub mod runners;
pub mod savepoint;
pub mod stop;
pub mod tls;
