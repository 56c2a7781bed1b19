//! A subtransaction around one message: what the message's work did is kept when it succeeds
//! and rolled back when it raises, and the error is caught and returned instead of ending the
//! worker — the pattern of PL/pgSQL's `BEGIN … EXCEPTION`. The handler itself runs as the
//! subscription's owner, with its setting changes undone afterwards and a time bound.

use crate::api::run_as::RunAs;
use pgrx::pg_sys;
use std::time::Duration;

// utils/timeout.h, not in pgrx's bindings. `TimeoutId` is a C enum; STATEMENT_TIMEOUT is its
// fourth member in PostgreSQL 13 to 17 (after STARTUP_PACKET_TIMEOUT, DEADLOCK_TIMEOUT,
// LOCK_TIMEOUT).
const STATEMENT_TIMEOUT: u32 = 3;
// Called through `pg_guard_ffi_boundary`, so an ERROR inside would become a Rust panic.
unsafe extern "C-unwind" {
    fn enable_timeout_after(id: u32, delay_ms: i32);
    fn disable_timeout(id: u32, keep_indicator: bool);
}

/// The search_path handlers run with (see [`remember_handler_search_path`]).
static HANDLER_SEARCH_PATH: std::sync::OnceLock<std::ffi::CString> = std::sync::OnceLock::new();

/// Keeps the worker's search_path as its database set it, before the worker pins its own.
pub fn remember_handler_search_path() {
    // SAFETY: on the main thread of a connected worker; GetConfigOption returns a pointer to
    // the setting's current value (never NULL for an existing, unrestricted setting), copied
    // here at once.
    let path = unsafe {
        let v = pg_sys::GetConfigOption(c"search_path".as_ptr(), false, false);
        if v.is_null() {
            c"\"$user\", public".to_owned()
        } else {
            std::ffi::CStr::from_ptr(v).to_owned()
        }
    };
    let _ = HANDLER_SEARCH_PATH.set(path);
}

pub use crate::subtransaction::{subtransaction, Caught};

/// The SQLSTATE of a lock wait that ran out (`lock_timeout`).
pub const LOCK_NOT_AVAILABLE: &str = "55P03";

/// Locks `amqp.message` (ACCESS SHARE) before anything else of the transaction, as the outbox
/// worker's transactions do: a `DROP EXTENSION` locks it first too (see `drop_guard`), so the
/// two queue on it instead of deadlocking on the tables behind it (the DROP holding one the
/// transaction reads next, the transaction one the DROP drops next). False when the extension
/// is gone (also when a DROP committed while this waited): the transaction has nothing to do.
pub fn message_table_first() -> bool {
    crate::message_table::installed_and_locked(pg_sys::AccessShareLock)
}

/// `sql` (one statement returning at most one text value) in a transaction of its own, in a
/// subtransaction: its error is returned instead of ending the worker. `lock_wait`: the longest
/// it waits for a lock, after which it fails with [`LOCK_NOT_AVAILABLE`] (left for its next
/// turn by the caller) instead of holding every session queued behind it. `amqp.message` is
/// locked first ([`message_table_first`]); `Ok(None)` without running `sql` when the
/// extension is gone.
pub fn statement_alone(
    what: &str,
    sql: &'static str,
    lock_wait: Option<Duration>,
) -> Result<Option<String>, Caught> {
    crate::worker::pg::transaction(what, || {
        if !message_table_first() {
            return Ok(None);
        }
        subtransaction(|| {
            pgrx::Spi::connect_mut(|client| -> pgrx::spi::SpiResult<Option<String>> {
                if let Some(wait) = lock_wait {
                    super::queries::set_local_lock_timeout(client, wait)?;
                }
                client.update(sql, None, &[])?.first().get_one::<String>()
            })
            .unwrap_or_else(|e| pgrx::error!("amqp_outbox: {e}"))
        })
    })
}

/// Runs the handler call `call` as `owner`, bounded by `timeout` (zero: none), with the
/// database's search_path, and any setting it changes (SET LOCAL, set_config) undone
/// afterwards, as for a function with a SET clause: one handler cannot change the next one's
/// settings. Call inside [`subtransaction`]:
/// a timeout raises 57014 there.
pub fn as_owner<R>(owner: pg_sys::Oid, timeout: Duration, call: impl FnOnce() -> R) -> R {
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: on the worker's main thread inside a (sub)transaction. The GUC nest level opened
    // here is closed below on success; on an ERROR the subtransaction's abort closes it. The
    // search_path value is a NUL-terminated string this process keeps. The statement timeout
    // is registered by InitPostgres for every backend with a database
    // connection (this worker's is); it is disabled below, and on error by the abort.
    let nest = unsafe {
        let nest = pg_sys::NewGUCNestLevel();
        // As a function's SET clause does (GUC_ACTION_SAVE): undone when the nest level closes.
        if let Some(path) = HANDLER_SEARCH_PATH.get() {
            pg_sys::set_config_option(
                c"search_path".as_ptr(),
                path.as_ptr(),
                pg_sys::GucContext::PGC_USERSET,
                pg_sys::GucSource::PGC_S_SESSION,
                pg_sys::GucAction::GUC_ACTION_SAVE,
                true,
                0,
                false,
            );
        }
        if ms > 0 {
            pg_sys::ffi::pg_guard_ffi_boundary(|| enable_timeout_after(STATEMENT_TIMEOUT, ms));
        }
        nest
    };
    let guard = TimeoutGuard(ms > 0);
    let result = {
        let _as = RunAs::new(owner);
        call()
    };
    drop(guard);
    // A timeout that fired after the handler's last check would otherwise cancel the worker's
    // next statement: take it here, inside the message's subtransaction.
    pg_sys::check_for_interrupts!();
    // SAFETY: closes the nest level opened above (isCommit = false: the changes are undone).
    unsafe { pg_sys::AtEOXact_GUC(false, nest) };
    result
}

/// Disables the statement timeout when the call returns or unwinds.
struct TimeoutGuard(bool);

impl Drop for TimeoutGuard {
    fn drop(&mut self) {
        if self.0 {
            // SAFETY: on the main thread; disabling a timeout that already fired or was never
            // enabled is allowed. keep_indicator = false: a late firing is forgotten.
            unsafe {
                pg_sys::ffi::pg_guard_ffi_boundary(|| disable_timeout(STATEMENT_TIMEOUT, false))
            };
        }
    }
}
