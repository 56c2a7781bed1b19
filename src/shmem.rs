//! Shared memory: the worker's latch (so a commit can wake it), requests from SQL functions to
//! the worker, and counters. Only present when the library is in `shared_preload_libraries`.

use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PGRXSharedMemory, PgAtomic, PgLwLock};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering};

/// Address of the worker's `PGPROC` latch, or 0 when no worker runs. Shared memory is mapped at
/// the same address in every process forked from the postmaster, so the pointer is valid in all
/// backends. A stale pointer (worker gone, slot reused) only causes a spurious wake-up.
// SAFETY: the name is unique: each `amqp_outbox_*` shared-memory name is used once, here.
static WORKER_LATCH: PgAtomic<AtomicUsize> = unsafe { PgAtomic::new(c"amqp_outbox_worker_latch") };
// SAFETY: the name is unique: each `amqp_outbox_*` shared-memory name is used once, here.
static WORKER_PID: PgAtomic<AtomicI32> = unsafe { PgAtomic::new(c"amqp_outbox_worker_pid") };
// SAFETY: the name is unique: each `amqp_outbox_*` shared-memory name is used once, here.
static COUNTERS: PgAtomic<Counters> = unsafe { PgAtomic::new(c"amqp_outbox_counters") };
// SAFETY: the name is unique: each `amqp_outbox_*` shared-memory name is used once, here.
static REQUESTS: PgLwLock<Requests> = unsafe { PgLwLock::new(c"amqp_outbox_requests") };
/// amqp.broker or amqp.exchange changed: the worker re-reads them. An atomic, so a commit
/// callback can set it without taking a lock.
// SAFETY: the name is unique: each `amqp_outbox_*` shared-memory name is used once, here.
static RELOAD: PgAtomic<AtomicBool> = unsafe { PgAtomic::new(c"amqp_outbox_reload") };
/// The worker is about to look for committed rows and wants the next commit to wake it. The
/// first commit after that clears it and sets the latch; later ones skip the latch, which is
/// already set, so a busy database does not signal the worker once per commit.
// SAFETY: the name is unique: each `amqp_outbox_*` shared-memory name is used once, here.
static COMMIT_WAKE_ARMED: PgAtomic<AtomicBool> =
    unsafe { PgAtomic::new(c"amqp_outbox_commit_wake_armed") };
// SAFETY: the name is unique: each `amqp_outbox_*` shared-memory name is used once, here.
static BROKER_STATES: PgLwLock<BrokerStates> =
    unsafe { PgLwLock::new(c"amqp_outbox_broker_states") };
// SAFETY: the name is unique: each `amqp_outbox_*` shared-memory name is used once, here.
static IN_FLIGHT: PgLwLock<InFlightTable> = unsafe { PgLwLock::new(c"amqp_outbox_in_flight") };

/// Set in `_PG_init` of the postmaster; inherited by every backend it forks.
static READY: AtomicBool = AtomicBool::new(false);

#[derive(Default)]
pub struct Counters {
    pub published: AtomicU64,
    pub confirmed: AtomicU64,
    pub failed: AtomicU64,
    pub parked: AtomicU64,
    pub acknowledged: AtomicU64,
    pub resent_gap: AtomicU64,
    pub resent_timeout: AtomicU64,
    /// Steps that ran a settle-and-claim transaction: commits that come close together share one.
    pub steps: AtomicU64,
    /// Commits that woke the worker (it had asked for the next commit's wake-up).
    pub commit_wakeups: AtomicU64,
}

/// Messages the worker has in flight, for `amqp.message_status`. Larger windows show only the
/// first entries.
pub const IN_FLIGHT_SHOWN: usize = 32768;

#[derive(Clone, Copy)]
pub struct InFlightTable {
    len: usize,
    /// (id, confirmed)
    entries: [(i64, bool); IN_FLIGHT_SHOWN],
}

impl Default for InFlightTable {
    fn default() -> Self {
        InFlightTable {
            len: 0,
            entries: [(0, false); IN_FLIGHT_SHOWN],
        }
    }
}
// SAFETY: plain `Copy` data (integers and bools, no pointers), meaningful in every process.
unsafe impl PGRXSharedMemory for InFlightTable {}

pub fn report_in_flight(entries: &[(i64, bool)]) {
    if !ready() {
        return;
    }
    let mut t = IN_FLIGHT.exclusive();
    let n = entries.len().min(IN_FLIGHT_SHOWN);
    t.entries[..n].copy_from_slice(&entries[..n]);
    t.len = n;
}

pub fn in_flight() -> Vec<(i64, bool)> {
    if !ready() {
        return Vec::new();
    }
    let t = IN_FLIGHT.share();
    t.entries[..t.len].to_vec()
}

/// Brokers whose connection state the worker publishes for `amqp.broker_status`.
pub const MAX_BROKERS: usize = 64;
const HOST_LEN: usize = 160;
const ERROR_LEN: usize = 240;

/// One broker's connection as the worker sees it. Fixed-size: it lives in shared memory.
#[derive(Clone, Copy)]
pub struct BrokerSlot {
    pub used: bool,
    pub broker_id: i32,
    pub connected: bool,
    pub epoch: u64,
    /// When the state last changed (PostgreSQL timestamp).
    pub since: i64,
    pub in_flight: u32,
    /// Rows waiting, as last counted (only while `amqp_outbox.max_pending` is set).
    pub pending: i64,
    host: [u8; HOST_LEN],
    host_len: usize,
    error: [u8; ERROR_LEN],
    error_len: usize,
}

impl BrokerSlot {
    const EMPTY: BrokerSlot = BrokerSlot {
        used: false,
        broker_id: 0,
        connected: false,
        epoch: 0,
        since: 0,
        in_flight: 0,
        pending: 0,
        host: [0; HOST_LEN],
        host_len: 0,
        error: [0; ERROR_LEN],
        error_len: 0,
    };

    fn set_text(buf: &mut [u8], len: &mut usize, text: &str) {
        // Cut on a character boundary so the stored text stays valid UTF-8.
        let mut n = text.len().min(buf.len());
        while !text.is_char_boundary(n) {
            n -= 1;
        }
        buf[..n].copy_from_slice(&text.as_bytes()[..n]);
        *len = n;
    }

    pub fn host(&self) -> &str {
        std::str::from_utf8(&self.host[..self.host_len]).unwrap_or("")
    }

    pub fn error(&self) -> &str {
        std::str::from_utf8(&self.error[..self.error_len]).unwrap_or("")
    }
}

#[derive(Clone, Copy)]
pub struct BrokerStates {
    slots: [BrokerSlot; MAX_BROKERS],
}

impl Default for BrokerStates {
    fn default() -> Self {
        BrokerStates {
            slots: [BrokerSlot::EMPTY; MAX_BROKERS],
        }
    }
}
// SAFETY: plain `Copy` data (integers, bools, byte arrays, no pointers), meaningful in every
// process.
unsafe impl PGRXSharedMemory for BrokerStates {}

/// What the worker reports about one broker.
pub struct BrokerReport<'a> {
    pub broker_id: i32,
    pub connected: bool,
    pub host: Option<&'a str>,
    pub epoch: u64,
    pub error: Option<&'a str>,
    pub in_flight: usize,
    pub pending: i64,
}
// SAFETY: only atomics, no pointers; every access is atomic, so processes may share them.
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
// SAFETY: plain `Copy` data (integers and a bool, no pointers), meaningful in every process.
unsafe impl PGRXSharedMemory for Requests {}

pub fn init() {
    pg_shmem_init!(WORKER_LATCH);
    pg_shmem_init!(WORKER_PID);
    pg_shmem_init!(COUNTERS);
    pg_shmem_init!(REQUESTS);
    pg_shmem_init!(RELOAD);
    pg_shmem_init!(COMMIT_WAKE_ARMED);
    pg_shmem_init!(BROKER_STATES);
    pg_shmem_init!(IN_FLIGHT);
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
        // SAFETY: called on a PostgreSQL thread (a backend or the worker's main thread). The
        // address is a PGPROC's latch in shared memory, mapped at the same address in every
        // process; if the worker is gone, it is still a valid latch (a spurious wake-up).
        unsafe { pg_sys::SetLatch(latch as *mut pg_sys::Latch) };
    }
}

/// A transaction that published committed: wake the worker if it asked for it. Never raises.
pub fn wake_worker_for_commit() {
    if ready() && COMMIT_WAKE_ARMED.get().swap(false, Ordering::AcqRel) {
        count(|c| &c.commit_wakeups, 1);
        wake_worker();
    }
}

/// The worker wants the next commit's wake-up. It must call this before it takes the snapshot
/// that looks for committed rows: a commit after that snapshot then finds the flag set.
pub fn arm_commit_wake(armed: bool) {
    if ready() {
        COMMIT_WAKE_ARMED.get().store(armed, Ordering::Release);
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

/// The worker replaces the whole table; `since` moves only when the connection state changed.
pub fn report_brokers(reports: &[BrokerReport<'_>]) {
    if !ready() {
        return;
    }
    // SAFETY: only reads the clock; called on the worker's main thread.
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    let mut states = BROKER_STATES.exclusive();
    let old = *states;
    let mut fresh = BrokerStates::default();
    for (slot, r) in fresh.slots.iter_mut().zip(reports) {
        let previous = old
            .slots
            .iter()
            .find(|s| s.used && s.broker_id == r.broker_id);
        slot.used = true;
        slot.broker_id = r.broker_id;
        slot.connected = r.connected;
        slot.epoch = r.epoch;
        slot.in_flight = r.in_flight.min(u32::MAX as usize) as u32;
        slot.pending = r.pending;
        slot.since = match previous {
            Some(p) if p.connected == r.connected && p.epoch == r.epoch => p.since,
            _ => now,
        };
        BrokerSlot::set_text(&mut slot.host, &mut slot.host_len, r.host.unwrap_or(""));
        BrokerSlot::set_text(&mut slot.error, &mut slot.error_len, r.error.unwrap_or(""));
    }
    *states = fresh;
}

/// A copy of the broker table, for SQL.
pub fn broker_states() -> Vec<BrokerSlot> {
    if !ready() {
        return Vec::new();
    }
    let states = BROKER_STATES.share();
    states.slots.iter().filter(|s| s.used).copied().collect()
}

/// The broker's backlog as the worker last counted it.
pub fn pending(broker_id: i32) -> Option<i64> {
    if !ready() {
        return None;
    }
    let states = BROKER_STATES.share();
    states
        .slots
        .iter()
        .find(|s| s.used && s.broker_id == broker_id)
        .map(|s| s.pending)
}
