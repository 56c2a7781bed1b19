//! Shared memory: the worker's latch (so a commit can wake it), requests from SQL functions to
//! the worker, and counters. Only present when the library is in `shared_preload_libraries`.

use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PGRXSharedMemory, PgAtomic, PgLwLock};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering};

/// Address of the worker's `PGPROC` latch, or 0 when no worker runs. Shared memory is mapped at
/// the same address in every process forked from the postmaster, so the pointer is valid in all
/// backends. A stale pointer (worker gone, slot reused) only causes a spurious wake-up.
static WORKER_LATCH: PgAtomic<AtomicUsize> = unsafe { PgAtomic::new(c"amqp_outbox_worker_latch") };
static WORKER_PID: PgAtomic<AtomicI32> = unsafe { PgAtomic::new(c"amqp_outbox_worker_pid") };
static COUNTERS: PgAtomic<Counters> = unsafe { PgAtomic::new(c"amqp_outbox_counters") };
static REQUESTS: PgLwLock<Requests> = unsafe { PgLwLock::new(c"amqp_outbox_requests") };
/// amqp.broker or amqp.exchange changed: the worker re-reads them. An atomic, so a commit
/// callback can set it without taking a lock.
static RELOAD: PgAtomic<AtomicBool> = unsafe { PgAtomic::new(c"amqp_outbox_reload") };

/// Set in `_PG_init` of the postmaster; inherited by every backend it forks.
static READY: AtomicBool = AtomicBool::new(false);

#[derive(Default)]
pub struct Counters {
    pub published: AtomicU64,
    pub confirmed: AtomicU64,
    pub failed: AtomicU64,
    pub parked: AtomicU64,
}
unsafe impl PGRXSharedMemory for Counters {}

const MAX_REQUESTS: usize = 32;

/// Brokers whose connections SQL asked the worker to reopen (`amqp.disconnect()`).
#[derive(Default, Clone, Copy)]
pub struct Requests {
    disconnect: [i32; MAX_REQUESTS],
    len: usize,
    /// More requests than fit: reopen every connection.
    overflow: bool,
}
unsafe impl PGRXSharedMemory for Requests {}

pub fn init() {
    pg_shmem_init!(WORKER_LATCH);
    pg_shmem_init!(WORKER_PID);
    pg_shmem_init!(COUNTERS);
    pg_shmem_init!(REQUESTS);
    pg_shmem_init!(RELOAD);
    READY.store(true, Ordering::Relaxed);
}

pub fn ready() -> bool {
    READY.load(Ordering::Relaxed)
}

/// Sets the worker's latch. Never raises: it runs in a commit callback.
pub fn wake_worker() {
    if !ready() {
        return;
    }
    let latch = WORKER_LATCH.get().load(Ordering::Acquire);
    if latch != 0 {
        unsafe { pg_sys::SetLatch(latch as *mut pg_sys::Latch) };
    }
}

/// Called by the worker once it runs, and with `None` when it exits.
pub fn register_worker(latch: Option<*mut pg_sys::Latch>, pid: i32) {
    if !ready() {
        return;
    }
    WORKER_LATCH
        .get()
        .store(latch.map_or(0, |l| l as usize), Ordering::Release);
    WORKER_PID.get().store(pid, Ordering::Release);
}

pub fn worker_pid() -> Option<i32> {
    if !ready() {
        return None;
    }
    match WORKER_PID.get().load(Ordering::Acquire) {
        0 => None,
        pid => Some(pid),
    }
}

pub fn counters() -> Option<&'static Counters> {
    ready().then(|| COUNTERS.get())
}

pub fn request_disconnect(broker_id: i32) {
    if !ready() {
        return;
    }
    {
        let mut r = REQUESTS.exclusive();
        if !r.disconnect[..r.len].contains(&broker_id) {
            if r.len < MAX_REQUESTS {
                let n = r.len;
                r.disconnect[n] = broker_id;
                r.len += 1;
            } else {
                r.overflow = true;
            }
        }
    }
    wake_worker();
}

/// Never raises: may run in a commit callback.
pub fn request_reload() {
    if !ready() {
        return;
    }
    RELOAD.get().store(true, Ordering::Release);
    wake_worker();
}

/// What the worker must do now; clears the requests.
pub struct TakenRequests {
    /// `None`: every broker.
    pub disconnect: Option<Vec<i32>>,
    pub reload: bool,
}

pub fn take_requests() -> TakenRequests {
    let mut r = REQUESTS.exclusive();
    let taken = TakenRequests {
        disconnect: if r.overflow {
            None
        } else {
            Some(r.disconnect[..r.len].to_vec())
        },
        reload: RELOAD.get().swap(false, Ordering::AcqRel),
    };
    *r = Requests::default();
    taken
}

pub fn count(counter: impl Fn(&Counters) -> &AtomicU64, n: u64) {
    if let Some(c) = counters() {
        counter(c).fetch_add(n, Ordering::Relaxed);
    }
}
