//! The workers' side of `amqp_outbox.standby_names`: what would leave the database (the outbox
//! worker's claimed batches, the subscription worker's acknowledgements) waits here, with the
//! WAL insert position taken after what it depends on committed, until the named standbys have
//! flushed past it (read from `pg_stat_get_wal_senders()` while anything waits). The rule
//! itself is in [`super::standby_gate`].

use super::flight::Flight;
use super::pg;
use super::standby_gate::{Held, Standbys, WalLayout};
use amqp_outbox_broker::Command;
use pgrx::prelude::*;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How often the standbys' positions are read while a batch waits: a local standby flushes
/// within a millisecond, and a look reads shared memory (the walsenders' slots).
pub const LOOK_EVERY: Duration = Duration::from_micros(100);
/// How long a batch waits for its WAL to be flushed by the commits of others before the worker
/// flushes it ([`flush_wal_to`]): longer than a commit's flush at a steady rate, shorter than
/// a standby's round trip.
const FLUSH_AFTER: Duration = Duration::from_millis(1);
/// A batch waiting this long is logged as a WARNING (then once a minute while it lasts).
const WARN_AFTER: Duration = Duration::from_secs(10);
const WARN_EVERY: Duration = Duration::from_secs(60);

/// Items (commands for the broker) waiting for the standbys, with the rule and its timing.
pub struct StandbyWait<T> {
    standbys: Standbys,
    positions: StandbyPositions,
    held: Held<T>,
    /// What waits, for the log ("message(s)", "acknowledgement(s)").
    what: &'static str,
    looked_at: Option<Instant>,
    /// Since when the oldest held batch waits.
    waiting_since: Option<Instant>,
    warned_at: Option<Instant>,
}

impl<T> StandbyWait<T> {
    pub fn new(what: &'static str) -> Self {
        StandbyWait {
            standbys: Standbys::Off,
            positions: StandbyPositions::default(),
            held: Held::default(),
            what,
            looked_at: None,
            waiting_since: None,
            warned_at: None,
        }
    }

    /// Takes the setting; returns what waited if it no longer has to (the setting cleared).
    pub fn configure(&mut self, setting: &str) -> Vec<T> {
        let standbys = Standbys::parse(setting, &own_name());
        if standbys != self.standbys && self.what == MESSAGES {
            log!("amqp_outbox: amqp_outbox.standby_names is now \"{setting}\"");
        }
        self.standbys = standbys;
        if self.standbys.is_off() && !self.held.is_empty() {
            self.waiting_since = None;
            self.show();
            return self.held.release_all();
        }
        Vec::new()
    }

    pub fn active(&self) -> bool {
        !self.standbys.is_off()
    }

    /// Holds `items` until the standbys have flushed `lsn`, a position by which what the items
    /// depend on is flushed ([`commit_position`], or an [`insert_position`] read after it
    /// committed); returns what may go at once.
    pub fn hold(&mut self, items: Vec<T>, lsn: u64) -> Vec<T> {
        if items.is_empty() {
            return items;
        }
        if self.held.is_empty() {
            self.waiting_since = Some(Instant::now());
        }
        self.held.hold(lsn, items);
        // A standby on the same machine has often flushed already.
        self.look()
    }

    /// Looks at the standbys if something waits and a look is due; returns what may go now.
    pub fn poll(&mut self) -> Vec<T> {
        if self.held.is_empty() || self.looked_at.is_some_and(|t| t.elapsed() < LOOK_EVERY) {
            return Vec::new();
        }
        self.look()
    }

    /// Waits on the latch and `fd` for at most `timeout`, as `event`; while something waits
    /// for the standbys, for one look's interval instead, which is shorter than a latch wait
    /// can be: a sleep, then whatever came meanwhile is taken.
    pub fn wait(&self, fd: std::os::fd::RawFd, timeout: Duration, event: pg::WaitEvent) {
        if !self.held.is_empty() && timeout > LOOK_EVERY {
            std::thread::sleep(LOOK_EVERY);
            pg::wait(Some(fd), Duration::ZERO, event);
        } else {
            pg::wait(Some(fd), timeout, event);
        }
    }

    fn look(&mut self) -> Vec<T> {
        self.looked_at = Some(Instant::now());
        let connected = self
            .positions
            .read(|| pg::transaction("amqp_outbox: standby names", names_by_pid));
        let released = self.held.release(self.standbys.flushed(&connected));
        if self.held.is_empty() {
            self.waiting_since = None;
            self.warned_at = None;
        } else if !released.is_empty() {
            self.waiting_since = Some(Instant::now());
        } else {
            self.flush_if_stalled();
            self.warn_if_long(&connected);
        }
        self.show();
        released
    }

    /// The WAL the held batches wait for, flushed here once they have waited [`FLUSH_AFTER`]
    /// and it is still not on disk: nothing may flush it soon (asynchronous commits, a session
    /// between its INSERT and its COMMIT, a quiet server).
    fn flush_if_stalled(&self) {
        if self
            .waiting_since
            .is_some_and(|t| t.elapsed() >= FLUSH_AFTER)
        {
            if let Some(lsn) = self.held.newest() {
                flush_wal_to(lsn);
            }
        }
    }

    /// The outbox worker's wait, for `amqp.worker_status.state`.
    fn show(&self) {
        if self.what != MESSAGES {
            return;
        }
        let since = self.waiting_since.map_or(0, |t| {
            crate::shmem::launch::now_ms().saturating_sub(t.elapsed().as_millis() as u64)
        });
        if let Some(c) = crate::shmem::counters() {
            c.standby_wait_since_ms
                .store(since, std::sync::atomic::Ordering::Relaxed);
        }
    }

    fn warn_if_long(&mut self, connected: &[(String, u64)]) {
        let Some(since) = self.waiting_since else {
            return;
        };
        if since.elapsed() < WARN_AFTER || self.warned_at.is_some_and(|t| t.elapsed() < WARN_EVERY)
        {
            return;
        }
        self.warned_at = Some(Instant::now());
        let missing = self.standbys.missing(connected);
        let why = if missing.is_empty() {
            "behind".to_string()
        } else {
            format!("not connected: {}", missing.join(", "))
        };
        warning!(
            "amqp_outbox: {} {} wait for amqp_outbox.standby_names since {} s ({why})",
            self.held.len(),
            self.what,
            since.elapsed().as_secs()
        );
    }
}

/// What the outbox worker holds.
pub const MESSAGES: &str = "message(s)";
/// What the subscription worker holds.
pub const ACKNOWLEDGEMENTS: &str = "acknowledgement(s) of handled deliveries";

/// The outbox worker's claimed commands: held (and their flight timing stopped) while the
/// standbys lack their commits; returns what may go now.
pub fn hold_claimed(
    wait: &mut StandbyWait<Command>,
    commands: Vec<Command>,
    lsn: u64,
    flight: &mut Flight,
) -> Vec<Command> {
    if !wait.active() || commands.is_empty() {
        return commands;
    }
    flight.hold(ids(&commands));
    let ready = wait.hold(commands, lsn);
    sent(flight, ready)
}

/// Commands released from the wait: their time in flight starts now.
pub fn sent(flight: &mut Flight, commands: Vec<Command>) -> Vec<Command> {
    flight.send_held(ids(&commands));
    commands
}

fn ids(commands: &[Command]) -> Vec<i64> {
    commands
        .iter()
        .flat_map(|c| match c {
            Command::Publish { messages, .. } => messages.iter().map(|m| m.id).collect(),
            _ => Vec::new(),
        })
        .collect()
}

/// Where WAL pages and their headers lie on this server.
fn wal_layout() -> WalLayout {
    let header = |size: usize| {
        let align = pg_sys::MAXIMUM_ALIGNOF as usize;
        size.div_ceil(align) * align
    };
    WalLayout {
        page_size: u64::from(pg_sys::XLOG_BLCKSZ),
        // SAFETY: set once at startup from the control file, read-only afterwards.
        segment_size: u64::try_from(unsafe { pg_sys::wal_segment_size }).unwrap_or(16 << 20),
        short_header: header(std::mem::size_of::<pg_sys::XLogPageHeaderData>()) as u64,
        long_header: header(std::mem::size_of::<pg_sys::XLogLongPageHeaderData>()) as u64,
    }
}

/// `XactTruncationLock`'s place in `MainLWLockArray` (`storage/lwlocknames.h`, the same in 15
/// to 18).
const XACT_TRUNCATION_LOCK: usize = 44;

/// A WAL position by which every commit of `writers` is flushed: the larger of the flush
/// position and what CLOG keeps for each asynchronous commit among them (the latest commit end
/// of its group of transactions). A synchronous commit is flushed before it becomes visible, so
/// the flush position read after the claim's snapshot covers it; an asynchronous one is not. Read
/// after CLOG, since a CLOG page forgets its positions only once written out, after the WAL up to
/// them was flushed. `fallback` (the insert position at the snapshot) when a writer is too old
/// for CLOG to hold.
pub fn commit_position(writers: &[u32], fallback: u64) -> u64 {
    let mut xids = writers.to_vec();
    xids.sort_unstable();
    xids.dedup();
    let mut lsn = 0;
    for xid in xids {
        match async_commit_position(xid) {
            Some(l) => lsn = lsn.max(l),
            None => return fallback,
        }
    }
    // SAFETY: reads the shared flush position under its spinlock; the caller checked that the
    // server is not in recovery (a claim runs only on a primary).
    lsn.max(unsafe { pg_sys::GetFlushRecPtr(std::ptr::null_mut()) })
}

/// The commit position CLOG keeps for `xid`'s group (0: none kept, the commits were flushed);
/// `None` for an id CLOG may no longer hold (special or truncated).
fn async_commit_position(xid: u32) -> Option<u64> {
    if xid < pg_sys::FirstNormalTransactionId.into_inner() {
        return None;
    }
    // SAFETY: MainLWLockArray lives in shared memory for the server's life; under
    // XactTruncationLock (shared), as pg_xact_status() looks, CLOG cannot be truncated past
    // `xid` between the check and the read. An ERROR in between releases the lock at abort.
    unsafe {
        let lock =
            std::ptr::addr_of_mut!((*pg_sys::MainLWLockArray.add(XACT_TRUNCATION_LOCK)).lock);
        pg_sys::LWLockAcquire(lock, pg_sys::LWLockMode::LW_SHARED);
        let xid = pg_sys::TransactionId::from(xid);
        let held = !pg_sys::TransactionIdPrecedes(xid, crate::pg_compat::oldest_clog_xid());
        let mut lsn: pg_sys::XLogRecPtr = 0;
        if held {
            pg_sys::TransactionIdGetStatus(xid, &mut lsn);
        }
        pg_sys::LWLockRelease(lock);
        held.then_some(lsn)
    }
}

/// The WAL insert position now, as the end of the last record ([`WalLayout::record_end`]).
pub fn insert_position() -> u64 {
    // SAFETY: reads the shared insert position under its spinlock.
    wal_layout().record_end(unsafe { pg_sys::GetXLogInsertRecPtr() })
}

/// Writes and flushes the WAL up to `lsn` unless it is on disk already. A walsender sends only
/// flushed WAL; left alone, WAL no synchronous commit follows reaches the disk at the WAL
/// writer's next round (`wal_writer_delay`, 200 ms by default).
pub(crate) fn flush_wal_to(lsn: pg_sys::XLogRecPtr) {
    // SAFETY: the main thread, outside any critical section; both read the shared positions
    // under their locks, and XLogFlush returns at once when `lsn` is flushed already.
    unsafe {
        if pg_sys::RecoveryInProgress() {
            return;
        }
        if pg_sys::GetFlushRecPtr(std::ptr::null_mut()) < lsn {
            pg_sys::XLogFlush(lsn);
        }
    }
}

/// This server's `cluster_name` (empty when unset).
pub(crate) fn own_name() -> String {
    // SAFETY: a GUC's string, NULL or NUL-terminated, read on the thread that owns it.
    unsafe {
        let p = pg_sys::cluster_name;
        if p.is_null() {
            String::new()
        } else {
            std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }
}

/// Each walsender's pid and the flush position its standby reported, from shared memory: no
/// transaction, so that a batch waiting for a standby can be looked at often.
fn walsender_flushes() -> Vec<(i32, u64)> {
    // SAFETY: WalSndCtl is set up by the postmaster before any backend runs and lives as long as
    // the server; it has max_wal_senders slots. Each field is read alone, without the slot's
    // spinlock: a pid and an aligned 8-byte position cannot be read torn, and a position only
    // grows, so a stale read only delays the release.
    unsafe {
        let ctl = pg_sys::WalSndCtl;
        if ctl.is_null() {
            return Vec::new();
        }
        let first = (*ctl).walsnds.as_ptr();
        (0..pg_sys::max_wal_senders.max(0) as usize)
            .filter_map(|i| {
                let w = first.add(i);
                let pid = std::ptr::read_volatile(std::ptr::addr_of!((*w).pid));
                let flush = std::ptr::read_volatile(std::ptr::addr_of!((*w).flush));
                (pid != 0 && flush != 0).then_some((pid, flush))
            })
            .collect()
    }
}

/// The `application_name` of each walsender's standby, by walsender pid (in a transaction; the
/// caller must be allowed to see them: a superuser, or `pg_read_all_stats`).
pub(crate) fn names_by_pid() -> HashMap<i32, String> {
    const SQL: &str = "SELECT w.pid, coalesce(a.application_name, '') \
                         FROM pg_catalog.pg_stat_get_wal_senders() w \
                        CROSS JOIN LATERAL pg_catalog.pg_stat_get_activity(w.pid) a";
    let result: Result<HashMap<i32, String>, pgrx::spi::Error> = Spi::connect(|client| {
        let mut out = HashMap::new();
        for row in client.select(SQL, None, &[])? {
            if let (Some(pid), Some(name)) = (row.get::<i32>(1)?, row.get::<String>(2)?) {
                out.insert(pid, name);
            }
        }
        Ok(out)
    });
    match result {
        Ok(names) => names,
        Err(e) => error!("amqp_outbox: worker query failed: {e}"),
    }
}

/// Each connected standby's `application_name` and flush position: the positions from shared
/// memory at every read, the names by walsender pid, read again (with `names`, a query the
/// caller runs in a transaction) only when a walsender appears that is not known yet.
#[derive(Default)]
pub(crate) struct StandbyPositions {
    names: HashMap<i32, String>,
}

impl StandbyPositions {
    pub(crate) fn read(
        &mut self,
        names: impl FnOnce() -> HashMap<i32, String>,
    ) -> Vec<(String, u64)> {
        let flushes = walsender_flushes();
        if flushes.iter().any(|(pid, _)| !self.names.contains_key(pid)) {
            self.names = names();
        }
        flushes
            .iter()
            .filter_map(|(pid, lsn)| self.names.get(pid).map(|n| (n.clone(), *lsn)))
            .collect()
    }
}
