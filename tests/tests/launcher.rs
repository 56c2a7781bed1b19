//! The launcher: every database with the extension gets its workers, without a per-database
//! setting and without a restart — found at start, after `CREATE EXTENSION` (woken by its
//! commit), gone after `DROP DATABASE` (which the workers must not block); one database's
//! worker terminated while the others publish; `amqp_outbox.max_workers` reached.
//!
//! Each test runs its own cluster (`amqp_outbox.database = '*'`) against the shared RabbitMQ.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use amqp_outbox_e2e::chaos::{proc_stat_field, proc_state, with_postmaster_signals_blocked};
use amqp_outbox_e2e::outbox::{add_broker, create_extension};
use amqp_outbox_e2e::{
    eventually, eventually_count, Collector, PgCluster, PgConfig, Rabbit, Route,
};
use postgres::Client;

const UP: Duration = Duration::from_secs(40);
const ARRIVAL: Duration = Duration::from_secs(60);

fn every_database(extra: &[(&str, &str)]) -> PgConfig {
    // Written after the harness's own `amqp_outbox.database` line: the last one wins.
    let mut config = PgConfig::default()
        .setting("amqp_outbox.database", "'*'")
        .setting("max_worker_processes", 24);
    for (k, v) in extra {
        config = config.setting(k, v);
    }
    config
}

/// A database with the extension, a broker row and its own exchange and queue.
struct Db {
    name: String,
    client: Client,
    route: Route,
    collector: Collector,
    broker: i32,
    sent: usize,
}

impl Db {
    fn create(cluster: &PgCluster, rabbit: &Rabbit, name: &str) -> Db {
        cluster
            .client_db("postgres")
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .unwrap_or_else(|e| panic!("CREATE DATABASE {name}: {e}"));
        Db::with_extension(cluster, rabbit, name)
    }

    fn with_extension(cluster: &PgCluster, rabbit: &Rabbit, name: &str) -> Db {
        let mut client = cluster.client_db(name);
        create_extension(&mut client);
        let broker = add_broker(&mut client, rabbit.endpoint());
        let route = rabbit.declare_route(&format!("launcher_{name}"));
        let collector = rabbit.consume(&route);
        Db {
            name: name.to_string(),
            client,
            route,
            collector,
            broker,
            sent: 0,
        }
    }

    fn publish(&mut self, n: usize) {
        for _ in 0..n {
            let body = format!("{}:{}", self.name, self.sent);
            self.client
                .execute(
                    "SELECT amqp.publish($1, $2, $3, $4)",
                    &[
                        &self.broker,
                        &self.route.exchange,
                        &self.route.routing_key,
                        &body,
                    ],
                )
                .unwrap_or_else(|e| panic!("publish in {}: {e}", self.name));
            self.sent += 1;
        }
    }

    /// Every message published so far arrived (a terminated worker may send some twice: at
    /// least once), each from this database only.
    fn wait_all_arrived(&self) {
        let counts = eventually(ARRIVAL, &format!("{}'s messages", self.name), || {
            let counts = self.collector.body_counts();
            match (0..self.sent)
                .map(|i| format!("{}:{i}", self.name))
                .find(|b| !counts.contains_key(b))
            {
                None => Ok(counts),
                Some(missing) => Err(format!("{missing} missing in {counts:?}")),
            }
        });
        assert!(
            counts
                .keys()
                .all(|b| b.starts_with(&format!("{}:", self.name))),
            "another database's message in {}'s queue: {counts:?}",
            self.name
        );
    }
}

/// `amqp.worker_status` as seen from `client`: database → (state, outbox pid, subscription pid).
fn status(client: &mut Client) -> BTreeMap<String, (String, Option<i32>, Option<i32>)> {
    client
        .query(
            "SELECT database, state, worker_pid, subscription_worker_pid FROM amqp.worker_status",
            &[],
        )
        .unwrap_or_else(|e| panic!("amqp.worker_status: {e}"))
        .iter()
        .map(|r| {
            (
                r.get::<_, Option<String>>(0).unwrap_or_default(),
                (r.get(1), r.get(2), r.get(3)),
            )
        })
        .collect()
}

/// This database's monitor pid (0: none).
fn monitor_pid(client: &mut Client) -> i32 {
    client
        .query_one(
            "SELECT coalesce(monitor_pid, 0) FROM amqp.worker_status WHERE database = current_database()",
            &[],
        )
        .map(|r| r.get(0))
        .unwrap_or_else(|e| panic!("amqp.worker_status: {e}"))
}

/// Waits until the database's state is `running` (all three workers announced); returns the
/// outbox and subscription workers' pids.
fn wait_running(client: &mut Client, database: &str) -> (i32, i32) {
    eventually(
        UP,
        &format!("{database}'s workers running"),
        || match status(client).get(database) {
            Some((state, Some(w), Some(s))) if state == "running" => Ok((*w, *s)),
            other => Err(format!("{other:?}")),
        },
    )
}

#[test]
fn every_database_with_the_extension_is_served_and_dropping_one_is_not_blocked() {
    let rabbit = Rabbit::shared();
    let cluster = PgCluster::new(every_database(&[]));
    let mut e2e = Db::with_extension(&cluster, &rabbit, "e2e");
    let mut a = Db::create(&cluster, &rabbit, "shop_a");
    let mut b = Db::create(&cluster, &rabbit, "shop_b");
    // `postgres` has no extension: probed, then left alone.
    for db in ["e2e", "shop_a", "shop_b"] {
        wait_running(&mut e2e.client, db);
    }
    let seen = status(&mut a.client);
    assert!(!seen.contains_key("postgres"), "{seen:?}");
    for d in [&mut e2e, &mut a, &mut b] {
        d.publish(50);
    }
    for d in [&e2e, &a, &b] {
        d.wait_all_arrived();
    }

    // A database created while the others run: its CREATE EXTENSION's commit wakes the
    // launcher (its periodic look is once a minute).
    let created_at = Instant::now();
    let mut c = Db::create(&cluster, &rabbit, "shop_c");
    wait_running(&mut c.client, "shop_c");
    let took = created_at.elapsed();
    eprintln!("shop_c served {took:?} after CREATE DATABASE");
    assert!(
        took < Duration::from_secs(30),
        "shop_c served after {took:?}: not woken by CREATE EXTENSION"
    );

    // DROP DATABASE of a served database, while the others publish: not blocked by its
    // workers, and the others do not notice.
    let before = status(&mut e2e.client);
    for d in [&mut e2e, &mut a, &mut c] {
        d.publish(30);
    }
    drop(b.client);
    let dropping = Instant::now();
    cluster
        .client_db("postgres")
        .batch_execute("DROP DATABASE shop_b")
        .unwrap_or_else(|e| panic!("DROP DATABASE shop_b: {e}\n{}", cluster.log_tail(20)));
    eprintln!("DROP DATABASE shop_b took {:?}", dropping.elapsed());
    for d in [&mut e2e, &mut a, &mut c] {
        d.publish(30);
    }
    for d in [&e2e, &a, &c] {
        d.wait_all_arrived();
    }
    let after = eventually(UP, "shop_b gone from worker_status", || {
        let s = status(&mut e2e.client);
        if s.contains_key("shop_b") || s.values().any(|(_, w, _)| w.is_none()) {
            Err(format!("{s:?}"))
        } else {
            Ok(s)
        }
    });
    for db in ["e2e", "shop_a"] {
        assert_eq!(before[db].1, after[db].1, "{db}'s worker was restarted");
    }

    // ALTER DATABASE ... RENAME needs the database to itself too: its workers step aside and
    // come back.
    drop(c.client);
    cluster
        .client_db("postgres")
        .batch_execute("ALTER DATABASE shop_c RENAME TO shop_d")
        .unwrap_or_else(|e| panic!("RENAME: {e}\n{}", cluster.log_tail(20)));
    let mut d_client = cluster.client_db("shop_d");
    wait_running(&mut d_client, "shop_d");

    // CREATE DATABASE ... TEMPLATE a served database: the template's workers step aside, and
    // the copy (with the extension) is served once it is committed.
    drop(a.client);
    cluster
        .client_db("postgres")
        .batch_execute("CREATE DATABASE copy_a TEMPLATE shop_a")
        .unwrap_or_else(|e| panic!("CREATE DATABASE TEMPLATE: {e}\n{}", cluster.log_tail(20)));
    wait_running(&mut d_client, "copy_a");
    wait_running(&mut d_client, "shop_a");
    drop(b.route);
}

#[test]
fn one_databases_worker_terminated_the_others_do_not_notice() {
    let rabbit = Rabbit::shared();
    let cluster = PgCluster::new(every_database(&[]));
    let mut e2e = Db::with_extension(&cluster, &rabbit, "e2e");
    let mut a = Db::create(&cluster, &rabbit, "shop_a");
    let (e2e_pid, _) = wait_running(&mut e2e.client, "e2e");
    let (a_pid, _) = wait_running(&mut e2e.client, "shop_a");
    e2e.publish(100);
    a.publish(100);
    let killed: bool = e2e
        .client
        .query_one("SELECT pg_terminate_backend($1)", &[&a_pid])
        .map(|r| r.get(0))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(killed);
    e2e.publish(100);
    a.publish(100);
    let (new_a, _) = eventually(UP, "shop_a's worker back", || {
        let (w, s) = wait_running(&mut e2e.client, "shop_a");
        if w == a_pid {
            Err("still the old pid".to_string())
        } else {
            Ok((w, s))
        }
    });
    assert_ne!(new_a, a_pid);
    e2e.wait_all_arrived();
    a.wait_all_arrived();
    assert_eq!(
        wait_running(&mut e2e.client, "e2e").0,
        e2e_pid,
        "e2e's worker restarted"
    );
}

#[test]
fn databases_beyond_max_workers_are_listed_with_a_warning_and_served_when_room_frees() {
    let rabbit = Rabbit::shared();
    let cluster = PgCluster::new(every_database(&[("amqp_outbox.max_workers", "1")]));
    let mut e2e = Db::with_extension(&cluster, &rabbit, "e2e");
    wait_running(&mut e2e.client, "e2e");
    let mut a = Db::create(&cluster, &rabbit, "shop_a");
    let state = eventually(UP, "shop_a listed as not served", || {
        match status(&mut a.client).get("shop_a") {
            Some((s, None, None)) if s.contains("max_workers") => Ok(s.clone()),
            other => Err(format!("{other:?}")),
        }
    });
    assert_eq!(state, "not served: amqp_outbox.max_workers reached");
    cluster.wait_for_log(
        "database \"shop_a\" is not served: amqp_outbox.max_workers (1)",
        UP,
    );
    a.publish(10);
    // Room frees: e2e loses its extension (nothing waits in its outbox).
    e2e.client
        .batch_execute("DROP EXTENSION amqp_outbox")
        .unwrap_or_else(|e| panic!("DROP EXTENSION: {e}"));
    wait_running(&mut a.client, "shop_a");
    a.wait_all_arrived();
}

/// CPU time (utime + stime, in clock ticks) of these processes so far.
fn cpu_ticks(pids: &[i32]) -> u64 {
    pids.iter()
        .map(|&p| {
            let ticks = |n| proc_stat_field(p, n).and_then(|v| u64::try_from(v).ok());
            ticks(14).unwrap_or(0) + ticks(15).unwrap_or(0)
        })
        .sum()
}

#[test]
fn idle_databases_are_not_woken_by_another_databases_commits() {
    let rabbit = Rabbit::shared();
    let cluster = PgCluster::new(every_database(&[]));
    let mut busy = Db::with_extension(&cluster, &rabbit, "e2e");
    let idle: Vec<Db> = (0..5)
        .map(|i| Db::create(&cluster, &rabbit, &format!("idle_{i}")))
        .collect();
    let mut pids = Vec::new();
    for d in &idle {
        let (w, s) = wait_running(&mut busy.client, &d.name);
        pids.extend([w, s]);
    }
    let wakeups = |c: &mut Client| -> BTreeMap<String, (i64, i64)> {
        c.query(
            "SELECT database, commit_wakeups, steps FROM amqp.worker_status",
            &[],
        )
        .unwrap_or_else(|e| panic!("{e}"))
        .iter()
        .map(|r| (r.get::<_, String>(0), (r.get(1), r.get(2))))
        .collect()
    };
    // Past their start (connections, declarations): what they cost while idle.
    std::thread::sleep(Duration::from_secs(3));
    let before = wakeups(&mut busy.client);
    let per_pid: Vec<u64> = pids.iter().map(|p| cpu_ticks(&[*p])).collect();
    let ticks_before = cpu_ticks(&pids);
    let started = Instant::now();
    busy.publish(500);
    busy.wait_all_arrived();
    std::thread::sleep(Duration::from_secs(5));
    let ticks = cpu_ticks(&pids) - ticks_before;
    let per_pid_after: Vec<u64> = pids.iter().map(|p| cpu_ticks(&[*p])).collect();
    eprintln!("per worker (outbox, subscriptions, ...): {per_pid:?} -> {per_pid_after:?}");
    let after = wakeups(&mut busy.client);
    eprintln!(
        "{} idle databases: {ticks} clock ticks of CPU (all {} workers together) in {:?} while e2e published 500 messages",
        idle.len(),
        pids.len(),
        started.elapsed()
    );
    assert!(
        after["e2e"].0 > before["e2e"].0,
        "e2e's commits woke it: {after:?}"
    );
    for d in &idle {
        assert_eq!(
            after[&d.name].0, before[&d.name].0,
            "{} was woken by e2e's commits: {before:?} → {after:?}",
            d.name
        );
    }
}

#[test]
fn a_database_taken_out_of_amqp_outbox_database_loses_its_workers_at_the_reload() {
    let rabbit = Rabbit::shared();
    let mut cluster = PgCluster::new(every_database(&[]));
    let mut e2e = Db::with_extension(&cluster, &rabbit, "e2e");
    let mut a = Db::create(&cluster, &rabbit, "shop_a");
    let (e2e_pid, _) = wait_running(&mut e2e.client, "e2e");
    wait_running(&mut e2e.client, "shop_a");
    cluster.set_setting("amqp_outbox.database", "'e2e'");
    cluster.reload();
    eventually(UP, "shop_a excluded", || {
        match status(&mut a.client).get("shop_a") {
            Some((s, None, None)) if s == "not served: excluded by amqp_outbox.database" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    a.publish(5);
    e2e.publish(5);
    e2e.wait_all_arrived();
    // No process of ours is in shop_a (so none can deliver), and its messages wait there.
    let in_a: i64 = e2e
        .client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity \
              WHERE datname = 'shop_a' AND backend_type LIKE 'amqp_outbox%'",
            &[],
        )
        .map(|r| r.get(0))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(in_a, 0, "a worker still runs in the excluded database");
    let waiting: i64 = a
        .client
        .query_one("SELECT count(*) FROM amqp.message", &[])
        .map(|r| r.get(0))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(waiting, 5);
    assert!(a.collector.is_empty(), "shop_a delivered without workers");
    assert_eq!(wait_running(&mut e2e.client, "e2e").0, e2e_pid);
    // Back in the list: served again, and what waited goes out.
    cluster.set_setting("amqp_outbox.database", "'*'");
    cluster.reload();
    wait_running(&mut a.client, "shop_a");
    a.wait_all_arrived();
}

#[test]
fn databases_without_the_extension_are_probed_and_left_alone() {
    // Little room (PostgreSQL's logical replication launcher, ours, two probes, one database's
    // three workers), and eight databases that only a probe can tell apart from one to serve.
    let rabbit = Rabbit::shared();
    let cluster = PgCluster::new(
        PgConfig::default()
            .setting("amqp_outbox.database", "'*'")
            .setting("max_worker_processes", 7),
    );
    let mut admin = cluster.client_db("postgres");
    for i in 0..8 {
        admin
            .batch_execute(&format!("CREATE DATABASE plain_{i}"))
            .unwrap_or_else(|e| panic!("CREATE DATABASE: {e}"));
    }
    let mut e2e = Db::with_extension(&cluster, &rabbit, "e2e");
    wait_running(&mut e2e.client, "e2e");
    e2e.publish(20);
    e2e.wait_all_arrived();
    let log = cluster.log();
    assert!(
        !log.contains("is not served") && !log.contains("cannot start a worker"),
        "{}",
        cluster.log_tail(30)
    );
    let seen = status(&mut e2e.client);
    assert_eq!(seen.len(), 1, "only e2e is served: {seen:?}");
    let probing: i64 = e2e
        .client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity \
              WHERE backend_type LIKE 'amqp_outbox%' AND datname LIKE 'plain_%'",
            &[],
        )
        .map(|r| r.get(0))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        probing, 0,
        "a worker stayed in a database without the extension"
    );
}

/// The pid of the launcher, once one runs that is not `not`.
fn wait_launcher(cluster: &PgCluster, not: Option<i32>) -> i32 {
    let mut c = cluster.client_db("postgres");
    launcher_over(&mut c, not, UP, &|| cluster.log_tail(5))
}

/// The launcher's pid over `client`'s connection, once one runs that is not `not`, within
/// `within`; `detail` adds to a timeout's message. A test of the postmaster's sleep polls over a
/// connection it opened before: a new one would wake the postmaster.
fn launcher_over(
    client: &mut Client,
    not: Option<i32>,
    within: Duration,
    detail: &dyn Fn() -> String,
) -> i32 {
    eventually(within, "a launcher in pg_stat_activity", || {
        client
            .batch_execute("SELECT pg_stat_clear_snapshot()")
            .map_err(|e| e.to_string())?;
        let pid: Option<i32> = client
            .query_one(
                "SELECT min(pid) FROM pg_stat_activity WHERE backend_type = 'amqp_outbox launcher'",
                &[],
            )
            .map_err(|e| e.to_string())?
            .get(0);
        match pid {
            Some(p) if Some(p) != not => Ok(p),
            other => Err(format!("launcher {other:?}\n{}", detail())),
        }
    })
}

/// A launcher whose exit PostgreSQL 15's postmaster sees only after it chose to sleep (it was
/// busy then: its signals were blocked) is back within seconds all the same: the launcher's
/// watch ends that sleep. Before, the postmaster slept on for up to a minute, or until a
/// connection came, and every database's stopped worker waited with it (a CI run waited 40 s
/// for the launcher). The postmaster is held there under gdb while the launcher is terminated;
/// nothing else wakes it (no autovacuum, no new connection). PostgreSQL 16 and later do not miss
/// the exit; `a_terminated_launcher_comes_back_…` covers them.
#[test]
fn a_launcher_exit_the_postmaster_sees_late_is_restarted_within_seconds() {
    let rabbit = Rabbit::shared();
    let cluster = PgCluster::new(every_database(&[("autovacuum", "off")]));
    let mut e2e = Db::with_extension(&cluster, &rabbit, "e2e");
    wait_running(&mut e2e.client, "e2e");
    let version: i32 = e2e
        .client
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .map(|r| r.get(0))
        .unwrap_or_else(|e| panic!("{e}"));
    if version >= 160_000 {
        eprintln!("PostgreSQL {version}: its postmaster waits on a latch and sees every exit");
        return;
    }
    let launcher = wait_launcher(&cluster, None);
    let mut client = cluster.client_db("postgres");
    let log_from = cluster.log().len();
    with_postmaster_signals_blocked(&cluster, || {
        let killed: bool = client
            .query_one("SELECT pg_terminate_backend($1)", &[&launcher])
            .map(|r| r.get(0))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(killed);
        // Exited: a zombie until the held postmaster reaps it.
        eventually(UP, "the launcher exited", || match proc_state(launcher) {
            Some('Z') | None => Ok(()),
            other => Err(format!("launcher state {other:?}")),
        });
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let let_go = Instant::now();
    let new = launcher_over(&mut client, Some(launcher), ARRIVAL, &String::new);
    let took = let_go.elapsed();
    let log = cluster.log()[log_from..].to_string();
    eprintln!("launcher {launcher} -> {new} {took:?} after the postmaster was let go");
    assert!(
        log.contains("asking the postmaster again"),
        "the watch did not have to wake the postmaster: the race was not reproduced\n{log}"
    );
    assert!(
        took < Duration::from_secs(10),
        "the launcher came back only after {took:?}\n{log}"
    );
    // The watch ends once the launcher is back.
    eventually_count(
        &mut client,
        UP,
        "no launcher watch left",
        "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'amqp_outbox launcher watch'",
        0,
    );
    assert!(health_of(&mut e2e.client, "launcher").starts_with("ok"));
}

/// amqp.health()'s status of `component`.
fn health_of(client: &mut Client, component: &str) -> String {
    client
        .query_one(
            "SELECT status || ': ' || detail FROM amqp.health() WHERE component = $1",
            &[&component],
        )
        .map(|r| r.get(0))
        .unwrap_or_else(|e| panic!("amqp.health(): {e}"))
}

/// A terminated launcher comes back (the postmaster restarts it: it exits non-zero), and the
/// workers its predecessor started are started again when they stop, without a probe first.
/// Before, a terminated launcher was gone until the server restarted, and the next stopped
/// worker with it.
#[test]
fn a_terminated_launcher_comes_back_and_restarts_the_workers_it_did_not_start() {
    let rabbit = Rabbit::shared();
    let cluster = PgCluster::new(every_database(&[]));
    let mut e2e = Db::with_extension(&cluster, &rabbit, "e2e");
    let (outbox, inbox) = wait_running(&mut e2e.client, "e2e");
    let monitor = monitor_pid(&mut e2e.client);
    let mut launcher = wait_launcher(&cluster, None);
    assert!(health_of(&mut e2e.client, "launcher").starts_with("ok"));
    for round in 0..2 {
        let killed: bool = e2e
            .client
            .query_one("SELECT pg_terminate_backend($1)", &[&launcher])
            .map(|r| r.get(0))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(killed, "round {round}");
        let back = Instant::now();
        let new = wait_launcher(&cluster, Some(launcher));
        eprintln!(
            "round {round}: launcher {launcher} -> {new} in {:?}",
            back.elapsed()
        );
        // Its workers were not touched: the new launcher adopts them.
        assert_eq!(wait_running(&mut e2e.client, "e2e"), (outbox, inbox));
        assert_eq!(monitor_pid(&mut e2e.client), monitor);
        launcher = new;
    }
    assert!(health_of(&mut e2e.client, "launcher").starts_with("ok"));
    // All three workers terminated at once: the new launcher (which the postmaster does not
    // tell about workers it did not start) starts them again.
    e2e.publish(20);
    let stopped = Instant::now();
    e2e.client
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
              WHERE pid IN ($1, $2, $3)",
            &[&outbox, &inbox, &monitor],
        )
        .unwrap_or_else(|e| panic!("{e}"));
    let (new_outbox, new_inbox) = eventually(UP, "e2e's workers back", || {
        match wait_running(&mut e2e.client, "e2e") {
            (w, s) if w != outbox && s != inbox && monitor_pid(&mut e2e.client) != monitor => {
                Ok((w, s))
            }
            other => Err(format!("{other:?}")),
        }
    });
    let new_monitor = monitor_pid(&mut e2e.client);
    eprintln!(
        "workers {outbox}/{inbox}/{monitor} -> {new_outbox}/{new_inbox}/{new_monitor} in {:?}",
        stopped.elapsed()
    );
    e2e.publish(20);
    e2e.wait_all_arrived();
    eventually(UP, "the monitor's health ok", || {
        let h = health_of(&mut e2e.client, "monitor");
        if h.starts_with("ok") {
            Ok(())
        } else {
            Err(h)
        }
    });
    for c in ["worker", "subscription worker", "launcher", "monitor"] {
        let h = health_of(&mut e2e.client, c);
        assert!(h.starts_with("ok"), "{c}: {h}");
    }
}

/// Statements PostgreSQL refuses for want of a right stop no worker and take no lock: the
/// hook that makes room for `DROP DATABASE` and the like, and the one that guards `DROP
/// EXTENSION`, run before PostgreSQL's permission checks, so they must make those checks
/// first (FAULTS.md case 24). Before, any login role stopped a served database's workers by
/// trying, and locked `amqp.message` (every publisher behind it) by trying `DROP EXTENSION`.
#[test]
fn refused_database_statements_stop_no_worker_and_take_no_lock() {
    let rabbit = Rabbit::shared();
    let cluster = PgCluster::new(every_database(&[]));
    let mut e2e = Db::with_extension(&cluster, &rabbit, "e2e");
    let mut a = Db::create(&cluster, &rabbit, "shop_a");
    let before = wait_running(&mut e2e.client, "shop_a");
    e2e.client
        .batch_execute("CREATE ROLE intruder LOGIN IN ROLE amqp_outbox_publisher")
        .unwrap_or_else(|e| panic!("{e}"));
    let as_intruder = |db: &str| {
        let conn = cluster
            .connection_string(db)
            .replace("user=postgres", "user=intruder");
        Client::connect(&conn, postgres::NoTls).unwrap_or_else(|e| panic!("{e}"))
    };
    let mut intruder = as_intruder("postgres");
    for sql in [
        "DROP DATABASE shop_a",
        "ALTER DATABASE shop_a RENAME TO shop_x",
        "CREATE DATABASE copy_x TEMPLATE shop_a",
    ] {
        let e = intruder
            .batch_execute(sql)
            .err()
            .unwrap_or_else(|| panic!("{sql} succeeded"));
        assert_eq!(
            e.code(),
            Some(&postgres::error::SqlState::INSUFFICIENT_PRIVILEGE),
            "{sql}: {e}"
        );
        let now = status(&mut e2e.client);
        assert_eq!(
            now.get("shop_a").map(|s| (s.1, s.2)),
            Some((Some(before.0), Some(before.1))),
            "after {sql}: shop_a's workers were stopped"
        );
    }
    // A publisher's transaction holds amqp.message; a DROP EXTENSION the role may not run is
    // refused at once instead of queueing for the table (and every publisher behind it).
    a.client
        .batch_execute("BEGIN")
        .unwrap_or_else(|e| panic!("{e}"));
    a.publish(1);
    let mut in_a = as_intruder("shop_a");
    let e = in_a
        .batch_execute("SET lock_timeout = '5s'; DROP EXTENSION amqp_outbox")
        .expect_err("DROP EXTENSION as intruder succeeded");
    assert_eq!(
        e.code(),
        Some(&postgres::error::SqlState::INSUFFICIENT_PRIVILEGE),
        "{e}"
    );
    a.client
        .batch_execute("COMMIT")
        .unwrap_or_else(|e| panic!("{e}"));
    a.wait_all_arrived();
    assert_eq!(wait_running(&mut e2e.client, "shop_a"), before);
}
