//! The fault-injection suite: one test per case of FAULTS.md (1 to 16).
//!
//! Every test runs its own PostgreSQL cluster and its own RabbitMQ node (never the shared ones),
//! injects its fault on this machine, heals it, drains, and checks with the ledger: lost = 0,
//! phantom = 0, duplicates within the documented bound (`amqp_outbox.max_in_flight` per fault,
//! plus what the test consumer itself gets redelivered when its own connection breaks), every
//! duplicate sharing one `message_id`. Rows left in the outbox after the final drain are
//! reported. Each test appends a row to `target/chaos/results.tsv` (`make chaos` prints it).
//!
//! Fast cases run in `make test`; the slow ones are `#[ignore]` and run with `make chaos`
//! (`--include-ignored`, `AMQP_OUTBOX_CHAOS_SCALE=10` for larger volumes).

use std::sync::Arc;
use std::time::{Duration, Instant};

use amqp_outbox_e2e::chaos::{
    count_log_lines, holds_for, pg_program, proc_status_kb, scale, scaled, send_signal,
    skip_loudly, wait_backend_state, MemWatch, ProxyMode, ResultRow, Standby, TcpProxy,
};
use amqp_outbox_e2e::outbox::create_extension;
use amqp_outbox_e2e::pg::PgInstall;
use amqp_outbox_e2e::{
    eventually, try_eventually, unique_name, AmqpEndpoint, Collector, Ledger, MessageKey, Outbox,
    Outcome, PgCluster, PgConfig, PrivateRabbit, Producer, ProducerConfig, Received, Report, Route,
    StopMode,
};
use postgres::Client;

const WORKER_UP: Duration = Duration::from_secs(60);
const ARRIVAL: Duration = Duration::from_secs(90);
/// The documented duplicate bound per fault: `amqp_outbox.max_in_flight` (default 2000).
const MAX_IN_FLIGHT: usize = 2000;
/// What the test consumer may get twice when its own connection breaks (its prefetch).
const CONSUMER_PREFETCH: usize = 500;

fn drain_timeout() -> Duration {
    Duration::from_secs(240) + Duration::from_secs_f64(120.0 * scale())
}

/// Settings every fault test starts from: quick reconnects, a hung connection detected in
/// seconds, resends after 10 s without proof.
fn base_config() -> PgConfig {
    PgConfig::default()
        .setting("amqp_outbox.retry_backoff_min", 100)
        .setting("amqp_outbox.retry_backoff_max", 1000)
        .setting("amqp_outbox.confirm_timeout", 5000)
        .setting("amqp_outbox.resend_after", 10000)
}

/// One fault test's world: its own RabbitMQ node and PostgreSQL cluster, the extension with one
/// broker row, a route and a consumer, a ledger and the worker's memory watch. Fields drop in
/// order: watch, consumer, route, client, cluster, node.
struct Rig {
    case: &'static str,
    mem: MemWatch,
    collector: Collector,
    route: Route,
    client: Client,
    outbox: Outbox,
    cluster: PgCluster,
    node: PrivateRabbit,
    ledger: Arc<Ledger>,
}

impl Rig {
    fn new(case: &'static str, config: PgConfig) -> Rig {
        Rig::with_node(case, config, PrivateRabbit::start(), None)
    }

    /// With a node already booted, and optionally another login than guest for the broker row.
    fn with_node(
        case: &'static str,
        config: PgConfig,
        node: PrivateRabbit,
        endpoint: Option<AmqpEndpoint>,
    ) -> Rig {
        eprintln!("=== FAULTS.md case {case} (scale {})", scale());
        let rabbit = node.rabbit();
        let cluster = PgCluster::new(config);
        let mut client = cluster.client();
        let outbox = Outbox::install(&mut client, &endpoint.unwrap_or_else(|| node.endpoint()));
        let slug: String = case
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        let mut route = rabbit.declare_route(&format!("chaos-{slug}"));
        // The node goes away with its data: nothing to clean up.
        route.delete_on_drop = false;
        drop(rabbit);
        let collector = Collector::start(node.endpoint(), route.queue.clone());
        collector.wait_connected(Duration::from_secs(30));
        cluster.wait_for_worker(&mut client, WORKER_UP);
        let mem = MemWatch::start(&cluster);
        Rig {
            case,
            mem,
            collector,
            route,
            client,
            outbox,
            cluster,
            node,
            ledger: Arc::new(Ledger::new()),
        }
    }

    fn producer_config(&self, name: &str) -> ProducerConfig {
        ProducerConfig::new(
            name,
            self.outbox.broker_id,
            &self.route.exchange,
            &self.route.routing_key,
        )
    }

    /// `n` producers named `<prefix>0..`, publishing until stopped (or `max` committed each).
    fn producers(
        &self,
        prefix: &str,
        n: usize,
        max: u64,
        pause_ms: u64,
        rollback: f64,
    ) -> Vec<Producer> {
        (0..n)
            .map(|i| {
                let mut cfg = self.producer_config(&format!("{prefix}{i}"));
                cfg.max_messages = max;
                cfg.max_batch = 10;
                cfg.rollback_ratio = rollback;
                cfg.pause = Duration::from_millis(pause_ms);
                Producer::spawn(&self.cluster, cfg, self.ledger.clone())
            })
            .collect()
    }

    /// A new connection to the test database (after a crash restart), retried.
    fn reconnect(&mut self) {
        let cluster = &self.cluster;
        self.client = eventually(WORKER_UP, "a connection to the test cluster", || {
            cluster.try_client()
        });
    }

    /// Publishes `key` in a transaction of its own and records it as committed.
    fn publish_key(&mut self, key: &MessageKey) {
        self.outbox.publish(
            &mut self.client,
            &self.route.exchange,
            &self.route.routing_key,
            &key.body(),
        );
        self.ledger.committed([key]);
    }

    /// The route as (broker id, exchange, routing key), and a connection string to the test
    /// database: for the threads that publish on connections of their own.
    fn publish_target(&self) -> ((i32, String, String), String) {
        let route = (
            self.outbox.broker_id,
            self.route.exchange.clone(),
            self.route.routing_key.clone(),
        );
        let conninfo = self
            .cluster
            .connection_string(&self.cluster.config().database);
        (route, conninfo)
    }

    /// Waits until the consumer has `n` more deliveries than `since`; on failure says what the
    /// outbox and the worker's connection looked like.
    fn wait_more_deliveries(&mut self, since: usize, n: usize, what: &str) {
        let collector = &self.collector;
        let r = try_eventually(ARRIVAL, || {
            let now = collector.len();
            if now >= since + n {
                Ok(())
            } else {
                Err(format!(
                    "{} new deliveries (want {n}); consumer connections {}, last consumer error {:?}",
                    now - since,
                    collector.connections(),
                    collector.last_error()
                ))
            }
        });
        if let Err(e) = r {
            let pending = Outbox::pending(&mut self.client);
            let status: Vec<String> = self
                .client
                .query("SELECT row_to_json(s)::text FROM amqp.broker_status s", &[])
                .map(|rows| rows.iter().map(|r| r.get(0)).collect())
                .unwrap_or_default();
            panic!(
                "case {}: timed out after {ARRIVAL:?} waiting for {what}: {e}\n\
                 outbox pending {pending:?}; broker_status {status:?}\n--- server log tail ---\n{}",
                self.case,
                short_tail(&self.cluster.log(), 25)
            );
        }
    }

    fn in_flight(&mut self) -> i64 {
        self.client
            .query_one(
                "SELECT coalesce(sum(in_flight), 0)::bigint FROM amqp.broker_status",
                &[],
            )
            .map(|r| r.get(0))
            .unwrap_or(0)
    }

    fn worker_pid(&mut self) -> Option<i32> {
        self.cluster.worker_pid(&mut self.client).ok().flatten()
    }

    /// Deliveries that are not `finish()` markers (and not bodies the test excluded).
    fn deliveries(&self, exclude: &[&str]) -> Vec<Received> {
        self.collector
            .deliveries()
            .into_iter()
            .filter(|d| {
                let t = d.text();
                !t.starts_with("e2e.marker.") && !exclude.iter().any(|p| t.starts_with(p))
            })
            .collect()
    }

    /// Heal-and-drain, then the checker: resolves unknown outcomes, waits until every committed
    /// message arrived (time to heal measured from `heal_at`), waits until the outbox has no
    /// unparked row, sends a marker through the outbox and waits for it (everything published
    /// earlier is in the queue by then), then records the row of the results table and asserts
    /// lost = 0, phantom = 0, nothing unexpected, duplicates ≤ `max_extra` sharing one
    /// message_id. Bodies starting with one of `exclude` are not judged.
    fn finish(
        &mut self,
        heal_at: Option<Instant>,
        max_extra: usize,
        exclude: &[&str],
        note: &str,
    ) -> Report {
        let unknown_before = self.ledger.count(|o| matches!(o, Outcome::Unknown { .. }));
        let client = &mut self.client;
        let ledger = &self.ledger;
        if unknown_before > 0 {
            eventually(WORKER_UP, "unknown outcomes resolved", || {
                ledger.resolve_unknown(client)
            });
        }
        let unknown_after = ledger.count(|o| matches!(o, Outcome::Unknown { .. }));
        let collector = &self.collector;
        let mut heal = None;
        let arrived = try_eventually(drain_timeout(), || {
            ledger.all_arrived(collector)?;
            heal = heal_at.map(|t| t.elapsed());
            Ok(())
        });
        let mut problems = Vec::new();
        if let Err(e) = &arrived {
            problems.push(format!("not everything arrived: {e}"));
        }
        if let Err(e) = try_eventually(ARRIVAL, || match Outbox::pending(client)? {
            0 => Ok(()),
            n => Err(format!("{n} unparked rows left")),
        }) {
            problems.push(format!("outbox not drained: {e}"));
        }
        if problems.is_empty() {
            let marker = unique_name("marker");
            match self.outbox_publish_raw(&marker) {
                Ok(()) => {
                    if let Err(e) = try_eventually(ARRIVAL, || {
                        if self.collector.has_body(&marker) {
                            Ok(())
                        } else {
                            Err("marker not arrived".to_string())
                        }
                    }) {
                        problems.push(format!("the final marker did not arrive: {e}"));
                    }
                }
                Err(e) => problems.push(format!("cannot publish the final marker: {e}")),
            }
            let _ = try_eventually(ARRIVAL, || match Outbox::pending(&mut self.client)? {
                0 => Ok(()),
                n => Err(format!("{n}")),
            });
        }
        let rows_left = Outbox::rows(&mut self.client).ok();
        let report = self.ledger.check(&self.deliveries(exclude));
        let mut row = ResultRow::from_report(self.case, &report);
        row.heal = heal;
        row.worker_peak_kb = self.mem.peak_kb();
        row.rows_left = rows_left;
        let mut notes = vec![note.to_string()];
        if unknown_before > 0 {
            notes.push(format!(
                "{unknown_before} unknown outcomes, {unknown_after} left unresolved"
            ));
        }
        if !report.unknown_delivered.is_empty() {
            notes.push(format!(
                "{} unresolved-but-delivered",
                report.unknown_delivered.len()
            ));
        }
        let ok = problems.is_empty()
            && report.lost.is_empty()
            && report.phantom.is_empty()
            && report.unexpected.is_empty()
            && report.duplicates_with_differing_ids().is_empty()
            && report.extra_copies() <= max_extra;
        if !ok {
            row.status = "FAIL".into();
        }
        row.note = notes
            .into_iter()
            .filter(|s| !s.is_empty())
            .collect::<Vec<_>>()
            .join("; ");
        row.record();
        eprintln!("{report}");
        if !ok {
            let statuses = Outbox::message_statuses(&mut self.client)
                .map(|v| {
                    v.iter()
                        .take(20)
                        .map(|s| {
                            format!(
                                "id {} {} attempts {} {:?}",
                                s.id, s.state, s.attempts, s.last_error
                            )
                        })
                        .collect::<Vec<_>>()
                        .join("\n")
                })
                .unwrap_or_default();
            panic!(
                "case {}: delivery check failed (at most {max_extra} extra copies allowed)\n\
                 problems: {problems:?}\n{report}\noutbox rows (first 20):\n{statuses}\n\
                 --- server log tail ---\n{}",
                self.case,
                short_tail(&self.cluster.log(), 30)
            );
        }
        report
    }

    fn outbox_publish_raw(&mut self, body: &str) -> Result<(), String> {
        self.client
            .execute(
                "SELECT amqp.publish($1, $2, $3, $4)",
                &[
                    &self.outbox.broker_id,
                    &self.route.exchange,
                    &self.route.routing_key,
                    &body,
                ],
            )
            .map(drop)
            .map_err(|e| e.to_string())
    }
}

/// `Ok` once every backlog message (producers `bl*`, `n` in all) has arrived at least once.
/// Counts distinct keys without cloning the deliveries' headers (1M deliveries).
fn backlog_arrived(ledger: &Ledger, collector: &Collector, n: u64) -> Result<(), String> {
    let got = collector.len();
    if (got as u64) < n {
        return Err(format!("{got} deliveries, {n} backlog messages"));
    }
    let seen: std::collections::BTreeSet<MessageKey> = collector
        .bodies()
        .iter()
        .filter_map(|b| MessageKey::parse(b))
        .filter(|k| k.producer.starts_with("bl"))
        .collect();
    let missing = ledger
        .committed_keys()
        .into_iter()
        .filter(|k| k.producer.starts_with("bl") && !seen.contains(k))
        .take(10)
        .collect::<Vec<_>>();
    if missing.is_empty() && seen.len() as u64 >= n {
        Ok(())
    } else {
        Err(format!(
            "{} of {n} backlog messages arrived; missing e.g. {}",
            seen.len(),
            missing
                .iter()
                .map(|k| k.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ))
    }
}

/// The last `n` lines of a log, each cut to 300 characters.
fn short_tail(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..]
        .iter()
        .map(|l| l.chars().take(300).collect::<String>())
        .collect::<Vec<_>>()
        .join("\n")
}

fn join_all(producers: Vec<Producer>) -> Vec<amqp_outbox_e2e::ProducerStats> {
    producers.into_iter().map(Producer::join).collect()
}

fn published(ps: &[Producer]) -> u64 {
    ps.iter().map(Producer::published).sum()
}

/// Waits until the producers have ended `n` more messages' transactions.
fn wait_published(ps: &[Producer], n: u64, what: &str) {
    let start = published(ps);
    eventually(ARRIVAL, what, || {
        let now = published(ps);
        if now >= start + n {
            Ok(())
        } else {
            Err(format!("{} since", now - start))
        }
    });
}

fn sqlstate(e: &postgres::Error) -> String {
    e.code()
        .map(|c| c.code().to_string())
        .unwrap_or_else(|| format!("no SQLSTATE ({e})"))
}

/// A publish through the outbox in its own transaction, returning the SQLSTATE on error.
fn try_sql(client: &mut Client, sql: &str) -> Result<(), String> {
    client.batch_execute(sql).map_err(|e| sqlstate(&e))
}

// ------------------------------------------------------------------------------------------
// 1. rollback matrix
// ------------------------------------------------------------------------------------------

#[test]
fn case01_rollback_matrix_delivers_no_aborted_message() {
    let mut rig = Rig::new(
        "1 rollback matrix",
        base_config().setting("max_prepared_transactions", 5),
    );
    let (b, ex, rk) = (
        rig.outbox.broker_id,
        rig.route.exchange.clone(),
        rig.route.routing_key.clone(),
    );
    let ledger = rig.ledger.clone();
    let k = |n: u64| MessageKey::new("m", n);
    let publish = |c: &mut Client, key: &MessageKey| {
        c.execute(
            "SELECT amqp.publish($1, $2, $3, $4)",
            &[&b, &ex, &rk, &key.body()],
        )
        .unwrap_or_else(|e| panic!("publish {key}: {e}"));
    };
    // A background stream with 30 % rollbacks.
    let producers = rig.producers("rb", 2, 300, 2, 0.3);
    let c = &mut rig.client;

    // Plain ROLLBACK.
    c.batch_execute("BEGIN").unwrap();
    publish(c, &k(0));
    c.batch_execute("ROLLBACK").unwrap();
    ledger.aborted([&k(0)]);

    // SAVEPOINT; publish; ROLLBACK TO; COMMIT: the outer transaction's messages survive.
    c.batch_execute("BEGIN").unwrap();
    publish(c, &k(1));
    c.batch_execute("SAVEPOINT s").unwrap();
    publish(c, &k(2));
    publish(c, &k(3));
    c.batch_execute("ROLLBACK TO SAVEPOINT s").unwrap();
    publish(c, &k(4));
    c.batch_execute("COMMIT").unwrap();
    ledger.committed([&k(1), &k(4)]);
    ledger.aborted([&k(2), &k(3)]);

    // Nested savepoints: the released inner one goes with the outer one.
    c.batch_execute("BEGIN; SAVEPOINT a").unwrap();
    publish(c, &k(5));
    c.batch_execute("SAVEPOINT b").unwrap();
    publish(c, &k(6));
    c.batch_execute("RELEASE SAVEPOINT b; ROLLBACK TO SAVEPOINT a")
        .unwrap();
    publish(c, &k(7));
    c.batch_execute("COMMIT").unwrap();
    ledger.aborted([&k(5), &k(6)]);
    ledger.committed([&k(7)]);

    // PL/pgSQL EXCEPTION block around a publish.
    c.batch_execute(&format!(
        "DO $$ BEGIN
           BEGIN
             PERFORM amqp.publish({b}, '{ex}', '{rk}', 'm:8');
             RAISE EXCEPTION 'undo';
           EXCEPTION WHEN raise_exception THEN NULL;
           END;
           PERFORM amqp.publish({b}, '{ex}', '{rk}', 'm:9');
         END $$"
    ))
    .unwrap();
    ledger.aborted([&k(8)]);
    ledger.committed([&k(9)]);

    // An error after the publish.
    c.batch_execute("BEGIN").unwrap();
    publish(c, &k(10));
    assert!(c.batch_execute("SELECT 1/0").is_err());
    c.batch_execute("ROLLBACK").unwrap();
    ledger.aborted([&k(10)]);

    // statement_timeout after the publish.
    c.batch_execute("BEGIN; SET LOCAL statement_timeout = '100ms'")
        .unwrap();
    publish(c, &k(11));
    let e = c.batch_execute("SELECT pg_sleep(10)").unwrap_err();
    assert_eq!(sqlstate(&e), "57014", "statement_timeout: {e}");
    c.batch_execute("ROLLBACK").unwrap();
    ledger.aborted([&k(11)]);

    // Two-phase commit: ROLLBACK PREPARED never delivers, COMMIT PREPARED (no commit wake in
    // the publishing session) does.
    c.batch_execute("BEGIN").unwrap();
    publish(c, &k(12));
    c.batch_execute("PREPARE TRANSACTION 'chaos_rb'").unwrap();
    c.batch_execute("ROLLBACK PREPARED 'chaos_rb'").unwrap();
    ledger.aborted([&k(12)]);
    c.batch_execute("BEGIN").unwrap();
    publish(c, &k(13));
    c.batch_execute("PREPARE TRANSACTION 'chaos_cp'").unwrap();
    c.batch_execute("COMMIT PREPARED 'chaos_cp'").unwrap();
    ledger.committed([&k(13)]);

    // pg_terminate_backend of the caller mid-transaction.
    let mut victim = rig.cluster.client();
    let victim_pid: i32 = victim
        .query_one("SELECT pg_backend_pid()", &[])
        .unwrap()
        .get(0);
    victim.batch_execute("BEGIN").unwrap();
    publish(&mut victim, &k(14));
    let c = &mut rig.client;
    let killed: bool = c
        .query_one("SELECT pg_terminate_backend($1, 30000)", &[&victim_pid])
        .unwrap()
        .get(0);
    assert!(killed);
    assert!(
        victim.batch_execute("COMMIT").is_err(),
        "COMMIT on a terminated session must fail"
    );
    ledger.aborted([&k(14)]);

    // The client process killed (SIGKILL) mid-transaction: psql with an open transaction.
    let install = PgInstall::find().unwrap();
    let app = format!("chaos_killed_{}", std::process::id());
    let mut psql = std::process::Command::new(install.bindir.join("psql"))
        .args([
            "-X",
            "-q",
            "-h",
            "127.0.0.1",
            "-p",
            &rig.cluster.port().to_string(),
            "-U",
            "postgres",
            "-d",
            &rig.cluster.config().database,
        ])
        .env("PGAPPNAME", &app)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn psql");
    {
        use std::io::Write;
        let stdin = psql.stdin.as_mut().unwrap();
        writeln!(
            stdin,
            "BEGIN;\nSELECT amqp.publish({b}, '{ex}', '{rk}', 'm:15');"
        )
        .unwrap();
        stdin.flush().unwrap();
    }
    let backend = wait_backend_state(c, &app, "idle in transaction", ARRIVAL);
    psql.kill().expect("SIGKILL psql");
    let _ = psql.wait();
    ledger.aborted([&k(15)]);
    eventually(ARRIVAL, "the killed client's backend to end", || {
        c.batch_execute("SELECT pg_stat_clear_snapshot()")
            .map_err(|e| e.to_string())?;
        let n: i64 = c
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = $1",
                &[&backend],
            )
            .map_err(|e| e.to_string())?
            .get(0);
        if n == 0 {
            Ok(())
        } else {
            Err("still there".into())
        }
    });

    let stats = join_all(producers);
    eprintln!("producers: {stats:?}");
    let report = rig.finish(
        None,
        0,
        &[],
        "savepoint/exception/error/timeout/2PC/terminate/SIGKILL client",
    );
    assert!(report.aborted >= 12, "{report}");
}

// ------------------------------------------------------------------------------------------
// 2. worker killed
// ------------------------------------------------------------------------------------------

#[test]
fn case02_worker_killed_comes_back_and_loses_nothing() {
    let mut rig = Rig::new("2 worker killed", base_config());
    let producers = rig.producers("wk", 3, u64::MAX, 10, 0.05);
    let terminations = 3;
    let mut previous: Option<i32> = None;
    let mut restart_times = Vec::new();
    for kill in 0..=terminations {
        let since = rig.collector.len();
        rig.wait_more_deliveries(since, 200, &format!("deliveries before kill #{kill}"));
        let pid = rig.worker_pid().expect("worker running");
        assert_ne!(Some(pid), previous, "the killed worker is still there");
        let t = Instant::now();
        if kill < terminations {
            // SIGTERM through pg_terminate_backend: the worker must exit non-zero (restart).
            let ok: bool = rig
                .client
                .query_one("SELECT pg_terminate_backend($1)", &[&pid])
                .unwrap()
                .get(0);
            assert!(ok);
        } else {
            // SIGKILL: the postmaster restarts the whole cluster (crash recovery).
            send_signal(pid, libc::SIGKILL).unwrap();
            rig.reconnect();
        }
        let cluster = &rig.cluster;
        let client = &mut rig.client;
        let new = eventually(WORKER_UP, "the worker back", || {
            if client.is_closed() {
                *client = cluster.try_client()?;
            }
            match cluster.worker_pid(client) {
                Ok(Some(p)) if p != pid => Ok(p),
                Ok(other) => Err(format!("worker {other:?}")),
                Err(e) => {
                    if let Ok(c) = cluster.try_client() {
                        *client = c;
                    }
                    Err(e)
                }
            }
        });
        restart_times.push(t.elapsed());
        eprintln!("kill #{kill}: worker {pid} -> {new} in {:?}", t.elapsed());
        previous = Some(pid);
    }
    let heal_at = Instant::now();
    rig.wait_more_deliveries(rig.collector.len(), 200, "deliveries after the last kill");
    let stats = join_all(producers);
    eprintln!("producers: {stats:?}");
    let max_restart = restart_times.iter().max().copied().unwrap_or_default();
    let report = rig.finish(
        Some(heal_at),
        (terminations + 1) * MAX_IN_FLIGHT,
        &[],
        &format!(
            "{terminations}x pg_terminate_backend + 1x kill -9; worker back in max {:.1}s",
            max_restart.as_secs_f64()
        ),
    );
    assert!(report.committed > 1000, "{report}");
    // bgw_restart_time is 5 s; allow for a loaded machine (and crash recovery after kill -9).
    assert!(
        max_restart < Duration::from_secs(30),
        "worker restart took {max_restart:?}"
    );
}

// ------------------------------------------------------------------------------------------
// 3. PostgreSQL crash
// ------------------------------------------------------------------------------------------

#[test]
fn case03_postgres_immediate_stop_under_load() {
    let mut rig = Rig::new("3 PostgreSQL crash", base_config());
    let producers = rig.producers("pc", 4, u64::MAX, 3, 0.1);
    let since = rig.collector.len();
    rig.wait_more_deliveries(since, 500, "deliveries before the crash");
    rig.cluster.stop(StopMode::Immediate);
    rig.cluster.start();
    let heal_at = Instant::now();
    rig.reconnect();
    wait_published(
        &producers,
        500,
        "producers to commit again after the restart",
    );
    let stats = join_all(producers);
    eprintln!("producers: {stats:?}");
    let unknown: u64 = stats.iter().map(|s| s.unknown).sum();
    let report = rig.finish(
        Some(heal_at),
        MAX_IN_FLIGHT + CONSUMER_PREFETCH,
        &[],
        &format!(
            "pg_ctl stop -m immediate + start; {unknown} messages with COMMIT outcome unknown"
        ),
    );
    assert!(report.aborted > 0, "{report}");
}

// ------------------------------------------------------------------------------------------
// 4. broker dies before confirm
// ------------------------------------------------------------------------------------------

#[test]
fn case04_broker_killed_restarted_with_messages_in_flight() {
    let mut rig = Rig::new(
        "4 broker dies before confirm",
        base_config().setting("amqp_outbox.confirm_timeout", 3000),
    );
    let producers = rig.producers("bk", 3, u64::MAX, 10, 0.0);
    let mut seen_in_flight = 0;
    for phase in ["kill -9", "stop_app", "restart"] {
        let since = rig.collector.len();
        rig.wait_more_deliveries(since, 300, &format!("deliveries before {phase}"));
        // Strike while messages are unconfirmed (best effort: a fast broker may be between
        // batches).
        if try_eventually(Duration::from_secs(10), || match rig.in_flight() {
            n if n > 0 => Ok(n),
            _ => Err("none in flight".to_string()),
        })
        .is_ok()
        {
            seen_in_flight += 1;
        }
        match phase {
            "kill -9" => {
                rig.node.signal(libc::SIGKILL).unwrap();
                rig.node.stop(); // reaps the node and waits for its port
                wait_published(&producers, 300, "commits while the broker is dead");
                rig.node.boot();
            }
            "stop_app" => {
                rig.node.stop_app();
                wait_published(&producers, 300, "commits while the app is stopped");
                rig.node.start_app();
            }
            _ => {
                rig.node.stop();
                wait_published(&producers, 300, "commits while the node is stopped");
                rig.node.boot();
            }
        }
        let since = rig.collector.len();
        rig.wait_more_deliveries(since, 300, &format!("deliveries after {phase}"));
    }
    let heal_at = Instant::now();
    let stats = join_all(producers);
    eprintln!("producers: {stats:?}");
    rig.finish(
        Some(heal_at),
        3 * (MAX_IN_FLIGHT + CONSUMER_PREFETCH),
        &[],
        &format!("kill -9 beam, stop_app/start_app, full restart; struck with messages in flight {seen_in_flight}/3"),
    );
}

// ------------------------------------------------------------------------------------------
// 5. connection churn
// ------------------------------------------------------------------------------------------

#[test]
fn case05_connection_churn() {
    let mut rig = Rig::new("5 connection churn", base_config());
    let producers = rig.producers("cc", 3, u64::MAX, 5, 0.0);
    rig.wait_more_deliveries(0, 200, "deliveries before the churn");
    let end = Instant::now() + Duration::from_secs_f64(15.0 * scale().min(4.0));
    let mut closes = 0usize;
    while Instant::now() < end {
        if rig.node.ctl(&["close_all_connections", "chaos"]).is_ok() {
            closes += 1;
        }
        // Fault pacing (not synchronisation): the next close in 0.2–2 s.
        std::thread::sleep(Duration::from_millis(200 + rand::random::<u64>() % 1800));
    }
    let heal_at = Instant::now();
    let since = rig.collector.len();
    rig.wait_more_deliveries(since, 200, "deliveries after the churn");
    let stats = join_all(producers);
    eprintln!("producers: {stats:?}");
    let channel: i64 = rig
        .client
        .query_one("SELECT max(channel)::bigint FROM amqp.broker_status", &[])
        .ok()
        .and_then(|r| r.get::<_, Option<i64>>(0))
        .unwrap_or(-1);
    rig.finish(
        Some(heal_at),
        closes * (MAX_IN_FLIGHT + CONSUMER_PREFETCH),
        &[],
        &format!("{closes} close_all_connections; worker channel number now {channel}"),
    );
}

// ------------------------------------------------------------------------------------------
// 6. unroutable
// ------------------------------------------------------------------------------------------

/// id, attempts, parked, last_error, seconds from created_at to parked_at.
type ParkedRow = (i64, i32, bool, Option<String>, Option<f64>);

#[test]
fn case06_unroutable_is_parked_not_delivered_and_others_flow() {
    let max_attempts = 4;
    let mut rig = Rig::new(
        "6 unroutable",
        base_config()
            .setting("amqp_outbox.max_attempts", max_attempts)
            .setting("amqp_outbox.retry_backoff_min", 200),
    );
    let producers = rig.producers("ur", 2, 600, 10, 0.0);
    let mut ids = Vec::new();
    for i in 0..5u64 {
        let id: i64 = rig
            .client
            .query_one(
                "SELECT amqp.publish_message($1, $2, 'no.such.binding', $3)",
                &[
                    &rig.outbox.broker_id,
                    &rig.route.exchange,
                    &MessageKey::new("u", i).body(),
                ],
            )
            .unwrap()
            .get(0);
        ids.push(id);
    }
    let t0 = Instant::now();
    // Until parked: never deleted (never counted as delivered), attempts grow with backoff.
    let client = &mut rig.client;
    let parked = eventually(ARRIVAL, "the unroutable rows to be parked", || {
        let rows = client
            .query(
                "SELECT id, attempts, parked_at IS NOT NULL, last_error, \
                        extract(epoch FROM parked_at - created_at)::float8 \
                   FROM amqp.message WHERE id = ANY($1) ORDER BY id",
                &[&ids],
            )
            .map_err(|e| e.to_string())?;
        if rows.len() != ids.len() {
            panic!(
                "an unroutable row was deleted (counted as delivered): {} of {} left",
                rows.len(),
                ids.len()
            );
        }
        let all: Vec<ParkedRow> = rows
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
            .collect();
        if all.iter().all(|r| r.2) {
            Ok(all)
        } else {
            Err(format!("{all:?}"))
        }
    });
    eprintln!("parked after {:?}: {parked:?}", t0.elapsed());
    for (id, attempts, _, err, secs) in &parked {
        assert_eq!(
            *attempts, max_attempts,
            "row {id} parked after {attempts} attempts"
        );
        assert!(
            err.as_deref().is_some_and(|e| !e.trim().is_empty()),
            "row {id} parked without an error"
        );
        // Backoff before attempts 2, 3 and 4: 200, 400 and 800 ms, each times a jitter of at
        // least 0.75 (a row is claimed only once its next_attempt_at has passed).
        assert!(
            secs.unwrap_or(0.0) >= 0.75 * 1.4 - 0.005,
            "row {id} parked after {secs:?} s: no backoff between attempts"
        );
    }
    assert!(
        !rig.collector.bodies().iter().any(|b| b.starts_with("u:")),
        "an unroutable message reached the queue"
    );
    // The other messages kept flowing meanwhile.
    let stats: Vec<_> = producers.into_iter().map(Producer::wait).collect();
    eprintln!("producers: {stats:?}");
    rig.ledger.wait_all_arrived(&rig.collector, ARRIVAL);
    // Make the route exist, release the parked rows: they are delivered after all.
    rig.node
        .rabbit()
        .bind_queue(&rig.route.queue, &rig.route.exchange, "no.such.binding");
    let released: i64 = rig
        .client
        .query_one("SELECT amqp.retry_all($1)", &[&rig.outbox.broker_id])
        .unwrap()
        .get(0);
    assert_eq!(released, 5);
    let heal_at = Instant::now();
    let keys: Vec<MessageKey> = (0..5).map(|i| MessageKey::new("u", i)).collect();
    rig.ledger.committed(&keys);
    rig.finish(
        Some(heal_at),
        0,
        &[],
        &format!(
            "5 unroutable parked after {max_attempts} attempts ({:?}), delivered after bind + retry_all",
            parked[0].3.as_deref().unwrap_or("")
        ),
    );
}

// ------------------------------------------------------------------------------------------
// 7. poison messages
// ------------------------------------------------------------------------------------------

#[test]
fn case07_poison_messages_are_parked_without_a_reconnect_storm() {
    let max_attempts = 3;
    let mut node = PrivateRabbit::prepare();
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(node.dir().join("rabbitmq.conf"))
            .unwrap();
        writeln!(f, "max_message_size = 131072").unwrap();
    }
    node.boot();
    let ctl = |args: &[&str]| node.ctl(args).unwrap_or_else(|e| panic!("{e}"));
    ctl(&["add_user", "limited", "limited-pw"]);
    // `limited` may write to the default exchange (acknowledgement records), the
    // acknowledgement queue and the test's own exchanges (e2e.chaos-…), nothing else.
    ctl(&[
        "set_permissions",
        "-p",
        "/",
        "limited",
        ".*",
        "^(amq\\.default|amqp_outbox\\..*|e2e\\.chaos-.*)$",
        ".*",
    ]);
    let mut endpoint = node.endpoint();
    endpoint.username = "limited".into();
    endpoint.password = "limited-pw".into();
    // An exchange that exists but `limited` may not write to.
    let forbidden = {
        let mut r = node.rabbit().declare_route("noperm");
        r.delete_on_drop = false;
        r.exchange.clone()
    };
    let mut rig = Rig::with_node(
        "7 poison messages",
        base_config()
            .setting("amqp_outbox.max_attempts", max_attempts)
            .setting("amqp_outbox.retry_backoff_min", 200),
        node,
        Some(endpoint),
    );
    let log_from = rig.cluster.log().len();
    let producers = rig.producers("ps", 2, 500, 10, 0.0);
    let b = rig.outbox.broker_id;
    let big = format!("big:0:{}", "x".repeat(200_000));
    let poison: Vec<(&str, String, String)> = vec![
        (
            "404",
            "e2e.chaos-missing.x".to_string(),
            "p404:0".to_string(),
        ),
        ("403", forbidden, "p403:0".to_string()),
        ("size", rig.route.exchange.clone(), big),
    ];
    let mut ids = Vec::new();
    for (what, exchange, body) in &poison {
        let id: i64 = rig
            .client
            .query_one(
                "SELECT amqp.publish_message($1, $2, $3, $4)",
                &[&b, exchange, &rig.route.routing_key, body],
            )
            .unwrap()
            .get(0);
        ids.push((*what, id));
    }
    let t0 = Instant::now();
    // Other messages are delivered on time while the poison is retried.
    let stats: Vec<_> = producers.into_iter().map(Producer::wait).collect();
    eprintln!("producers: {stats:?}");
    rig.ledger.wait_all_arrived(&rig.collector, ARRIVAL);
    let good_after = t0.elapsed();
    let client = &mut rig.client;
    let parked = eventually(ARRIVAL, "every poison message parked", || {
        let mut out = Vec::new();
        for (what, id) in &ids {
            let row = client
                .query_opt(
                    "SELECT attempts, parked_at IS NOT NULL, last_error FROM amqp.message WHERE id = $1",
                    &[id],
                )
                .map_err(|e| e.to_string())?
                .unwrap_or_else(|| panic!("poison message {what} (id {id}) was deleted"));
            let (attempts, parked, err): (i32, bool, Option<String>) =
                (row.get(0), row.get(1), row.get(2));
            if !parked {
                return Err(format!("{what} (id {id}): attempts {attempts}, {err:?}"));
            }
            out.push((*what, *id, attempts, err.unwrap_or_default()));
        }
        Ok(out)
    });
    let parked_after = t0.elapsed();
    for (what, id, attempts, err) in &parked {
        eprintln!("poison {what} (id {id}) parked after {attempts} attempts: {err}");
        assert!(*attempts >= max_attempts, "{what}: parked after {attempts}");
        assert!(!err.trim().is_empty(), "{what}: no error recorded");
    }
    let log = rig.cluster.log();
    let connects = count_log_lines(&log, log_from, &["amqp_outbox: broker", "connected to"]);
    let unavailable = count_log_lines(&log, log_from, &["amqp_outbox: broker", "unavailable"]);
    // Each refused attempt may cost a channel (or a connection); a storm would be hundreds.
    let storm_bound = 3 * (max_attempts as usize) * 3 + 10;
    assert!(
        connects + unavailable <= storm_bound,
        "reconnect storm: {connects} connects, {unavailable} unavailable in the log"
    );
    // Discard them on purpose: they move to amqp.discarded.
    for (_, id, _, _) in &parked {
        rig.client
            .execute("SELECT amqp.discard($1, 'chaos test')", &[id])
            .unwrap();
    }
    let errors: Vec<String> = parked
        .iter()
        .map(|(w, _, a, e)| {
            format!(
                "{w}: {a} attempts, {}",
                e.chars().take(60).collect::<String>()
            )
        })
        .collect();
    rig.finish(
        None,
        // Each refused attempt closes the channel; good messages in flight on it are published
        // again (documented: duplicates bounded by max_in_flight per fault).
        3 * (max_attempts as usize) * MAX_IN_FLIGHT,
        &["p404:", "p403:", "big:"],
        &format!(
            "good messages all in {:.1}s, poison parked after {:.1}s; {connects} connects/{unavailable} unavailable log lines; {}",
            good_after.as_secs_f64(),
            parked_after.as_secs_f64(),
            errors.join(" | ")
        ),
    );
    assert!(
        !rig.collector
            .bodies()
            .iter()
            .any(|b| b.starts_with("p404:") || b.starts_with("p403:") || b.starts_with("big:")),
        "a poison message was delivered"
    );
}

// ------------------------------------------------------------------------------------------
// 8. broker hangs
// ------------------------------------------------------------------------------------------

#[test]
fn case08_broker_hang_is_detected_and_healed() {
    let mut rig = Rig::new(
        "8 broker hangs",
        base_config()
            .setting("amqp_outbox.heartbeat", 2)
            .setting("amqp_outbox.confirm_timeout", 3000)
            .setting("amqp_outbox.connect_timeout", 3000),
    );
    let producers = rig.producers("bh", 3, u64::MAX, 5, 0.0);
    rig.wait_more_deliveries(0, 300, "deliveries before the hang");
    let beam = rig.node.beam_pid().expect("beam.smp pid");
    send_signal(beam, libc::SIGSTOP).unwrap();
    let stopped_at = Instant::now();
    // Until the worker has noticed (and at least 3 heartbeats have passed): the worker must
    // never sit in a transaction while the broker hangs.
    let client = &mut rig.client;
    let mut longest_xact = 0.0f64;
    let detected = try_eventually(Duration::from_secs(60), || {
        let row = client
            .query_one(
                "SELECT coalesce(bool_or(NOT connected), false), \
                        (SELECT coalesce(max(extract(epoch FROM now() - xact_start)), 0)::float8 \
                           FROM pg_stat_activity WHERE backend_type = 'amqp_outbox'), \
                        (SELECT string_agg(coalesce(state, '-'), ',') \
                           FROM pg_stat_activity WHERE backend_type = 'amqp_outbox') \
                   FROM amqp.broker_status",
                &[],
            )
            .map_err(|e| e.to_string())?;
        let (disconnected, xact, state): (bool, f64, Option<String>) =
            (row.get(0), row.get(1), row.get(2));
        let _ = client.batch_execute("SELECT pg_stat_clear_snapshot()");
        longest_xact = longest_xact.max(xact);
        if state.as_deref() == Some("idle in transaction") {
            panic!("the worker sits idle in transaction while the broker hangs");
        }
        if disconnected && stopped_at.elapsed() >= Duration::from_secs(6) {
            Ok(stopped_at.elapsed())
        } else {
            Err(format!(
                "disconnected {disconnected}, worker xact age {xact:.1}s, state {state:?}"
            ))
        }
    });
    send_signal(beam, libc::SIGCONT).unwrap();
    let heal_at = Instant::now();
    let detected =
        detected.unwrap_or_else(|e| panic!("the hang was not detected within 60 s: {e}"));
    assert!(
        longest_xact < 5.0,
        "the worker held a transaction for {longest_xact:.1} s while the broker hung"
    );
    let since = rig.collector.len();
    rig.wait_more_deliveries(since, 300, "deliveries after SIGCONT");
    let stats = join_all(producers);
    eprintln!("producers: {stats:?}");
    rig.finish(
        Some(heal_at),
        2 * (MAX_IN_FLIGHT + CONSUMER_PREFETCH),
        &[],
        &format!(
            "SIGSTOP beam {:.1}s (heartbeat 2s, confirm_timeout 3s); disconnect seen by then; worker xact max {longest_xact:.2}s",
            detected.as_secs_f64()
        ),
    );
}

// ------------------------------------------------------------------------------------------
// 9. resource alarm
// ------------------------------------------------------------------------------------------

fn header_seq(d: &Received) -> Option<i64> {
    match d.header("x-amqp-outbox-seq")? {
        serde_json::Value::Number(n) => n.as_i64(),
        serde_json::Value::String(s) => s.parse().ok(),
        _ => None,
    }
}

#[test]
fn case09_resource_alarm_pauses_and_drains() {
    let mut rig = Rig::new("9 resource alarm", base_config());
    let producers = rig.producers("ra", 2, u64::MAX, 5, 0.0);
    rig.wait_more_deliveries(0, 300, "deliveries before the alarm");
    rig.node.ctl(&["set_disk_free_limit", "100000GB"]).unwrap();
    let node = &rig.node;
    eventually(ARRIVAL, "the disk alarm", || {
        let out = node.ctl(&["eval", "rabbit_alarm:get_alarms()."])?;
        if out.contains("disk") {
            Ok(())
        } else {
            Err(out)
        }
    });
    // Publishing pauses: the consumer's count settles and stays.
    let collector = &rig.collector;
    let mut last = usize::MAX;
    eventually(ARRIVAL, "deliveries to stop during the alarm", || {
        let n = collector.len();
        if n == last {
            Ok(())
        } else {
            last = n;
            std::thread::sleep(Duration::from_millis(1500));
            Err(format!("{n} deliveries, still growing"))
        }
    });
    // Meanwhile producers keep committing (publish() never waits on the broker).
    wait_published(&producers, 300, "commits during the alarm");
    let paused_at = rig.collector.len();
    holds_for(
        Duration::from_secs(3),
        "no delivery during the alarm",
        || {
            if collector.len() == paused_at {
                Ok(())
            } else {
                Err(format!(
                    "{} deliveries during the alarm",
                    collector.len() - paused_at
                ))
            }
        },
    )
    .unwrap();
    // The ack listener keeps consuming on its own connection: the acknowledgement queue has
    // its consumer and nothing waiting in it.
    let ack_queue = Outbox::ack_queue_name(&mut rig.client);
    let node = &rig.node;
    let ack_state = eventually(ARRIVAL, "the ack queue consumed during the alarm", || {
        let out = node.ctl(&[
            "list_queues",
            "name",
            "messages_ready",
            "consumers",
            "--quiet",
            "--no-table-headers",
        ])?;
        let line = out
            .lines()
            .find(|l| l.starts_with(&ack_queue))
            .ok_or_else(|| format!("no {ack_queue} in {out}"))?;
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() >= 3 && f[1] == "0" && f[2] != "0" {
            Ok(line.to_string())
        } else {
            Err(format!("ack queue: {line}"))
        }
    });
    // Messages that reached the queue but whose acknowledgement record was blocked by the
    // alarm have no proof yet: they stay (and are counted) until it clears.
    let seqs: Vec<i64> = rig
        .collector
        .deliveries()
        .iter()
        .filter_map(header_seq)
        .collect();
    let unproven: i64 = rig
        .client
        .query_one(
            "SELECT count(*) FROM amqp.message WHERE id = ANY($1)",
            &[&seqs],
        )
        .unwrap()
        .get(0);
    let pending = Outbox::pending(&mut rig.client).unwrap();
    rig.node.ctl(&["set_disk_free_limit", "50MB"]).unwrap();
    let heal_at = Instant::now();
    let since = rig.collector.len();
    rig.wait_more_deliveries(since, 300, "deliveries after the alarm cleared");
    let stats = join_all(producers);
    eprintln!("producers: {stats:?}");
    rig.finish(
        Some(heal_at),
        MAX_IN_FLIGHT,
        &[],
        &format!("disk alarm: publishing paused with {pending} pending; ack listener consuming ({ack_state}); {unproven} delivered-but-unproven rows kept until it cleared"),
    );
}

// ------------------------------------------------------------------------------------------
// 10. outage backlog
// ------------------------------------------------------------------------------------------

/// Publishes `keys` of producer `name` in transactions of `chunk` (one statement each).
fn bulk_publish(
    conninfo: String,
    rig_route: (i32, String, String),
    name: String,
    from: u64,
    to: u64,
    chunk: u64,
    ledger: Arc<Ledger>,
) {
    let mut c = Client::connect(&conninfo, postgres::NoTls).expect("connect");
    let (b, ex, rk) = rig_route;
    let mut i = from;
    while i < to {
        let j = (i + chunk).min(to);
        let (lo, hi) = (i as i64, j as i64 - 1);
        c.batch_execute("BEGIN").unwrap();
        c.execute(
            "SELECT count(amqp.publish($1, $2, $3, $4 || ':' || g)) FROM generate_series($5::bigint, $6::bigint) g",
            &[&b, &ex, &rk, &name, &lo, &hi],
        )
        .unwrap();
        c.batch_execute("COMMIT").unwrap();
        let keys: Vec<MessageKey> = (i..j).map(|s| MessageKey::new(&name, s)).collect();
        ledger.committed(&keys);
        i = j;
    }
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Publishes one message per 20 ms until stopped and returns each publish's latency in ms.
fn latency_probe(
    conninfo: String,
    route: (i32, String, String),
    name: String,
    ledger: Arc<Ledger>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<Vec<f64>> {
    std::thread::spawn(move || {
        let mut c = Client::connect(&conninfo, postgres::NoTls).expect("connect");
        let st = c.prepare("SELECT amqp.publish($1, $2, $3, $4)").unwrap();
        let mut out = Vec::new();
        let mut seq = 0u64;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let key = MessageKey::new(&name, seq);
            seq += 1;
            let t = Instant::now();
            c.execute(&st, &[&route.0, &route.1, &route.2, &key.body()])
                .unwrap();
            out.push(t.elapsed().as_secs_f64() * 1000.0);
            ledger.committed([&key]);
            std::thread::sleep(Duration::from_millis(20));
        }
        out
    })
}

#[test]
#[ignore = "slow: 100k-message backlog (1M with AMQP_OUTBOX_CHAOS_SCALE=10); run by make chaos"]
fn case10_outage_backlog_drains_with_bounded_memory() {
    let mut rig = Rig::new("10 outage backlog", base_config());
    let n = scaled(100_000);
    let (route, conninfo) = rig.publish_target();
    // Baseline publish() latency, broker up.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let probe = latency_probe(
        conninfo.clone(),
        route.clone(),
        "lat0".into(),
        rig.ledger.clone(),
        stop.clone(),
    );
    rig.wait_more_deliveries(0, 100, "baseline probe messages");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut base = probe.join().unwrap();
    let base_p99 = percentile(&mut base, 0.99);

    rig.node.stop_app();
    let t = Instant::now();
    let threads: Vec<_> = (0..2u64)
        .map(|p| {
            let (conninfo, route, ledger) = (conninfo.clone(), route.clone(), rig.ledger.clone());
            std::thread::spawn(move || {
                bulk_publish(conninfo, route, format!("bl{p}"), 0, n / 2, 5000, ledger)
            })
        })
        .collect();
    for th in threads {
        th.join().expect("bulk producer");
    }
    let insert_secs = t.elapsed().as_secs_f64();
    let size_peak: i64 = rig
        .client
        .query_one("SELECT pg_total_relation_size('amqp.message')", &[])
        .unwrap()
        .get(0);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    rig.node.start_app();
    let heal_at = Instant::now();
    let probe = latency_probe(
        conninfo,
        route,
        "lat1".into(),
        rig.ledger.clone(),
        stop.clone(),
    );
    let ledger = rig.ledger.clone();
    let collector = &rig.collector;
    let drained = eventually(
        drain_timeout() + Duration::from_secs(n / 1000),
        "the backlog to drain",
        || {
            // Only the backlog: the latency probe keeps committing while this runs.
            backlog_arrived(&ledger, collector, n)?;
            Ok(heal_at.elapsed())
        },
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut during = probe.join().unwrap();
    let during_p50 = percentile(&mut during, 0.5);
    let during_p99 = percentile(&mut during, 0.99);
    let rate = n as f64 / drained.as_secs_f64();
    let mem = rig.mem.state();
    let report = rig.finish(Some(heal_at), MAX_IN_FLIGHT + CONSUMER_PREFETCH, &[], "");
    rig.client.batch_execute("VACUUM amqp.message").unwrap();
    // The heap is truncated by VACUUM once the rows are gone; the primary key's index keeps
    // its pages (PostgreSQL recycles, not returns, empty btree pages): reported apart.
    let (size_after, index_after): (i64, i64) = {
        let r = rig
            .client
            .query_one(
                "SELECT pg_relation_size('amqp.message'), pg_indexes_size('amqp.message')",
                &[],
            )
            .unwrap();
        (r.get(0), r.get(1))
    };
    let peak_mb = mem.peak_kb.unwrap_or(0) as f64 / 1024.0;
    let summary = format!(
        "{n} backlog inserted in {insert_secs:.1}s; drained at {rate:.0} msg/s ({:.1}s); publish() p99 {base_p99:.1}ms before, p50 {during_p50:.1}/p99 {during_p99:.1}ms during drain; table+indexes {:.1}MB at peak; after VACUUM heap {:.2}MB, indexes {:.2}MB; worker VmHWM {peak_mb:.1}MB",
        drained.as_secs_f64(),
        size_peak as f64 / 1048576.0,
        size_after as f64 / 1048576.0,
        index_after as f64 / 1048576.0,
    );
    eprintln!("case 10: {summary}");
    ResultRow {
        case: "10 backlog metrics".into(),
        messages: report.committed,
        committed: report.committed,
        heal: Some(drained),
        worker_peak_kb: mem.peak_kb,
        rows_left: Some(0),
        status: "INFO".into(),
        note: summary.clone(),
        ..ResultRow::from_report("10", &report)
    }
    .record();
    assert!(
        peak_mb < 512.0,
        "worker memory not bounded: VmHWM {peak_mb:.1} MB for a {n} backlog"
    );
    assert!(
        during_p99 < 1000.0_f64.max(base_p99 * 50.0),
        "publish() latency harmed during the drain: {summary}"
    );
    assert!(
        size_after < 1_048_576,
        "the table's heap did not return to a small size: {summary}"
    );
}

// ------------------------------------------------------------------------------------------
// 11. pinned xmin
// ------------------------------------------------------------------------------------------

#[test]
#[ignore = "slow: a REPEATABLE READ transaction held for minutes under load; run by make chaos"]
fn case11_pinned_xmin_degrades_boundedly() {
    let mut rig = Rig::new("11 pinned xmin", base_config());
    let hold = Duration::from_secs_f64(60.0 * scale().clamp(1.0, 3.0));
    let producers = rig.producers("px", 3, u64::MAX, 5, 0.05);
    rig.wait_more_deliveries(0, 300, "deliveries before pinning xmin");
    let mut holder = rig.cluster.client();
    holder
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM amqp.message")
        .unwrap();
    let start = Instant::now();
    let mut samples = Vec::new(); // (secs, pending, oldest age s, dead tuples, deliveries)
    while start.elapsed() < hold {
        let row = rig
            .client
            .query_one(
                "SELECT (SELECT count(*) FROM amqp.message WHERE parked_at IS NULL), \
                        coalesce((SELECT extract(epoch FROM max(oldest_pending_age)) FROM amqp.outbox_summary), 0)::float8, \
                        coalesce((SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = 'amqp.message'::regclass), 0)",
                &[],
            )
            .unwrap();
        samples.push((
            start.elapsed().as_secs_f64(),
            row.get::<_, i64>(0),
            row.get::<_, f64>(1),
            row.get::<_, i64>(2),
            rig.collector.len(),
        ));
        // Sampling period (a measurement, not a synchronisation).
        std::thread::sleep(Duration::from_secs(2));
    }
    holder.batch_execute("COMMIT").unwrap();
    let heal_at = Instant::now();
    let stats = join_all(producers);
    eprintln!("producers: {stats:?}");
    let max_pending = samples.iter().map(|s| s.1).max().unwrap_or(0);
    let max_age = samples.iter().map(|s| s.2).fold(0.0, f64::max);
    let max_dead = samples.iter().map(|s| s.3).max().unwrap_or(0);
    let rate = |a: &(f64, i64, f64, i64, usize), b: &(f64, i64, f64, i64, usize)| {
        (b.4 - a.4) as f64 / (b.0 - a.0).max(0.001)
    };
    let k = samples.len();
    let (early, late) = if k >= 6 {
        (
            rate(&samples[0], &samples[2]),
            rate(&samples[k - 3], &samples[k - 1]),
        )
    } else {
        (0.0, 0.0)
    };
    let summary = format!(
        "xmin pinned {:.0}s: max pending {max_pending}, max oldest age {max_age:.1}s, dead tuples up to {max_dead}; delivery rate {early:.0}/s early vs {late:.0}/s late",
        hold.as_secs_f64()
    );
    eprintln!("case 11: {summary}");
    rig.finish(Some(heal_at), MAX_IN_FLIGHT, &[], &summary);
    assert!(
        max_pending < 20_000,
        "backlog grew without bound: {summary}"
    );
    assert!(max_age < 60.0, "delivery lag not bounded: {summary}");
}

// ------------------------------------------------------------------------------------------
// 12. lifecycle and config
// ------------------------------------------------------------------------------------------

#[test]
fn case12_lifecycle_and_config() {
    let mut rig = Rig::new(
        "12 lifecycle and config",
        base_config()
            .setting("amqp_outbox.retry_backoff_min", 200)
            .setting("amqp_outbox.retry_backoff_max", 2000),
    );
    let mut seq = 0u64;
    let mut next = || {
        seq += 1;
        MessageKey::new("l", seq)
    };
    let mut notes = Vec::new();

    // (a) Broker down at server start: backoff, no hot loop, delivered once it is up.
    rig.node.stop();
    let from = rig.cluster.log().len();
    rig.cluster.restart();
    rig.reconnect();
    let k = next();
    rig.publish_key(&k);
    let cluster = &rig.cluster;
    eventually(
        ARRIVAL,
        "the worker to report the broker unavailable",
        || {
            if count_log_lines(&cluster.log(), from, &["broker", "unavailable"]) > 0 {
                Ok(())
            } else {
                Err(cluster.log_tail(5))
            }
        },
    );
    let window_from = rig.cluster.log().len();
    let t = Instant::now();
    let window = Duration::from_secs(6);
    // Observation window (counting log lines over a few seconds is the measurement).
    std::thread::sleep(window);
    let lines = count_log_lines(&rig.cluster.log(), window_from, &["amqp_outbox"]);
    notes.push(format!(
        "broker down at start: {lines} log lines in {:.0}s",
        t.elapsed().as_secs_f64()
    ));
    assert!(
        lines <= 10,
        "hot loop while the broker is down: {lines} log lines in {:?}:\n{}",
        t.elapsed(),
        rig.cluster.log_tail(20)
    );
    rig.node.boot();
    rig.collector.wait_for_body(&k.body(), ARRIVAL);

    // (b) Wrong password: one clear line, no password, no hot loop; fixed by UPDATE.
    let secret = unique_name("Pw").replace('.', "-");
    let from = rig.cluster.log().len();
    rig.client
        .execute(
            "UPDATE amqp.broker SET password = $2 WHERE broker_id = $1",
            &[&rig.outbox.broker_id, &secret],
        )
        .unwrap();
    let k = next();
    rig.publish_key(&k);
    let cluster = &rig.cluster;
    eventually(ARRIVAL, "the failed login in the log", || {
        if count_log_lines(&cluster.log(), from, &["broker", "unavailable"]) > 0 {
            Ok(())
        } else {
            Err(cluster.log_tail(5))
        }
    });
    let window_from = rig.cluster.log().len();
    std::thread::sleep(window);
    let log = rig.cluster.log();
    let lines = count_log_lines(&log, window_from, &["amqp_outbox"]);
    let first_line = log[from..]
        .lines()
        .find(|l| l.contains("unavailable"))
        .unwrap_or("")
        .to_string();
    notes.push(format!("wrong password: {lines} log lines in 6s"));
    eprintln!("wrong password reported as: {first_line}");
    assert!(lines <= 10, "hot loop on a wrong password: {lines} lines");
    assert!(!log.contains(&secret), "the password is in the server log");
    let status: Option<String> = rig
        .client
        .query_one(
            "SELECT string_agg(coalesce(last_error, ''), ' ') FROM amqp.broker_status",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(
        !status.unwrap_or_default().contains(&secret),
        "amqp.broker_status shows the password"
    );
    rig.client
        .execute(
            "UPDATE amqp.broker SET password = 'guest' WHERE broker_id = $1",
            &[&rig.outbox.broker_id],
        )
        .unwrap();
    rig.collector.wait_for_body(&k.body(), ARRIVAL);

    // (c) A new host: through a proxy, then directly; the old one is cut.
    let proxy = TcpProxy::start(format!("127.0.0.1:{}", rig.node.port()).parse().unwrap());
    rig.client
        .execute(
            "UPDATE amqp.broker SET port = $2 WHERE broker_id = $1",
            &[&rig.outbox.broker_id, &i32::from(proxy.port())],
        )
        .unwrap();
    let k = next();
    rig.publish_key(&k);
    rig.collector.wait_for_body(&k.body(), ARRIVAL);
    assert!(
        proxy.accepted() > 0,
        "the new host (the proxy) was not used"
    );
    rig.client
        .execute(
            "UPDATE amqp.broker SET port = $2 WHERE broker_id = $1",
            &[&rig.outbox.broker_id, &i32::from(rig.node.port())],
        )
        .unwrap();
    let client = &mut rig.client;
    let node_port = rig.node.port();
    eventually(ARRIVAL, "broker_status on the direct host", || {
        let host: Option<String> = client
            .query_one(
                "SELECT max(host) FROM amqp.broker_status WHERE connected",
                &[],
            )
            .map_err(|e| e.to_string())?
            .get(0);
        match host {
            Some(h) if h.contains(&format!(":{node_port}")) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    proxy.set_mode(ProxyMode::Refuse);
    proxy.cut();
    let k = next();
    rig.publish_key(&k);
    rig.collector.wait_for_body(&k.body(), ARRIVAL);
    drop(proxy);

    // (d) A setting reload: amqp_outbox.enabled off holds messages, on releases them.
    rig.cluster.set_setting("amqp_outbox.enabled", "off");
    rig.cluster.reload();
    let client = &mut rig.client;
    eventually(ARRIVAL, "enabled = off to be visible", || {
        let v: String = client
            .query_one("SHOW amqp_outbox.enabled", &[])
            .map_err(|e| e.to_string())?
            .get(0);
        if v == "off" {
            Ok(())
        } else {
            Err(v)
        }
    });
    let k = next();
    rig.publish_key(&k);
    let collector = &rig.collector;
    let held = holds_for(Duration::from_secs(3), "held while disabled", || {
        if collector.has_body(&k.body()) {
            Err("published while amqp_outbox.enabled = off".into())
        } else {
            Ok(())
        }
    });
    rig.cluster.set_setting("amqp_outbox.enabled", "on");
    rig.cluster.reload();
    rig.collector.wait_for_body(&k.body(), ARRIVAL);
    notes.push(format!(
        "enabled=off reload: {}",
        if held.is_ok() { "held" } else { "NOT held" }
    ));

    // (e) DROP EXTENSION while the worker publishes: refused while messages wait; after they
    // are deleted, no crash; CREATE EXTENSION again works.
    let b = rig.outbox.broker_id;
    rig.client
        .execute(
            "SELECT count(amqp.publish($1, $2, $3, 'drop:' || g)) FROM generate_series(1, 2000) g",
            &[&b, &rig.route.exchange, &rig.route.routing_key],
        )
        .unwrap();
    let worker_before = rig.worker_pid();
    let from = rig.cluster.log().len();
    // Refused while messages wait (they would be lost); dropped once they are deleted on
    // purpose, in the same transaction.
    // (The refused attempt sees a message of its own transaction: the worker may already have
    // delivered the 2,000.)
    let refused = {
        let mut tx = rig.client.transaction().unwrap();
        tx.execute(
            "SELECT amqp.publish($1, $2, $3, 'drop:held')",
            &[&b, &rig.route.exchange, &rig.route.routing_key],
        )
        .unwrap();
        tx.batch_execute("DROP EXTENSION amqp_outbox")
            .expect_err("DROP EXTENSION with messages in the outbox must be refused")
    };
    assert_eq!(
        refused.as_db_error().map(|e| e.code().code().to_string()),
        Some("2BP01".to_string()),
        "{refused}"
    );
    rig.client
        .batch_execute("BEGIN; DELETE FROM amqp.message; DROP EXTENSION amqp_outbox; COMMIT")
        .unwrap();
    let cluster = &rig.cluster;
    eventually(
        ARRIVAL,
        "the worker to notice the dropped extension",
        || {
            let log = cluster.log();
            if count_log_lines(&log, from, &["extension not installed"]) > 0
                || count_log_lines(&log, from, &["worker started"]) > 0
            {
                Ok(())
            } else {
                Err(cluster.log_tail(5))
            }
        },
    );
    let log = rig.cluster.log();
    assert!(
        !log.contains("terminated by signal") && !log.contains("PANIC"),
        "the cluster crashed:\n{}",
        rig.cluster.log_tail(40)
    );
    let log = rig.cluster.log();
    let worker_exits = count_log_lines(&log, from, &["amqp_outbox", "exited with exit code"]);
    let worker_error = log[from..]
        .lines()
        .find(|l| l.contains("amqp_outbox ERROR"))
        .map(|l| l.chars().take(160).collect::<String>());
    create_extension(&mut rig.client);
    let b: i32 = amqp_outbox_e2e::outbox::add_broker(&mut rig.client, &rig.node.endpoint());
    rig.outbox = Outbox { broker_id: b };
    let worker_after = rig.worker_pid();
    let k = next();
    rig.publish_key(&k);
    rig.collector.wait_for_body(&k.body(), ARRIVAL);
    notes.push(format!(
        "DROP EXTENSION mid-publish: no cluster crash, worker {worker_before:?} -> {worker_after:?} ({worker_exits} worker exit(s), error {worker_error:?}), works after CREATE EXTENSION"
    ));
    let log = rig.cluster.log();
    assert!(!log.contains(&secret));
    assert!(
        !log.contains("terminated by signal"),
        "a process died by a signal:\n{}",
        rig.cluster.log_tail(40)
    );
    rig.finish(None, MAX_IN_FLIGHT, &["drop:"], &notes.join("; "));
}

// ------------------------------------------------------------------------------------------
// 13. bad input
// ------------------------------------------------------------------------------------------

#[test]
fn case13_bad_input_is_refused_and_bad_rows_are_parked() {
    let mut rig = Rig::new(
        "13 bad input",
        base_config()
            .setting("amqp_outbox.max_message_size", "'16kB'")
            .setting("amqp_outbox.max_attempts", 3),
    );
    let b = rig.outbox.broker_id;
    let (ex, rk) = (rig.route.exchange.clone(), rig.route.routing_key.clone());
    let long = "x".repeat(256);
    let big = "y".repeat(20_000);
    let before = Outbox::rows(&mut rig.client).unwrap();
    let cases: Vec<(&str, String, &str)> = vec![
        (
            "NULL exchange",
            format!("SELECT amqp.publish({b}, NULL, '{rk}', 'x')"),
            "22004",
        ),
        (
            "NULL routing key",
            format!("SELECT amqp.publish({b}, '{ex}', NULL, 'x')"),
            "22004",
        ),
        (
            "NULL body",
            format!("SELECT amqp.publish({b}, '{ex}', '{rk}', NULL)"),
            "22004",
        ),
        (
            "NULL broker",
            format!("SELECT amqp.publish(NULL, '{ex}', '{rk}', 'x')"),
            "22004",
        ),
        (
            "unknown broker",
            format!("SELECT amqp.publish(9999, '{ex}', '{rk}', 'x')"),
            "42704",
        ),
        (
            "exchange 256 bytes",
            format!("SELECT amqp.publish({b}, '{long}', '{rk}', 'x')"),
            "22001",
        ),
        (
            "routing key 256 bytes",
            format!("SELECT amqp.publish({b}, '{ex}', '{long}', 'x')"),
            "22001",
        ),
        (
            "delivery mode 3",
            format!("SELECT amqp.publish({b}, '{ex}', '{rk}', 'x', 3)"),
            "22023",
        ),
        (
            "headers not an object",
            format!("SELECT amqp.publish_message({b}, '{ex}', '{rk}', 'x', '[1]')"),
            "22023",
        ),
        (
            "body over the cap",
            format!("SELECT amqp.publish({b}, '{ex}', '{rk}', '{big}')"),
            "54000",
        ),
        (
            "bad exchange type",
            format!("SELECT amqp.exchange_declare({b}, 'e', 'nope', false, true, false)"),
            "22023",
        ),
    ];
    let mut failures = Vec::new();
    for (what, sql, want) in &cases {
        match try_sql(&mut rig.client, sql) {
            Ok(()) => failures.push(format!("{what}: accepted, want {want}")),
            Err(got) if got != *want => failures.push(format!("{what}: {got}, want {want}")),
            Err(_) => {}
        }
    }
    let direct = |cols: &str, vals: &str| {
        format!(
            "INSERT INTO amqp.message (broker_id, exchange, routing_key, body{cols}) \
             VALUES ({b}, '{ex}', '{rk}', 'x'::bytea{vals})"
        )
    };
    let direct_cases: Vec<(&str, String, &str)> = vec![
        ("direct: exchange 256 bytes", format!("INSERT INTO amqp.message (broker_id, exchange, routing_key, body) VALUES ({b}, '{long}', '{rk}', 'x')"), "23514"),
        ("direct: delivery mode 5", direct(", delivery_mode", ", 5"), "23514"),
        ("direct: headers array", direct(", headers", ", '[]'"), "23514"),
    ];
    for (what, sql, want) in &direct_cases {
        match try_sql(&mut rig.client, sql) {
            Ok(()) => failures.push(format!("{what}: accepted, want {want}")),
            Err(got) if got != *want => failures.push(format!("{what}: {got}, want {want}")),
            Err(_) => {}
        }
    }
    assert_eq!(
        Outbox::rows(&mut rig.client).unwrap(),
        before,
        "a refused publish inserted a row"
    );
    assert!(failures.is_empty(), "wrong SQLSTATEs: {failures:#?}");

    // A row inserted directly with a body over the cap: parked by the worker, not retried.
    rig.publish_key(&MessageKey::new("g", 0));
    let big_id: i64 = rig
        .client
        .query_one(
            &format!(
                "INSERT INTO amqp.message (broker_id, exchange, routing_key, body) \
                 VALUES ({b}, '{ex}', '{rk}', convert_to('big:0:' || repeat('z', 20000), 'UTF8')) RETURNING id"
            ),
            &[],
        )
        .unwrap()
        .get(0);
    rig.client.batch_execute("SELECT amqp.wake()").unwrap();
    rig.publish_key(&MessageKey::new("g", 1));
    let client = &mut rig.client;
    let (attempts, err) = eventually(ARRIVAL, "the oversize row to be parked", || {
        let row = client
            .query_one(
                "SELECT attempts, parked_at IS NOT NULL, last_error FROM amqp.message WHERE id = $1",
                &[&big_id],
            )
            .map_err(|e| e.to_string())?;
        let (a, p, e): (i32, bool, Option<String>) = (row.get(0), row.get(1), row.get(2));
        if p {
            Ok((a, e.unwrap_or_default()))
        } else {
            Err(format!("attempts {a}, {e:?}"))
        }
    });
    let failed_at = |c: &mut Client| -> i64 {
        c.query_one("SELECT failed FROM amqp.worker_status", &[])
            .unwrap()
            .get(0)
    };
    let f0 = failed_at(&mut rig.client);
    let client = &mut rig.client;
    holds_for(
        Duration::from_secs(3),
        "the parked row is left alone",
        || {
            let a: i32 = client
                .query_one(
                    "SELECT attempts FROM amqp.message WHERE id = $1",
                    &[&big_id],
                )
                .map_err(|e| e.to_string())?
                .get(0);
            if a == attempts {
                Ok(())
            } else {
                Err(format!("attempts {attempts} -> {a}: retried after parking"))
            }
        },
    )
    .unwrap();
    let f1 = failed_at(&mut rig.client);
    assert_eq!(f0, f1, "worker_status.failed grew after parking");
    assert!(
        err.contains("max_message_size") || err.contains("bytes"),
        "{err}"
    );
    let note = format!(
        "{} SQLSTATE cases ok; direct oversize row parked after {attempts} attempt(s): {err}",
        cases.len() + direct_cases.len()
    );
    rig.finish(None, 0, &["big:"], &note);
}

/// Case 13, a row inserted directly for a broker_id that has no `amqp.broker` row (there is no
/// foreign key): FAULTS.md wants directly inserted bad rows parked, not left forever.
/// Ignored in `make test` because it fails on the current product (the row stays `pending`
/// with 0 attempts forever); `make chaos` runs it and reports it.
#[test]
fn case13b_direct_row_for_unknown_broker_is_parked() {
    let mut rig = Rig::new("13b bad input: unknown broker", base_config());
    let (ex, rk) = (rig.route.exchange.clone(), rig.route.routing_key.clone());
    let failed_at = |c: &mut Client| -> i64 {
        c.query_one("SELECT failed FROM amqp.worker_status", &[])
            .unwrap()
            .get(0)
    };
    let f1 = failed_at(&mut rig.client);
    let mut note = String::new();
    // A direct row for a broker that does not exist: what happens to it (reported).
    rig.publish_key(&MessageKey::new("g", 0));
    let orphan: i64 = rig
        .client
        .query_one(
            &format!(
                "INSERT INTO amqp.message (broker_id, exchange, routing_key, body) \
                 VALUES (4242, '{ex}', '{rk}', 'orphan:0') RETURNING id"
            ),
            &[],
        )
        .unwrap()
        .get(0);
    rig.client.batch_execute("SELECT amqp.wake()").unwrap();
    let client = &mut rig.client;
    let orphan_state = try_eventually(Duration::from_secs(20), || {
        let row = client
            .query_opt(
                "SELECT state, attempts, last_error FROM amqp.message_status WHERE id = $1",
                &[&orphan],
            )
            .map_err(|e| e.to_string())?;
        match row {
            None => Ok("deleted (counted as delivered?)".to_string()),
            Some(r) if r.get::<_, String>(0) == "parked" => Ok(format!(
                "parked after {} attempts: {:?}",
                r.get::<_, i32>(1),
                r.get::<_, Option<String>>(2)
            )),
            Some(r) => Err(format!(
                "{} attempts {}",
                r.get::<_, String>(0),
                r.get::<_, i32>(1)
            )),
        }
    });
    let f2 = failed_at(&mut rig.client);
    note.push_str(&format!(
        "; direct row for unknown broker 4242: {}",
        match &orphan_state {
            Ok(s) => s.clone(),
            Err(s) => format!("not parked after 20s ({s})"),
        }
    ));
    assert!(
        f2 - f1 < 50,
        "hot loop on the unknown-broker row: failed grew by {}",
        f2 - f1
    );
    let parked = orphan_state.is_ok();
    if parked {
        rig.client
            .execute("SELECT amqp.discard($1, 'chaos test')", &[&orphan])
            .unwrap();
    } else {
        rig.client
            .execute("DELETE FROM amqp.message WHERE id = $1", &[&orphan])
            .unwrap();
    }
    let mut report_note = note.trim_start_matches("; ").to_string();
    if !parked {
        report_note.push_str(" (deleted by the test to finish the drain)");
    }
    rig.finish(None, 0, &["orphan:"], &report_note);
    assert!(
        !rig.collector.has_body("orphan:0"),
        "a row for an unknown broker was delivered"
    );
    if !parked {
        ResultRow {
            case: "13b bad input: unknown broker".into(),
            status: "FAIL".into(),
            note: format!("PRODUCT GAP: direct row for a missing broker_id never parked: {note}"),
            ..ResultRow::default()
        }
        .record();
    }
    assert!(
        parked,
        "PRODUCT GAP: a row inserted directly with broker_id 4242 (no such broker) is neither \
         parked nor refused: {note}"
    );
}

// ------------------------------------------------------------------------------------------
// 14. privileges and secrets
// ------------------------------------------------------------------------------------------

#[test]
fn case14_privileges_secrets_and_search_path_hijack() {
    let mut rig = Rig::new("14 privileges and secrets", base_config());
    let b = rig.outbox.broker_id;
    let (ex, rk) = (rig.route.exchange.clone(), rig.route.routing_key.clone());
    let mut notes = Vec::new();

    // A broker login with a secret password.
    let secret = unique_name("Sec").replace('.', "-");
    rig.node.ctl(&["add_user", "e2euser", &secret]).unwrap();
    rig.node
        .ctl(&["set_permissions", "-p", "/", "e2euser", ".*", ".*", ".*"])
        .unwrap();
    rig.client
        .execute(
            "UPDATE amqp.broker SET username = 'e2euser', password = $2 WHERE broker_id = $1",
            &[&b, &secret],
        )
        .unwrap();
    rig.publish_key(&MessageKey::new("s", 0));
    rig.collector.wait_for_body("s:0", ARRIVAL);
    // An error path that names the login (a vhost that does not exist), then back.
    let from = rig.cluster.log().len();
    rig.client
        .execute(
            "UPDATE amqp.broker SET vhost = 'nope' WHERE broker_id = $1",
            &[&b],
        )
        .unwrap();
    rig.publish_key(&MessageKey::new("s", 1));
    let cluster = &rig.cluster;
    eventually(ARRIVAL, "the vhost error in the log", || {
        if count_log_lines(&cluster.log(), from, &["unavailable"]) > 0 {
            Ok(())
        } else {
            Err(cluster.log_tail(3))
        }
    });
    rig.client
        .execute(
            "UPDATE amqp.broker SET vhost = '/' WHERE broker_id = $1",
            &[&b],
        )
        .unwrap();
    rig.collector.wait_for_body("s:1", ARRIVAL);

    // A role without grants.
    rig.client
        .batch_execute("CREATE ROLE nogrants LOGIN; CREATE ROLE monitor LOGIN IN ROLE pg_monitor")
        .unwrap();
    let as_role = |role: &str| {
        postgres::Client::connect(
            &rig.cluster
                .connection_string(&rig.cluster.config().database)
                .replace("user=postgres", &format!("user={role}")),
            postgres::NoTls,
        )
        .unwrap()
    };
    let mut nog = as_role("nogrants");
    let mut denied = Vec::new();
    let mut allowed = Vec::new();
    for sql in [
        "SELECT * FROM amqp.broker",
        "SELECT password FROM amqp.broker",
        "SELECT * FROM amqp.message",
        "SELECT * FROM amqp.discarded",
        "UPDATE amqp.broker SET host = 'evil'",
        "DELETE FROM amqp.message",
    ] {
        match nog.batch_execute(sql) {
            Err(e) if sqlstate(&e) == "42501" => denied.push(sql),
            Err(e) => panic!("{sql} as nogrants: {e} (want 42501)"),
            Ok(()) => allowed.push(sql),
        }
    }
    assert!(
        allowed.is_empty(),
        "a role without grants could run: {allowed:?}"
    );
    // Reported, not asserted (roles and privileges are being implemented).
    let publish = nog
        .batch_execute(&format!(
            "SELECT amqp.publish({b}, '{ex}', '{rk}', 'nogrants:0')"
        ))
        .map_err(|e| sqlstate(&e));
    let views = nog
        .batch_execute("SELECT * FROM amqp.broker_status")
        .map_err(|e| sqlstate(&e));
    let setting = nog
        .query_one("SHOW amqp_outbox.database", &[])
        .map(|r| r.get::<_, String>(0))
        .map_err(|e| sqlstate(&e));
    notes.push(format!(
        "nogrants: {} statements denied (42501); publish {:?}, broker_status {:?}, SHOW setting {:?}",
        denied.len(),
        publish,
        views,
        setting
    ));
    let mut mon = as_role("monitor");
    let status: Vec<String> = mon
        .query("SELECT row_to_json(s)::text FROM amqp.broker_status s", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(
        !status.iter().any(|s| s.contains(&secret)),
        "broker_status shows the password to pg_monitor: {status:?}"
    );
    assert!(
        mon.batch_execute("SELECT password FROM amqp.broker")
            .is_err(),
        "pg_monitor can read broker passwords"
    );

    // search_path hijack: public functions and an operator shadowing built-ins, first on the
    // search_path of the publishing session and of the database (the worker's).
    rig.client
        .batch_execute(
            "CREATE TABLE public.hijack_log (fn text, at timestamptz DEFAULT pg_catalog.clock_timestamp());
             GRANT INSERT ON public.hijack_log TO PUBLIC;
             CREATE FUNCTION public.now() RETURNS timestamptz LANGUAGE plpgsql AS
               $$BEGIN INSERT INTO public.hijack_log(fn) VALUES ('now'); RETURN '1999-01-01'; END$$;
             CREATE FUNCTION public.pg_backend_pid() RETURNS int LANGUAGE plpgsql AS
               $$BEGIN INSERT INTO public.hijack_log(fn) VALUES ('pg_backend_pid'); RETURN -1; END$$;
             CREATE FUNCTION public.octet_length(text) RETURNS int LANGUAGE plpgsql AS
               $$BEGIN INSERT INTO public.hijack_log(fn) VALUES ('octet_length(text)'); RETURN 0; END$$;
             CREATE FUNCTION public.octet_length(bytea) RETURNS int LANGUAGE plpgsql AS
               $$BEGIN INSERT INTO public.hijack_log(fn) VALUES ('octet_length(bytea)'); RETURN 0; END$$;
             CREATE FUNCTION public.jsonb_typeof(jsonb) RETURNS text LANGUAGE plpgsql AS
               $$BEGIN INSERT INTO public.hijack_log(fn) VALUES ('jsonb_typeof'); RETURN 'object'; END$$;
             CREATE FUNCTION public.nextval(regclass) RETURNS bigint LANGUAGE plpgsql AS
               $$BEGIN INSERT INTO public.hijack_log(fn) VALUES ('nextval'); RETURN pg_catalog.nextval($1); END$$;
             CREATE FUNCTION public.to_hex(bigint) RETURNS text LANGUAGE plpgsql AS
               $$BEGIN INSERT INTO public.hijack_log(fn) VALUES ('to_hex'); RETURN pg_catalog.to_hex($1); END$$;
             CREATE FUNCTION public.hijack_int4eq(int, int) RETURNS bool LANGUAGE plpgsql AS
               $$BEGIN INSERT INTO public.hijack_log(fn) VALUES ('=(int,int)'); RETURN $1 OPERATOR(pg_catalog.=) $2; END$$;
             CREATE OPERATOR public.= (LEFTARG = int, RIGHTARG = int, FUNCTION = public.hijack_int4eq);
             CREATE FUNCTION public.hijack_int8eq(bigint, bigint) RETURNS bool LANGUAGE plpgsql AS
               $$BEGIN INSERT INTO public.hijack_log(fn) VALUES ('=(bigint,bigint)'); RETURN $1 OPERATOR(pg_catalog.=) $2; END$$;
             CREATE OPERATOR public.= (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = public.hijack_int8eq);",
        )
        .unwrap();
    let db = rig.cluster.config().database.clone();
    rig.client
        .batch_execute(&format!(
            "ALTER DATABASE \"{db}\" SET search_path = public, pg_catalog"
        ))
        .unwrap();
    // A new worker picks the database's search_path up.
    let old = rig.worker_pid().unwrap();
    rig.client
        .execute("SELECT pg_terminate_backend($1)", &[&old])
        .unwrap();
    let cluster = &rig.cluster;
    let client = &mut rig.client;
    eventually(WORKER_UP, "a new worker", || {
        match cluster.worker_pid(client)? {
            Some(p) if p != old => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    let mut hijacked = rig.cluster.client();
    hijacked
        .batch_execute("SET search_path = public, pg_catalog")
        .unwrap();
    let real_pid: i32 = hijacked
        .query_one("SELECT pg_catalog.pg_backend_pid()", &[])
        .unwrap()
        .get(0);
    for i in 0..20u64 {
        let key = MessageKey::new("hj", i);
        hijacked
            .execute(
                "SELECT amqp.publish_message($1, $2, $3, $4, '{\"h\": 1}')",
                &[&b, &ex, &rk, &key.body()],
            )
            .unwrap_or_else(|e| panic!("publish with a hijacked search_path: {e}"));
        rig.ledger.committed([&key]);
    }
    let d = rig.collector.wait_for_body("hj:19", ARRIVAL);
    let pid_header = d.header("x-amqp-outbox-producer-pid").and_then(|v| {
        v.as_i64()
            .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
    });
    let hits: Vec<String> = rig
        .client
        .query("SELECT DISTINCT fn FROM public.hijack_log ORDER BY 1", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    notes.push(format!(
        "search_path hijack (session + database): hijacked built-ins called: {hits:?}"
    ));
    // The worker was restarted once (duplicates bounded by the in-flight window).
    let report = rig.finish(None, MAX_IN_FLIGHT, &["nogrants:"], &notes.join("; "));
    let log = rig.cluster.log();
    assert!(
        !log.contains(&secret),
        "the broker password is in the server log:\n{}",
        log.lines()
            .filter(|l| l.contains(&secret))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(
        pid_header,
        Some(i64::from(real_pid)),
        "producer pid header hijacked"
    );
    assert!(
        hits.is_empty(),
        "a search_path hijack reached the extension: {hits:?}"
    );
    assert!(report.committed >= 22);
}

// ------------------------------------------------------------------------------------------
// 15. TLS
// ------------------------------------------------------------------------------------------

#[test]
#[ignore = "FAULTS.md case 15 (TLS) runs in tests/tests/tls.rs (end to end) and broker/tests/tls.rs (untrusted CA, wrong host name, expired certificate, client certificate, no plaintext fallback); SKIPPED here"]
fn case15_tls_runs_in_tls_rs() {
    skip_loudly(
        "15 TLS",
        "covered by tests/tests/tls.rs and broker/tests/tls.rs, which need their own TLS nodes",
    );
}

// ------------------------------------------------------------------------------------------
// 16. standby
// ------------------------------------------------------------------------------------------

#[test]
fn case16_standby_publishes_nothing_until_promoted() {
    // The primary holds its messages (enabled = off), so its standby has rows to (not) publish.
    let mut rig = Rig::new(
        "16 standby",
        base_config().setting("amqp_outbox.enabled", "off"),
    );
    let (route, conninfo) = rig.publish_target();
    bulk_publish(
        conninfo.clone(),
        route.clone(),
        "sb".into(),
        0,
        200,
        100,
        rig.ledger.clone(),
    );
    let standby = Standby::create(
        &rig.cluster,
        &[("amqp_outbox.enabled", "on"), ("hot_standby", "on")],
    )
    .unwrap_or_else(|e| panic!("cannot create the standby: {e}"));
    // More messages after the base backup: streamed to the standby.
    bulk_publish(
        conninfo,
        route,
        "sb".into(),
        200,
        300,
        50,
        rig.ledger.clone(),
    );
    let mut sc = eventually(ARRIVAL, "the standby to accept connections", || {
        standby.client(&rig.cluster.config().database)
    });
    eventually(ARRIVAL, "the standby to replay every message row", || {
        let row = sc
            .query_one(
                "SELECT pg_is_in_recovery(), (SELECT count(*) FROM amqp.message)",
                &[],
            )
            .map_err(|e| e.to_string())?;
        let (rec, n): (bool, i64) = (row.get(0), row.get(1));
        if rec && n == 300 {
            Ok(())
        } else {
            Err(format!("in recovery {rec}, {n} rows"))
        }
    });
    rig.cluster.stop(StopMode::Fast);
    // The standby: no worker, no publish.
    let collector = &rig.collector;
    holds_for(Duration::from_secs(5), "the standby does nothing", || {
        let _ = sc.batch_execute("SELECT pg_stat_clear_snapshot()");
        let n: i64 = sc
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'amqp_outbox'",
                &[],
            )
            .map_err(|e| e.to_string())?
            .get(0);
        if n > 0 {
            return Err("an amqp_outbox worker runs on the standby".into());
        }
        if !collector.is_empty() {
            return Err(format!(
                "{} messages published from the standby",
                collector.len()
            ));
        }
        Ok(())
    })
    .unwrap();
    standby.promote().unwrap();
    let heal_at = Instant::now();
    rig.client = eventually(ARRIVAL, "a connection to the promoted standby", || {
        standby.client(&rig.cluster.config().database)
    });
    let client = &mut rig.client;
    let pid = eventually(WORKER_UP, "the worker on the promoted standby", || {
        let _ = client.batch_execute("SELECT pg_stat_clear_snapshot()");
        client
            .query_opt(
                "SELECT pid FROM pg_stat_activity WHERE backend_type = 'amqp_outbox'",
                &[],
            )
            .map_err(|e| e.to_string())?
            .map(|r| r.get::<_, i32>(0))
            .ok_or_else(|| "no worker yet".to_string())
    });
    let hwm = proc_status_kb(pid, "VmHWM");
    rig.finish(
        Some(heal_at),
        0,
        &[],
        &format!("standby: no worker and nothing published for 5s; after promotion worker {pid} (VmHWM {hwm:?} kB) published all"),
    );
    drop(standby);
}

// ------------------------------------------------------------------------------------------
// 17. hostile input beside good traffic
// ------------------------------------------------------------------------------------------

/// Rows no publish path accepts but a direct INSERT or an UPDATE can write (headers with a
/// number out of range, 400 digits, 200-deep nesting, a 256-byte name, 200 KB), a queue
/// declaration with such an argument, and 100 messages to a missing exchange, all while two
/// producers publish: every poison row is refused or parked, the producers' messages all
/// arrive, none twice, and the worker keeps its process.
#[test]
fn case17_hostile_input_beside_good_traffic() {
    let mut rig = Rig::new("17 hostile input", base_config());
    let b = rig.outbox.broker_id;
    let (ex, rk) = (rig.route.exchange.clone(), rig.route.routing_key.clone());
    let worker = rig.worker_pid();
    let producers = rig.producers("hg", 2, scaled(1000), 2, 0.0);
    let t0 = Instant::now();
    let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
    let headers = [
        ("1e400", r#"{"f": 1e400}"#.to_string()),
        ("digits", format!(r#"{{"n": 1{}}}"#, "0".repeat(400))),
        ("deep", format!(r#"{{"d": {deep}}}"#)),
        ("name", format!(r#"{{"{}": 1}}"#, "n".repeat(256))),
        ("frame", format!(r#"{{"big": "{}"}}"#, "x".repeat(200_000))),
    ];
    let mut poison = Vec::new();
    for (what, h) in &headers {
        let id: i64 = rig
            .client
            .query_one(
                "INSERT INTO amqp.message (broker_id, exchange, routing_key, body, headers) \
                 VALUES ($1, $2, $3, convert_to('hx:' || $4, 'UTF8'), $5::text::jsonb) RETURNING id",
                &[&b, &ex, &rk, what, h],
            )
            .unwrap_or_else(|e| panic!("INSERT {what}: {e}"))
            .get(0);
        poison.push((*what, id));
    }
    let updated: i64 = {
        let mut tx = rig.client.transaction().unwrap();
        let id: i64 = tx
            .query_one(
                "SELECT amqp.publish_message($1, $2, $3, 'hx:updated')",
                &[&b, &ex, &rk],
            )
            .unwrap()
            .get(0);
        tx.execute(
            "UPDATE amqp.message SET headers = '{\"f\": 1e400}' WHERE id = $1",
            &[&id],
        )
        .unwrap();
        tx.commit().unwrap();
        id
    };
    poison.push(("update", updated));
    let bad_queue = unique_name("hostile_q");
    rig.client
        .execute(
            "INSERT INTO amqp.queue (broker_id, queue, arguments) VALUES ($1, $2, '{\"x\": 1e400}')",
            &[&b, &bad_queue],
        )
        .unwrap();
    let missing = unique_name("hostile_missing_x");
    rig.client
        .execute(
            "SELECT count(amqp.publish($1, $2, $3, 'miss:' || g)) FROM generate_series(1, 100) g",
            &[&b, &missing, &rk],
        )
        .unwrap();

    let stats: Vec<_> = producers.into_iter().map(Producer::wait).collect();
    eprintln!("producers: {stats:?}");
    rig.ledger.wait_all_arrived(&rig.collector, ARRIVAL);
    let good_after = t0.elapsed();
    let client = &mut rig.client;
    for (what, id) in &poison {
        let (attempts, error) = eventually(ARRIVAL, &format!("poison {what} parked"), || {
            let row = client
                .query_one(
                    "SELECT attempts, parked_at IS NOT NULL, last_error FROM amqp.message WHERE id = $1",
                    &[id],
                )
                .map_err(|e| e.to_string())?;
            let (attempts, parked, error): (i32, bool, Option<String>) =
                (row.get(0), row.get(1), row.get(2));
            if parked {
                Ok((attempts, error.unwrap_or_default()))
            } else {
                Err(format!("attempts {attempts}, {error:?}"))
            }
        });
        eprintln!("poison {what} (id {id}) parked after {attempts} attempt(s): {error}");
        assert_eq!(
            attempts, 1,
            "{what}: retrying cannot help, parked at the first attempt"
        );
    }
    let refused: i64 = rig
        .client
        .query_one(
            "SELECT count(*) FROM amqp.message WHERE exchange = $1 AND attempts > 0 \
                AND last_error LIKE '%404%'",
            &[&missing],
        )
        .unwrap()
        .get(0);
    assert_eq!(
        refused, 100,
        "every message to the missing exchange refused with 404"
    );
    assert_eq!(rig.worker_pid(), worker, "the worker restarted");
    rig.client
        .execute(
            "SELECT amqp.discard(id, 'hostile') FROM amqp.message WHERE parked_at IS NOT NULL",
            &[],
        )
        .unwrap();
    rig.client
        .execute("DELETE FROM amqp.message WHERE exchange = $1", &[&missing])
        .unwrap();
    rig.client
        .execute("DELETE FROM amqp.queue WHERE queue = $1", &[&bad_queue])
        .unwrap();
    // No fault of the connection here: not one good message may arrive twice.
    rig.finish(
        None,
        0,
        &["hx:", "miss:"],
        &format!(
            "good messages all in {:.1}s beside 6 poison rows, a poison declaration and 100 \
             messages to a missing exchange; poison parked at the first attempt",
            good_after.as_secs_f64()
        ),
    );
    let delivered_poison = rig
        .collector
        .bodies()
        .iter()
        .filter(|b| b.starts_with("hx:") || b.starts_with("miss:"))
        .count();
    assert_eq!(delivered_poison, 0, "a poison message was delivered");
}

/// Not a FAULTS.md case: the harness's own tools (proxy, memory, results file) work.
#[test]
fn chaos_support_tools_work() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let target = listener.local_addr().unwrap();
    let proxy = TcpProxy::start(target);
    let echo = std::thread::spawn(move || {
        use std::io::{Read, Write};
        let (mut s, _) = listener.accept().unwrap();
        let mut buf = [0u8; 5];
        s.read_exact(&mut buf).unwrap();
        s.write_all(&buf).unwrap();
    });
    {
        use std::io::{Read, Write};
        let mut c = std::net::TcpStream::connect(("127.0.0.1", proxy.port())).unwrap();
        c.write_all(b"hello").unwrap();
        let mut buf = [0u8; 5];
        c.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"hello");
    }
    echo.join().unwrap();
    assert_eq!(proxy.accepted(), 1);
    assert!(proc_status_kb(std::process::id() as i32, "VmHWM").unwrap() > 0);
    let _ = pg_program;
}
