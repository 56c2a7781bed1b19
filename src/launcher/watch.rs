//! The launcher's watch: a short-lived background worker that a stopping launcher leaves behind,
//! which makes sure the postmaster really starts the launcher again.
//!
//! The postmaster restarts a stopped launcher after [`super::LAUNCHER_RESTART`], but up to
//! PostgreSQL 15 it can miss that for up to a minute: it computes how long to sleep with signals
//! blocked, then unblocks them and sleeps. A launcher whose exit is reported in between (the
//! postmaster was busy, say starting a worker) is recorded as stopped only after that sleep's
//! length was chosen, and with nothing else to wake the postmaster (no new connection, no other
//! child ending), every database's stopped worker then waits with it. The watch waits for the
//! launcher to announce itself and, while it does not, sends the postmaster a SIGUSR1 with no
//! request flagged: it ends that sleep, and the postmaster then sees the launcher is due. On 16
//! and later the postmaster does not miss it; the watch then only waits and exits.

use super::wait;
use crate::shmem::launch;
use crate::wait_event::WaitEvent;
use pgrx::bgworkers::SignalWakeFlags;
use pgrx::bgworkers::{BackgroundWorker, BackgroundWorkerBuilder, BgWorkerStartTime};
use pgrx::prelude::*;
use std::time::{Duration, Instant};

/// How often the watch looks for the launcher.
const LOOK_EVERY: Duration = Duration::from_millis(250);
/// The launcher is late once it has not announced itself this long after the watch started
/// (the postmaster restarts it after `LAUNCHER_RESTART`, one second; starting takes
/// milliseconds).
const LATE_AFTER: Duration = Duration::from_millis(1500);
/// How often a late launcher is asked for again.
const ASK_EVERY: Duration = Duration::from_millis(500);
/// The watch gives up after this: the postmaster sleeps a minute at most, so by then it has
/// started the launcher or cannot.
const GIVE_UP_AFTER: Duration = Duration::from_secs(75);

/// Starts the watch; from a launcher that is stopping while the postmaster lives. Nothing
/// happens when no background worker slot is free: then the postmaster's restart alone
/// brings the launcher back.
pub fn start() {
    let builder = BackgroundWorkerBuilder::new("amqp_outbox launcher watch")
        .set_type("amqp_outbox launcher watch")
        .set_library("amqp_outbox")
        .set_function("amqp_outbox_launcher_watch_main")
        .enable_spi_access()
        .set_start_time(BgWorkerStartTime::RecoveryFinished)
        .set_restart_time(None);
    if builder.load_dynamic().is_err() {
        log!("amqp_outbox: no background worker slot for the launcher's watch (max_worker_processes)");
    }
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn amqp_outbox_launcher_watch_main(_arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGTERM);
    // No database, as the launcher: it shows in pg_stat_activity and blocks no DROP DATABASE.
    BackgroundWorker::connect_worker_to_spi(None, None);
    crate::wait_event::register(&[WaitEvent::LauncherWatch]);
    let started = Instant::now();
    let mut asked_at: Option<Instant> = None;
    while launch::launcher_pid().is_none() && started.elapsed() < GIVE_UP_AFTER {
        if wait(LOOK_EVERY, WaitEvent::LauncherWatch).is_err() {
            break;
        }
        if started.elapsed() >= LATE_AFTER && asked_at.is_none_or(|t| t.elapsed() >= ASK_EVERY) {
            if asked_at.is_none() {
                log!(
                    "amqp_outbox: the launcher is not back after {:.1} s; asking the postmaster again",
                    started.elapsed().as_secs_f64()
                );
            }
            asked_at = Some(Instant::now());
            // SAFETY: reads a plain global set at the process's start, and sends the signal
            // PostgreSQL's processes send the postmaster; with no request flagged in shared
            // memory it asks for nothing, it only ends the postmaster's sleep.
            unsafe { libc::kill(pg_sys::PostmasterPid, libc::SIGUSR1) };
        }
    }
    if asked_at.is_some() {
        log!(
            "amqp_outbox: launcher watch ending after {:.1} s (launcher {})",
            started.elapsed().as_secs_f64(),
            if launch::launcher_pid().is_some() {
                "back"
            } else {
                "still not back"
            }
        );
    }
}
