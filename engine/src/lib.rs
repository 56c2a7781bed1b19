//! The delivery logic of amqp_outbox that is neither PostgreSQL's API nor a connection to it:
//! plain Rust, shared by whatever hosts the delivery (today the extension's background worker,
//! which reads and writes the outbox through SPI on its main thread).
//!
//! - [`flight`]: what is in flight, held back after a nack, or due for a retry; the proof of
//!   delivery each message still needs.
//! - [`scan_floor`]: the lowest id a claim must read from, so that a claim reads about one
//!   tuple per delivered message and never misses a row committed late.
//! - [`cadence`], [`gather`], [`pacer`]: when the loop claims, how long commits gather into one
//!   batch, how periodic statements are spaced.
//! - [`standby_gate`]: what may leave for the broker once the named standbys have the commits.
//! - [`row`], [`message`]: a claimed row, and the AMQP message made of it; [`headers`]: the
//!   user's jsonb headers and arguments, checked before they go to AMQP.
//! - [`brokers`]: the broker configuration read from the tables ([`broker_tables`]) and sent to
//!   the AMQP thread.
//! - [`claim`]: reads the next rows and hands them over; [`events`] turns the AMQP thread's
//!   events into a [`settle::Settlement`], which [`settle`] writes to the table; [`faults`]:
//!   test-only fault injection.
//! - [`consume`]: the consuming side: subscriptions, their messages handled in batches, the
//!   counters.
//! - [`monitor`]: the reconciliation monitor's rounds and its compensations.
//! - [`scheduled`]: delayed messages moved into the outbox when due; old idempotency keys.
//! - [`settings`]: the settings the delivery reads, filled by the host from its configuration.
//! - [`wait_ms`]: a wait's timeout in whole milliseconds, rounded up, for every host's waits.
//! - [`outbox`], [`telemetry`]: what the delivery needs of its host, as traits: the statements
//!   it runs on `amqp.message` (inside the transactions the host opens); where its counters and
//!   log lines go; [`statements`]: the texts of those statements, for every host to run.
//!
//! Nothing here may depend on pgrx (`make lint` checks): it never runs PostgreSQL code.

pub mod broker_tables;
pub mod brokers;
pub mod cadence;
pub mod claim;
pub mod consume;
pub mod events;
pub mod faults;
pub mod flight;
pub mod gather;
pub mod headers;
pub mod message;
pub mod monitor;
pub mod outbox;
pub mod pacer;
pub mod row;
pub mod scan_floor;
pub mod scheduled;
pub mod settings;
pub mod settle;
pub mod standby_gate;
pub mod statements;
pub mod telemetry;
pub mod wait_ms;
