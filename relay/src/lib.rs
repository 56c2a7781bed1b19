//! The relay: amqp_outbox's delivery for hosted PostgreSQL, where no library can be loaded (the
//! plain-SQL install, `sql/hosted/`). It shares the delivery engine (`amqp_outbox_engine`) with
//! the extension's background worker and reaches the database over a client connection.
//!
//! - [`client_outbox`]: the engine's `Outbox` over a `postgres` connection, running the very
//!   statements the worker runs through SPI.
//!
//! Nothing here may depend on pgrx (`make lint` checks): it never runs inside PostgreSQL.

pub mod client_outbox;
