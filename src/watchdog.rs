//! Keeping control of work that does not end: a subscription handler or a compensation (user
//! code), or any statement of a worker that runs long (a lock wait, a bad plan). A worker stops
//! on SIGTERM between transactions; inside one, a SIGTERM alone would wait until it ends, and a
//! handler's cancel (`amqp_outbox.handler_timeout`, SQLSTATE 57014) can be caught by PL/pgSQL
//! code (`EXCEPTION WHEN query_canceled`), which then goes on. So a watchdog thread watches every
//! transaction of the workers and every handler call:
//!
//! - one second after a SIGTERM (`pg_terminate_backend()`, server shutdown), if the work has
//!   not ended, and at a handler's hard deadline (twice the timeout, at least one second past
//!   it), it has the worker end as a backend ends when terminated: a FATAL error at the next
//!   interrupt check, which nothing can catch;
//! - a worker ended that way inside a handler leaves the message in shared memory
//!   ([`crate::shmem::handler_trap`]); the next worker records it as failed (its attempts
//!   count, then it is dead-lettered) instead of running its handler again in a loop.
//!
//! The thread calls nothing of PostgreSQL: it only sends a signal to its own process, and
//! blocks every signal itself.

use crate::shmem::handler_trap::{self, Ended};
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Watched work runs now (read by the signal handler).
static WATCHED: AtomicBool = AtomicBool::new(false);
/// A SIGTERM arrived (set by the signal handler, read by the watchdog).
static TERM_REQUESTED: AtomicBool = AtomicBool::new(false);
/// The watchdog decided: the next SIGTERM ends the work (set before it sends it).
static END_WORK: AtomicBool = AtomicBool::new(false);
/// The watchdog sent the SIGTERM because the hard deadline passed.
static HARD_TIMEOUT: AtomicBool = AtomicBool::new(false);
/// How long watched work still has to end after a SIGTERM.
const TERM_GRACE: Duration = Duration::from_secs(1);
/// How often the watchdog looks while work is watched, and while none is (a watch it finds
/// late starts late by at most this: a hard deadline is seconds away, the grace a second).
const TICK: Duration = Duration::from_millis(100);
const IDLE_TICK: Duration = Duration::from_secs(1);
/// The subscription and message whose handler runs now.
static CURRENT: Mutex<Option<(String, String)>> = Mutex::new(None);

/// Installs a worker's SIGTERM handler (instead of pgrx's, which only sets the flag) and its
/// exit callback; once, at the worker's start.
pub fn install() {
    // SAFETY: the worker's main thread at its start; the handler only touches sig_atomic_t
    // flags, an atomic and the process's latch, as PostgreSQL's own `die` does. The exit
    // callback runs while shared memory is attached.
    unsafe {
        crate::pg_compat::pqsignal(libc::SIGTERM, Some(on_sigterm));
        pg_sys::before_shmem_exit(Some(on_exit), pg_sys::Datum::from(0));
    }
}

// SIGNAL HANDLER: only flag writes, an atomic load and SetLatch, none of which can fail or
// panic; an ERROR (what #[pg_guard] makes of a panic) must never be raised in a signal handler.
unsafe extern "C-unwind" fn on_sigterm(_signal: i32) {
    // SAFETY: in a signal handler: volatile writes of sig_atomic_t flags and SetLatch, which
    // PostgreSQL documents as safe there.
    unsafe {
        (&raw mut pg_sys::ShutdownRequestPending).write_volatile(1);
        TERM_REQUESTED.store(true, Ordering::SeqCst);
        if WATCHED.load(Ordering::SeqCst) && END_WORK.load(Ordering::SeqCst) {
            // As `die` does: the next CHECK_FOR_INTERRUPTS raises FATAL, which ends the
            // process whatever the handler's exception blocks say.
            (&raw mut pg_sys::InterruptPending).write_volatile(1);
            (&raw mut pg_sys::ProcDiePending).write_volatile(1);
        }
        pg_sys::SetLatch(pg_sys::MyLatch);
    }
}

#[pg_guard]
extern "C-unwind" fn on_exit(_code: i32, _arg: pg_sys::Datum) {
    if !WATCHED.load(Ordering::SeqCst) {
        return;
    }
    let Some((subscription, message_id)) = CURRENT.lock().ok().and_then(|c| c.clone()) else {
        return;
    };
    let ended = if HARD_TIMEOUT.load(Ordering::SeqCst) {
        Ended::Timeout
    } else {
        Ended::Terminated
    };
    log!(
        "amqp_outbox: subscription \"{subscription}\": the worker ended while the handler of message {message_id} ran ({}); the next worker records the message as failed",
        reason(ended)
    );
    handler_trap::set(ended, &subscription, &message_id);
}

/// The error a message left by [`on_exit`] is recorded with.
pub fn reason(ended: Ended) -> &'static str {
    match ended {
        Ended::Timeout => {
            "the handler did not return within twice amqp_outbox.handler_timeout (it caught the cancel); the worker was ended"
        }
        Ended::Terminated => {
            "the worker was terminated and the handler did not return within a second"
        }
    }
}

/// While alive, the work is watched: a transaction of a worker ([`Watched::work`]) or, inside
/// one, a handler call ([`Watched::handler`]). Dropping it restores what was watched before.
pub struct Watched {
    before: Watch,
    handler: bool,
}

impl Watched {
    /// Work that a SIGTERM ends after [`TERM_GRACE`].
    pub fn work() -> Watched {
        Watched::start(None)
    }

    /// The handler for `message_id` of `subscription`; `timeout` (zero: none) sets its hard
    /// deadline.
    pub fn handler(subscription: &str, message_id: &str, timeout: Duration) -> Watched {
        if let Ok(mut c) = CURRENT.lock() {
            *c = Some((subscription.to_string(), message_id.to_string()));
        }
        let mut w = Watched::start(hard_deadline(timeout));
        w.handler = true;
        w
    }

    /// A user's function that no message stands for (a compensation): the same hard deadline,
    /// but nothing is left for the next worker (its caller counts the attempt beforehand).
    pub fn function(timeout: Duration) -> Watched {
        Watched::start(hard_deadline(timeout))
    }

    fn start(hard: Option<Instant>) -> Watched {
        let before = watchdog().set(Watch::Work(hard));
        WATCHED.store(true, Ordering::SeqCst);
        Watched {
            before,
            handler: false,
        }
    }
}

/// A user function's hard deadline for `timeout` (zero: none): twice it, at least one second
/// past it.
fn hard_deadline(timeout: Duration) -> Option<Instant> {
    (!timeout.is_zero()).then(|| Instant::now() + timeout + timeout.max(Duration::from_secs(1)))
}

impl Drop for Watched {
    fn drop(&mut self) {
        if self.handler {
            if let Ok(mut c) = CURRENT.lock() {
                *c = None;
            }
        }
        WATCHED.store(matches!(self.before, Watch::Work(_)), Ordering::SeqCst);
        watchdog().set(self.before);
    }
}

/// What the watchdog watches: nothing, or work with its hard deadline (if any).
#[derive(Clone, Copy)]
enum Watch {
    Idle,
    Work(Option<Instant>),
}

struct Watchdog {
    watch: Mutex<Watch>,
    /// Only waited on with a timeout: a tick.
    changed: Condvar,
}

impl Watchdog {
    /// Watches `now`; returns what it watched before. No wake-up of the thread: it looks every
    /// [`TICK`] (a notification per transaction or handler call would cost a context switch).
    fn set(&self, now: Watch) -> Watch {
        match self.watch.lock() {
            Ok(mut w) => std::mem::replace(&mut *w, now),
            Err(_) => Watch::Idle,
        }
    }

    fn run(&self) {
        let Ok(mut w) = self.watch.lock() else {
            return;
        };
        // When the watchdog first saw a SIGTERM during a handler call.
        let mut term_seen: Option<Instant> = None;
        loop {
            let hard = match *w {
                Watch::Idle => {
                    term_seen = None;
                    w = match self.changed.wait_timeout(w, IDLE_TICK) {
                        Ok((w, _)) => w,
                        Err(_) => return,
                    };
                    continue;
                }
                Watch::Work(hard) => hard,
            };
            let now = Instant::now();
            if TERM_REQUESTED.load(Ordering::SeqCst) {
                term_seen.get_or_insert(now);
            }
            let hard_passed = hard.is_some_and(|at| now >= at);
            let grace_over = term_seen.is_some_and(|t| now.duration_since(t) >= TERM_GRACE);
            if hard_passed || grace_over {
                *w = Watch::Idle;
                HARD_TIMEOUT.store(hard_passed, Ordering::SeqCst);
                END_WORK.store(true, Ordering::SeqCst);
                // SAFETY: kill(2) of this very process; the signal reaches the main thread
                // (this thread blocks every signal), whose handler is `on_sigterm`.
                unsafe { libc::kill(libc::getpid(), libc::SIGTERM) };
                continue;
            }
            w = match self.changed.wait_timeout(w, TICK) {
                Ok((w, _)) => w,
                Err(_) => return,
            };
        }
    }
}

fn watchdog() -> &'static Watchdog {
    static W: OnceLock<&'static Watchdog> = OnceLock::new();
    W.get_or_init(|| {
        let w: &'static Watchdog = Box::leak(Box::new(Watchdog {
            watch: Mutex::new(Watch::Idle),
            changed: Condvar::new(),
        }));
        let spawned = amqp_outbox_broker::spawn_without_signals("amqp_outbox watchdog", move || w.run());
        if spawned.is_err() {
            warning!("amqp_outbox: could not start the handler watchdog thread; handler_timeout is only a cancel");
        }
        w
    })
}
