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

use crate::shmem;
use pgrx::prelude::*;

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn amqp_outbox_monitor_main(arg: pg_sys::Datum) {
    // Compensations are users' functions: the same start as the subscription worker's.
    let database = crate::inbox::start_user_code_process(arg);
    // A compensation happens at most once: its effects and its done mark must survive a crash
    // once committed, whatever postgresql.conf says.
    crate::worker::pg::pin(c"synchronous_commit", c"on");
    // The pass statement is planned for hundreds of due rows as now() moves past the check_at
    // statistics; JIT-compiling it then cost seconds a pass (measured: 2.3-4.3 s instead of
    // 0.3 s), and the monitor fell behind. (Compensation functions are users' code: their own
    // statements are planned under this setting too, which only forgoes a compilation.)
    crate::worker::pg::pin(c"jit", c"off");
    lower_priority();
    crate::worker::announce(shmem::WorkerKind::Monitor, &database);
    log!("amqp_outbox: monitor started for database \"{database}\"");
    schedule::Monitor::default().run()
}

/// The monitor's niceness. Reconciliation is background work: where the CPU is short, the
/// handlers, publishers and the delivery beside it come first (with 100,000 open monitored
/// messages, an unrelated subscription's handler p99 was 12.6-13.9 ms at niceness 0 and
/// 6.5-8.5 ms at 10, the monitor keeping its schedule in both).
const NICENESS: libc::c_int = 10;

fn lower_priority() {
    // SAFETY: a system call on this process alone (its one thread), no memory passed.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, NICENESS) } != 0 {
        debug1!(
            "amqp_outbox: monitor: setpriority: {}",
            std::io::Error::last_os_error()
        );
    }
}
