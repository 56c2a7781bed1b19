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
pub mod hosted;
pub mod ledger;
pub mod outbox;
pub mod pg;
pub mod private_rabbit;
pub mod rabbit;
pub mod rabbit_cluster;
pub mod raw_amqp;
pub mod world;

pub use ledger::{Ledger, MessageKey, Outcome, Report};
pub use outbox::{MessageStatus, Outbox, Producer, ProducerConfig, ProducerStats, WorkerStatus};
pub use pg::{PgCluster, PgConfig, PgInstall, StopMode};
pub use private_rabbit::PrivateRabbit;
pub use rabbit::{AmqpEndpoint, Collector, QueueCounts, Rabbit, Received, Route};
pub use rabbit_cluster::{QuorumState, RabbitCluster};
pub use world::World;

/// Like [`eventually`], but returns the last error instead of panicking.
pub use amqp_outbox_testkit::try_eventually;
pub(crate) use amqp_outbox_testkit::{pick_ports, tail};

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

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

/// Waits until `sql` (one `bigint`) reads `want` over `client`, each time in a fresh snapshot of
/// the statistics views (`pg_stat_activity` and the like); the timeout's message names `what`
/// and the last count.
pub fn eventually_count(
    client: &mut postgres::Client,
    timeout: Duration,
    what: &str,
    sql: &str,
    want: i64,
) {
    eventually(timeout, what, || {
        client
            .batch_execute("SELECT pg_catalog.pg_stat_clear_snapshot()")
            .map_err(|e| e.to_string())?;
        let n: i64 = client
            .query_one(sql, &[])
            .map_err(|e| e.to_string())?
            .get(0);
        if n == want {
            Ok(())
        } else {
            Err(format!("{n}, not {want}"))
        }
    })
}

/// A name unique across test processes and within one: `prefix.pid.counter.random`.
/// Only characters valid in AMQP names and in unquoted SQL string literals.
pub fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let r: u32 = rand::random();
    format!("e2e.{prefix}.{}.{n}.{r:08x}", std::process::id())
}

/// True when this process runs as root (then PostgreSQL's tools run as `postgres`).
pub fn running_as_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}
