//! End-to-end test harness for `amqp_outbox`.
//!
//! The tests in `tests/` run a real PostgreSQL 15 cluster with the extension preloaded
//! ([`PgCluster`]) against a real RabbitMQ: the shared one on 127.0.0.1:5672 ([`Rabbit`]) for
//! tests that only publish, or a private node started by the test ([`PrivateRabbit`]) for tests
//! that stop or break the broker. Deliveries are collected by a [`Collector`]; the [`ledger`]
//! module records what producers committed and checks what arrived (lost, phantom, duplicates,
//! order).
//!
//! Synchronisation is always [`eventually`] (poll until a condition holds or a deadline passes),
//! never a fixed sleep.
//!
//! Assumes the extension is installed into the PostgreSQL that `pg_config` names
//! (`make install` / `cargo pgrx install` runs before these tests).

pub mod chaos;
pub mod ledger;
pub mod outbox;
pub mod pg;
pub mod private_rabbit;
pub mod rabbit;
pub mod rabbit_cluster;

pub use ledger::{Ledger, MessageKey, Outcome, Report};
pub use outbox::{MessageStatus, Outbox, Producer, ProducerConfig, ProducerStats, WorkerStatus};
pub use pg::{PgCluster, PgConfig, StopMode};
pub use private_rabbit::PrivateRabbit;
pub use rabbit::{AmqpEndpoint, Collector, QueueCounts, Rabbit, Received, Route};
pub use rabbit_cluster::{ClusterCollector, QuorumState, RabbitCluster};

use std::net::TcpListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Polls `check` until it returns `Ok`, and returns that value. Panics after `timeout` with
/// `what` and the last error `check` gave, so a failing test says what it was waiting for.
///
/// The polling interval starts at 20 ms and grows to 250 ms.
pub fn eventually<T>(
    timeout: Duration,
    what: &str,
    mut check: impl FnMut() -> Result<T, String>,
) -> T {
    match try_eventually(timeout, &mut check) {
        Ok(v) => v,
        Err(last) => panic!("timed out after {timeout:?} waiting for {what}; last state: {last}"),
    }
}

/// Like [`eventually`], but returns the last error instead of panicking.
pub fn try_eventually<T>(
    timeout: Duration,
    mut check: impl FnMut() -> Result<T, String>,
) -> Result<T, String> {
    let deadline = Instant::now() + timeout;
    let mut interval = Duration::from_millis(20);
    loop {
        match check() {
            Ok(v) => return Ok(v),
            Err(e) => {
                if Instant::now() >= deadline {
                    return Err(e);
                }
            }
        }
        std::thread::sleep(interval.min(deadline.saturating_duration_since(Instant::now())));
        interval = (interval * 2).min(Duration::from_millis(250));
    }
}

/// A name unique across test processes and within one: `prefix.pid.counter.random`.
/// Only characters valid in AMQP names and in unquoted SQL string literals.
pub fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let r: u32 = rand::random();
    format!("e2e.{prefix}.{}.{n}.{r:08x}", std::process::id())
}

/// True when nothing listens on 127.0.0.1:`port` (we could bind it ourselves).
pub(crate) fn port_is_free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// A port in `lo..hi` that is free now and was not handed out before by this process.
/// `span` consecutive ports starting at the result must all be free.
pub(crate) fn pick_ports(lo: u16, hi: u16, span: u16) -> u16 {
    use std::collections::HashSet;
    use std::sync::Mutex;
    static TAKEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
    let mut guard = TAKEN.lock().unwrap_or_else(|e| e.into_inner());
    let taken = guard.get_or_insert_with(HashSet::new);
    for _ in 0..1000 {
        let base = lo + (rand::random::<u16>() % (hi - lo - span));
        let all_free = (base..base + span).all(|p| !taken.contains(&p) && port_is_free(p));
        if all_free {
            taken.extend(base..base + span);
            return base;
        }
    }
    panic!("no {span} free consecutive ports found in {lo}..{hi}");
}

/// True when this process runs as root (then PostgreSQL's tools run as `postgres`).
pub fn running_as_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The last `n` lines of `text`, for failure messages.
pub(crate) fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
