//! The launcher: one background worker, registered at server start and connected to no
//! database, that gives every database with the extension its three workers (outbox,
//! subscriptions, monitor) and the lanes its subscription worker asks for — databases allowed
//! by `amqp_outbox.database`, at most `amqp_outbox.max_workers` of them.
//!
//! It looks at `pg_database` when woken (a committed `CREATE EXTENSION`, a worker that started
//! or stopped, a database statement that paused a database, a reload) and otherwise once a
//! minute. A database's outbox worker is its probe: it exits at once, marking the slot, when its
//! database has no extension; the launcher then leaves the database alone until the next
//! `CREATE EXTENSION` commits (or `ABSENT_FOR` passes).
//!
//! - [`catalog`]: the connectable databases; [`workers`]: start and stop one worker;
//!   [`slots`]: which slot a database gets; [`watch`]: what makes sure a stopped launcher
//!   comes back.

mod catalog;
mod slots;
mod watch;
mod workers;

use crate::gucs;
use crate::shmem::launch::{self, SlotView, Unserved};
use crate::shmem::{MAX_DATABASES, MAX_LANES};
use crate::wait_event::WaitEvent;
use catalog::Database;
use pgrx::bgworkers::SignalWakeFlags;
use pgrx::bgworkers::{BackgroundWorker, BackgroundWorkerBuilder, BgWorkerStartTime};
use pgrx::prelude::*;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};
use workers::{Kind, Tracked};

/// A launcher that stopped (terminated, failed) is started again by the postmaster after this.
const LAUNCHER_RESTART: Duration = Duration::from_secs(1);
/// How often the launcher looks at `pg_database` when nothing wakes it.
const RESCAN_EVERY: Duration = Duration::from_secs(60);
/// A worker that stopped (terminated, failed) is started again after this.
const RESTART_AFTER: Duration = Duration::from_secs(2);
/// A lane that stopped is started again after this.
const LANE_RESTART: Duration = Duration::from_secs(1);

/// What tending a database's lanes left to do.
enum Lanes {
    Done,
    /// A lane that stopped is started again then.
    LookAgain(Duration),
    /// No background worker slot was free (`max_worker_processes`).
    NoSlot,
}
/// Probes running at once: a server with many databases must not take every background worker
/// slot to look for the extension.
const MAX_PROBES: usize = 2;
/// A database found without the extension is looked at again after this even if no
/// `CREATE EXTENSION` was seen to commit (one in a prepared transaction wakes nobody).
const ABSENT_FOR: Duration = Duration::from_secs(300);

/// Registers the launcher; from `_PG_init` while preloading.
pub fn register() {
    BackgroundWorkerBuilder::new("amqp_outbox launcher")
        .set_type("amqp_outbox launcher")
        .set_library("amqp_outbox")
        .set_function("amqp_outbox_launcher_main")
        .enable_spi_access()
        // Not on a standby: its databases' workers would publish nothing there.
        .set_start_time(BgWorkerStartTime::RecoveryFinished)
        // It exits non-zero whenever it stops (see amqp_outbox_launcher_main): the postmaster
        // starts it again after this, except while the server shuts down.
        .set_restart_time(Some(LAUNCHER_RESTART))
        .load();
}

/// A database the launcher gave a slot to.
struct Served {
    db: Database,
    outbox: Tracked,
    inbox: Tracked,
    monitor: Tracked,
    /// Its lanes, as many as its subscription worker wants (see `shmem::set_lanes_wanted`).
    lanes: [Tracked; MAX_LANES],
    /// When one of its lanes was found stopped.
    lanes_stopped_at: Option<Instant>,
    /// When a worker of it was found stopped (restart after `RESTART_AFTER`).
    stopped_at: Option<Instant>,
    /// `CREATE EXTENSION` count when its workers were last started: a commit after that
    /// means "no extension" may already be out of date.
    created_at_start: u64,
    /// Only its outbox worker runs, to learn whether the extension is there (the cap is
    /// reached); it does not count against the cap.
    probe: bool,
}

impl Served {
    fn tracked(&mut self, kind: Kind) -> &mut Tracked {
        match kind {
            Kind::Outbox => &mut self.outbox,
            Kind::Inbox => &mut self.inbox,
            Kind::Monitor => &mut self.monitor,
            Kind::Lane(n) => &mut self.lanes[n % MAX_LANES],
        }
    }

    fn stop_lanes(&mut self, view: &SlotView) -> bool {
        let mut any = false;
        for n in 0..MAX_LANES {
            if self.lanes[n].alive(Kind::Lane(n), view) {
                self.lanes[n].stop(Kind::Lane(n), view);
                any = true;
            }
        }
        any
    }

    /// Starts the lanes wanted that do not run (a new one at once, one that stopped after
    /// [`LANE_RESTART`]) and stops those no longer wanted.
    fn tend_lanes(&mut self, slot: usize, view: &SlotView) -> Lanes {
        let mut out = Lanes::Done;
        for n in 0..MAX_LANES {
            let kind = Kind::Lane(n);
            let alive = self.lanes[n].alive(kind, view);
            if n >= view.lanes_wanted {
                if alive {
                    self.lanes[n].stop(kind, view);
                }
                continue;
            }
            if alive {
                continue;
            }
            if self.lanes[n].started() {
                // It stopped: not in a loop with a lane that fails at once.
                let since = *self.lanes_stopped_at.get_or_insert_with(Instant::now);
                let due = LANE_RESTART.saturating_sub(since.elapsed());
                if !due.is_zero() {
                    out = Lanes::LookAgain(due);
                    continue;
                }
            }
            if !self.lanes[n].start(kind, slot, &self.db.name) {
                return Lanes::NoSlot;
            }
        }
        if matches!(out, Lanes::Done) {
            self.lanes_stopped_at = None;
        }
        out
    }
}

struct Launcher {
    served: Vec<Option<Served>>,
    /// Databases found without the extension, and when.
    absent: HashMap<u32, Instant>,
    created_seen: u64,
    /// Databases a probe found with the extension (they get all its workers when there is room).
    known: HashSet<u32>,
    /// Databases already warned about as not served (one WARNING each, not one per scan).
    warned: HashSet<u32>,
    /// Served databases whose worker could not be started again (warned once until it is).
    start_warned: HashSet<u32>,
}

#[pg_guard]
extern "C-unwind" fn unregister_on_exit(_code: i32, _arg: pg_sys::Datum) {
    launch::register_launcher(None, 0);
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn amqp_outbox_launcher_main(_arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    // No database: only the shared catalogs, so that no DROP DATABASE ever waits for it.
    BackgroundWorker::connect_worker_to_spi(None, None);
    // SAFETY: the main thread of a started worker: MyLatch and MyProcPid are its own until it
    // exits, and the callback registered here clears them from shared memory first.
    unsafe {
        launch::register_launcher(Some(pg_sys::MyLatch), pg_sys::MyProcPid);
        pg_sys::before_shmem_exit(Some(unregister_on_exit), pg_sys::Datum::from(0));
    }
    log!(
        "amqp_outbox: launcher started (amqp_outbox.database = '{}', amqp_outbox.max_workers = {})",
        gucs::database_filter_text(),
        gucs::max_workers()
    );
    let mut launcher = Launcher {
        served: (0..MAX_DATABASES).map(|_| None).collect(),
        absent: HashMap::new(),
        created_seen: launch::extensions_created(),
        known: HashSet::new(),
        warned: HashSet::new(),
        start_warned: HashSet::new(),
    };
    crate::wait_event::register(&[WaitEvent::LauncherMain]);
    launcher.adopt();
    let stop = loop {
        let timeout = launcher.round();
        if let Err(stop) = wait(timeout, WaitEvent::LauncherMain) {
            break stop;
        }
        if BackgroundWorker::sighup_received() {
            // SAFETY: the launcher's main thread, between transactions.
            unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
        }
    };
    // A SIGTERM is either the server shutting down (the postmaster then restarts nothing) or
    // pg_terminate_backend(): exit code 1 has the postmaster start the launcher again, as
    // PostgreSQL's own logical replication launcher, while code 0 would unregister it for good
    // and leave every database's stopped worker stopped until the server restarts.
    log!("amqp_outbox: launcher stopping (terminated); the postmaster starts it again unless the server is shutting down");
    if stop == Stop::Terminated {
        watch::start();
    }
    // SAFETY: the launcher's main thread, between transactions; proc_exit runs the exit
    // callbacks (ours included) and never returns.
    unsafe { crate::pg_compat::proc_exit(1) };
}

/// Why a launcher (or its watch) stops.
#[derive(Debug, PartialEq, Eq)]
enum Stop {
    /// SIGTERM: `pg_terminate_backend()`, or the server shutting down.
    Terminated,
    PostmasterDied,
}

/// Waits on the latch for at most `timeout`, showing `event` (as pgrx's
/// `BackgroundWorker::wait_latch`, which always shows `Extension`); `Err` when the process must
/// stop.
fn wait(timeout: Duration, event: WaitEvent) -> Result<(), Stop> {
    let events = pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_POSTMASTER_DEATH;
    let timeout_ms = std::ffi::c_long::from(amqp_outbox_engine::wait_ms::wait_ms(timeout));
    // SAFETY: the launcher's main thread, which owns MyLatch; only its owner resets it.
    let woken = unsafe {
        let woken = pg_sys::WaitLatch(pg_sys::MyLatch, events as i32, timeout_ms, event.info());
        pg_sys::ResetLatch(pg_sys::MyLatch);
        woken
    };
    pg_sys::check_for_interrupts!();
    if woken & pg_sys::WL_POSTMASTER_DEATH as i32 != 0 {
        Err(Stop::PostmasterDied)
    } else if BackgroundWorker::sigterm_received() {
        Err(Stop::Terminated)
    } else {
        Ok(())
    }
}

/// Whether a `CREATE EXTENSION` committed in `database` between the counts `since` and `now`
/// (then a probe that found nothing may be out of date).
fn created_since(since: u64, now: u64, database: u32) -> bool {
    since != now && launch::created_in(since, now).is_none_or(|dbs| dbs.contains(&database))
}

impl Launcher {
    /// Workers left running by a launcher that exited: tracked by their pid. Databases that
    /// launcher served are known to have the extension: their workers start again without a
    /// probe first (a worker it started that has not announced itself yet is then a twin,
    /// which finds the slot held and exits).
    fn adopt(&mut self) {
        for (i, entry) in self.served.iter_mut().enumerate() {
            let view = launch::slot_view(i);
            if view.database != 0 && view.served && !view.absent {
                self.known.insert(view.database);
            }
            if view.database != 0 && view.has_worker() {
                *entry = Some(Served {
                    db: Database {
                        oid: view.database,
                        name: String::new(),
                    },
                    outbox: Tracked::default(),
                    inbox: Tracked::default(),
                    monitor: Tracked::default(),
                    lanes: Default::default(),
                    lanes_stopped_at: None,
                    stopped_at: None,
                    created_at_start: self.created_seen,
                    probe: false,
                });
                self.known.insert(view.database);
            }
        }
    }

    fn release(&mut self, i: usize) {
        self.served[i] = None;
        launch::release_slot(i);
    }

    /// One look at the databases and the workers; returns how long to sleep at most.
    fn round(&mut self) -> Duration {
        let created = launch::extensions_created();
        if created != self.created_seen {
            match launch::created_in(self.created_seen, created) {
                Some(dbs) => {
                    // Committed there: no probe needed, its workers start at once.
                    for db in dbs {
                        self.absent.remove(&db);
                        self.known.insert(db);
                    }
                }
                None => self.absent.clear(),
            }
            self.created_seen = created;
        }
        self.absent.retain(|_, at| at.elapsed() < ABSENT_FOR);
        let filter = gucs::database_filter();
        let wanted: Vec<Database> = catalog::connectable_databases()
            .into_iter()
            .filter(|d| filter.allows(&d.name) && !self.absent.contains_key(&d.oid))
            .collect();
        let mut timeout = RESCAN_EVERY;
        for i in 0..MAX_DATABASES {
            if let Some(t) = self.tend(i, &wanted) {
                timeout = timeout.min(t);
            }
        }
        let (unserved, retry_soon) = self.assign(&wanted);
        self.report_unserved(&unserved, &wanted);
        if retry_soon {
            timeout = timeout.min(RESTART_AFTER);
        }
        timeout
    }

    /// Keeps slot `i`'s workers as they should be; `Some(t)`: look again within `t`.
    fn tend(&mut self, i: usize, wanted: &[Database]) -> Option<Duration> {
        let view = launch::slot_view(i);
        let created_seen = self.created_seen;
        let entry = self.served[i].as_mut()?;
        if let Some(db) = wanted.iter().find(|d| d.oid == entry.db.oid) {
            // Learns the name of an adopted database.
            entry.db.name.clone_from(&db.name);
        }
        let alive = Kind::ALL.map(|k| entry.tracked(k).alive(k, &view));
        let keep = wanted.iter().any(|d| d.oid == entry.db.oid) && !view.paused;
        if entry.probe {
            if alive[0] && keep {
                return None;
            }
            if alive[0] {
                entry.outbox.stop(Kind::Outbox, &view);
                return Some(RESTART_AFTER);
            }
            if view.absent {
                if !created_since(entry.created_at_start, created_seen, entry.db.oid) {
                    self.absent.insert(entry.db.oid, Instant::now());
                }
            } else if keep {
                self.known.insert(entry.db.oid);
            }
            self.release(i);
            return None;
        }
        if !alive[0] && view.absent {
            // No extension there any more (DROP EXTENSION). Its other workers go too.
            self.known.remove(&entry.db.oid);
            let lanes = entry.stop_lanes(&view);
            if alive[1] || alive[2] || lanes {
                entry.inbox.stop(Kind::Inbox, &view);
                entry.monitor.stop(Kind::Monitor, &view);
                return Some(RESTART_AFTER);
            }
            if !created_since(entry.created_at_start, created_seen, entry.db.oid) {
                self.absent.insert(entry.db.oid, Instant::now());
            }
            self.release(i);
            return None;
        }
        if !keep {
            let lanes = entry.stop_lanes(&view);
            if alive.iter().any(|a| *a) || lanes {
                for k in Kind::ALL {
                    entry.tracked(k).stop(k, &view);
                }
                return Some(RESTART_AFTER);
            }
            if view.paused {
                // Keeps the slot (and its counters) while the statement runs.
                return Some(Duration::from_secs(1));
            }
            self.release(i);
            return None;
        }
        if alive.iter().all(|a| *a) {
            entry.stopped_at = None;
            match entry.tend_lanes(i, &view) {
                Lanes::Done => {}
                Lanes::LookAgain(t) => return Some(t),
                Lanes::NoSlot => {
                    if self.start_warned.insert(entry.db.oid) {
                        warning!(
                            "amqp_outbox: cannot start a lane for database \"{}\": no background worker slot free (raise max_worker_processes)",
                            entry.db.name
                        );
                    }
                    return Some(RESTART_AFTER);
                }
            }
            self.start_warned.remove(&entry.db.oid);
            return None;
        }
        let stopped_at = *entry.stopped_at.get_or_insert_with(Instant::now);
        let due = RESTART_AFTER.saturating_sub(stopped_at.elapsed());
        if !due.is_zero() {
            return Some(due);
        }
        entry.stopped_at = None;
        entry.created_at_start = created_seen;
        let name = entry.db.name.clone();
        for (k, up) in Kind::ALL.into_iter().zip(alive) {
            if !up && !entry.tracked(k).start(k, i, &name) {
                // Once per database, not at every retry.
                if self.start_warned.insert(entry.db.oid) {
                    warning!(
                        "amqp_outbox: cannot start a worker for database \"{name}\": no background worker slot free (raise max_worker_processes)"
                    );
                }
                return Some(RESTART_AFTER);
            }
        }
        None
    }

    /// Gives a slot to every wanted database that has none; returns those left without, and
    /// whether some must be tried again soon (a probe that could not start or wait its turn).
    fn assign(&mut self, wanted: &[Database]) -> (Vec<(u32, Unserved)>, bool) {
        let mut unserved = Vec::new();
        let mut retry_soon = false;
        let cap = gucs::max_workers().min(MAX_DATABASES);
        self.known
            .retain(|oid| wanted.iter().any(|d| d.oid == *oid));
        for db in wanted {
            // Found without the extension in this very round (after `wanted` was made).
            if self.absent.contains_key(&db.oid)
                || self.served.iter().flatten().any(|s| s.db.oid == db.oid)
            {
                continue;
            }
            if launch::slot_of(db.oid).is_some_and(|i| launch::slot_view(i).paused) {
                continue;
            }
            // A database not known to have the extension is probed first: only its outbox
            // worker starts, looks, and exits; a probe does not count against the cap.
            let probe = !self.known.contains(&db.oid);
            let serving = self.served.iter().flatten().filter(|s| !s.probe).count();
            let probing = self.served.iter().flatten().filter(|s| s.probe).count();
            if probe && probing >= MAX_PROBES {
                // Its turn comes when a running probe exits (which wakes the launcher).
                continue;
            }
            if !probe && serving >= cap {
                unserved.push((db.oid, Unserved::MaxWorkers));
                continue;
            }
            let views: Vec<_> = (0..MAX_DATABASES).map(launch::slot_view).collect();
            let taken: Vec<bool> = self.served.iter().map(Option::is_some).collect();
            let Some(i) = slots::choose(db.oid, &views, &taken) else {
                // Every slot busy (probes included): the next round tries again.
                continue;
            };
            launch::assign_slot(i, db.oid, probe);
            let mut served = Served {
                db: db.clone(),
                outbox: Tracked::default(),
                inbox: Tracked::default(),
                monitor: Tracked::default(),
                lanes: Default::default(),
                lanes_stopped_at: None,
                stopped_at: None,
                created_at_start: self.created_seen,
                probe,
            };
            let started = served.outbox.start(Kind::Outbox, i, &db.name)
                && (probe
                    || (served.inbox.start(Kind::Inbox, i, &db.name)
                        && served.monitor.start(Kind::Monitor, i, &db.name)));
            if !started {
                let view = launch::slot_view(i);
                for k in Kind::ALL {
                    served.tracked(k).stop(k, &view);
                }
                launch::release_slot(i);
                retry_soon = true;
                // A probe's database may not even have the extension: only a known one is
                // reported as not served.
                if !probe {
                    unserved.push((db.oid, Unserved::NoWorkerSlot));
                }
                continue;
            }
            self.served[i] = Some(served);
        }
        (unserved, retry_soon)
    }

    fn report_unserved(&mut self, unserved: &[(u32, Unserved)], wanted: &[Database]) {
        launch::set_unserved(unserved);
        let now: HashSet<u32> = unserved.iter().map(|(oid, _)| *oid).collect();
        for (oid, why) in unserved {
            if !self.warned.insert(*oid) {
                continue;
            }
            let name = wanted
                .iter()
                .find(|d| d.oid == *oid)
                .map_or("?", |d| d.name.as_str());
            match why {
                Unserved::MaxWorkers => warning!(
                    "amqp_outbox: database \"{name}\" is not served: amqp_outbox.max_workers ({}) databases are served already",
                    gucs::max_workers()
                ),
                Unserved::NoWorkerSlot => warning!(
                    "amqp_outbox: database \"{name}\" is not served: no background worker slot free (raise max_worker_processes)"
                ),
            }
        }
        self.warned.retain(|oid| now.contains(oid));
    }
}
