//! The monitor: one per database, its own process, so that reconciliation never waits for a
//! subscription handler and never delays one. About once a second it runs `amqp._monitor()`
//! (receipts counted, due messages classified, resends, compensations queued), then the due
//! compensations; every few seconds the counts `amqp.health()` reads, and the production log's
//! day partitions and retention.
//!
//! - [`schedule`]: the loop and its time budget.
//! - [`compensation`]: one compensation per transaction, run as its handler's owner.

mod compensation;
mod schedule;

use crate::inbox::guarded;
use crate::shmem;
use crate::worker::pg;
use pgrx::bgworkers::{BackgroundWorker, SignalWakeFlags};
use pgrx::prelude::*;

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn amqp_outbox_monitor_main(arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    // A compensation that does not return cannot keep the process from a SIGTERM.
    crate::watchdog::install();
    let database = crate::worker::connect_to_slot_database(arg);
    // Compensation handlers run with the search_path the database gives a session; the
    // monitor's own statements resolve in pg_catalog only.
    guarded::remember_handler_search_path();
    pg::pin(c"search_path", c"pg_catalog, pg_temp");
    pg::pin(c"lock_timeout", c"10s");
    crate::worker::announce(shmem::WorkerKind::Monitor, &database);
    log!("amqp_outbox: monitor started for database \"{database}\"");
    schedule::Monitor::default().run()
}
