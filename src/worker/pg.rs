//! Thin wrappers over the PostgreSQL calls of the worker's main thread: short transactions,
//! the wait on latch + socket, signals, settings, and reporting activity to pg_stat_activity.

use pgrx::prelude::*;
use std::ffi::{CStr, CString};
use std::os::fd::RawFd;
use std::time::Duration;

pub use crate::wait_event::WaitEvent;

/// Sets a configuration parameter for the rest of the worker's life. At `PGC_S_OVERRIDE`, the
/// highest source, the value is also the reset value, is not undone by a transaction's end
/// (it is set outside any), and a reload of postgresql.conf (lower source) leaves it alone.
/// Call only outside a transaction, before the first query.
pub fn pin(name: &CStr, value: &CStr) {
    // SAFETY: on the main thread after the worker connected to its database (GUCs exist); both
    // strings are NUL-terminated and only read (PostgreSQL copies the value); an invalid value
    // raises an ERROR, which pg_guard turns into the worker's exit, never undefined behaviour.
    unsafe {
        pg_sys::SetConfigOption(
            name.as_ptr(),
            value.as_ptr(),
            pg_sys::GucContext::PGC_SUSET,
            pg_sys::GucSource::PGC_S_OVERRIDE,
        )
    };
}

/// [`pin`] with Rust strings (the engine's settings); one with a NUL byte cannot be a setting
/// and raises an ERROR (the worker exits and is started again).
pub fn pin_str(name: &str, value: &str) {
    match (CString::new(name), CString::new(value)) {
        (Ok(n), Ok(v)) => pin(&n, &v),
        _ => error!("amqp_outbox: the setting {name:?} cannot be pinned"),
    }
}

/// Runs `body` in its own transaction with a snapshot, and reports it in pg_stat_activity.
/// An ERROR inside aborts the transaction and ends the worker (exit 1, started again by the
/// launcher): the worker never sits idle in transaction.
pub fn transaction<R>(what: &str, body: impl FnOnce() -> R) -> R {
    report_activity(Some(what));
    // A SIGTERM ends it within a second even when a statement in it does not end.
    let watched = crate::watchdog::Watched::work();
    // SAFETY: the main thread, outside any transaction (the loop never nests them): start one,
    // give it a snapshot, run the body, then pop exactly the snapshot pushed here and commit.
    // An ERROR in between never comes back here: it ends the worker, and PostgreSQL's exit
    // callbacks abort the transaction.
    let result = unsafe {
        pg_sys::SetCurrentStatementStartTimestamp();
        pg_sys::StartTransactionCommand();
        pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
        let r = body();
        pg_sys::PopActiveSnapshot();
        pg_sys::CommitTransactionCommand();
        // A background worker reports its table statistics only when asked: without this,
        // autovacuum never learns of the worker's deletes and amqp.message bloats. Rate-limited
        // inside PostgreSQL.
        pg_sys::pgstat_report_stat(false);
        r
    };
    drop(watched);
    report_activity(None);
    result
}

fn report_activity(what: Option<&str>) {
    let state = if what.is_some() {
        pg_sys::BackendState::STATE_RUNNING
    } else {
        pg_sys::BackendState::STATE_IDLE
    };
    let text = what.and_then(|w| CString::new(w).ok());
    // SAFETY: the main thread of a backend with a PGPROC; the text is NUL-terminated (or null,
    // allowed for idle) and lives until the call returns, which copies it into shared memory.
    unsafe {
        pg_sys::pgstat_report_activity(
            state,
            text.as_ref().map_or(std::ptr::null(), |t| t.as_ptr()),
        )
    };
}

pub enum Woken {
    /// Latch set (a commit, a signal, a request from SQL) or timeout.
    Latch,
    /// The AMQP thread has events.
    Events,
}

/// The wait's event set (latch, postmaster death, and the wake socket when given), built once:
/// `WaitLatchOrSocket` builds and frees one per call (an epoll instance, one registration per
/// event, a close), about 6 % of the worker's CPU at 2,000 messages/s, where it waits several
/// times per message.
struct WaitSet {
    set: *mut pg_sys::WaitEventSet,
    fd: Option<RawFd>,
}

thread_local! {
    /// Only the main thread waits; the set lives until the process exits.
    static WAIT_SET: std::cell::RefCell<Option<WaitSet>> = const { std::cell::RefCell::new(None) };
}

/// The kept event set for `fd`, (re)built when `fd` differs from the last call's.
fn wait_set(fd: Option<RawFd>) -> *mut pg_sys::WaitEventSet {
    WAIT_SET.with(|kept| {
        let mut kept = kept.borrow_mut();
        if let Some(w) = kept.as_ref() {
            if w.fd == fd {
                return w.set;
            }
            // SAFETY: a set this function created and nothing else holds.
            unsafe { pg_sys::FreeWaitEventSet(w.set) };
        }
        // SAFETY: the main thread, which owns MyLatch; the set outlives every transaction (see
        // create_lasting_wait_event_set); the socket is the broker handle's wake socket, open
        // for as long as the worker runs.
        let set = unsafe {
            let set = crate::pg_compat::create_lasting_wait_event_set(3);
            pg_sys::AddWaitEventToSet(
                set,
                pg_sys::WL_LATCH_SET,
                -1,
                pg_sys::MyLatch,
                std::ptr::null_mut(),
            );
            pg_sys::AddWaitEventToSet(
                set,
                pg_sys::WL_EXIT_ON_PM_DEATH,
                -1,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            );
            if let Some(fd) = fd {
                pg_sys::AddWaitEventToSet(
                    set,
                    pg_sys::WL_SOCKET_READABLE,
                    fd,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                );
            }
            set
        };
        *kept = Some(WaitSet { set, fd });
        set
    })
}

/// Sleeps until the latch is set, `fd` is readable, or `timeout` passes, showing `event` in
/// pg_stat_activity. Exits (code 1) if the postmaster died.
pub fn wait(fd: Option<RawFd>, timeout: Duration, event: WaitEvent) -> Woken {
    let timeout_ms = std::ffi::c_long::from(amqp_outbox_engine::wait_ms::wait_ms(timeout));
    let set = wait_set(fd);
    let mut occurred: [pg_sys::WaitEvent; 3] = Default::default();
    // SAFETY: the main thread, which owns MyLatch and the set; `occurred` has room for the
    // 3 events passed as its length.
    let n = unsafe {
        pg_sys::WaitEventSetWait(
            set,
            timeout_ms,
            occurred.as_mut_ptr(),
            occurred.len() as i32,
            event.info(),
        )
    };
    // SAFETY: as above; only the latch's owner may reset it, and this is its owner.
    unsafe { pg_sys::ResetLatch(pg_sys::MyLatch) };
    pg_sys::check_for_interrupts!();
    let n = usize::try_from(n).unwrap_or(0).min(occurred.len());
    if occurred[..n]
        .iter()
        .any(|e| e.events & pg_sys::WL_SOCKET_READABLE != 0)
    {
        Woken::Events
    } else {
        Woken::Latch
    }
}

/// Sleeps for `d` whatever sets the latch meanwhile (it stays set for the next `wait`), showing
/// `event` in pg_stat_activity. Exits (code 1) if the postmaster died.
pub fn sleep(d: Duration, event: WaitEvent) {
    if d < Duration::from_millis(1) {
        // WaitLatch counts whole milliseconds: a shorter gap would grow to one (at 2,000
        // commits/s, about a third of the time between steps). Signals still only set flags,
        // which the loop reads after this; a dead postmaster is noticed at the next wait.
        std::thread::sleep(d);
        return;
    }
    let events = pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH;
    let timeout_ms = d.as_millis().clamp(1, i64::MAX as u128) as std::ffi::c_long;
    // SAFETY: the main thread; no latch is passed (null is allowed without WL_LATCH_SET).
    unsafe {
        pg_sys::WaitLatch(
            std::ptr::null_mut(),
            events as i32,
            timeout_ms,
            event.info(),
        )
    };
    pg_sys::check_for_interrupts!();
}

pub fn shutdown_requested() -> bool {
    // SAFETY: a sig_atomic_t flag the signal handler sets; a volatile read of a valid static.
    unsafe { std::ptr::read_volatile(&raw const pg_sys::ShutdownRequestPending) != 0 }
}

/// Re-reads postgresql.conf after SIGHUP. Returns true when it did.
pub fn reload_config_if_requested() -> bool {
    // SAFETY: the main thread, outside a transaction, as PostgreSQL's own processes do it: the
    // flag is a sig_atomic_t static that only the SIGHUP handler sets, cleared before reading
    // the file so that a SIGHUP arriving meanwhile is not lost.
    unsafe {
        if std::ptr::read_volatile(&raw const pg_sys::ConfigReloadPending) != 0 {
            std::ptr::write_volatile(&raw mut pg_sys::ConfigReloadPending, 0);
            pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP);
            return true;
        }
    }
    false
}

pub fn in_recovery() -> bool {
    // SAFETY: reads shared state under PostgreSQL's own locking; valid in any backend.
    unsafe { pg_sys::RecoveryInProgress() }
}
