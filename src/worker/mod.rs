//! The background worker. Everything here runs on the worker's main thread, the only one that
//! may call PostgreSQL; the AMQP side runs on its own thread (crate `amqp_outbox_broker`).

mod flight;
mod main_loop;
mod pg;
mod queries;

pub use queries::ack_queue_name;

use crate::{gucs, shmem};
use pgrx::bgworkers::{
    BackgroundWorker, BackgroundWorkerBuilder, BgWorkerStartTime, SignalWakeFlags,
};
use pgrx::prelude::*;
use std::time::Duration;

/// Registers the worker; called from `_PG_init` while shared_preload_libraries is processed.
pub fn register() {
    BackgroundWorkerBuilder::new("amqp_outbox worker")
        .set_type("amqp_outbox")
        .set_library("amqp_outbox")
        .set_function("amqp_outbox_worker_main")
        .enable_spi_access()
        // Not started on a standby at all; after promotion it starts and publishes what the
        // primary committed.
        .set_start_time(BgWorkerStartTime::RecoveryFinished)
        .set_restart_time(Some(Duration::from_secs(5)))
        .load();
}

unsafe extern "C-unwind" fn unregister_on_exit(_code: i32, _arg: pg_sys::Datum) {
    shmem::register_worker(None, 0);
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn amqp_outbox_worker_main(_arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    let database = gucs::database_name();
    // Raises FATAL (exit 1, restarted) while the database does not exist yet.
    BackgroundWorker::connect_worker_to_spi(Some(&database), None);
    unsafe {
        shmem::register_worker(Some(pg_sys::MyLatch), pg_sys::MyProcPid);
        pg_sys::before_shmem_exit(Some(unregister_on_exit), pg_sys::Datum::from(0));
        // Losing the worker's own commits in a crash only means publishing again (at least
        // once); waiting for each WAL flush would cap the drain rate.
        pg_sys::SetConfigOption(
            c"synchronous_commit".as_ptr(),
            c"off".as_ptr(),
            pg_sys::GucContext::PGC_SUSET,
            pg_sys::GucSource::PGC_S_OVERRIDE,
        );
        // The worker's statements are short; a lock wait must not hold a transaction open.
        pg_sys::SetConfigOption(
            c"lock_timeout".as_ptr(),
            c"10s".as_ptr(),
            pg_sys::GucContext::PGC_SUSET,
            pg_sys::GucSource::PGC_S_OVERRIDE,
        );
    }
    log!("amqp_outbox: worker started for database \"{database}\"");
    let handle = match amqp_outbox_broker::spawn() {
        Ok(h) => h,
        Err(e) => error!("amqp_outbox: could not start the AMQP thread: {e}"),
    };
    main_loop::Worker::new(handle).run()
}
