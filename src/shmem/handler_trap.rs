//! The message a subscription worker or lane was handling when it was ended from inside its
//! handler (the hard handler timeout, or `pg_terminate_backend()`): written as that process
//! exits, read by the next one in its place, which records the message as failed instead of
//! running its handler again (it would end the process again, in a loop).

use super::{slot_index, PerDb, MAX_LANES};
use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PGRXSharedMemory, PgLwLock};
use std::sync::atomic::{AtomicUsize, Ordering};

const SUBSCRIPTION_MAX: usize = 200;
const MESSAGE_ID_MAX: usize = 256;

/// Why the worker ended inside a handler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// The handler ran past its hard deadline (it caught the cancel of `handler_timeout`).
    Timeout,
    /// The worker was terminated (SIGTERM) while the handler ran.
    Terminated,
}

impl Ended {
    /// Its code in a trap and in `amqp.inbox_waiting.ended` (0 there: nothing ended).
    pub fn code(self) -> u8 {
        match self {
            Ended::Timeout => 1,
            Ended::Terminated => 2,
        }
    }

    pub fn from_code(code: u8) -> Option<Ended> {
        match code {
            1 => Some(Ended::Timeout),
            2 => Some(Ended::Terminated),
            _ => None,
        }
    }
}

#[derive(Clone, Copy)]
pub struct Trap {
    /// 0: nothing; 1: timeout; 2: terminated.
    ended: u8,
    subscription: [u8; SUBSCRIPTION_MAX],
    subscription_len: usize,
    message_id: [u8; MESSAGE_ID_MAX],
    message_id_len: usize,
}

impl Default for Trap {
    fn default() -> Self {
        Trap {
            ended: 0,
            subscription: [0; SUBSCRIPTION_MAX],
            subscription_len: 0,
            message_id: [0; MESSAGE_ID_MAX],
            message_id_len: 0,
        }
    }
}
// SAFETY: plain `Copy` data (integers and byte arrays, no pointers), meaningful in every
// process.
unsafe impl PGRXSharedMemory for Trap {}

/// One trap per process that runs handlers: the subscription worker (0), then each lane.
#[derive(Clone, Copy, Default)]
pub struct Traps([Trap; 1 + MAX_LANES]);
// SAFETY: plain `Copy` data (see `Trap`).
unsafe impl PGRXSharedMemory for Traps {}

// SAFETY: the name is unique: each `amqp_outbox_*` shared-memory name is used once, here.
static TRAPS: PgLwLock<PerDb<Traps>> = unsafe { PgLwLock::new(c"amqp_outbox_handler_traps") };

/// This process's trap: 0 for the subscription worker, 1 + n for lane n.
static MINE: AtomicUsize = AtomicUsize::new(0);

/// A lane uses its own trap (set once at its start).
pub fn use_lane_trap(lane: usize) {
    MINE.store(1 + lane.min(MAX_LANES - 1), Ordering::Relaxed);
}

fn mine() -> usize {
    MINE.load(Ordering::Relaxed)
}

pub(super) fn init() {
    pg_shmem_init!(TRAPS);
}

/// Remembers, for the next worker of this database, that the handler of `message_id` ended
/// this one. A subscription name or message id too long to keep is not remembered (its
/// handler then runs again: the redelivery is counted by the broker, not here).
pub fn set(ended: Ended, subscription: &str, message_id: &str) {
    let Some(i) = slot_index() else { return };
    let (s, m) = (subscription.as_bytes(), message_id.as_bytes());
    if s.len() > SUBSCRIPTION_MAX || m.len() > MESSAGE_ID_MAX {
        return;
    }
    let mut all = TRAPS.exclusive();
    let t = &mut all.0[i].0[mine()];
    t.ended = ended.code();
    t.subscription[..s.len()].copy_from_slice(s);
    t.subscription_len = s.len();
    t.message_id[..m.len()].copy_from_slice(m);
    t.message_id_len = m.len();
}

/// Slot `i` serves another database now: what its previous one left goes.
pub(super) fn clear(i: usize) {
    TRAPS.exclusive().0[i] = Traps::default();
}

/// What the previous worker of this database left, if anything; clears it.
pub fn take() -> Option<(Ended, String, String)> {
    let i = slot_index()?;
    let mut all = TRAPS.exclusive();
    let t = std::mem::take(&mut all.0[i].0[mine()]);
    let ended = Ended::from_code(t.ended)?;
    let text = |b: &[u8], n: usize| String::from_utf8_lossy(&b[..n.min(b.len())]).into_owned();
    Some((
        ended,
        text(&t.subscription, t.subscription_len),
        text(&t.message_id, t.message_id_len),
    ))
}
