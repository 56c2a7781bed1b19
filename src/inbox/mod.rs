//! The subscription worker: one per database, its own process, so that handlers (user code,
//! possibly slow or stuck) never hold up the outbox worker's publishing. Everything here runs
//! on the worker's main thread; the AMQP side is the broker crate's inbox thread.
//!
//! - [`main_loop`]: the schedule: events from the AMQP thread, reloads, retries, retention.
//! - [`subscriptions`]: the active subscriptions as read from `amqp.subscription`.
//! - [`handling`]: the engine's handling of a batch (one transaction, one subtransaction per
//!   message; `amqp_outbox_engine::consume`) on SPI.
//! - [`guarded`]: a subtransaction that catches the handler's error, with a time bound.
//! - [`lane`]: the lanes, processes that handle the messages of subscriptions with a
//!   parallelism or an ordering, which the subscription worker hands them.
//! - [`queries`]: the statements through SPI (the engine's texts, and the lanes' own).

pub(crate) mod guarded;
mod handling;
mod lane;
mod main_loop;
mod queries;
mod subscriptions;

use crate::shmem;
use crate::worker::pg;
use pgrx::bgworkers::{BackgroundWorker, SignalWakeFlags};
use pgrx::prelude::*;

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn amqp_outbox_inbox_main(arg: pg_sys::Datum) {
    let database = start_user_code_process(arg);
    // A message is acknowledged once its transaction committed: that commit must be durable
    // (unlike the outbox worker's), whatever postgresql.conf says.
    pg::pin(c"synchronous_commit", c"on");
    crate::worker::announce(shmem::WorkerKind::Inbox, &database);
    log!("amqp_outbox: subscription worker started for database \"{database}\"");
    let handle = match amqp_outbox_broker::inbox::spawn() {
        Ok(h) => h,
        Err(e) => error!("amqp_outbox: could not start the subscription worker's AMQP thread: {e}"),
    };
    main_loop::Inbox::new(handle).run()
}

/// The start of a process that runs users' functions (the subscription worker, the monitor):
/// signals, and its own SIGTERM handler that ends a function which does not return; connected
/// to its slot's database; the search_path functions get (the one the database would give a
/// session: postgresql.conf, ALTER DATABASE ... SET; see `guarded::as_owner`) remembered before
/// the process pins its own (plain SQL resolves in pg_catalog only). Returns the database name.
pub(crate) fn start_user_code_process(arg: pg_sys::Datum) -> String {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    crate::watchdog::install();
    let database = crate::worker::connect_to_slot_database(arg);
    guarded::remember_handler_search_path();
    pg::pin(c"search_path", c"pg_catalog, pg_temp");
    pg::pin(c"lock_timeout", c"10s");
    database
}
