//! The background worker. Everything here runs on the worker's main thread, the only one that
//! may call PostgreSQL; the AMQP side runs on its own thread (crate `amqp_outbox_broker`).
//!
//! - [`main_loop`]: the schedule only: signals, wake-ups, the batch interval, the sweep timer.
//! - [`step`]: one short transaction: record outcomes, reload, claim.
//! - [`events`] turns the AMQP thread's events into a [`settle::Settlement`], which
//!   [`settle`] writes to the table.
//! - [`claim`] reads the next rows and hands them over, built by [`message`].
//! - [`flight`]: what is in flight, held back after a nack, or due for a retry.
//! - [`brokers`]: the configuration sent to the AMQP thread; [`presence`]: is the extension
//!   there; [`status`]: copies to the status views; [`faults`]: test-only fault injection.
//! - [`queries`]: every SQL statement (the claim in `claim.sql`); [`pg`]: the PostgreSQL calls
//!   around them.

pub(crate) mod brokers;
mod claim;
mod events;
mod faults;
mod flight;
mod main_loop;
mod message;
pub(crate) mod pg;
mod presence;
pub(crate) mod queries;
mod settle;
mod status;
mod step;

use crate::{gucs, shmem};
use pgrx::bgworkers::{
    BackgroundWorker, BackgroundWorkerBuilder, BgWorkerStartTime, SignalWakeFlags,
};
use pgrx::prelude::*;
use std::time::Duration;

/// Registers the outbox worker of the database at `slot` (its position in
/// `amqp_outbox.database`, which is also its shared-memory slot).
pub fn register(slot: usize, name: &str) {
    register_for_slot(
        &format!("amqp_outbox worker for {name}"),
        "amqp_outbox",
        "amqp_outbox_worker_main",
        slot,
    );
}

/// Registers one of a database's workers: `function` gets `slot` as its argument. Not started
/// on a standby at all; after promotion it starts and works on what the primary committed.
pub(crate) fn register_for_slot(name: &str, kind: &str, function: &str, slot: usize) {
    BackgroundWorkerBuilder::new(name)
        .set_type(kind)
        .set_library("amqp_outbox")
        .set_function(function)
        .set_argument((slot as i32).into_datum())
        .enable_spi_access()
        .set_start_time(BgWorkerStartTime::RecoveryFinished)
        .set_restart_time(Some(Duration::from_secs(5)))
        .load();
}

/// Run by PostgreSQL as the worker exits: SQL functions must stop setting a latch that is gone.
#[pg_guard]
extern "C-unwind" fn unregister_on_exit(_code: i32, _arg: pg_sys::Datum) {
    shmem::register_worker(shmem::WorkerKind::Outbox, None, 0);
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn amqp_outbox_worker_main(arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    let (slot, database) = gucs::database_of_slot(arg.value());
    shmem::set_worker_slot(slot);
    // Raises FATAL (exit 1, restarted) while the database does not exist yet.
    BackgroundWorker::connect_worker_to_spi(Some(&database), None);
    // Pinned before the first query, for the worker's whole life (see pg::pin): its statements
    // resolve functions and operators in pg_catalog only, whatever a user creates elsewhere.
    pg::pin(c"search_path", c"pg_catalog, pg_temp");
    // Losing the worker's own commits in a crash only means publishing again (at least once);
    // waiting for each WAL flush would cap the drain rate.
    pg::pin(c"synchronous_commit", c"off");
    // The worker's statements are short; a lock wait must not hold a transaction open.
    pg::pin(c"lock_timeout", c"10s");
    // SAFETY: the main thread of a connected worker: MyLatch and MyProcPid are its own, valid
    // until it exits, and the callback registered here clears them from shared memory before
    // that (before_shmem_exit runs while shared memory is still attached).
    unsafe {
        shmem::register_worker(
            shmem::WorkerKind::Outbox,
            Some(pg_sys::MyLatch),
            pg_sys::MyProcPid,
        );
        pg_sys::before_shmem_exit(Some(unregister_on_exit), pg_sys::Datum::from(0));
    }
    log!("amqp_outbox: worker started for database \"{database}\"");
    let handle = match amqp_outbox_broker::spawn() {
        Ok(h) => h,
        Err(e) => error!("amqp_outbox: could not start the AMQP thread: {e}"),
    };
    main_loop::Worker::new(handle).run()
}
