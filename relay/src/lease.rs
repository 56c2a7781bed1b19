//! Which relay serves a database: the one whose session holds the advisory lock (1634562416, 1)
//! there ('amqp' in ASCII; the plain-SQL install's status views read the same lock). Any number
//! of relays may run; the others try to take the lock every `takeover_every`, and get it once
//! the active relay's session ends (the process died, its connection was cut, it stopped).
//!
//! The lock's session also LISTENs on the channel `amqp_outbox` (what the extension's commit
//! wake-up and requests are in the plain-SQL install) and runs on its own thread, which keeps
//! the notices for the delivery loop and wakes it. The loop acts only while the lock was seen
//! held within [`LEASE`]: a relay cut off from its database stops before the server can end the
//! session and hand the lock to another (the session's TCP keepalives and user timeout are set
//! past the lease).

use crate::config::PostgresTls;
use crate::connect;
use crate::log::Log;
use crate::stop;
use amqp_outbox_broker::wake::{self, WakeReceiver, WakeSender};
use fallible_iterator::FallibleIterator;
use postgres::Client;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The lock's two keys.
pub const LOCK_KEYS: (i32, i32) = (1_634_562_416, 1);

/// The delivery acts only while the lock was confirmed within this.
pub const LEASE: Duration = Duration::from_secs(3);

/// How often the held lock's session is confirmed.
const CONFIRM_EVERY: Duration = Duration::from_millis(500);

/// The session's settings: the server ends a silent relay's session (and frees the lock) after
/// about 5 + 2 × 2 s idle, or 6 s of unanswered data: both past [`LEASE`].
const SESSION_SQL: &str = "\
SET tcp_keepalives_idle = 5; SET tcp_keepalives_interval = 2; SET tcp_keepalives_count = 2; \
SET tcp_user_timeout = 6000; LISTEN amqp_outbox";

const TRY_LOCK_SQL: &str = "SELECT pg_catalog.pg_try_advisory_lock($1, $2)";

/// What arrived on the channel since the loop last looked.
#[derive(Debug, Default, PartialEq)]
pub struct Notices {
    /// Commits that published (or `amqp.wake()`).
    pub commits: u64,
    /// The configuration or declarations changed (`'reload'`), or the lock was just taken.
    pub reload: bool,
    /// `amqp.subscription` changed.
    pub subscriptions: bool,
    /// `amqp.scheduled_message` changed.
    pub scheduled: bool,
    /// `amqp.disconnect(broker_id)` asked for these.
    pub disconnect: Vec<i32>,
}

impl Notices {
    fn add(&mut self, payload: &str) {
        match payload {
            "" => self.commits += 1,
            "reload" => self.reload = true,
            "subscriptions" => self.subscriptions = true,
            "scheduled" => self.scheduled = true,
            other => {
                if let Some(id) = other
                    .strip_prefix("disconnect:")
                    .and_then(|id| id.parse().ok())
                {
                    if !self.disconnect.contains(&id) {
                        self.disconnect.push(id);
                    }
                }
                // Anything else is some other program's: ignored.
            }
        }
    }
}

#[derive(Default)]
struct State {
    /// Counts the lock's acquisitions: a loop that saw another number must start afresh.
    generation: u64,
    held: bool,
    confirmed_at: Option<Instant>,
    notices: Notices,
    /// `amqp.subscription` changed (or the lock was just taken), for the consuming side.
    subscriptions_changed: bool,
}

struct Shared {
    state: Mutex<State>,
    wake: WakeSender,
    ending: AtomicBool,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding it leaves plain values: still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn ending(&self) -> bool {
        self.ending.load(Ordering::SeqCst) || stop::requested()
    }
}

/// The lease on one database, kept by its own thread.
pub struct Lease {
    shared: Arc<Shared>,
    wake: WakeReceiver,
    thread: Option<JoinHandle<()>>,
}

impl Lease {
    pub fn start(
        url: String,
        tls: PostgresTls,
        takeover_every: Duration,
        log: Log,
    ) -> std::io::Result<Lease> {
        let (receiver, sender) = wake::pair()?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            wake: sender,
            ending: AtomicBool::new(false),
        });
        let keeper = shared.clone();
        let thread = std::thread::Builder::new()
            .name("lease".into())
            .spawn(move || keep(&url, &tls, takeover_every, &log, &keeper))?;
        Ok(Lease {
            shared,
            wake: receiver,
            thread: Some(thread),
        })
    }

    /// The acquisition this relay holds now and has confirmed within [`LEASE`], if any.
    pub fn held(&self) -> Option<u64> {
        let s = self.shared.state();
        let fresh = s.confirmed_at.is_some_and(|t| t.elapsed() < LEASE);
        (s.held && fresh).then_some(s.generation)
    }

    /// What arrived since the last call (and consumes the wake-ups that announced it).
    pub fn take_notices(&self) -> Notices {
        self.wake.clear();
        std::mem::take(&mut self.shared.state().notices)
    }

    /// Whether `amqp.subscription` changed (or the configuration was reloaded) since the last
    /// call: the consuming side reads the subscriptions again.
    pub fn take_subscriptions_changed(&self) -> bool {
        std::mem::take(&mut self.shared.state().subscriptions_changed)
    }

    /// Readable when notices arrived or the lease changed.
    pub fn fd(&self) -> RawFd {
        self.wake.fd()
    }

    /// When the lease runs out unless confirmed again (the loop's longest sleep).
    pub fn expires_in(&self) -> Duration {
        let s = self.shared.state();
        s.confirmed_at
            .map_or(Duration::ZERO, |t| LEASE.saturating_sub(t.elapsed()))
    }
}

impl Drop for Lease {
    /// Ends the session (the server frees the lock).
    fn drop(&mut self) {
        self.shared.ending.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The thread: connect, stand by until the lock is ours, hold it; again after any failure.
fn keep(url: &str, tls: &PostgresTls, takeover_every: Duration, log: &Log, shared: &Shared) {
    let mut backoff = Duration::from_millis(500);
    let mut last_error = String::new();
    while !shared.ending() {
        let result = connect::connect(url, tls).and_then(|mut client| {
            backoff = Duration::from_millis(500);
            hold(&mut client, takeover_every, log, shared).map_err(|e| connect::describe(&e))
        });
        let was_held = {
            let mut s = shared.state();
            std::mem::replace(&mut s.held, false)
        };
        shared.wake.wake();
        match result {
            Ok(()) => break,
            Err(e) => {
                if was_held {
                    log.warning(&format!("lost the lease on this database: {e}"));
                } else if e != last_error {
                    log.warning(&e);
                }
                last_error = e;
            }
        }
        stop::wait(&[], backoff);
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

/// One session: stands by, then holds the lock until the relay stops (`Ok`) or the session
/// fails.
fn hold(
    client: &mut Client,
    takeover_every: Duration,
    log: &Log,
    shared: &Shared,
) -> Result<(), postgres::Error> {
    client.batch_execute(SESSION_SQL)?;
    let mut said_standing_by = false;
    loop {
        if shared.ending() {
            return Ok(());
        }
        let got: bool = client
            .query_one(TRY_LOCK_SQL, &[&LOCK_KEYS.0, &LOCK_KEYS.1])?
            .get(0);
        if got {
            break;
        }
        if !said_standing_by {
            log.log("another relay serves this database; standing by");
            said_standing_by = true;
        }
        // What was sent meanwhile is the active relay's to act on.
        client.notifications().iter().count()?;
        stop::wait(&[], takeover_every);
    }
    {
        let mut s = shared.state();
        s.generation += 1;
        s.held = true;
        s.confirmed_at = Some(Instant::now());
        s.subscriptions_changed = true;
        s.notices = Notices {
            reload: true,
            subscriptions: true,
            scheduled: true,
            ..Notices::default()
        };
    }
    log.log("serving this database");
    shared.wake.wake();
    let mut confirmed = Instant::now();
    loop {
        if shared.ending() {
            return Ok(());
        }
        let mut arrived = Vec::new();
        {
            // Waits for the first one at most until the next confirmation is due, then takes
            // only what has already come: a timeout iterator would go on collecting until its
            // whole timeout is over, holding every commit's wake-up back by up to that long.
            let mut notifications = client.notifications();
            let first = notifications.timeout_iter(CONFIRM_EVERY).next()?;
            if let Some(n) = first {
                arrived.push(n.payload().to_owned());
                let mut buffered = notifications.iter();
                while let Some(n) = buffered.next()? {
                    arrived.push(n.payload().to_owned());
                    if arrived.len() >= 1000 {
                        break;
                    }
                }
            }
        }
        if !arrived.is_empty() {
            let mut s = shared.state();
            for payload in &arrived {
                s.notices.add(payload);
                // A reload may have changed a subscription's broker.
                s.subscriptions_changed |= matches!(payload.as_str(), "subscriptions" | "reload");
            }
            drop(s);
            shared.wake.wake();
        }
        if confirmed.elapsed() >= CONFIRM_EVERY {
            // Answers only while the session (and with it the lock) lives.
            client.batch_execute("SELECT")?;
            confirmed = Instant::now();
            shared.state().confirmed_at = Some(confirmed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_become_notices() {
        let mut n = Notices::default();
        for p in [
            "",
            "",
            "reload",
            "disconnect:3",
            "disconnect:3",
            "disconnect:x",
            "other",
            "scheduled",
        ] {
            n.add(p);
        }
        assert_eq!(
            n,
            Notices {
                commits: 2,
                reload: true,
                subscriptions: false,
                scheduled: true,
                disconnect: vec![3],
            }
        );
    }
}
