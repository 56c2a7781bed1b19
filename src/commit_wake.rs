//! Wakes the worker when a transaction that published commits, instead of letting it poll.
//!
//! One raw transaction callback per backend, registered on its first publish; a flag says whether
//! the current transaction published. The callback runs after commit, where an error or a panic
//! would take the whole cluster down, so it only reads a flag and sets a latch.

use crate::shmem;
use pgrx::{pg_guard, pg_sys};
use std::sync::atomic::{AtomicBool, Ordering};

static REGISTERED: AtomicBool = AtomicBool::new(false);
static WAKE_AT_COMMIT: AtomicBool = AtomicBool::new(false);
static RELOAD_AT_COMMIT: AtomicBool = AtomicBool::new(false);
static CREATED_AT_COMMIT: AtomicBool = AtomicBool::new(false);
static LAUNCHER_AT_COMMIT: AtomicBool = AtomicBool::new(false);
static SCHEDULED_AT_COMMIT: AtomicBool = AtomicBool::new(false);
/// This backend wrote `amqp.subscription` since the flag was last taken (read by the
/// subscription worker, whose handlers may call `amqp.unsubscribe()`).
static SUBSCRIPTIONS_WRITTEN: AtomicBool = AtomicBool::new(false);

fn register() {
    if !REGISTERED.swap(true, Ordering::Relaxed) {
        // SAFETY: on the backend's main thread, once per process (the flag above). The callback
        // has PostgreSQL's XactCallback signature, lives as long as the library and ignores
        // its (null) argument.
        unsafe { pg_sys::RegisterXactCallback(Some(on_xact_event), std::ptr::null_mut()) };
    }
}

/// Called by every publish; cheap after the first call of the transaction.
pub fn wake_worker_at_commit() {
    register();
    WAKE_AT_COMMIT.store(true, Ordering::Relaxed);
}

/// The transaction wrote `amqp.scheduled_message` (its statement trigger): once it commits,
/// the worker learns when the earliest delayed message is due.
pub fn look_at_scheduled_at_commit() {
    register();
    SCHEDULED_AT_COMMIT.store(true, Ordering::Relaxed);
}

/// The transaction changed the worker's configuration (brokers, declarations).
pub fn reload_worker_at_commit() {
    register();
    RELOAD_AT_COMMIT.store(true, Ordering::Relaxed);
}

/// A statement of this backend wrote `amqp.subscription`.
pub fn subscriptions_written() {
    SUBSCRIPTIONS_WRITTEN.store(true, Ordering::Relaxed);
}

/// Whether a statement of this backend wrote `amqp.subscription` since the last call.
pub fn take_subscriptions_written() -> bool {
    SUBSCRIPTIONS_WRITTEN.swap(false, Ordering::Relaxed)
}

/// The transaction creates the extension: once it commits, the launcher starts this
/// database's workers.
pub fn extension_created_at_commit() {
    register();
    CREATED_AT_COMMIT.store(true, Ordering::Relaxed);
}

/// The transaction creates a database (perhaps from a template with the extension): once it
/// commits, the launcher looks at the databases.
pub fn wake_launcher_at_commit() {
    register();
    LAUNCHER_AT_COMMIT.store(true, Ordering::Relaxed);
}

#[pg_guard]
unsafe extern "C-unwind" fn on_xact_event(
    event: pg_sys::XactEvent::Type,
    _arg: *mut std::ffi::c_void,
) {
    match event {
        pg_sys::XactEvent::XACT_EVENT_COMMIT => {
            if RELOAD_AT_COMMIT.swap(false, Ordering::Relaxed) {
                shmem::request_reload();
            }
            if WAKE_AT_COMMIT.swap(false, Ordering::Relaxed) {
                shmem::wake_worker_for_commit();
            }
            if CREATED_AT_COMMIT.swap(false, Ordering::Relaxed) {
                shmem::launch::extension_created();
            }
            if LAUNCHER_AT_COMMIT.swap(false, Ordering::Relaxed) {
                shmem::launch::wake_launcher();
            }
            if SCHEDULED_AT_COMMIT.swap(false, Ordering::Relaxed) {
                shmem::note_scheduled();
            }
        }
        // A prepared transaction commits later in another session (COMMIT PREPARED), which
        // wakes nobody: the worker's naptime finds those rows.
        pg_sys::XactEvent::XACT_EVENT_ABORT | pg_sys::XactEvent::XACT_EVENT_PREPARE => {
            WAKE_AT_COMMIT.store(false, Ordering::Relaxed);
            RELOAD_AT_COMMIT.store(false, Ordering::Relaxed);
            CREATED_AT_COMMIT.store(false, Ordering::Relaxed);
            LAUNCHER_AT_COMMIT.store(false, Ordering::Relaxed);
            SCHEDULED_AT_COMMIT.store(false, Ordering::Relaxed);
        }
        _ => {}
    }
}
