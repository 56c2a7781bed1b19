//! The launcher's shared state: its latch (so `CREATE EXTENSION` and database statements can
//! wake it), the databases it could not serve, and its hold on the database slots. Only the
//! launcher assigns slots; workers and backends read them.

use super::created_ring::CreatedRing;
use super::{
    set_latch, BrokerStates, Counters, InFlightTable, Requests, BROKER_STATES, IN_FLIGHT,
    MAX_DATABASES, MAX_LANES, REQUESTS, SLOTS,
};
use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PGRXSharedMemory, PgAtomic};
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Databases listed as not served (beyond the cap), at most.
pub const MAX_UNSERVED: usize = 64;

/// Why a database has no workers although it has the extension and is allowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Unserved {
    /// `amqp_outbox.max_workers` databases are served already.
    MaxWorkers = 1,
    /// PostgreSQL had no background worker slot left (`max_worker_processes`).
    NoWorkerSlot = 2,
}

pub struct Launcher {
    latch: AtomicUsize,
    pid: AtomicI32,
    /// The last databases where `CREATE EXTENSION` committed.
    created: CreatedRing,
    /// (database oid, reason) of the databases not served; `unserved_len` of them are valid.
    unserved: [(AtomicU32, AtomicU32); MAX_UNSERVED],
    unserved_len: AtomicUsize,
}
impl Default for Launcher {
    fn default() -> Self {
        Launcher {
            latch: AtomicUsize::new(0),
            pid: AtomicI32::new(0),
            created: CreatedRing::default(),
            unserved: std::array::from_fn(|_| (AtomicU32::new(0), AtomicU32::new(0))),
            unserved_len: AtomicUsize::new(0),
        }
    }
}
// SAFETY: only atomics, no pointers (the latch is an address in shared memory, the same in
// every process); every access is atomic.
unsafe impl PGRXSharedMemory for Launcher {}

// SAFETY: the name is unique: each `amqp_outbox_*` shared-memory name is used once.
static LAUNCHER: PgAtomic<Launcher> = unsafe { PgAtomic::new(c"amqp_outbox_launcher") };

pub(super) fn init() {
    pg_shmem_init!(LAUNCHER);
}

fn launcher() -> Option<&'static Launcher> {
    super::ready().then(|| LAUNCHER.get())
}

/// The launcher registers its latch (and clears it with `None` as it exits).
pub fn register_launcher(latch: Option<*mut pg_sys::Latch>, pid: i32) {
    if let Some(l) = launcher() {
        l.latch
            .store(latch.map_or(0, |p| p as usize), Ordering::Release);
        l.pid.store(pid, Ordering::Release);
    }
}

pub fn launcher_pid() -> Option<i32> {
    launcher()
        .map(|l| l.pid.load(Ordering::Acquire))
        .filter(|p| *p != 0)
}

/// Wakes the launcher. Never raises: runs in commit callbacks.
pub fn wake_launcher() {
    if let Some(l) = launcher() {
        set_latch(&l.latch);
    }
}

/// A `CREATE EXTENSION` committed in this backend's database: the launcher serves it.
pub fn extension_created() {
    if let Some(l) = launcher() {
        // SAFETY: MyDatabaseId is a plain global of a connected backend.
        let db = unsafe { pg_sys::MyDatabaseId }.to_u32();
        l.created.record(db);
        set_latch(&l.latch);
    }
}

/// How many `CREATE EXTENSION` committed so far.
pub fn extensions_created() -> u64 {
    launcher().map_or(0, |l| l.created.count())
}

/// The databases of the `CREATE EXTENSION`s after the first `since`, up to `now`; `None` when
/// too many came to tell, or one is still being written (look at every database again).
pub fn created_in(since: u64, now: u64) -> Option<Vec<u32>> {
    launcher()?.created.between(since, now)
}

pub fn set_unserved(list: &[(u32, Unserved)]) {
    let Some(l) = launcher() else { return };
    let n = list.len().min(MAX_UNSERVED);
    for (slot, (oid, why)) in l.unserved.iter().zip(&list[..n]) {
        slot.0.store(*oid, Ordering::Relaxed);
        slot.1.store(*why as u32, Ordering::Relaxed);
    }
    l.unserved_len.store(n, Ordering::Release);
}

pub fn unserved() -> Vec<(u32, Unserved)> {
    let Some(l) = launcher() else {
        return Vec::new();
    };
    let n = l.unserved_len.load(Ordering::Acquire).min(MAX_UNSERVED);
    l.unserved[..n]
        .iter()
        .map(|(oid, why)| {
            let why = if why.load(Ordering::Relaxed) == Unserved::NoWorkerSlot as u32 {
                Unserved::NoWorkerSlot
            } else {
                Unserved::MaxWorkers
            };
            (oid.load(Ordering::Relaxed), why)
        })
        .collect()
}

impl Unserved {
    pub fn text(self) -> &'static str {
        match self {
            Unserved::MaxWorkers => "not served: amqp_outbox.max_workers reached",
            Unserved::NoWorkerSlot => {
                "not served: no background worker slot (max_worker_processes)"
            }
        }
    }
}

/// Messages waiting this long for the standbys show in `amqp.worker_status.state`.
const STANDBY_WAIT_SHOWN_MS: u64 = 1000;

/// The pids of a database's outbox worker, subscription worker and monitor (0: none).
pub type Pids = (i32, i32, i32);

/// The databases the launcher serves now: oid, state, counters, pids.
pub fn served() -> Vec<(u32, &'static str, &'static Counters, Pids)> {
    if !super::ready() {
        return Vec::new();
    }
    SLOTS
        .get()
        .0
        .iter()
        .filter(|s| s.served.load(Ordering::Acquire))
        .map(|s| {
            let pids = (
                s.pid.load(Ordering::Acquire),
                s.inbox_pid.load(Ordering::Acquire),
                s.monitor_pid.load(Ordering::Acquire),
            );
            let waiting_since = s.counters.standby_wait_since_ms.load(Ordering::Relaxed);
            let state = if s.paused_until_ms.load(Ordering::Acquire) > now_ms() {
                "paused"
            } else if waiting_since != 0
                && now_ms().saturating_sub(waiting_since) >= STANDBY_WAIT_SHOWN_MS
            {
                "waiting for standbys (amqp_outbox.standby_names)"
            } else if pids.0 != 0 && pids.1 != 0 && pids.2 != 0 {
                "running"
            } else {
                "starting"
            };
            (s.database.load(Ordering::Acquire), state, &s.counters, pids)
        })
        .collect()
}

/// The launcher no longer serves slot `i` (its counters stay until the slot is reused).
pub fn release_slot(i: usize) {
    SLOTS.get().0[i].served.store(false, Ordering::Release);
}

/// What the launcher and the views see of one slot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotView {
    pub database: u32,
    pub outbox_pid: i32,
    pub inbox_pid: i32,
    pub monitor_pid: i32,
    pub lane_pids: [i32; MAX_LANES],
    pub lanes_wanted: usize,
    pub absent: bool,
    pub paused: bool,
    /// A launcher served the database here (all its workers; not only a probe).
    pub served: bool,
}

impl SlotView {
    /// A worker of any kind holds this slot.
    pub fn has_worker(&self) -> bool {
        self.outbox_pid != 0
            || self.inbox_pid != 0
            || self.monitor_pid != 0
            || self.lane_pids.iter().any(|p| *p != 0)
    }
}

pub fn slot_view(i: usize) -> SlotView {
    let Some(s) = super::ready().then(|| &SLOTS.get().0[i]) else {
        return SlotView::default();
    };
    SlotView {
        database: s.database.load(Ordering::Acquire),
        outbox_pid: s.pid.load(Ordering::Acquire),
        inbox_pid: s.inbox_pid.load(Ordering::Acquire),
        monitor_pid: s.monitor_pid.load(Ordering::Acquire),
        lane_pids: std::array::from_fn(|n| s.lane_pid[n].load(Ordering::Acquire)),
        lanes_wanted: s.lanes_wanted.load(Ordering::Acquire) as usize,
        absent: s.absent.load(Ordering::Acquire),
        paused: s.paused_until_ms.load(Ordering::Acquire) > now_ms(),
        served: s.served.load(Ordering::Acquire),
    }
}

/// The launcher gives slot `i` to `database` (`probe_only`: see [`super::DbSlot`]). A slot
/// that served another database starts afresh (counters, broker states, in-flight table,
/// requests).
pub fn assign_slot(i: usize, database: u32, probe_only: bool) {
    let s = &SLOTS.get().0[i];
    s.absent.store(false, Ordering::Release);
    s.probe_only.store(probe_only, Ordering::Release);
    s.served.store(!probe_only, Ordering::Release);
    if s.database.swap(database, Ordering::AcqRel) == database {
        return;
    }
    s.paused_until_ms.store(0, Ordering::Release);
    s.lanes_wanted.store(0, Ordering::Release);
    let Counters {
        published,
        confirmed,
        failed,
        parked,
        acknowledged,
        resent_gap,
        resent_timeout,
        steps,
        commit_wakeups,
        standby_wait_since_ms,
    } = &s.counters;
    for c in [
        published,
        confirmed,
        failed,
        parked,
        acknowledged,
        resent_gap,
        resent_timeout,
        steps,
        commit_wakeups,
        standby_wait_since_ms,
    ] {
        c.store(0, Ordering::Relaxed);
    }
    BROKER_STATES.exclusive().0[i] = BrokerStates::default();
    IN_FLIGHT.exclusive().0[i] = InFlightTable::default();
    REQUESTS.exclusive().0[i] = Requests::default();
    super::handler_trap::clear(i);
}

/// The outbox worker found its database without the extension and is exiting.
pub fn mark_absent() {
    if let Some(s) = super::slot() {
        s.absent.store(true, Ordering::Release);
    }
}

/// Whether this worker only had to look for the extension (see [`super::DbSlot`]).
pub fn probe_only() -> bool {
    super::slot().is_some_and(|s| s.probe_only.load(Ordering::Acquire))
}

/// The database's slot, by oid.
pub fn slot_of(database: u32) -> Option<usize> {
    if !super::ready() || database == 0 {
        return None;
    }
    SLOTS
        .get()
        .0
        .iter()
        .position(|s| s.database.load(Ordering::Acquire) == database)
}

/// The database of a worker's slot (its bgw_main_arg).
pub fn database_of_slot(i: usize) -> u32 {
    if i >= MAX_DATABASES || !super::ready() {
        return 0;
    }
    SLOTS.get().0[i].database.load(Ordering::Acquire)
}

/// Stops the database's workers being started for `for_at_most` (see [`super::DbSlot`]),
/// or (`None`) ends the pause. Returns the pids of its workers that run now.
pub fn pause(database: u32, for_at_most: Option<Duration>) -> Vec<i32> {
    let Some(i) = slot_of(database) else {
        return Vec::new();
    };
    let s = &SLOTS.get().0[i];
    let until = for_at_most.map_or(0, |d| now_ms() + d.as_millis() as u64);
    s.paused_until_ms.store(until, Ordering::Release);
    [&s.pid, &s.inbox_pid, &s.monitor_pid]
        .into_iter()
        .chain(s.lane_pid.iter())
        .map(|p| p.load(Ordering::Acquire))
        .filter(|p| *p != 0)
        .collect()
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
