//! The names `pg_stat_activity.wait_event` shows while the extension's processes wait on their
//! latch (`wait_event_type` `Extension`). PostgreSQL 17 lets an extension name its waits
//! (custom wait events): each process registers the names of its own waits once, when it
//! starts, and passes them to every latch wait. On 15 and 16, and for a name that could not be
//! registered (a cluster holds at most 128 custom wait events), a wait shows as `Extension`, as
//! every extension's wait did before 17.

use crate::pg_compat;
use crate::subtransaction::subtransaction;
use pgrx::prelude::*;
use std::ffi::CStr;
use std::sync::atomic::{AtomicU32, Ordering};

/// A wait of one of the extension's processes (docs/operations.md lists them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitEvent {
    /// The outbox worker waits for a commit, an answer of the broker or its naptime.
    OutboxMain,
    /// The outbox worker lets commits gather between two claims (`amqp_outbox.batch_interval`).
    OutboxBatchGap,
    /// The subscription worker waits for deliveries.
    SubscriptionMain,
    /// A lane waits for messages to handle.
    LaneMain,
    /// The monitor waits for its next round.
    MonitorMain,
    /// The launcher waits for a database to serve or a worker to end.
    LauncherMain,
    /// The launcher's watch waits for a stopped launcher to be back.
    LauncherWatch,
    /// A session in `amqp.wait_for_standbys()` waits for the standbys.
    WaitForStandbys,
}

const COUNT: usize = 8;

/// The `wait_event_info` each event was registered with in this process (0: not registered).
static REGISTERED: [AtomicU32; COUNT] = [const { AtomicU32::new(0) }; COUNT];

impl WaitEvent {
    #[cfg(test)]
    pub const ALL: [WaitEvent; COUNT] = [
        WaitEvent::OutboxMain,
        WaitEvent::OutboxBatchGap,
        WaitEvent::SubscriptionMain,
        WaitEvent::LaneMain,
        WaitEvent::MonitorMain,
        WaitEvent::LauncherMain,
        WaitEvent::LauncherWatch,
        WaitEvent::WaitForStandbys,
    ];

    /// The name `pg_stat_activity.wait_event` shows (PostgreSQL 17 and later).
    pub fn name(self) -> &'static CStr {
        match self {
            WaitEvent::OutboxMain => c"AmqpOutboxWorkerMain",
            WaitEvent::OutboxBatchGap => c"AmqpOutboxBatchGap",
            WaitEvent::SubscriptionMain => c"AmqpOutboxSubscriptionMain",
            WaitEvent::LaneMain => c"AmqpOutboxLaneMain",
            WaitEvent::MonitorMain => c"AmqpOutboxMonitorMain",
            WaitEvent::LauncherMain => c"AmqpOutboxLauncherMain",
            WaitEvent::LauncherWatch => c"AmqpOutboxLauncherWatch",
            WaitEvent::WaitForStandbys => c"AmqpOutboxWaitForStandbys",
        }
    }

    fn slot(self) -> &'static AtomicU32 {
        &REGISTERED[self as usize]
    }

    /// What to pass as `wait_event_info` to a latch wait: the registered name, or `Extension`.
    pub fn info(self) -> u32 {
        match self.slot().load(Ordering::Relaxed) {
            0 => pg_sys::PG_WAIT_EXTENSION,
            info => info,
        }
    }
}

/// Registers the names of `events` for this process (PostgreSQL 17 and later; nothing before),
/// each in a subtransaction: a name that cannot be registered is logged once and its wait keeps
/// showing `Extension`, it never ends the process. In the current transaction, or in one of its
/// own when none is open. On the process's main thread.
pub fn register(events: &[WaitEvent]) {
    if !pg_compat::CUSTOM_WAIT_EVENTS {
        return;
    }
    let pending: Vec<WaitEvent> = events
        .iter()
        .copied()
        .filter(|e| e.slot().load(Ordering::Relaxed) == 0)
        .collect();
    if pending.is_empty() {
        return;
    }
    // SAFETY: the main thread of a backend or worker connected to shared memory; a transaction
    // of its own is started only when none is open, and committed right after.
    let own = unsafe { !pg_sys::IsTransactionState() };
    if own {
        // SAFETY: as above, outside any transaction.
        unsafe { pg_sys::StartTransactionCommand() };
    }
    for event in pending {
        // SAFETY: inside the subtransaction, which catches an ERROR of the registration.
        match subtransaction(|| unsafe { pg_compat::custom_wait_event(event.name()) }) {
            Ok(Some(info)) => event.slot().store(info, Ordering::Relaxed),
            Ok(None) => {}
            Err(e) => log!(
                "amqp_outbox: wait event {} not registered ({}): the wait shows as Extension",
                event.name().to_string_lossy(),
                e.message
            ),
        }
    }
    if own {
        // SAFETY: the transaction started above, with nothing else in it.
        unsafe { pg_sys::CommitTransactionCommand() };
    }
}

#[cfg(test)]
mod tests {
    use super::WaitEvent;

    #[test]
    fn names_are_distinct_and_fit_postgres_limits() {
        let names: std::collections::BTreeSet<&str> = WaitEvent::ALL
            .iter()
            .map(|e| e.name().to_str().unwrap_or_default())
            .collect();
        assert_eq!(names.len(), WaitEvent::ALL.len());
        for name in names {
            // NAMEDATALEN - 1; CamelCase as PostgreSQL's own wait events.
            assert!(name.len() < 64 && name.starts_with("AmqpOutbox"), "{name}");
            assert!(name.chars().all(|c| c.is_ascii_alphanumeric()), "{name}");
        }
    }

    #[test]
    fn each_event_has_its_own_slot() {
        for (i, e) in WaitEvent::ALL.iter().enumerate() {
            assert_eq!(*e as usize, i);
        }
    }
}
