//! Starting and stopping one database's workers (three, and its lanes) as dynamic background
//! workers. They are
//! never restarted by the postmaster: the launcher decides (a database without the extension,
//! a paused or dropped database must stay without workers).

use crate::shmem::launch::SlotView;
use pgrx::bgworkers::{
    BackgroundWorkerBuilder, BackgroundWorkerStatus, BgWorkerStartTime, DynamicBackgroundWorker,
};
use pgrx::prelude::*;
use pgrx::PgMemoryContexts;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Outbox,
    Inbox,
    Monitor,
    /// Lane n (0-based): runs handlers of subscriptions with a parallelism or an ordering.
    Lane(usize),
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Outbox, Kind::Inbox, Kind::Monitor];

    fn names(self, database: &str) -> (String, &'static str, &'static str) {
        match self {
            Kind::Outbox => (
                format!("amqp_outbox worker for {database}"),
                "amqp_outbox",
                "amqp_outbox_worker_main",
            ),
            Kind::Inbox => (
                format!("amqp_outbox subscriptions for {database}"),
                "amqp_outbox subscriptions",
                "amqp_outbox_inbox_main",
            ),
            Kind::Monitor => (
                format!("amqp_outbox monitor for {database}"),
                "amqp_outbox monitor",
                "amqp_outbox_monitor_main",
            ),
            Kind::Lane(n) => (
                format!("amqp_outbox lane {} for {database}", n + 1),
                "amqp_outbox lane",
                "amqp_outbox_lane_main",
            ),
        }
    }

    fn argument(self, slot: usize) -> i32 {
        match self {
            Kind::Lane(n) => crate::worker::lane_argument(slot, n),
            _ => slot as i32,
        }
    }

    fn pid(self, view: &SlotView) -> i32 {
        match self {
            Kind::Outbox => view.outbox_pid,
            Kind::Inbox => view.inbox_pid,
            Kind::Monitor => view.monitor_pid,
            Kind::Lane(n) => view.lane_pids.get(n).copied().unwrap_or(0),
        }
    }
}

/// One worker as the launcher tracks it: the handle of the worker it started, if any. A
/// launcher that restarted finds the workers of its predecessor by their pid in shared memory.
#[derive(Default)]
pub struct Tracked(Option<DynamicBackgroundWorker>);

impl Tracked {
    /// Registered and not known to have stopped, or still announced in shared memory.
    pub fn alive(&self, kind: Kind, view: &SlotView) -> bool {
        let by_handle = self
            .0
            .as_ref()
            .is_some_and(|h| matches!(h.pid(), Ok(_) | Err(BackgroundWorkerStatus::NotYetStarted)));
        by_handle || kind.pid(view) != 0
    }

    /// This launcher started it (it may have stopped since).
    pub fn started(&self) -> bool {
        self.0.is_some()
    }

    /// Starts the worker for the database in `slot`. `false`: no background worker slot left
    /// (`max_worker_processes`).
    pub fn start(&mut self, kind: Kind, slot: usize, database: &str) -> bool {
        let (name, type_, function) = kind.names(database);
        // SAFETY: reads this process's pid, a plain global.
        let me = unsafe { pg_sys::MyProcPid };
        let builder = BackgroundWorkerBuilder::new(&name)
            .set_type(type_)
            .set_library("amqp_outbox")
            .set_function(function)
            .set_argument(kind.argument(slot).into_datum())
            .set_extra(database)
            .enable_spi_access()
            .set_start_time(BgWorkerStartTime::RecoveryFinished)
            .set_restart_time(None)
            // The postmaster signals the launcher when the worker starts and stops.
            .set_notify_pid(me);
        // SAFETY: the launcher's main thread. The handle must outlive any transaction, so it is
        // allocated in TopMemoryContext, which lives as long as the process.
        let loaded = unsafe {
            PgMemoryContexts::TopMemoryContext.switch_to(|_| builder.load_dynamic().ok())
        };
        let started = loaded.is_some();
        self.0 = loaded;
        started
    }

    /// Asks the worker to stop (SIGTERM), whether the launcher started it or found it running.
    pub fn stop(&mut self, kind: Kind, view: &SlotView) {
        if let Some(h) = self.0.take() {
            // Unregisters it too: the postmaster will not start it again.
            let _terminating = h.terminate();
        }
        let pid = kind.pid(view);
        if pid != 0 {
            // SAFETY: a plain kill(2) of a worker of this cluster (same OS user), as
            // pg_terminate_backend() sends; a pid that just exited gets ESRCH, ignored.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
    }
}
