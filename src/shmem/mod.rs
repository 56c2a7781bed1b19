//! Shared memory, one slot per database served: the workers' latches (so a commit can wake
//! them), requests from SQL functions to the worker, counters, broker states. Only present when
//! the library is in `shared_preload_libraries`. The launcher's part, and how it hands out
//! slots, is in [`launch`].

mod created_ring;
pub mod handler_trap;
pub mod launch;
mod worker_hold;

use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PGRXSharedMemory, PgAtomic, PgLwLock};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// Databases served at most (`amqp_outbox.max_workers` may set fewer): one outbox worker and
/// one subscription worker each. Everything below exists once per database.
pub const MAX_DATABASES: usize = 32;

/// Lanes of one database at most: worker processes that handle the messages of subscriptions
/// with a parallelism or an ordering (see `inbox::lane`). A subscription's parallelism is at
/// most this.
pub const MAX_LANES: usize = 16;

/// One database's workers, as the other processes see them. The launcher assigns a slot to a
/// database and starts its workers with the slot's index; backends find theirs by database oid.
#[derive(Default)]
pub struct DbSlot {
    /// The oid of the database this slot serves (set by the launcher); 0 while never used.
    /// Kept after the workers exit, so counters stay readable until the slot is reused.
    database: AtomicU32,
    /// The outbox worker found no extension in its database and exited: not to be restarted
    /// until a `CREATE EXTENSION`.
    absent: AtomicBool,
    /// Set by the launcher when it starts the outbox worker only to learn whether the
    /// database has the extension (all `amqp_outbox.max_workers` are taken): it exits after
    /// its first look.
    probe_only: AtomicBool,
    /// The launcher serves this database now (`amqp.worker_status` lists it).
    served: AtomicBool,
    /// A statement that needs the database to itself (DROP, RENAME, ALTER DATABASE SET
    /// TABLESPACE, CREATE DATABASE from it as a template) stopped the workers until this
    /// instant (milliseconds since the Unix epoch); 0: not paused.
    paused_until_ms: AtomicU64,
    /// Address of the outbox worker's `PGPROC` latch, or 0 when it does not run. Shared memory
    /// is mapped at the same address in every process forked from the postmaster, so the
    /// pointer is valid in all backends. A stale pointer (worker gone, slot reused) only causes
    /// a spurious wake-up.
    latch: AtomicUsize,
    pid: AtomicI32,
    /// amqp.broker, amqp.exchange… changed: the worker re-reads them. An atomic, so a commit
    /// callback can set it without taking a lock.
    reload: AtomicBool,
    /// The worker is about to look for committed rows and wants the next commit to wake it.
    /// The first commit after that clears it and sets the latch; later ones skip the latch,
    /// which is already set, so a busy database does not signal the worker once per commit.
    commit_wake_armed: AtomicBool,
    counters: Counters,
    /// The subscription worker of this database: latch, pid, and its own reload flag.
    inbox_latch: AtomicUsize,
    inbox_pid: AtomicI32,
    inbox_reload: AtomicBool,
    /// The monitor (reconciliation) of this database: latch and pid.
    monitor_latch: AtomicUsize,
    monitor_pid: AtomicI32,
    /// Its lanes (see [`MAX_LANES`]): latch and pid of each.
    lane_latch: [AtomicUsize; MAX_LANES],
    lane_pid: [AtomicI32; MAX_LANES],
    /// How many lanes the subscription worker wants running (the launcher starts them).
    lanes_wanted: AtomicU32,
    /// A lane committed work: the subscription worker looks which of its deliveries are done.
    lanes_progress: AtomicBool,
    /// Bumped by the subscription worker each time it read the subscriptions again: lanes
    /// read them again too.
    subscriptions_generation: AtomicU64,
    /// A transaction that published for later (`deliver_after`) committed: the outbox worker
    /// looks when the earliest delayed message is due.
    scheduled: AtomicBool,
}

/// One `T` per database slot, in shared memory.
#[derive(Clone, Copy)]
pub struct PerDb<T>([T; MAX_DATABASES]);

impl<T: Default + Copy> Default for PerDb<T> {
    fn default() -> Self {
        PerDb([T::default(); MAX_DATABASES])
    }
}
// SAFETY: an array of values that are themselves plain shared-memory data (checked by the
// bound), meaningful in every process.
unsafe impl<T: PGRXSharedMemory> PGRXSharedMemory for PerDb<T> {}

/// The atomics of every slot (not `Copy`: built in place).
pub struct Slots([DbSlot; MAX_DATABASES]);

impl Default for Slots {
    fn default() -> Self {
        Slots(std::array::from_fn(|_| DbSlot::default()))
    }
}
// SAFETY: only atomics, no pointers; every access is atomic, so processes may share them.
unsafe impl PGRXSharedMemory for Slots {}

// SAFETY: the name is unique: each `amqp_outbox_*` shared-memory name is used once, here.
static SLOTS: PgAtomic<Slots> = unsafe { PgAtomic::new(c"amqp_outbox_db_slots") };
// SAFETY: the name is unique: each `amqp_outbox_*` shared-memory name is used once, here.
static REQUESTS: PgLwLock<PerDb<Requests>> = unsafe { PgLwLock::new(c"amqp_outbox_requests") };
// SAFETY: the name is unique: each `amqp_outbox_*` shared-memory name is used once, here.
static BROKER_STATES: PgLwLock<PerDb<BrokerStates>> =
    unsafe { PgLwLock::new(c"amqp_outbox_broker_states") };
// SAFETY: the name is unique: each `amqp_outbox_*` shared-memory name is used once, here.
static IN_FLIGHT: PgLwLock<PerDb<InFlightTable>> =
    unsafe { PgLwLock::new(c"amqp_outbox_in_flight") };

/// A worker's own slot (its bgw_main_arg); `usize::MAX` in backends.
static MY_SLOT: AtomicUsize = AtomicUsize::new(usize::MAX);

/// Called by a worker before it registers: the slot it serves.
pub fn set_worker_slot(slot: usize) {
    MY_SLOT.store(slot, Ordering::Relaxed);
}

/// This process's slot: a worker's own, or the one serving the backend's database (none when
/// no worker of this database has run since the server started).
fn slot() -> Option<&'static DbSlot> {
    let i = slot_index()?;
    Some(&SLOTS.get().0[i])
}

fn slot_index() -> Option<usize> {
    if !ready() {
        return None;
    }
    let mine = MY_SLOT.load(Ordering::Relaxed);
    if mine < MAX_DATABASES {
        return Some(mine);
    }
    // SAFETY: MyDatabaseId is a plain global of this backend, set once it connected.
    let db = unsafe { pg_sys::MyDatabaseId }.to_u32();
    if db == 0 {
        return None;
    }
    SLOTS
        .get()
        .0
        .iter()
        .position(|s| s.database.load(Ordering::Acquire) == db)
}

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
    /// Since when (Unix ms) claimed messages wait for `amqp_outbox.standby_names`; 0: none.
    pub standby_wait_since_ms: AtomicU64,
}

/// Messages the worker has in flight, for `amqp.message_status`. Larger windows show only the
/// first entries.
pub const IN_FLIGHT_SHOWN: usize = 8192;

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
    let Some(i) = slot_index() else { return };
    let mut all = IN_FLIGHT.exclusive();
    let t = &mut all.0[i];
    let n = entries.len().min(IN_FLIGHT_SHOWN);
    t.entries[..n].copy_from_slice(&entries[..n]);
    t.len = n;
}

pub fn in_flight() -> Vec<(i64, bool)> {
    let Some(i) = slot_index() else {
        return Vec::new();
    };
    let all = IN_FLIGHT.share();
    let t = &all.0[i];
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
    launch::init();
    handler_trap::init();
    pg_shmem_init!(SLOTS);
    pg_shmem_init!(REQUESTS);
    pg_shmem_init!(BROKER_STATES);
    pg_shmem_init!(IN_FLIGHT);
    READY.store(true, Ordering::Relaxed);
}

pub fn ready() -> bool {
    READY.load(Ordering::Relaxed)
}

fn set_latch(latch: &AtomicUsize) {
    let latch = latch.load(Ordering::Acquire);
    if latch != 0 {
        // SAFETY: called on a PostgreSQL thread (a backend or a worker's main thread). The
        // address is a PGPROC's latch in shared memory, mapped at the same address in every
        // process; if the worker is gone, it is still a valid latch (a spurious wake-up).
        unsafe { pg_sys::SetLatch(latch as *mut pg_sys::Latch) };
    }
}

/// Sets this database's outbox worker's latch, and makes its next wake-up claim as a commit's
/// would (a wake-up with only confirms in it claims nothing): `amqp.wake()` after rows were
/// inserted by hand. Never raises.
pub fn wake_worker() {
    if let Some(s) = slot() {
        s.commit_wake_armed.store(false, Ordering::Release);
        set_latch(&s.latch);
    }
}

/// A transaction that published committed: wake the worker if it asked for it. Never raises.
pub fn wake_worker_for_commit() {
    if let Some(s) = slot() {
        if s.commit_wake_armed.swap(false, Ordering::AcqRel) {
            s.counters.commit_wakeups.fetch_add(1, Ordering::Relaxed);
            set_latch(&s.latch);
        }
    }
}

/// The worker wants the next commit's wake-up. It must call this before it takes the snapshot
/// that looks for committed rows: a commit after that snapshot then finds the flag set.
pub fn arm_commit_wake(armed: bool) {
    if let Some(s) = slot() {
        s.commit_wake_armed.store(armed, Ordering::Release);
    }
}

/// Whether a commit has taken the wake-up armed by [`arm_commit_wake`] (`true`) since then. The
/// worker looks before it sleeps: a lock or buffer wait inside its own transactions sleeps on
/// the same latch and resets it, which would leave that commit's wake-up to the naptime.
pub fn commit_wake_taken() -> bool {
    slot().is_some_and(|s| !s.commit_wake_armed.load(Ordering::Acquire))
}

/// Which worker of a database.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum WorkerKind {
    Outbox,
    Inbox,
    Monitor,
    /// Lane `n` (0-based, below [`MAX_LANES`]).
    Lane(usize),
}

/// A worker announces itself in its slot (after [`set_worker_slot`]): its pid and latch.
/// `false`: another worker of the same kind holds the slot (a twin, started by a launcher that
/// had not seen it yet), and this one must exit without touching anything. The pid is the hold: it is taken only when free
/// and given back only by the process that took it (see [`unregister_worker`]), and a worker
/// that dies without giving it back crashes the cluster, which clears shared memory.
pub fn register_worker(kind: WorkerKind, latch: *mut pg_sys::Latch, pid: i32) -> bool {
    let Some(s) = slot() else { return true };
    let (l, p) = worker_fields(s, kind);
    if !worker_hold::take(p, pid) {
        return false;
    }
    l.store(latch as usize, Ordering::Release);
    true
}

/// The worker `pid` leaves its slot (as it exits), if it holds it, and wakes the launcher so
/// that a stopped worker is started again within seconds even when this launcher did not start
/// it (and so gets no notice from the postmaster).
pub fn unregister_worker(kind: WorkerKind, pid: i32) {
    let Some(s) = slot() else { return };
    let (l, p) = worker_fields(s, kind);
    if p.load(Ordering::Acquire) == pid {
        l.store(0, Ordering::Release);
        worker_hold::give_back(p, pid);
    }
    launch::wake_launcher();
}

fn worker_fields(s: &DbSlot, kind: WorkerKind) -> (&AtomicUsize, &AtomicI32) {
    match kind {
        WorkerKind::Outbox => (&s.latch, &s.pid),
        WorkerKind::Inbox => (&s.inbox_latch, &s.inbox_pid),
        WorkerKind::Monitor => (&s.monitor_latch, &s.monitor_pid),
        WorkerKind::Lane(n) => (&s.lane_latch[n % MAX_LANES], &s.lane_pid[n % MAX_LANES]),
    }
}

/// The subscription worker wants `n` lanes: tells the launcher when that changed.
pub fn set_lanes_wanted(n: usize) {
    if let Some(s) = slot() {
        let n = n.min(MAX_LANES) as u32;
        if s.lanes_wanted.swap(n, Ordering::AcqRel) != n {
            launch::wake_launcher();
        }
    }
}

/// Wakes this database's lanes (messages wait for them, or a key may have become free).
pub fn wake_lanes() {
    if let Some(s) = slot() {
        for l in &s.lane_latch {
            set_latch(l);
        }
    }
}

/// A lane committed work: the subscription worker acknowledges what is done.
pub fn note_lane_progress() {
    if let Some(s) = slot() {
        if !s.lanes_progress.swap(true, Ordering::AcqRel) {
            set_latch(&s.inbox_latch);
        }
    }
}

/// A transaction that published for later committed: the outbox worker looks at
/// `amqp.scheduled_message` again. Never raises.
pub fn note_scheduled() {
    if let Some(s) = slot() {
        if !s.scheduled.swap(true, Ordering::AcqRel) {
            set_latch(&s.latch);
        }
    }
}

/// Whether [`note_scheduled`] was called since the outbox worker last took it.
pub fn scheduled_noted() -> bool {
    slot().is_some_and(|s| s.scheduled.load(Ordering::Acquire))
}

/// As [`scheduled_noted`], and clears it.
pub fn take_scheduled() -> bool {
    slot().is_some_and(|s| s.scheduled.swap(false, Ordering::AcqRel))
}

/// Whether a lane committed work since the subscription worker last asked; clears it.
pub fn take_lane_progress() -> bool {
    slot().is_some_and(|s| s.lanes_progress.swap(false, Ordering::AcqRel))
}

/// The subscription worker read the subscriptions again.
pub fn bump_subscriptions_generation() {
    if let Some(s) = slot() {
        s.subscriptions_generation.fetch_add(1, Ordering::AcqRel);
    }
}

pub fn subscriptions_generation() -> u64 {
    slot().map_or(0, |s| s.subscriptions_generation.load(Ordering::Acquire))
}

pub fn counters() -> Option<&'static Counters> {
    slot().map(|s| &s.counters)
}

pub fn request_disconnect(broker_id: i32) {
    let Some(i) = slot_index() else { return };
    {
        let mut all = REQUESTS.exclusive();
        let r = &mut all.0[i];
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

/// Both workers of this database re-read their configuration. Never raises: may run in a
/// commit callback.
pub fn request_reload() {
    if let Some(s) = slot() {
        s.reload.store(true, Ordering::Release);
        s.inbox_reload.store(true, Ordering::Release);
        set_latch(&s.latch);
        set_latch(&s.inbox_latch);
    }
}

/// The subscription worker: whether a reload was requested since it last asked; clears it.
pub fn take_inbox_reload() -> bool {
    slot().is_some_and(|s| s.inbox_reload.swap(false, Ordering::AcqRel))
}

/// What the worker must do now; clears the requests.
pub struct TakenRequests {
    /// `None`: every broker.
    pub disconnect: Option<Vec<i32>>,
    pub reload: bool,
}

pub fn take_requests() -> TakenRequests {
    let (Some(i), Some(s)) = (slot_index(), slot()) else {
        return TakenRequests {
            disconnect: Some(Vec::new()),
            reload: false,
        };
    };
    let mut all = REQUESTS.exclusive();
    let r = &mut all.0[i];
    let taken = TakenRequests {
        disconnect: if r.overflow {
            None
        } else {
            Some(r.disconnect[..r.len].to_vec())
        },
        reload: s.reload.swap(false, Ordering::AcqRel),
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
    let Some(i) = slot_index() else { return };
    // SAFETY: only reads the clock; called on the worker's main thread.
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    let mut all = BROKER_STATES.exclusive();
    let states = &mut all.0[i];
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
    let Some(i) = slot_index() else {
        return Vec::new();
    };
    let all = BROKER_STATES.share();
    all.0[i].slots.iter().filter(|s| s.used).copied().collect()
}

/// The broker's backlog as the worker last counted it.
pub fn pending(broker_id: i32) -> Option<i64> {
    let i = slot_index()?;
    let all = BROKER_STATES.share();
    all.0[i]
        .slots
        .iter()
        .find(|s| s.used && s.broker_id == broker_id)
        .map(|s| s.pending)
}
