//! PostgreSQL failover with an asynchronous standby (`amqp_outbox.standby_names`): a message is
//! published only once the named standby has its commit, so a promotion after the primary died
//! never leaves a message for a commit the surviving database lacks. Without the setting it
//! does (the documented trade-off, asserted so the test can fail both ways).
//!
//! Each test has its own primary, standby (`pg_basebackup`, own port and directory) and queue on
//! the shared RabbitMQ (or on a RabbitMQ node of its own, where it counts unacknowledged
//! deliveries with `rabbitmqctl`); the servers it stops are its own.
//!
//! Also what the workers do with what they hold for a standby that is behind when they are
//! killed (SIGKILL, `pg_terminate_backend()`): nothing leaves before the standby has it, after
//! the restart either, and nothing held is lost; and what a reload of the setting does to what
//! is held.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::time::{Duration, Instant};

use amqp_outbox_e2e::chaos::{holds_for, send_signal, ResultRow, Standby};
use amqp_outbox_e2e::{
    eventually, Collector, Outbox, PgCluster, PgConfig, PrivateRabbit, Rabbit, StopMode, World,
};
use postgres::Client;

const ARRIVAL: Duration = Duration::from_secs(30);
const STANDBY: &str = "standby1";

fn config(standby_names: Option<&str>) -> PgConfig {
    let config = PgConfig::default()
        .setting("amqp_outbox.retry_backoff_min", 100)
        .setting("amqp_outbox.retry_backoff_max", 1000);
    match standby_names {
        Some(names) => config.setting("amqp_outbox.standby_names", format!("'{names}'")),
        None => config,
    }
}

/// A streaming standby named [`STANDBY`] (its walreceiver's `application_name` is its
/// `cluster_name`), caught up with the primary.
fn standby_of(w: &mut World) -> (Standby, Client) {
    let standby = Standby::create(
        &w.cluster,
        &[
            ("cluster_name", &format!("'{STANDBY}'")),
            ("hot_standby", "on"),
        ],
    )
    .unwrap_or_else(|e| panic!("cannot create the standby: {e}"));
    let db = w.cluster.config().database.clone();
    let sc = eventually(ARRIVAL, "the standby to accept connections", || {
        standby.client(&db)
    });
    wait_walsenders(&mut w.client, "the standby streaming under its name", 1);
    (standby, sc)
}

/// Stops the standby's replication (its WAL receiver goes; it keeps what it has).
fn cut_replication(w: &mut World, standby: &Standby, sc: &mut Client) {
    let auto = standby.data_dir().join("postgresql.auto.conf");
    let mut f = fs::OpenOptions::new()
        .append(true)
        .open(&auto)
        .unwrap_or_else(|e| panic!("open {}: {e}", auto.display()));
    f.write_all(b"\nprimary_conninfo = ''\n")
        .expect("write postgresql.auto.conf");
    sc.batch_execute("SELECT pg_reload_conf()")
        .expect("reload the standby");
    wait_walsenders(&mut w.client, "the standby to disconnect", 0);
}

/// Waits until `n` walsenders stream to [`STANDBY`].
fn wait_walsenders(client: &mut Client, what: &str, n: i64) {
    eventually(ARRIVAL, what, || {
        let now: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_stat_replication WHERE application_name = $1 AND state = 'streaming'",
                &[&STANDBY],
            )
            .map_err(|e| e.to_string())?
            .get(0);
        if now == n {
            Ok(())
        } else {
            Err(format!("{now} streaming"))
        }
    });
}

/// For [`WATCH`], no delivery whose body starts with `prefix` arrives at `collector`.
fn none_goes_out(collector: &Collector, prefix: &str, what: &str) {
    holds_for(WATCH, what, || {
        let leaked: Vec<String> = collector
            .bodies()
            .into_iter()
            .filter(|b| b.starts_with(prefix))
            .collect();
        if leaked.is_empty() {
            Ok(())
        } else {
            Err(format!("published before the standby had them: {leaked:?}"))
        }
    })
    .unwrap();
}

/// An order and its message, in one transaction.
fn order(client: &mut Client, broker_id: i32, w_route: (&str, &str), body: &str) {
    let mut tx = client.transaction().expect("BEGIN");
    tx.execute("INSERT INTO orders (body) VALUES ($1)", &[&body])
        .expect("INSERT INTO orders");
    tx.execute(
        "SELECT amqp.publish($1, $2, $3, $4)",
        &[&broker_id, &w_route.0, &w_route.1, &body],
    )
    .expect("amqp.publish");
    tx.commit().expect("COMMIT");
}

/// What a failover leaves: `before` published while streaming, `cut` committed on the primary
/// only, then the primary killed, the standby promoted and `after` published there. Returns the
/// collector's bodies at the end and how long the promoted standby took to deliver.
fn failover(standby_names: Option<&str>, name: &str) -> (Vec<String>, Duration) {
    let rabbit = Rabbit::shared();
    let mut w = World::new(name, config(standby_names), &rabbit);
    w.client
        .batch_execute("CREATE TABLE orders (body text PRIMARY KEY)")
        .expect("CREATE TABLE orders");
    let (mut standby, mut sc) = standby_of(&mut w);
    let (broker_id, exchange, key) = (
        w.outbox.broker_id,
        w.route.exchange.clone(),
        w.route.routing_key.clone(),
    );
    for i in 0..20 {
        order(
            &mut w.client,
            broker_id,
            (&exchange, &key),
            &format!("before:{i}"),
        );
    }
    for i in 0..20 {
        w.collector.wait_for_body(&format!("before:{i}"), ARRIVAL);
    }
    Outbox::wait_drained(&mut w.client, ARRIVAL);

    cut_replication(&mut w, &standby, &mut sc);
    for i in 0..30 {
        order(
            &mut w.client,
            broker_id,
            (&exchange, &key),
            &format!("cut:{i}"),
        );
    }
    if standby_names.is_some() {
        none_goes_out(&w.collector, "cut:", "nothing of the cut commits goes out");
    } else {
        // The trade-off without the setting: they go out at once.
        for i in 0..30 {
            w.collector.wait_for_body(&format!("cut:{i}"), ARRIVAL);
        }
    }

    w.cluster.stop(StopMode::Immediate);
    standby.promote().unwrap_or_else(|e| panic!("promote: {e}"));
    let promoted = Instant::now();
    let db = w.cluster.config().database.clone();
    let mut pc = eventually(ARRIVAL, "a connection to the promoted standby", || {
        standby.client(&db)
    });
    eventually(ARRIVAL, "the promoted standby's worker", || {
        let n: i64 = pc
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'amqp_outbox'",
                &[],
            )
            .map_err(|e| e.to_string())?
            .get(0);
        if n > 0 {
            Ok(())
        } else {
            Err("no worker yet".to_string())
        }
    });
    // The surviving history: every order before the cut, none of the cut.
    let (before, cut): (i64, i64) = pc
        .query_one(
            "SELECT count(*) FILTER (WHERE body LIKE 'before:%'), count(*) FILTER (WHERE body LIKE 'cut:%') FROM orders",
            &[],
        )
        .map(|r| (r.get(0), r.get(1)))
        .expect("orders on the promoted standby");
    assert_eq!((before, cut), (20, 0), "orders the promoted standby has");
    for i in 0..10 {
        order(&mut pc, broker_id, (&exchange, &key), &format!("after:{i}"));
    }
    for i in 0..10 {
        w.collector.wait_for_body(&format!("after:{i}"), ARRIVAL);
    }
    let took = promoted.elapsed();
    // Anything left over from the old primary's last moments has had its chance.
    std::thread::sleep(Duration::from_secs(1));
    standby.stop_immediate();
    (w.collector.bodies(), took)
}

#[test]
fn with_standby_names_a_failover_publishes_nothing_the_standby_lacks() {
    let (bodies, took) = failover(Some(STANDBY), "failover_gated");
    let phantoms: Vec<&String> = bodies.iter().filter(|b| b.starts_with("cut:")).collect();
    assert!(
        phantoms.is_empty(),
        "messages of commits the promoted standby never had: {phantoms:?}"
    );
    for prefix in ["before:", "after:"] {
        for i in 0..if prefix == "before:" { 20 } else { 10 } {
            let body = format!("{prefix}{i}");
            assert!(bodies.contains(&body), "{body} never arrived");
        }
    }
    eprintln!("promoted standby delivered within {took:?}");
    ResultRow {
        case: "23 primary failover, producer".into(),
        messages: 60,
        committed: 30,
        lost: 0,
        phantom: phantoms.len(),
        duplicates: bodies.len().saturating_sub(30),
        heal: Some(took),
        status: "PASS".into(),
        note: "standby_names set: 30 commits the promoted standby lacks, none published; 20 before and 10 after the promotion delivered".into(),
        ..ResultRow::default()
    }
    .record();
}

/// The trade-off without the setting: the primary published commits its standby never got.
#[test]
fn without_standby_names_a_failover_leaves_phantoms() {
    let (bodies, _) = failover(None, "failover_ungated");
    let phantoms = bodies.iter().filter(|b| b.starts_with("cut:")).count();
    assert_eq!(
        phantoms, 30,
        "without amqp_outbox.standby_names every cut commit was published before the failover"
    );
}

/// A commit that nothing flushes (`synchronous_commit = off`, and no synchronous commit after
/// it) still goes out once the standby has it: the worker flushes the WAL its batch waits for;
/// and `amqp.wait_for_standbys()` after such a commit returns true once the standby has it.
/// Left to the WAL writer (`wal_writer_delay` at its 10 s maximum here), each would wait for its
/// next round, and at most one of three could be in time.
#[test]
fn an_asynchronous_commit_reaches_the_standby_without_waiting_for_the_wal_writer() {
    let rabbit = Rabbit::shared();
    let config = config(Some(STANDBY)).setting("wal_writer_delay", "'10s'");
    let mut w = World::new("failover_async_commit", config, &rabbit);
    let (_standby, _sc) = standby_of(&mut w);
    w.client
        .batch_execute("SET synchronous_commit = off")
        .expect("SET synchronous_commit");
    for i in 0..3 {
        let body = format!("async:{i}");
        let published = Instant::now();
        w.publish(&body);
        w.collector.wait_for_body(&body, Duration::from_secs(4));
        eprintln!("{body} arrived after {:?}", published.elapsed());
    }
    w.client
        .batch_execute("CREATE TABLE effects (n int)")
        .expect("CREATE TABLE effects");
    for n in 0..3i32 {
        w.client
            .execute("INSERT INTO effects VALUES ($1)", &[&n])
            .expect("INSERT INTO effects");
        let had: bool = w
            .client
            .query_one("SELECT amqp.wait_for_standbys('3 seconds')", &[])
            .expect("amqp.wait_for_standbys()")
            .get(0);
        assert!(had, "the standby did not have commit {n} within 3 s");
    }
}

/// The position a batch waits for covers asynchronous commits: messages committed with
/// `synchronous_commit = off` while the standby's WAL receiver is stopped stay held (their
/// commits are past anything the primary had flushed when they were claimed, so waiting only for
/// the flush position would publish them) and go once it runs again. Interleaved with
/// synchronous ones, which are held as well.
#[test]
fn asynchronous_commits_are_held_for_a_standby_that_is_behind() {
    let rabbit = Rabbit::shared();
    let config = kill_config(STANDBY).setting("wal_writer_delay", "'10s'");
    let mut w = World::new("failover_async_held", config, &rabbit);
    let (_standby, mut sc) = standby_of(&mut w);
    w.publish("before");
    w.collector.wait_for_body("before", ARRIVAL);
    Outbox::wait_drained(&mut w.client, ARRIVAL);

    let paused = Paused::new(&mut sc);
    for i in 0..6 {
        let sync = if i % 2 == 0 { "off" } else { "on" };
        w.client
            .batch_execute(&format!("SET synchronous_commit = {sync}"))
            .expect("SET synchronous_commit");
        w.publish(&format!("held:{i}"));
    }
    none_goes_out(
        &w.collector,
        "held:",
        "nothing goes out while the standby is behind",
    );
    paused.resume();
    for i in 0..6 {
        w.collector.wait_for_body(&format!("held:{i}"), ARRIVAL);
    }
}

/// A named standby that does not exist holds every message back (none dropped); clearing the
/// setting with a reload lets them all go.
#[test]
fn a_standby_that_is_not_there_holds_messages_until_the_setting_is_cleared() {
    let rabbit = Rabbit::shared();
    let mut w = World::new("failover_nosuch", config(Some("no_such_standby")), &rabbit);
    for i in 0..5 {
        w.publish(&format!("held:{i}"));
    }
    let collector = &w.collector;
    holds_for(Duration::from_secs(3), "nothing goes out", || {
        if collector.is_empty() {
            Ok(())
        } else {
            Err(format!("published: {:?}", collector.bodies()))
        }
    })
    .unwrap();
    assert_eq!(w.rows(), 5, "the held messages stay in the outbox");
    // Both views say why nothing goes out.
    let state: String = w
        .client
        .query_one(
            "SELECT state FROM amqp.worker_status WHERE database = current_database()",
            &[],
        )
        .expect("amqp.worker_status")
        .get(0);
    assert_eq!(state, "waiting for standbys (amqp_outbox.standby_names)");
    let health: Vec<(String, String)> = w
        .client
        .query(
            "SELECT component, status FROM amqp.health() WHERE component LIKE 'standby%'",
            &[],
        )
        .expect("amqp.health()")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        health,
        vec![(
            "standby no_such_standby".to_string(),
            "critical".to_string()
        )]
    );
    w.cluster.set_setting("amqp_outbox.standby_names", "''");
    w.cluster.reload();
    for i in 0..5 {
        w.collector.wait_for_body(&format!("held:{i}"), ARRIVAL);
    }
    Outbox::wait_drained(&mut w.client, ARRIVAL);
    let client = &mut w.client;
    eventually(ARRIVAL, "the worker's state back to running", || {
        let state: String = client
            .query_one(
                "SELECT state FROM amqp.worker_status WHERE database = current_database()",
                &[],
            )
            .map_err(|e| e.to_string())?
            .get(0);
        if state == "running" {
            Ok(())
        } else {
            Err(state)
        }
    });
}

/// The consuming side of a failover: `cut` deliveries handled on the primary while the standby
/// no longer streams, then the primary killed and the standby promoted. Returns the effects the
/// promoted database ends with (body → how many times).
fn consumer_failover(standby_names: Option<&str>, name: &str) -> Vec<(String, i64)> {
    let rabbit = Rabbit::shared();
    let mut w = World::new(name, config(standby_names), &rabbit);
    let queue = rabbit.declare_queue(name);
    subscribe_effects(&mut w, &queue.queue);
    let (mut standby, mut sc) = standby_of(&mut w);
    let effects = |c: &mut Client, prefix: &str| -> i64 {
        c.query_one(
            "SELECT count(*) FROM effects WHERE body LIKE $1 || '%'",
            &[&prefix],
        )
        .map(|r| r.get(0))
        .unwrap_or(-1)
    };
    for i in 0..10 {
        rabbit
            .publish("", &queue.queue, format!("early:{i}").as_bytes())
            .expect("publish");
    }
    eventually(ARRIVAL, "the early deliveries handled", || {
        match effects(&mut w.client, "early:") {
            10 => Ok(()),
            n => Err(format!("{n} handled")),
        }
    });
    eventually(
        ARRIVAL,
        "the standby has the early effects",
        || match effects(&mut sc, "early:") {
            10 => Ok(()),
            n => Err(format!("{n} on the standby")),
        },
    );

    cut_replication(&mut w, &standby, &mut sc);
    for i in 0..10 {
        rabbit
            .publish("", &queue.queue, format!("cut:{i}").as_bytes())
            .expect("publish");
    }
    eventually(
        ARRIVAL,
        "the cut deliveries handled on the primary",
        || match effects(&mut w.client, "cut:") {
            10 => Ok(()),
            n => Err(format!("{n} handled")),
        },
    );
    // Long enough for acknowledgements that are not held to reach the broker.
    std::thread::sleep(Duration::from_millis(500));
    w.cluster.stop(StopMode::Immediate);
    standby.promote().unwrap_or_else(|e| panic!("promote: {e}"));
    let db = w.cluster.config().database.clone();
    let mut pc = eventually(ARRIVAL, "a connection to the promoted standby", || {
        standby.client(&db)
    });
    if standby_names.is_some() {
        eventually(
            ARRIVAL,
            "the cut deliveries handled again on the promoted standby",
            || match effects(&mut pc, "cut:") {
                10 => Ok(()),
                n => Err(format!("{n} handled")),
            },
        );
    } else {
        // What it would have handled comes within seconds: give it the time.
        std::thread::sleep(Duration::from_secs(5));
    }
    let out = pc
        .query(
            "SELECT body, count(*) FROM effects GROUP BY body ORDER BY body",
            &[],
        )
        .expect("effects on the promoted standby")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    standby.stop_immediate();
    out
}

#[test]
fn with_standby_names_a_failover_loses_no_effect_of_an_acknowledged_delivery() {
    let effects = consumer_failover(Some(STANDBY), "failover_consumer_gated");
    let doubled: Vec<&(String, i64)> = effects.iter().filter(|(_, n)| *n != 1).collect();
    assert!(
        doubled.is_empty(),
        "effects applied more than once: {doubled:?}"
    );
    assert_eq!(
        effects.len(),
        20,
        "every delivery's effect is in the promoted database once: {effects:?}"
    );
    ResultRow {
        case: "23 primary failover, consumer".into(),
        messages: 20,
        committed: 20,
        lost: 20 - effects.len(),
        duplicates: doubled.len(),
        status: "PASS".into(),
        note: "standby_names set: 10 deliveries handled on the primary only were handled again on the promoted standby, none twice".into(),
        ..ResultRow::default()
    }
    .record();
}

/// The trade-off without the setting: deliveries acknowledged after a commit the standby never
/// got are gone from the broker, and their effects from the promoted database.
#[test]
fn without_standby_names_a_failover_loses_effects() {
    let effects = consumer_failover(None, "failover_consumer_ungated");
    let cut = effects
        .iter()
        .filter(|(b, _)| b.starts_with("cut:"))
        .count();
    assert_eq!(
        cut, 0,
        "without amqp_outbox.standby_names the effects of the cut deliveries are lost: {effects:?}"
    );
    assert_eq!(effects.len(), 10, "the early effects: {effects:?}");
}

// What the workers hold for a standby that is behind, when they are killed.

/// The outbox worker's backend_type.
const OUTBOX_WORKER: &str = "amqp_outbox";
/// The subscription worker's backend_type.
const SUBSCRIPTION_WORKER: &str = "amqp_outbox subscriptions";
/// What `amqp.worker_status.state` says while claimed messages wait for a standby.
const WAITING: &str = "waiting for standbys (amqp_outbox.standby_names)";
/// How long the tests watch that nothing leaves.
const WATCH: Duration = Duration::from_secs(3);

/// [`config`] with WAL kept for a standby that falls behind (it has no replication slot).
fn kill_config(standby_names: &str) -> PgConfig {
    config(Some(standby_names)).setting("wal_keep_size", "'256MB'")
}

/// How a test ends a worker.
#[derive(Clone, Copy, Debug)]
enum Kill {
    /// SIGKILL from the OS: the postmaster ends every process of the primary (walsenders
    /// included) and restarts them after crash recovery.
    Sigkill,
    /// `pg_terminate_backend()`: that worker alone ends and is started again.
    Terminate,
}

/// The pid of the primary's backend of `backend_type`, if one runs.
fn backend_pid(client: &mut Client, backend_type: &str) -> Result<Option<i32>, String> {
    client
        .batch_execute("SELECT pg_catalog.pg_stat_clear_snapshot()")
        .map_err(|e| e.to_string())?;
    client
        .query_opt(
            "SELECT pid FROM pg_catalog.pg_stat_activity WHERE backend_type = $1",
            &[&backend_type],
        )
        .map(|r| r.map(|r| r.get(0)))
        .map_err(|e| e.to_string())
}

/// Ends the primary's `backend_type` process `how` and waits for the one that replaces it;
/// `client` is connected again where the kill took its connection down. Returns the new pid.
fn kill_worker(cluster: &PgCluster, client: &mut Client, backend_type: &str, how: Kill) -> i32 {
    let old = eventually(ARRIVAL, &format!("a {backend_type} process"), || {
        backend_pid(client, backend_type)?.ok_or_else(|| "none".to_string())
    });
    match how {
        Kill::Sigkill => send_signal(old, libc::SIGKILL).expect("SIGKILL"),
        Kill::Terminate => {
            let ended: bool = client
                .query_one("SELECT pg_terminate_backend($1)", &[&old])
                .expect("pg_terminate_backend")
                .get(0);
            assert!(ended, "pg_terminate_backend({old}) found no such process");
        }
    }
    // A connection made in the instant before the postmaster saw the SIGKILL is closed by the
    // restart; one that sees the new worker was made after it.
    let new = eventually(ARRIVAL, &format!("a new {backend_type} process"), || {
        let pid = match backend_pid(client, backend_type) {
            Ok(pid) => pid,
            Err(e) => {
                *client = cluster.try_client()?;
                return Err(format!("connected again after: {e}"));
            }
        };
        match pid {
            Some(pid) if pid != old => Ok(pid),
            other => Err(format!("{other:?} (killed: {old})")),
        }
    });
    eprintln!("{backend_type} {old} ended by {how:?}; now {new}");
    new
}

/// The standby's WAL receiver stopped (SIGSTOP): the standby stays connected (the primary's
/// walsender keeps its slot until `wal_sender_timeout`) but flushes nothing more, so the primary
/// sees it behind. Continued (SIGCONT) by [`Paused::resume`] or when dropped, so that a failing
/// test leaves nothing stopped.
struct Paused {
    pid: i32,
    resumed: bool,
}

impl Paused {
    fn new(sc: &mut Client) -> Paused {
        let pid = eventually(ARRIVAL, "the standby's WAL receiver", || {
            sc.query_opt(
                "SELECT pid FROM pg_catalog.pg_stat_wal_receiver WHERE status = 'streaming'",
                &[],
            )
            .map_err(|e| e.to_string())?
            .map(|r| r.get::<_, i32>(0))
            .ok_or_else(|| "not streaming".to_string())
        });
        send_signal(pid, libc::SIGSTOP).expect("SIGSTOP the standby's WAL receiver");
        Paused {
            pid,
            resumed: false,
        }
    }

    fn resume(mut self) {
        self.cont();
    }

    fn cont(&mut self) {
        if !self.resumed {
            self.resumed = true;
            send_signal(self.pid, libc::SIGCONT).expect("SIGCONT the standby's WAL receiver");
        }
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        self.cont();
    }
}

/// This database's `amqp.worker_status`: (state, worker_pid).
fn worker_state(client: &mut Client) -> Result<(String, Option<i32>), String> {
    client
        .query_one(
            "SELECT state, worker_pid FROM amqp.worker_status WHERE database = current_database()",
            &[],
        )
        .map(|r| (r.get(0), r.get(1)))
        .map_err(|e| e.to_string())
}

/// Waits until the outbox worker `pid` says it has waited for the standbys for a second; fails
/// at once when a message whose body starts with `held:` arrives meanwhile.
fn wait_worker_waiting(w: &mut World, pid: i32) {
    let collector = &w.collector;
    eventually(ARRIVAL, "the outbox worker waiting for the standby", || {
        let leaked: Vec<String> = collector
            .bodies()
            .into_iter()
            .filter(|b| b.starts_with("held:"))
            .collect();
        assert!(
            leaked.is_empty(),
            "published before the standby had them: {leaked:?}"
        );
        match worker_state(&mut w.client)? {
            (state, Some(p)) if state == WAITING && p == pid => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
}

/// The bodies `collector` received that start with `prefix`.
fn received_with(w: &World, prefix: &str) -> Vec<String> {
    w.collector
        .bodies()
        .into_iter()
        .filter(|b| b.starts_with(prefix))
        .collect()
}

/// `{prefix}{from}` … published, one transaction each; records each body's `message_id`.
fn publish_recorded(
    w: &mut World,
    prefix: &str,
    range: std::ops::Range<usize>,
    ids: &mut BTreeMap<String, String>,
) {
    for i in range {
        let body = format!("{prefix}{i}");
        // Read in the publishing transaction: once it commits, the worker may deliver and
        // delete the row at once (CI saw the row gone).
        let mut tx = w.client.transaction().expect("BEGIN");
        let id: i64 = tx
            .query_one(
                "SELECT amqp.publish_message($1, $2, $3, $4)",
                &[
                    &w.outbox.broker_id,
                    &w.route.exchange,
                    &w.route.routing_key,
                    &body,
                ],
            )
            .expect("amqp.publish_message")
            .get(0);
        let message_id: String = tx
            .query_one("SELECT message_id FROM amqp.message WHERE id = $1", &[&id])
            .expect("the row's message_id")
            .get(0);
        tx.commit().expect("COMMIT");
        ids.insert(body, message_id);
    }
}

/// The outbox worker holds a claimed batch for a standby that is behind (its WAL receiver
/// stopped) and is killed `how`. Its successor holds them too, and what was committed after;
/// once the standby has them every one arrives, once, with its row's `message_id`.
fn held_messages_survive_a_killed_worker(how: Kill, name: &str) {
    let rabbit = Rabbit::shared();
    let mut w = World::new(name, kill_config(STANDBY), &rabbit);
    let (standby, mut sc) = standby_of(&mut w);
    let mut ids = BTreeMap::new();
    publish_recorded(&mut w, "before:", 0..5, &mut ids);
    for body in ids.keys() {
        w.collector.wait_for_body(body, ARRIVAL);
    }
    Outbox::wait_drained(&mut w.client, ARRIVAL);

    let paused = Paused::new(&mut sc);
    publish_recorded(&mut w, "held:", 0..10, &mut ids);
    let old = w.cluster.wait_for_worker(&mut w.client, ARRIVAL);
    wait_worker_waiting(&mut w, old);

    let new = kill_worker(&w.cluster, &mut w.client, OUTBOX_WORKER, how);
    // Committed while the new worker runs: held as well.
    publish_recorded(&mut w, "held:", 10..15, &mut ids);
    wait_worker_waiting(&mut w, new);
    let client = &mut w.client;
    let collector = &w.collector;
    holds_for(
        WATCH,
        "nothing held goes out after the restart while the standby is behind",
        || {
            let leaked: Vec<String> = collector
                .bodies()
                .into_iter()
                .filter(|b| b.starts_with("held:"))
                .collect();
            if !leaked.is_empty() {
                return Err(format!("published: {leaked:?}"));
            }
            match Outbox::rows(client)? {
                15 => Ok(()),
                n => Err(format!("{n} rows in the outbox, 15 held")),
            }
        },
    )
    .unwrap();
    // The premise: the standby has not flushed the held commits.
    let behind: bool = w
        .client
        .query_one(
            "SELECT NOT EXISTS (SELECT FROM pg_stat_replication \
                                WHERE application_name = $1 AND flush_lsn >= pg_current_wal_lsn())",
            &[&STANDBY],
        )
        .expect("pg_stat_replication")
        .get(0);
    assert!(behind, "the standby was not behind");

    paused.resume();
    for body in ids.keys() {
        w.collector.wait_for_body(body, ARRIVAL);
    }
    w.settle();
    let mut seen: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for d in w.deliveries() {
        seen.entry(d.text())
            .or_default()
            .push(d.message_id.clone().unwrap_or_default());
    }
    // Each message once: a held message had not been handed to the broker when its worker
    // ended (duplicates come only from messages published and not yet proven delivered).
    let expected: BTreeMap<String, Vec<String>> = ids
        .iter()
        .map(|(body, id)| (body.clone(), vec![id.clone()]))
        .collect();
    let copies: usize = seen.values().map(Vec::len).sum();
    assert_eq!(
        seen, expected,
        "every committed message once, with its row's message_id"
    );
    drop(standby);
    ResultRow {
        case: format!("23 held batch, worker {how:?}"),
        messages: ids.len(),
        committed: ids.len(),
        lost: 0,
        phantom: 0,
        duplicates: copies - seen.len(),
        status: "PASS".into(),
        note: "standby_names set, the standby's WAL receiver stopped: 10 claimed and held, the outbox worker killed, 5 more committed; none published until the standby had them, then each once with its message_id".into(),
        ..ResultRow::default()
    }
    .record();
}

#[test]
fn a_killed_outbox_worker_publishes_nothing_held_before_the_standby_has_it() {
    held_messages_survive_a_killed_worker(Kill::Sigkill, "failover_held_sigkill");
}

#[test]
fn a_terminated_outbox_worker_publishes_nothing_held_before_the_standby_has_it() {
    held_messages_survive_a_killed_worker(Kill::Terminate, "failover_held_terminate");
}

/// `effects` and its handler `record_effect`, subscribed as `fo` to `queue`.
fn subscribe_effects(w: &mut World, queue: &str) {
    w.client
        .batch_execute(
            "CREATE TABLE effects (body text);
             CREATE FUNCTION record_effect(d amqp.delivery) RETURNS void LANGUAGE sql
                 AS $$ INSERT INTO effects VALUES (amqp.body_text(d)) $$;",
        )
        .expect("the handler");
    w.client
        .execute(
            "SELECT amqp.subscribe('fo', $1, $2, 'record_effect(amqp.delivery)'::regprocedure)",
            &[&w.outbox.broker_id, &queue],
        )
        .expect("amqp.subscribe");
}

/// (rows, distinct bodies) of `effects` whose body starts with `prefix`.
fn effect_counts(c: &mut Client, prefix: &str) -> Result<(i64, i64), String> {
    c.query_one(
        "SELECT count(*), count(DISTINCT body) FROM effects WHERE body LIKE $1 || '%'",
        &[&prefix],
    )
    .map(|r| (r.get(0), r.get(1)))
    .map_err(|e| e.to_string())
}

/// Waits until `n` deliveries starting with `prefix` have had their effect, each once.
fn wait_effects(c: &mut Client, prefix: &str, n: i64) {
    eventually(
        ARRIVAL,
        &format!("{n} effects of {prefix}*"),
        || match effect_counts(c, prefix)? {
            (rows, distinct) if rows == n && distinct == n => Ok(()),
            other => Err(format!("(rows, distinct) = {other:?}")),
        },
    );
}

/// Subscription `fo`'s (handled, duplicates) counters.
fn handled_and_duplicates(c: &mut Client) -> Result<(i64, i64), String> {
    c.query_one(
        "SELECT handled, duplicates FROM amqp.subscription_status WHERE subscription = 'fo'",
        &[],
    )
    .map(|r| (r.get(0), r.get(1)))
    .map_err(|e| e.to_string())
}

/// (ready, unacknowledged, consumers) of `queue` on a private node, from `rabbitmqctl`.
fn queue_state(node: &PrivateRabbit, queue: &str) -> Result<(u64, u64, u64), String> {
    let out = node.ctl(&[
        "list_queues",
        "name",
        "messages_ready",
        "messages_unacknowledged",
        "consumers",
        "--quiet",
        "--no-table-headers",
    ])?;
    let fields: Vec<&str> = out
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.first() == Some(&queue))
        .ok_or_else(|| format!("no {queue} in: {out}"))?;
    let num = |i: usize| -> Result<u64, String> {
        fields
            .get(i)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("unexpected list_queues line: {fields:?}"))
    };
    Ok((num(1)?, num(2)?, num(3)?))
}

/// Waits until `queue` is in `state` (ready, unacknowledged, consumers).
fn wait_queue(node: &PrivateRabbit, queue: &str, state: (u64, u64, u64), what: &str) {
    eventually(ARRIVAL, what, || match queue_state(node, queue)? {
        s if s == state => Ok(()),
        s => Err(format!("(ready, unacknowledged, consumers) = {s:?}")),
    });
}

/// Watches that the subscription's `held` deliveries stay delivered and unacknowledged.
fn acks_stay_held(node: &PrivateRabbit, queue: &str, held: u64, what: &str) {
    holds_for(WATCH, what, || match queue_state(node, queue)? {
        (0, n, 1) if n == held => Ok(()),
        s => Err(format!(
            "(ready, unacknowledged, consumers) = {s:?}, {held} acknowledgements held"
        )),
    })
    .unwrap();
}

/// The subscription worker holds the acknowledgements of deliveries it handled while the
/// standby is behind, and is ended by `pg_terminate_backend()`, then by SIGKILL. Each time
/// RabbitMQ delivers those messages again, the inbox recognises them (no effect twice), and
/// their acknowledgements wait again; once the standby has the effects they go out and the
/// queue is empty.
#[test]
fn a_killed_subscription_worker_acknowledges_nothing_before_the_standby_has_it() {
    let node = PrivateRabbit::start();
    let rabbit = node.rabbit();
    let name = "failover_acks_killed";
    let mut w = World::new(name, kill_config(STANDBY), &rabbit);
    let queue = rabbit.declare_queue(name);
    subscribe_effects(&mut w, &queue.queue);
    let (standby, mut sc) = standby_of(&mut w);
    for i in 0..5 {
        rabbit
            .publish("", &queue.queue, format!("early:{i}").as_bytes())
            .expect("publish");
    }
    wait_effects(&mut w.client, "early:", 5);
    wait_queue(
        &node,
        &queue.queue,
        (0, 0, 1),
        "the early deliveries acknowledged while the standby streams",
    );

    let paused = Paused::new(&mut sc);
    for i in 0..10 {
        rabbit
            .publish("", &queue.queue, format!("held:{i}").as_bytes())
            .expect("publish");
    }
    wait_effects(&mut w.client, "held:", 10);
    acks_stay_held(
        &node,
        &queue.queue,
        10,
        "no acknowledgement before the standby has the effects",
    );
    assert_eq!(handled_and_duplicates(&mut w.client), Ok((15, 0)));

    for (round, how) in [Kill::Terminate, Kill::Sigkill].into_iter().enumerate() {
        kill_worker(&w.cluster, &mut w.client, SUBSCRIPTION_WORKER, how);
        // RabbitMQ delivers the 10 unacknowledged messages again: duplicates, no new effect.
        let dups = 10 * (round as i64 + 1);
        let client = &mut w.client;
        eventually(
            ARRIVAL,
            "the unacknowledged deliveries again, as duplicates",
            || match handled_and_duplicates(client)? {
                (15, d) if d == dups => Ok(()),
                other => Err(format!("(handled, duplicates) = {other:?}")),
            },
        );
        wait_effects(&mut w.client, "held:", 10);
        // The duplicates' acknowledgements wait for the same standby: it still lacks the
        // effects they stand for.
        acks_stay_held(
            &node,
            &queue.queue,
            10,
            &format!("no acknowledgement after {how:?} while the standby is behind"),
        );
    }

    paused.resume();
    wait_walsenders(&mut w.client, "the standby streaming again", 1);
    wait_queue(
        &node,
        &queue.queue,
        (0, 0, 1),
        "every delivery acknowledged once the standby has the effects",
    );
    wait_effects(&mut sc, "held:", 10);
    let effects: Vec<(String, i64)> = w
        .client
        .query(
            "SELECT body, count(*) FROM effects GROUP BY body ORDER BY body",
            &[],
        )
        .expect("effects")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let expected: Vec<(String, i64)> = {
        let mut v: Vec<String> = (0..5)
            .map(|i| format!("early:{i}"))
            .chain((0..10).map(|i| format!("held:{i}")))
            .collect();
        v.sort();
        v.into_iter().map(|b| (b, 1)).collect()
    };
    assert_eq!(effects, expected, "each delivery's effect once");
    assert_eq!(handled_and_duplicates(&mut w.client), Ok((15, 20)));
    drop(standby);
    ResultRow {
        case: "23 held acks, worker killed".into(),
        messages: 15,
        committed: 15,
        lost: 0,
        duplicates: 0,
        status: "PASS".into(),
        note: "standby_names set, the standby's WAL receiver stopped: 10 deliveries handled, their acknowledgements held through pg_terminate_backend and SIGKILL of the subscription worker (each time redelivered, recognised, held again); acknowledged once the standby had them, each effect once".into(),
        ..ResultRow::default()
    }
    .record();
}

/// A reload that changes `amqp_outbox.standby_names` while messages and acknowledgements wait
/// for a standby that is not there: to another missing name they keep waiting, to '' they go.
#[test]
fn a_reload_that_clears_standby_names_lets_held_messages_and_acknowledgements_go() {
    let node = PrivateRabbit::start();
    let rabbit = node.rabbit();
    let name = "failover_reload_held";
    let mut w = World::new(name, config(Some("no_such_standby")), &rabbit);
    let queue = rabbit.declare_queue(name);
    subscribe_effects(&mut w, &queue.queue);
    for i in 0..5 {
        w.publish(&format!("held:{i}"));
        rabbit
            .publish("", &queue.queue, format!("handled:{i}").as_bytes())
            .expect("publish");
    }
    wait_effects(&mut w.client, "handled:", 5);
    let pid = w.cluster.wait_for_worker(&mut w.client, ARRIVAL);
    wait_worker_waiting(&mut w, pid);
    acks_stay_held(
        &node,
        &queue.queue,
        5,
        "no acknowledgement for a standby that is not there",
    );

    for (setting, gone) in [("still_not_there", false), ("", true)] {
        let from = w.cluster.log().len();
        w.cluster
            .set_setting("amqp_outbox.standby_names", format!("'{setting}'"));
        w.cluster.reload();
        let line = format!("amqp_outbox.standby_names is now \"{setting}\"");
        let cluster = &w.cluster;
        eventually(ARRIVAL, "the workers to take the reload", || {
            if cluster.log().get(from..).unwrap_or("").contains(&line) {
                Ok(())
            } else {
                Err(format!("no log line {line:?}"))
            }
        });
        if gone {
            break;
        }
        acks_stay_held(
            &node,
            &queue.queue,
            5,
            "acknowledgements held after a change to another missing standby",
        );
        assert_eq!(
            received_with(&w, "held:"),
            Vec::<String>::new(),
            "published after a change to another missing standby"
        );
        assert_eq!(w.rows(), 5, "the held messages stay in the outbox");
    }
    for i in 0..5 {
        w.collector.wait_for_body(&format!("held:{i}"), ARRIVAL);
    }
    Outbox::wait_drained(&mut w.client, ARRIVAL);
    wait_queue(
        &node,
        &queue.queue,
        (0, 0, 1),
        "the held acknowledgements sent after the setting was cleared",
    );
    wait_effects(&mut w.client, "handled:", 5);
    assert_eq!(handled_and_duplicates(&mut w.client), Ok((5, 0)));
}
