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
//! - [`queries`]: runs every SQL statement (the delivery's texts are the engine's,
//!   `amqp_outbox_engine::statements`); [`pg`]: the PostgreSQL calls
//!   around them; [`host`]: the engine's traits for the worker (its statements through SPI, its
//!   counters and log lines).

pub(crate) mod brokers;
mod host;
mod main_loop;
mod origin;
pub(crate) mod pg;
mod presence;
pub(crate) mod queries;
mod shrink;
pub(crate) mod standbys;
mod status;
mod step;

// The parts that need neither PostgreSQL's API nor a connection (crate amqp_outbox_engine);
// claim, settle and events run their statements through the traits of `host`.
pub(crate) use amqp_outbox_engine::{
    claim, events, faults, flight, message, pacer, scan_floor, scheduled, settle, standby_gate,
};

use crate::shmem;
use pgrx::bgworkers::{BackgroundWorker, SignalWakeFlags};
use pgrx::prelude::*;

/// A worker's argument: its slot in the low byte; a lane's number (plus one) above it.
const SLOT_MASK: usize = 0xff;

pub(crate) fn lane_argument(slot: usize, lane: usize) -> i32 {
    ((lane + 1) << 8 | (slot & SLOT_MASK)) as i32
}

/// The lane number in a lane's argument (see [`lane_argument`]).
pub(crate) fn lane_of_argument(arg: pg_sys::Datum) -> usize {
    (arg.value() >> 8).saturating_sub(1)
}

/// Connects a database's worker (started by the launcher with its slot as argument) to the
/// slot's database; returns the database's name (the worker's bgw_extra). Exits at once when
/// the slot no longer names a database.
pub(crate) fn connect_to_slot_database(arg: pg_sys::Datum) -> String {
    let slot = arg.value() & SLOT_MASK;
    shmem::set_worker_slot(slot);
    let oid = shmem::launch::database_of_slot(slot);
    if oid == 0 {
        // SAFETY: the main thread, before any transaction; proc_exit never returns.
        unsafe { crate::pg_compat::proc_exit(0) };
    }
    // Raises FATAL when the database is gone (dropped meanwhile): the launcher sees the worker
    // stop and finds the database no longer there.
    BackgroundWorker::connect_worker_to_spi_by_oid(Some(pg_sys::Oid::from(oid)), None);
    BackgroundWorker::get_extra().to_string()
}

/// Run by PostgreSQL as a worker exits: SQL functions must stop setting a latch that is gone,
/// and the launcher learns that the worker stopped. `arg`: the kind (0 outbox, 1 subscriptions,
/// 2 monitor, 3 + n lane n).
#[pg_guard]
extern "C-unwind" fn unregister_on_exit(_code: i32, arg: pg_sys::Datum) {
    // SAFETY: reads this process's pid, a plain global.
    let me = unsafe { pg_sys::MyProcPid };
    shmem::unregister_worker(kind_of(arg.value()), me);
}

fn kind_of(n: usize) -> shmem::WorkerKind {
    match n {
        0 => shmem::WorkerKind::Outbox,
        1 => shmem::WorkerKind::Inbox,
        2 => shmem::WorkerKind::Monitor,
        lane => shmem::WorkerKind::Lane(lane - 3),
    }
}

/// Takes the slot's hold for a worker of `kind` (see [`shmem::register_worker`]). Exits at once
/// (code 0: the launcher decides about restarts) when another worker of the same kind holds it.
pub(crate) fn announce(kind: shmem::WorkerKind, database: &str) {
    let (n, what) = match kind {
        shmem::WorkerKind::Outbox => (0usize, "outbox"),
        shmem::WorkerKind::Inbox => (1, "subscription"),
        shmem::WorkerKind::Monitor => (2, "monitor"),
        shmem::WorkerKind::Lane(n) => (3 + n, "lane"),
    };
    // SAFETY: the main thread of a connected worker: MyLatch and MyProcPid are its own, valid
    // until it exits. The exit callback is registered first, so no path leaves a hold behind;
    // it runs while shared memory is still attached, and frees only a hold this process took.
    let taken = unsafe {
        pg_sys::before_shmem_exit(Some(unregister_on_exit), pg_sys::Datum::from(n));
        shmem::register_worker(kind, pg_sys::MyLatch, pg_sys::MyProcPid)
    };
    if !taken {
        log!(
            "amqp_outbox: another {what} worker already serves database \"{database}\"; this one exits"
        );
        // SAFETY: the main thread, before any transaction; proc_exit never returns.
        unsafe { crate::pg_compat::proc_exit(0) };
    }
    // The names its waits show in pg_stat_activity (PostgreSQL 17 and later).
    crate::wait_event::register(match kind {
        shmem::WorkerKind::Outbox => &[
            crate::wait_event::WaitEvent::OutboxMain,
            crate::wait_event::WaitEvent::OutboxBatchGap,
        ],
        shmem::WorkerKind::Inbox => &[crate::wait_event::WaitEvent::SubscriptionMain],
        shmem::WorkerKind::Monitor => &[crate::wait_event::WaitEvent::MonitorMain],
        shmem::WorkerKind::Lane(_) => &[crate::wait_event::WaitEvent::LaneMain],
    });
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn amqp_outbox_worker_main(arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    // Its own SIGTERM handler: a statement that does not end cannot keep the worker.
    crate::watchdog::install();
    let database = connect_to_slot_database(arg);
    // Pinned before the first query, for the worker's whole life (see pg::pin): the delivery's
    // session settings, the relay's too (why each: the engine's SESSION_SETTINGS).
    for (name, value) in amqp_outbox_engine::statements::SESSION_SETTINGS {
        pg::pin_str(name, value);
    }
    announce(shmem::WorkerKind::Outbox, &database);
    if shmem::launch::probe_only() {
        debug1!("amqp_outbox: looking for the extension in database \"{database}\"");
    } else {
        log!("amqp_outbox: worker started for database \"{database}\"");
    }
    let handle = match amqp_outbox_broker::spawn() {
        Ok(h) => h,
        Err(e) => error!("amqp_outbox: could not start the AMQP thread: {e}"),
    };
    main_loop::Worker::new(handle).run()
}
