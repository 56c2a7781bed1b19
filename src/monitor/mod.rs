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

/// The niceness and, where the kernel lets a process choose it, the slice, in one call; where
/// `sched_setattr` is missing, the niceness alone.
fn lower_priority() {
    if set_niceness_and_slice().is_ok() {
        return;
    }
    // SAFETY: a system call on this thread alone, no memory passed.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, NICENESS) } != 0 {
        debug1!(
            "amqp_outbox: monitor: setpriority: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// The CPU time the monitor runs before a woken process may take its core, where the kernel
/// lets a process choose it (Linux 6.12 and later; older kernels ignore it). Niceness alone
/// does not make a woken handler run at once: the kernel's default lets the running process
/// finish a slice of a few milliseconds first, and a pass is a few milliseconds of CPU (with
/// 100,000 open messages, an unrelated handler's p99 above the same traffic unmonitored fell
/// by about a third with the shortest slice, 100 µs, the least the kernel takes).
const SLICE_NS: u64 = 100_000;

/// `struct sched_attr` of `sched_setattr(2)`, its first version (48 bytes).
#[repr(C)]
struct SchedAttr {
    size: u32,
    policy: u32,
    flags: u64,
    nice: i32,
    priority: u32,
    runtime: u64,
    deadline: u64,
    period: u64,
}

/// SCHED_OTHER at [`NICENESS`] with a slice of [`SLICE_NS`], for this thread (the one that runs
/// the passes).
fn set_niceness_and_slice() -> std::io::Result<()> {
    let attr = SchedAttr {
        size: std::mem::size_of::<SchedAttr>() as u32,
        policy: libc::SCHED_OTHER as u32,
        flags: 0,
        nice: NICENESS,
        priority: 0,
        runtime: SLICE_NS,
        deadline: 0,
        period: 0,
    };
    // SAFETY: the kernel reads `size` bytes of a live, initialised struct of that size; pid 0
    // is this thread.
    let rc = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0) };
    if rc == 0 {
        return Ok(());
    }
    let error = std::io::Error::last_os_error();
    debug1!("amqp_outbox: monitor: sched_setattr: {error}");
    Err(error)
}
