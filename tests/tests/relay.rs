//! The relay (`amqp-outbox-relay`, relay/) as a process, against a private cluster that does not
//! load the library, where a role that is not a superuser ran the plain-SQL install, and the
//! shared RabbitMQ: it publishes what commits and nothing rolled back, reports in the status
//! views, stops cleanly on SIGTERM, comes back after its sessions are terminated, and a second
//! relay takes over when the active one is killed, with nothing lost.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use amqp_outbox_e2e::hosted::{installed, owner_client, DB, OWNER};
use amqp_outbox_e2e::raw_amqp::publish_with_message_id;
use amqp_outbox_e2e::{eventually, eventually_count, AmqpEndpoint, PgCluster, Rabbit, Route};
use amqp_outbox_testkit::amqp_admin::AmqpAdmin;
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use postgres::Client;

/// The relay's program, built with the tests (tests/src/bin).
const RELAY: &str = env!("CARGO_BIN_EXE_e2e-relay");

/// One relay process; killed when dropped. Its stderr goes to a file in the cluster's
/// directory, shown when a test fails.
struct Relay {
    child: Option<Child>,
    log: PathBuf,
}

impl Relay {
    fn start(cluster: &PgCluster, name: &str, settings: &[&str]) -> Relay {
        Relay::start_url(cluster, name, &url(cluster), settings)
    }

    /// A relay that reaches the database at `database_url`.
    fn start_url(cluster: &PgCluster, name: &str, database_url: &str, settings: &[&str]) -> Relay {
        let log = cluster.dir().join(format!("relay-{name}.log"));
        let file = std::fs::File::create(&log).expect("relay log");
        let mut command = Command::new(RELAY);
        command.arg("--database").arg(database_url).arg("--verbose");
        for s in settings {
            command.arg("--set").arg(s);
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("start the relay");
        Relay {
            child: Some(child),
            log,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn wait_for_log(&self, text: &str, timeout: Duration) {
        eventually(timeout, &format!("{text:?} in the relay's log"), || {
            let log = self.log();
            if log.contains(text) {
                Ok(())
            } else {
                Err(log)
            }
        });
    }

    fn signal(&self, signal: libc::c_int) {
        let pid = self.child.as_ref().expect("running").id() as libc::pid_t;
        // SAFETY: a signal to our own child, which has not been reaped.
        unsafe { libc::kill(pid, signal) };
    }

    fn kill9(&mut self) {
        self.signal(libc::SIGKILL);
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
    }

    /// SIGTERM, then the exit status (within `timeout`).
    fn terminate(&mut self, timeout: Duration) -> ExitStatus {
        self.signal(libc::SIGTERM);
        let child = self.child.as_mut().expect("running");
        let started = Instant::now();
        loop {
            if let Some(status) = child.try_wait().expect("wait") {
                self.child = None;
                return status;
            }
            assert!(
                started.elapsed() < timeout,
                "the relay did not stop within {timeout:?} of SIGTERM; its log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            eprintln!("--- relay log {:?} ---\n{}", self.log, self.log());
        }
    }
}

/// The relay's connection string: the install's owner, as documented, and the relay's own
/// application_name (the tests' is left out).
fn url(cluster: &PgCluster) -> String {
    cluster
        .connection_string(DB)
        .replace("user=postgres", &format!("user={OWNER}"))
        .replace("application_name=amqp_outbox_e2e", "")
}

/// The install, broker 1 on the shared RabbitMQ, a queue of its own and its consumer.
struct Fixture {
    cluster: PgCluster,
    route: Route,
    collector: amqp_outbox_e2e::Collector,
    owner: Client,
}

impl Fixture {
    fn new(prefix: &str) -> Fixture {
        let cluster = installed();
        let mut owner = owner_client(&cluster);
        owner
            .batch_execute("INSERT INTO amqp.broker (broker_id, host) VALUES (1, '127.0.0.1')")
            .expect("broker");
        let rabbit = Rabbit::shared();
        let route = rabbit.declare_queue(prefix);
        let collector = rabbit.consume_connected(&route);
        Fixture {
            cluster,
            route,
            collector,
            owner,
        }
    }

    /// Publishes `bodies` in one transaction.
    fn publish(&mut self, bodies: &[String]) {
        let mut t = self.owner.transaction().expect("BEGIN");
        for b in bodies {
            t.execute(
                "SELECT amqp.publish(1, '', $1, $2)",
                &[&self.route.queue, b],
            )
            .expect("publish");
        }
        t.commit().expect("COMMIT");
    }

    /// Waits until every delivered row is deleted.
    fn wait_drained(&mut self) {
        wait_drained(&mut self.owner);
    }

    /// The session serving the database, as `amqp.worker_status` shows it.
    fn relay_pid(&mut self) -> Option<i32> {
        self.owner
            .query_one(
                "SELECT worker_pid FROM amqp.worker_status WHERE state = 'running'",
                &[],
            )
            .ok()
            .and_then(|r| r.get(0))
    }

    fn wait_for_relay(&mut self, other_than: Option<i32>, timeout: Duration) -> i32 {
        eventually(timeout, "a relay serving the database", || {
            match self.relay_pid() {
                Some(pid) if Some(pid) != other_than => Ok(pid),
                other => Err(format!("{other:?}")),
            }
        })
    }

    /// Waits until every body of `expected` arrived; returns the deliveries per body.
    fn wait_delivered(
        &self,
        expected: &HashSet<String>,
        timeout: Duration,
    ) -> HashMap<String, Vec<amqp_outbox_e2e::Received>> {
        eventually(timeout, "every committed message at the consumer", || {
            let mut by_body: HashMap<String, Vec<_>> = HashMap::new();
            for d in self.collector.deliveries() {
                by_body.entry(d.text()).or_default().push(d);
            }
            let missing = expected
                .iter()
                .filter(|b| !by_body.contains_key(*b))
                .count();
            if missing == 0 {
                Ok(by_body)
            } else {
                Err(format!("{missing} of {} missing", expected.len()))
            }
        })
    }
}

/// Waits until the outbox holds nothing: every delivered row deleted, no delayed one waiting.
fn wait_drained(c: &mut Client) {
    eventually(Duration::from_secs(10), "the outbox drained", || {
        let rows: i64 = c
            .query_one(
                "SELECT (SELECT count(*) FROM amqp.message) \
                      + (SELECT count(*) FROM amqp.scheduled_message)",
                &[],
            )
            .map_err(|e| e.to_string())?
            .get(0);
        match rows {
            0 => Ok(()),
            n => Err(format!("{n} rows")),
        }
    });
}

fn bodies(prefix: &str, range: std::ops::Range<usize>) -> Vec<String> {
    range.map(|i| format!("{prefix}-{i}")).collect()
}

#[test]
fn the_relay_publishes_what_commits_reports_and_stops_on_sigterm() {
    let mut f = Fixture::new("relay_basic");
    let mut relay = Relay::start(&f.cluster, "a", &[]);
    let pid = f.wait_for_relay(None, Duration::from_secs(20));

    let mut expected = HashSet::new();
    for t in 0..10 {
        let batch = bodies(&format!("t{t}"), 0..10);
        f.publish(&batch);
        expected.extend(batch);
    }
    // Rolled back, whole and to a savepoint: never sent.
    f.owner
        .batch_execute(&format!(
            "BEGIN; SELECT amqp.publish(1, '', '{q}', 'undone-1'); ROLLBACK; \
             BEGIN; SAVEPOINT s; SELECT amqp.publish(1, '', '{q}', 'undone-2'); \
             ROLLBACK TO SAVEPOINT s; SELECT amqp.publish(1, '', '{q}', 'kept'); COMMIT;",
            q = f.route.queue
        ))
        .expect("rolled back publishes");
    expected.insert("kept".into());

    let delivered = f.wait_delivered(&expected, Duration::from_secs(30));
    assert!(!delivered.contains_key("undone-1") && !delivered.contains_key("undone-2"));
    assert_eq!(delivered.len(), expected.len(), "nothing else arrived");
    for (body, copies) in &delivered {
        assert!(copies[0].message_id.is_some(), "{body} has a message id");
        assert_eq!(copies[0].delivery_mode, Some(2), "{body} is persistent");
    }
    f.wait_drained();
    // The status views: the relay's counters and its broker's connection.
    eventually(Duration::from_secs(5), "the relay's report", || {
        let r = f
            .owner
            .query_one(
                "SELECT worker_pid, published, acknowledged, commit_wakeups, \
                        (SELECT connected FROM amqp.broker_status WHERE broker_id = 1) \
                   FROM amqp.worker_status",
                &[],
            )
            .map_err(|e| e.to_string())?;
        let (p, published, acked, wakeups, connected): (Option<i32>, i64, i64, i64, Option<bool>) =
            (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4));
        if p == Some(pid)
            && published >= 101
            && acked >= 101
            && wakeups > 0
            && connected == Some(true)
        {
            Ok(())
        } else {
            Err(format!(
                "pid {p:?} published {published} acknowledged {acked} wake-ups {wakeups} connected {connected:?}"
            ))
        }
    });

    let status = relay.terminate(Duration::from_secs(10));
    assert!(status.success(), "exit status {status:?}");
    assert!(relay.log().contains("stopped"), "{}", relay.log());
    eventually(Duration::from_secs(5), "the lease released", || {
        match f.relay_pid() {
            None => Ok(()),
            Some(p) => Err(format!("still {p}")),
        }
    });
}

#[test]
fn a_standing_by_relay_takes_over_when_the_active_one_is_killed() {
    let mut f = Fixture::new("relay_takeover");
    let mut first = Relay::start(&f.cluster, "first", &[]);
    let first_pid = f.wait_for_relay(None, Duration::from_secs(20));
    let mut second = Relay::start(&f.cluster, "second", &[]);
    second.wait_for_log("standing by", Duration::from_secs(20));

    // A stream of commits, the active relay killed in the middle of it.
    let mut expected = HashSet::new();
    let mut killed_at = None;
    for i in 0..300 {
        let body = vec![format!("m-{i}")];
        f.publish(&body);
        expected.extend(body);
        if i == 100 {
            first.kill9();
            killed_at = Some(Instant::now());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let took_over = f.wait_for_relay(Some(first_pid), Duration::from_secs(15));
    let after = killed_at.map(|t| t.elapsed());
    assert_ne!(took_over, first_pid);
    let delivered = f.wait_delivered(&expected, Duration::from_secs(60));
    eprintln!("taken over (seen) within {after:?} of the kill");

    // Duplicates are allowed (what the first had in flight), each with its message's id.
    let copies: usize = delivered.values().map(Vec::len).sum();
    assert!(
        copies <= expected.len() + 300,
        "{copies} deliveries for {} messages",
        expected.len()
    );
    for (body, copies) in &delivered {
        let ids: HashSet<_> = copies.iter().map(|d| d.message_id.clone()).collect();
        assert_eq!(ids.len(), 1, "{body}: one message id for every copy");
    }
    f.wait_drained();
    assert!(second.is_running());
}

#[test]
fn the_relay_comes_back_after_its_sessions_are_terminated() {
    let mut f = Fixture::new("relay_cut");
    let sub_queue = Rabbit::shared().declare_queue("relay_cut_sub");
    app_subscription(&mut f.owner, &sub_queue.queue);
    let mut relay = Relay::start(&f.cluster, "a", &[]);
    let pid = f.wait_for_relay(None, Duration::from_secs(20));
    let warm = bodies("before", 0..20);
    f.publish(&warm);
    f.wait_delivered(&warm.iter().cloned().collect(), Duration::from_secs(20));
    let parts = |c: &mut Client| -> Result<(i32, i32), String> {
        let r = c
            .query_one(
                "SELECT subscription_worker_pid, monitor_pid FROM amqp.worker_status",
                &[],
            )
            .map_err(|e| e.to_string())?;
        match (r.get::<_, Option<i32>>(0), r.get::<_, Option<i32>>(1)) {
            (Some(s), Some(m)) => Ok((s, m)),
            other => Err(format!("{other:?}")),
        }
    };
    let before = eventually(
        Duration::from_secs(20),
        "the consuming side and monitor",
        || parts(&mut f.owner),
    );

    // What a DBA's "terminate every session of that application" does: the lease's, the
    // delivery's, the consuming side's and the monitor's.
    let mut admin = f.cluster.client_db(DB);
    let ended: i64 = admin
        .query_one(
            "WITH relay AS MATERIALIZED (SELECT pid FROM pg_stat_activity \
                                          WHERE application_name = 'amqp-outbox-relay') \
             SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM relay",
            &[],
        )
        .expect("terminate")
        .get(0);
    assert!(ended >= 4, "the relay's four sessions: {ended}");
    let after = bodies("after", 0..50);
    f.publish(&after);
    let back = f.wait_for_relay(Some(pid), Duration::from_secs(20));
    assert_ne!(back, pid);
    f.wait_delivered(&after.iter().cloned().collect(), Duration::from_secs(30));
    // The consuming side and the monitor are back too, in new sessions, and handle.
    eventually(
        Duration::from_secs(20),
        "new consuming and monitor sessions",
        || {
            let now = parts(&mut f.owner)?;
            if now.0 != before.0 && now.1 != before.1 {
                Ok(())
            } else {
                Err(format!("{now:?} (before {before:?})"))
            }
        },
    );
    f.owner
        .execute(
            "SELECT amqp.publish(1, '', $1, 'handled-after')",
            &[&sub_queue.queue],
        )
        .expect("publish to the subscription");
    eventually(
        Duration::from_secs(20),
        "handled after the cut",
        || match handled(&mut f.owner, "handled-after") {
            (1, 1) => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    for component in ["subscription worker", "monitor"] {
        let status: String = f
            .owner
            .query_one(
                "SELECT status FROM amqp.health() WHERE component = $1",
                &[&component],
            )
            .expect("health")
            .get(0);
        assert_eq!(status, "ok", "{component}");
    }
    assert!(relay.is_running(), "the process itself went on");
}

#[test]
fn the_command_line_explains_itself_and_refuses_bad_settings() {
    let help = Command::new(RELAY).arg("--help").output().expect("--help");
    assert!(help.status.success());
    let text = String::from_utf8_lossy(&help.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines.len() <= 50,
        "--help fits one screen: {} lines",
        lines.len()
    );
    assert!(lines.iter().all(|l| l.chars().count() <= 100), "{text}");
    assert!(
        text.contains("--database") && text.contains("resend_after"),
        "{text}"
    );

    let bad = Command::new(RELAY)
        .args([
            "--database",
            "postgresql://x@127.0.0.1/y",
            "--set",
            "batch_size=0",
        ])
        .output()
        .expect("bad setting");
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("batch_size"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
    let none = Command::new(RELAY)
        .env_remove("AMQP_OUTBOX_RELAY_DATABASES")
        .env_remove("AMQP_OUTBOX_RELAY_CONFIG")
        .output()
        .expect("no database");
    assert_eq!(none.status.code(), Some(2));
}

#[test]
fn delayed_and_keyed_messages_go_out_through_the_relay_when_due() {
    let mut f = Fixture::new("relay_later");
    let _relay = Relay::start(&f.cluster, "a", &[]);
    f.wait_for_relay(None, Duration::from_secs(20));
    let q = f.route.queue.clone();
    let published_at = Instant::now();
    for (body, after) in [("later-3s", "3 seconds"), ("later-1s", "1 second")] {
        f.owner
            .execute(
                "SELECT amqp.publish_message(1, '', $1, $2, deliver_after => $3::text::interval)",
                &[&q, &body, &after],
            )
            .expect("delayed publish");
    }
    // One key, twice: one message.
    for _ in 0..2 {
        f.owner
            .execute(
                "SELECT amqp.publish_message(1, '', $1, 'keyed', idempotency_key => 'order-42')",
                &[&q],
            )
            .expect("keyed publish");
    }
    let expected: HashSet<String> = ["later-3s", "later-1s", "keyed"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let delivered = f.wait_delivered(&expected, Duration::from_secs(20));
    let at = |body: &str| delivered[body][0].received_at.duration_since(published_at);
    assert!(
        at("later-1s") >= Duration::from_secs(1),
        "{:?}",
        at("later-1s")
    );
    assert!(
        at("later-3s") >= Duration::from_secs(3),
        "{:?}",
        at("later-3s")
    );
    assert!(
        at("later-3s") < Duration::from_secs(10),
        "moved when due: {:?}",
        at("later-3s")
    );
    assert_eq!(delivered["keyed"].len(), 1, "one message for one key");
    let waiting: i64 = f
        .owner
        .query_one("SELECT count(*) FROM amqp.scheduled_message", &[])
        .expect("count")
        .get(0);
    assert_eq!(waiting, 0);
}

#[test]
fn the_relay_connects_over_tls_with_libpqs_sslmodes() {
    assert!(
        amqp_outbox_testkit::openssl_installed(),
        "openssl is not installed (scripts/setup.sh installs it)"
    );
    let pki = amqp_outbox_testkit::Pki::make().expect("certificates");
    let mut f = Fixture::new("relay_tls");
    let read = |name: &str| std::fs::read(pki.path(name)).expect("certificate file");
    f.cluster
        .write_data_file("server.crt", &read("server.pem"), 0o644);
    f.cluster
        .write_data_file("server.key", &read("server.key"), 0o600);
    let mut admin = f.cluster.client_db("postgres");
    // One statement each: a multi-statement string is one transaction block.
    for statement in [
        "ALTER SYSTEM SET ssl_cert_file = 'server.crt'",
        "ALTER SYSTEM SET ssl_key_file = 'server.key'",
        "ALTER SYSTEM SET ssl = on",
        "SELECT pg_reload_conf()",
    ] {
        admin.batch_execute(statement).expect("turn TLS on");
    }
    eventually(Duration::from_secs(10), "ssl = on", || {
        let on: String = f
            .cluster
            .client_db(DB)
            .query_one("SHOW ssl", &[])
            .map_err(|e| e.to_string())?
            .get(0);
        if on == "on" {
            Ok(())
        } else {
            Err(on)
        }
    });
    // The certificate names "localhost".
    let tls_url = url(&f.cluster).replace("host=127.0.0.1", "host=localhost");
    let dir = f.cluster.dir().to_path_buf();
    let start = |name: &str, sslmode: &str, ca: Option<&str>| {
        let log = dir.join(format!("relay-{name}.log"));
        let mut command = Command::new(RELAY);
        command.args(["--database", &format!("{tls_url} sslmode={sslmode}")]);
        if let Some(ca) = ca {
            command
                .arg("--set")
                .arg(format!("postgres_ca_file={}", pki.path(ca)));
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("start the relay");
        Relay {
            child: Some(child),
            log,
        }
    };
    let encrypted = |admin: &mut Client, pid: i32| -> bool {
        admin
            .query_one("SELECT ssl FROM pg_stat_ssl WHERE pid = $1", &[&pid])
            .expect("pg_stat_ssl")
            .get(0)
    };

    // Verifying against a CA that did not sign the server's certificate, or against the
    // system's trust store (which does not know the test CA): refused, with the reason, and
    // nothing served.
    for (name, sslmode, ca) in [
        ("wrong-ca", "require", Some("other_ca.pem")),
        ("system-store", "verify-full", None),
    ] {
        let mut refused = start(name, sslmode, ca);
        refused.wait_for_log("cannot connect", Duration::from_secs(20));
        let log = refused.log();
        assert!(log.to_lowercase().contains("certificate"), "{name}: {log}");
        assert_eq!(f.relay_pid(), None, "{name}: nothing served unverified");
        refused.kill9();
    }

    // `require` without CA certificates, as libpq: encrypted, not verified.
    let mut unverified = start("require", "require", None);
    let pid = f.wait_for_relay(None, Duration::from_secs(20));
    assert!(encrypted(&mut admin, pid), "sslmode=require encrypts");
    unverified.kill9();

    // verify-full with the right CA: served, encrypted, delivering.
    let _relay = start("verify-full", "verify-full", Some("ca.pem"));
    let pid = f.wait_for_relay(Some(pid), Duration::from_secs(20));
    assert!(
        encrypted(&mut admin, pid),
        "the relay's session is encrypted"
    );
    let expected = bodies("tls", 0..20);
    f.publish(&expected);
    f.wait_delivered(&expected.into_iter().collect(), Duration::from_secs(20));
}

#[test]
fn messages_waiting_in_the_extension_move_to_the_plain_sql_install_and_the_relay_delivers_them() {
    // The extension, its worker off: messages waiting, one of them delayed.
    let source =
        PgCluster::new(amqp_outbox_e2e::PgConfig::default().setting("amqp_outbox.enabled", "off"));
    let mut src = source.client();
    src.batch_execute(
        "CREATE EXTENSION amqp_outbox; \
         INSERT INTO amqp.broker (broker_id, host) VALUES (1, '127.0.0.1')",
    )
    .expect("the extension's database");
    let rabbit = Rabbit::shared();
    let route = rabbit.declare_queue("relay_move");
    let mut ids = HashMap::new();
    for i in 0..40 {
        let body = format!("moved-{i}");
        let id: i64 = src
            .query_one(
                "SELECT amqp.publish_message(1, '', $1, $2)",
                &[&route.queue, &body],
            )
            .expect("publish")
            .get(0);
        let message_id: String = src
            .query_one("SELECT message_id FROM amqp.message WHERE id = $1", &[&id])
            .expect("its message id")
            .get(0);
        ids.insert(body, message_id);
    }
    src.execute(
        "SELECT amqp.publish_message(1, '', $1, 'moved-later', deliver_after => '2 seconds')",
        &[&route.queue],
    )
    .expect("delayed publish");
    // The data of the outbox (nothing else lives in this database), as a DBA moving to a
    // hosted service dumps it.
    let path = source.dir().join("outbox.sql").display().to_string();
    source
        .run_client(
            "pg_dump",
            &["--data-only", "-f", &path, &source.config().database],
        )
        .unwrap_or_else(|e| panic!("{e}"));
    drop(src);
    source_worker_off_check(&source);

    // Restored by the install's owner into the plain-SQL install; the relay delivers.
    let target = installed();
    target
        .run_client(
            "psql",
            &[
                "-X",
                "-q",
                "-v",
                "ON_ERROR_STOP=1",
                "-U",
                OWNER,
                "-d",
                DB,
                "-f",
                &path,
            ],
        )
        .unwrap_or_else(|e| panic!("restore into the plain-SQL install: {e}"));
    let collector = rabbit.consume_connected(&route);
    let _relay = Relay::start(&target, "a", &[]);
    let mut expected: HashSet<String> = ids.keys().cloned().collect();
    expected.insert("moved-later".into());
    let arrived = eventually(Duration::from_secs(30), "the moved messages", || {
        let mut seen: HashMap<String, Option<String>> = HashMap::new();
        for d in collector.deliveries() {
            seen.insert(d.text(), d.message_id.clone());
        }
        let missing = expected.iter().filter(|b| !seen.contains_key(*b)).count();
        if missing == 0 {
            Ok(seen)
        } else {
            Err(format!("{missing} missing"))
        }
    });
    for (body, message_id) in &ids {
        assert_eq!(
            arrived[body].as_deref(),
            Some(message_id.as_str()),
            "{body} keeps its message id"
        );
    }
    wait_drained(&mut owner_client(&target));
}

/// The source delivered nothing meanwhile (its worker was off): every message still there.
fn source_worker_off_check(source: &PgCluster) {
    let waiting: i64 = source
        .client()
        .query_one(
            "SELECT (SELECT count(*) FROM amqp.message) + (SELECT count(*) FROM amqp.scheduled_message)",
            &[],
        )
        .expect("count")
        .get(0);
    assert_eq!(waiting, 41, "the source kept every message");
}

/// A role of the application's, its schema `app` with a table the handler writes and the
/// handler (owned by that role): 'fail' raises, 'escape' tries to become the relay's role.
/// Subscribed to `queue` (max_attempts 2) by the install's owner, then given to the role.
fn app_subscription(owner: &mut Client, queue: &str) {
    owner
        .batch_execute(&format!(
            "CREATE ROLE relay_app NOLOGIN; GRANT relay_app TO {OWNER}; \
             GRANT amqp_outbox_consumer TO relay_app; \
             CREATE SCHEMA app; GRANT USAGE, CREATE ON SCHEMA app TO relay_app; \
             CREATE TABLE app.handled (n bigserial, body text, who text); \
             GRANT SELECT, INSERT ON app.handled TO relay_app; \
             GRANT USAGE ON SEQUENCE app.handled_n_seq TO relay_app; \
             CREATE FUNCTION app.on_order(d amqp.delivery) RETURNS void LANGUAGE plpgsql AS $$ \
             BEGIN \
                 IF amqp.body_text(d) = 'fail' THEN \
                     RAISE EXCEPTION 'refused' USING ERRCODE = 'invalid_parameter_value'; \
                 END IF; \
                 IF amqp.body_text(d) = 'escape' THEN RESET ROLE; END IF; \
                 INSERT INTO app.handled (body, who) VALUES (amqp.body_text(d), current_user); \
             END $$; \
             ALTER FUNCTION app.on_order(amqp.delivery) OWNER TO relay_app; \
             SELECT amqp.subscribe('orders', 1, '{queue}', 'app.on_order(amqp.delivery)', \
                                   max_attempts => 2); \
             UPDATE amqp.subscription SET owner = 'relay_app' WHERE subscription = 'orders';"
        ))
        .expect("the application's role, handler and subscription");
}

/// How many rows `app.handled` has, and how many distinct bodies.
fn handled(c: &mut Client, like: &str) -> (i64, i64) {
    let r = c
        .query_one(
            "SELECT count(*), count(DISTINCT body) FROM app.handled WHERE body LIKE $1",
            &[&like],
        )
        .expect("handled");
    (r.get(0), r.get(1))
}

#[test]
fn the_relay_runs_subscriptions_as_their_owners_once_each_across_a_kill() {
    let mut f = Fixture::new("relay_consume");
    let sub_queue = Rabbit::shared().declare_queue("relay_sub");
    app_subscription(&mut f.owner, &sub_queue.queue);
    let fast_retries = ["retry_backoff_min=100ms", "retry_backoff_max=200ms"];
    let mut first = Relay::start(&f.cluster, "first", &fast_retries);
    f.wait_for_relay(None, Duration::from_secs(20));

    // Through the outbox to the subscription's queue, and back in through the relay.
    let publish = |owner: &mut Client, bodies: &[String]| {
        let mut t = owner.transaction().expect("BEGIN");
        for b in bodies {
            t.execute("SELECT amqp.publish(1, '', $1, $2)", &[&sub_queue.queue, b])
                .expect("publish");
        }
        t.commit().expect("COMMIT");
    };
    let specials = ["fail".to_string(), "escape".to_string()];
    publish(&mut f.owner, &bodies("a", 0..60));
    publish(&mut f.owner, &specials);
    eventually(Duration::from_secs(30), "60 handled", || {
        match handled(&mut f.owner, "a-%") {
            (60, 60) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    let owners: Vec<String> = f
        .owner
        .query("SELECT DISTINCT who FROM app.handled", &[])
        .expect("who")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(owners, ["relay_app"], "every handler ran as its owner");
    let status: String = f
        .owner
        .query_one(
            "SELECT status FROM amqp.health() WHERE component = 'subscription worker'",
            &[],
        )
        .expect("health")
        .get(0);
    assert_eq!(
        status, "ok",
        "amqp.health() sees the relay's consuming side"
    );

    // The failing message: kept, retried, dead after its second attempt. The one that tried
    // to become the relay's role: refused by PostgreSQL, its work undone.
    eventually(Duration::from_secs(20), "both specials failed", || {
        let rows = f
            .owner
            .query(
                "SELECT convert_from(body, 'UTF8'), attempts, dead_lettered_at IS NOT NULL, \
                        last_sqlstate, last_error \
                   FROM amqp.inbox_failed ORDER BY 1",
                &[],
            )
            .map_err(|e| e.to_string())?;
        let seen: Vec<(String, i32, bool, String, String)> = rows
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
            .collect();
        match seen.as_slice() {
            [(e, 2, true, es, em), (fl, 2, true, fs, _)]
                if e == "escape" && fl == "fail" && es == "42501" && fs == "22023" =>
            {
                assert!(em.contains("security-definer"), "{em}");
                Ok(())
            }
            other => Err(format!("{other:?}")),
        }
    });
    assert_eq!(
        handled(&mut f.owner, "escape"),
        (0, 0),
        "the escape's work undone"
    );

    // Killed while handling a stream: a second relay takes over; each message handled once.
    let mut second = Relay::start(&f.cluster, "second", &fast_retries);
    second.wait_for_log("standing by", Duration::from_secs(20));
    let stream = bodies("b", 0..300);
    for chunk in stream.chunks(10) {
        publish(&mut f.owner, chunk);
    }
    eventually(
        Duration::from_secs(30),
        "some of the stream handled",
        || match handled(&mut f.owner, "b-%") {
            (n, _) if n >= 30 => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    first.kill9();
    eventually(
        Duration::from_secs(60),
        "the whole stream handled",
        || match handled(&mut f.owner, "b-%") {
            (300, 300) => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(handled(&mut f.owner, "b-%"), (300, 300), "none twice");
    let (delivered, handled_count): (i64, i64) = {
        let r = f
            .owner
            .query_one(
                "SELECT delivered, handled FROM amqp.subscription_status WHERE subscription = 'orders'",
                &[],
            )
            .expect("status");
        (r.get(0), r.get(1))
    };
    assert!(
        handled_count > 0 && delivered >= handled_count,
        "{delivered} {handled_count}"
    );
    assert!(second.is_running());
}

/// A handler that calls `amqp.unsubscribe()` on its own subscription, through the relay: its
/// message is handled, the rest of its batch goes back to the queue (the relay learns that the
/// handler wrote `amqp.subscription` from the handler's own call). Each handler runs with its
/// message's trace context and the relay's bound of time, and the next message's handler
/// without the trace.
#[test]
fn a_handler_that_unsubscribes_itself_through_the_relay_leaves_the_rest_of_its_batch_queued() {
    let mut f = Fixture::new("relay_selfstop_out");
    let rabbit = Rabbit::shared();
    let q = rabbit.declare_queue("relay_selfstop");
    f.owner
        .batch_execute(
            "CREATE SCHEMA stopper; CREATE TABLE stopper.applied (n bigserial, body text, trace text, bound text); \
             CREATE FUNCTION stopper.selfstop(d amqp.delivery) RETURNS void LANGUAGE plpgsql AS $fn$
             BEGIN
                 IF amqp.body_text(d) = 'stop' THEN
                     PERFORM amqp.unsubscribe(d.subscription);
                 END IF;
                 INSERT INTO stopper.applied (body, trace, bound)
                 VALUES (amqp.body_text(d),
                         coalesce(current_setting('amqp_outbox.traceparent', true), ''),
                         current_setting('statement_timeout'));
             END
             $fn$;",
        )
        .expect("handler");
    let trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let _relay = Relay::start(&f.cluster, "selfstop", &[]);
    f.wait_for_relay(None, Duration::from_secs(20));
    // All six in the queue before the subscription starts: they come in one batch. The first
    // carries a trace context.
    let mut t = f.owner.transaction().expect("BEGIN");
    t.execute(
        "SELECT set_config('amqp_outbox.traceparent', $1, true)",
        &[&trace],
    )
    .expect("trace");
    t.execute("SELECT amqp.publish(1, '', $1, 'a')", &[&q.queue])
        .expect("publish");
    t.execute(
        "SELECT set_config('amqp_outbox.traceparent', '', true)",
        &[],
    )
    .expect("no trace");
    for b in ["b", "stop", "c", "d", "e"] {
        t.execute("SELECT amqp.publish(1, '', $1, $2)", &[&q.queue, &b])
            .expect("publish");
    }
    t.commit().expect("COMMIT");
    eventually(
        Duration::from_secs(20),
        "the six messages in the queue",
        || match rabbit.queue_counts(&q.queue)?.map(|c| c.messages) {
            Some(6) => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    f.owner
        .execute(
            "SELECT amqp.subscribe('selfstop', 1, $1, 'stopper.selfstop(amqp.delivery)')",
            &[&q.queue],
        )
        .expect("subscribe");
    eventually(
        Duration::from_secs(30),
        "the subscription gone and the rest back in the queue",
        || {
            let subs: i64 = f
                .owner
                .query_one("SELECT count(*) FROM amqp.subscription", &[])
                .map_err(|e| e.to_string())?
                .get(0);
            let ready = rabbit.queue_counts(&q.queue)?.map(|c| c.messages);
            if subs == 0 && ready == Some(3) {
                Ok(())
            } else {
                Err(format!("{subs} subscription(s), {ready:?} ready"))
            }
        },
    );
    let applied: Vec<(String, String, String)> = f
        .owner
        .query(
            "SELECT body, trace, bound FROM stopper.applied ORDER BY n",
            &[],
        )
        .expect("applied")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let bound = "30s".to_string();
    assert_eq!(
        applied,
        [
            ("a".to_string(), trace.to_string(), bound.clone()),
            ("b".to_string(), String::new(), bound.clone()),
            ("stop".to_string(), String::new(), bound),
        ]
    );
    let failed: i64 = f
        .owner
        .query_one("SELECT count(*) FROM amqp.inbox_failed", &[])
        .expect("failed")
        .get(0);
    assert_eq!(failed, 0);
}

#[test]
fn a_subscription_whose_owner_the_relay_cannot_become_waits_and_says_why() {
    let mut f = Fixture::new("relay_consume_owner");
    let sub_queue = Rabbit::shared().declare_queue("relay_sub_owner");
    app_subscription(&mut f.owner, &sub_queue.queue);
    f.owner
        .batch_execute(&format!("REVOKE relay_app FROM {OWNER}"))
        .expect("revoke");
    let _relay = Relay::start(&f.cluster, "a", &[]);
    f.wait_for_relay(None, Duration::from_secs(20));
    f.owner
        .execute(
            "SELECT amqp.publish(1, '', $1, 'waits')",
            &[&sub_queue.queue],
        )
        .expect("publish");
    eventually(Duration::from_secs(20), "the subscription's error", || {
        let error: Option<String> = f
            .owner
            .query_one(
                "SELECT last_error FROM amqp.subscription_status WHERE subscription = 'orders'",
                &[],
            )
            .map_err(|e| e.to_string())?
            .get(0);
        match error {
            Some(e) if e.contains("cannot run code as its owner") => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    assert_eq!(
        handled(&mut f.owner, "%"),
        (0, 0),
        "nothing ran as the relay's role"
    );
    // Granted again: the subscription runs within seconds, the message still there.
    f.owner
        .batch_execute(&format!("GRANT relay_app TO {OWNER}"))
        .expect("grant");
    eventually(
        Duration::from_secs(30),
        "the waiting message handled",
        || match handled(&mut f.owner, "waits") {
            (1, 1) => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
}

#[test]
fn the_relays_monitor_compensates_a_silent_consumer_as_the_handlers_owner() {
    let mut f = Fixture::new("relay_monitor");
    let sub_queue = Rabbit::shared().declare_queue("relay_monitor_sub");
    app_subscription(&mut f.owner, &sub_queue.queue);
    f.owner
        .batch_execute(
            "CREATE TABLE app.undone (message_id text, who text); \
             GRANT INSERT ON app.undone TO relay_app; \
             CREATE FUNCTION app.undo(original amqp.produced, failure amqp.receipt) RETURNS void \
                 LANGUAGE sql AS $$ INSERT INTO app.undone VALUES (original.message_id, current_user) $$; \
             CREATE FUNCTION app.undo_escaping(original amqp.produced, failure amqp.receipt) \
                 RETURNS void LANGUAGE plpgsql AS $$ \
                 BEGIN RESET ROLE; INSERT INTO app.undone VALUES (original.message_id, current_user); END $$; \
             ALTER FUNCTION app.undo(amqp.produced, amqp.receipt) OWNER TO relay_app; \
             ALTER FUNCTION app.undo_escaping(amqp.produced, amqp.receipt) OWNER TO relay_app; \
             SELECT amqp.on_failure('relay.order', 'app.undo(amqp.produced, amqp.receipt)'); \
             SELECT amqp.on_failure('relay.escape', 'app.undo_escaping(amqp.produced, amqp.receipt)'); \
             UPDATE amqp.compensation_handler SET owner = 'relay_app'; \
             INSERT INTO amqp.monitor_rule (business_type, consumers, late_after, lost_after, action) \
             VALUES ('relay.order', '{shipping}', '1 second', '2 seconds', 'compensate'), \
                    ('relay.escape', '{shipping}', '1 second', '2 seconds', 'compensate');",
        )
        .expect("compensation handlers and rules");
    let _relay = Relay::start(&f.cluster, "a", &["retry_backoff_min=100ms"]);
    f.wait_for_relay(None, Duration::from_secs(20));
    let mut ids = Vec::new();
    for business_type in ["relay.order", "relay.escape"] {
        let id: i64 = f
            .owner
            .query_one(
                "SELECT amqp.publish_message(1, '', $1, 'order', business_type => $2)",
                &[&f.route.queue, &business_type],
            )
            .expect("publish")
            .get(0);
        ids.push(id);
    }
    // Nobody answers for "shipping": lost after 2 s, then compensated as relay_app.
    let undone = eventually(Duration::from_secs(30), "the compensation", || {
        let rows = f
            .owner
            .query("SELECT who FROM app.undone", &[])
            .map_err(|e| e.to_string())?;
        match rows.len() {
            0 => Err("none yet".into()),
            _ => Ok(rows
                .iter()
                .map(|r| r.get::<_, String>(0))
                .collect::<Vec<_>>()),
        }
    });
    assert_eq!(
        undone,
        ["relay_app"],
        "compensated once, as the handler's owner"
    );
    // The one that tried to become the relay's role: refused, kept pending with the error.
    eventually(
        Duration::from_secs(20),
        "the escaping compensation refused",
        || {
            let r = f
                .owner
                .query_one(
                    "SELECT state, attempts, coalesce(last_error, '') FROM amqp.compensation \
                  WHERE business_type = 'relay.escape'",
                    &[],
                )
                .map_err(|e| e.to_string())?;
            let (state, attempts, error): (String, i32, String) = (r.get(0), r.get(1), r.get(2));
            if state == "pending" && attempts >= 1 && error.contains("security-definer") {
                Ok(())
            } else {
                Err(format!("{state} {attempts} {error}"))
            }
        },
    );
    let state: String = f
        .owner
        .query_one(
            "SELECT state FROM amqp.compensation WHERE business_type = 'relay.order'",
            &[],
        )
        .expect("compensation")
        .get(0);
    assert_eq!(state, "done");
    let status: String = f
        .owner
        .query_one(
            "SELECT status FROM amqp.health() WHERE component = 'monitor'",
            &[],
        )
        .expect("health")
        .get(0);
    assert_eq!(status, "ok", "amqp.health() sees the relay's monitor");
}

#[test]
fn the_relay_keeps_each_keys_order_behind_a_failed_message() {
    let mut f = Fixture::new("relay_ordered");
    let sub_queue = Rabbit::shared().declare_queue("relay_ordered_sub");
    app_subscription(&mut f.owner, &sub_queue.queue);
    let ordered_queue = Rabbit::shared().declare_queue("relay_ordered_keys");
    f.owner
        .batch_execute(&format!(
            "CREATE TABLE app.seen (n bigserial, k text, i int); \
             GRANT INSERT ON app.seen TO relay_app; \
             GRANT USAGE ON SEQUENCE app.seen_n_seq TO relay_app; \
             CREATE SEQUENCE app.fail_once; GRANT USAGE ON SEQUENCE app.fail_once TO relay_app; \
             CREATE FUNCTION app.in_order(d amqp.delivery) RETURNS void LANGUAGE plpgsql AS $$ \
             DECLARE m jsonb := amqp.body_text(d)::jsonb; \
             BEGIN \
                 IF m->>'k' = 'k3' AND (m->>'i')::int = 2 AND nextval('app.fail_once') = 1 THEN \
                     RAISE EXCEPTION 'fails once'; \
                 END IF; \
                 INSERT INTO app.seen (k, i) VALUES (m->>'k', (m->>'i')::int); \
             END $$; \
             ALTER FUNCTION app.in_order(amqp.delivery) OWNER TO relay_app; \
             SELECT amqp.subscribe('ordered', 1, '{q}', 'app.in_order(amqp.delivery)', \
                                   ordering => 'business_key'); \
             UPDATE amqp.subscription SET owner = 'relay_app' WHERE subscription = 'ordered';",
            q = ordered_queue.queue
        ))
        .expect("an ordered subscription");
    let _relay = Relay::start(&f.cluster, "a", &["retry_backoff_min=300ms"]);
    f.wait_for_relay(None, Duration::from_secs(20));
    // Five keys, twenty messages each, interleaved, a few per transaction.
    for i in 0..20 {
        let mut t = f.owner.transaction().expect("BEGIN");
        for k in 1..=5 {
            let key = format!("k{k}");
            let body = format!("{{\"k\": \"{key}\", \"i\": {i}}}");
            t.execute(
                "SELECT amqp.publish_message(1, '', $1, $2, business_key => $3)",
                &[&ordered_queue.queue, &body, &key],
            )
            .expect("publish");
        }
        t.commit().expect("COMMIT");
    }
    eventually(Duration::from_secs(60), "100 handled", || {
        let n: i64 = f
            .owner
            .query_one("SELECT count(*) FROM app.seen", &[])
            .map_err(|e| e.to_string())?
            .get(0);
        if n == 100 {
            Ok(())
        } else {
            Err(format!("{n}"))
        }
    });
    let expected: Vec<i32> = (0..20).collect();
    for k in 1..=5 {
        let order: Vec<i32> = f
            .owner
            .query_one(
                "SELECT array_agg(i ORDER BY n) FROM app.seen WHERE k = $1",
                &[&format!("k{k}")],
            )
            .expect("order")
            .get(0);
        assert_eq!(order, expected, "k{k} in its order, each once");
    }
    let failed: i64 = f
        .owner
        .query_one("SELECT nextval('app.fail_once') - 1", &[])
        .expect("fail_once")
        .get(0);
    assert_eq!(
        failed, 2,
        "the failing message failed once and ran again once"
    );
    eventually_count(
        &mut f.owner,
        Duration::from_secs(10),
        "nothing left waiting",
        "SELECT (SELECT count(*) FROM amqp.inbox_waiting) + (SELECT count(*) FROM amqp.inbox_failed)",
        0,
    );
}

#[test]
fn poison_in_the_outbox_and_from_the_broker_stops_nothing_in_the_relay() {
    let mut f = Fixture::new("relay_poison");
    let sub_queue = Rabbit::shared().declare_queue("relay_poison_sub");
    app_subscription(&mut f.owner, &sub_queue.queue);
    let relay = Relay::start(&f.cluster, "a", &[]);
    let pid = f.wait_for_relay(None, Duration::from_secs(20));

    // Rows whose headers AMQP cannot carry, written directly (the table's owner may), beside
    // good ones: parked at their first attempt, the rest delivered once each.
    let mut expected = HashSet::new();
    let before = bodies("before", 0..50);
    f.publish(&before);
    expected.extend(before);
    let mut poison = Vec::new();
    for headers in [
        "'{\"f\": 1e400}'::jsonb",
        "jsonb_build_object('big', repeat('x', 200000))",
        &format!("jsonb_build_object('{}', 1)", "n".repeat(256)),
    ] {
        let id: i64 = f
            .owner
            .query_one(
                &format!(
                    "INSERT INTO amqp.message (broker_id, exchange, routing_key, body, headers) \
                     VALUES (1, '', $1, convert_to('poison', 'UTF8'), {headers}) RETURNING id"
                ),
                &[&f.route.queue],
            )
            .expect("a poisoned row")
            .get(0);
        poison.push(id);
    }
    let after = bodies("after", 0..50);
    f.publish(&after);
    expected.extend(after);
    let delivered = f.wait_delivered(&expected, Duration::from_secs(30));
    assert!(
        !delivered.contains_key("poison"),
        "a poisoned message was sent"
    );
    for (body, copies) in &delivered {
        assert_eq!(copies.len(), 1, "{body} arrived {} times", copies.len());
    }
    for id in &poison {
        eventually(Duration::from_secs(20), "the poison parked", || {
            let r = f
                .owner
                .query_one(
                    "SELECT state, attempts FROM amqp.message_status WHERE id = $1",
                    &[id],
                )
                .map_err(|e| e.to_string())?;
            let (state, attempts): (String, i32) = (r.get(0), r.get(1));
            if state == "parked" && attempts == 1 {
                Ok(())
            } else {
                Err(format!("{state} {attempts}"))
            }
        });
    }

    // Deliveries with NUL characters and bytes that are not UTF-8, beside good ones: each
    // handled, on the same consumer connection.
    let admin = AmqpAdmin::connect(&AmqpEndpoint::shared().uri()).expect("AMQP client");
    let mut headers = FieldTable::default();
    headers.insert("k".into(), AMQPValue::LongString("a\0b".into()));
    headers.insert("n\0ame".into(), AMQPValue::LongString("v".into()));
    admin
        .publish("", &sub_queue.queue, b"good-1", BasicProperties::default())
        .expect("good-1");
    admin
        .publish(
            "",
            &sub_queue.queue,
            b"nul",
            BasicProperties::default()
                .with_message_id("id\0nul".into())
                .with_correlation_id("corr\0id".into())
                .with_headers(headers),
        )
        .expect("nul");
    publish_with_message_id(
        &AmqpEndpoint::shared(),
        "",
        &sub_queue.queue,
        b"bad\xff\xfeid",
        b"not-utf8",
    )
    .expect("not-utf8");
    admin
        .publish("", &sub_queue.queue, b"good-2", BasicProperties::default())
        .expect("good-2");
    eventually(
        Duration::from_secs(20),
        "the four handled",
        || match handled(&mut f.owner, "%") {
            (4, 4) => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    assert_eq!(f.relay_pid(), Some(pid), "the relay's session was replaced");
    let log = relay.log();
    assert!(
        !log.contains("stopped, starting again"),
        "a part of the relay started again:\n{log}"
    );
}

#[test]
fn a_relay_whose_network_hangs_loses_nothing_and_another_takes_over_when_its_session_ends() {
    use amqp_outbox_e2e::chaos::{ProxyMode, TcpProxy};
    let mut f = Fixture::new("relay_hang");
    let proxy = TcpProxy::start(([127, 0, 0, 1], f.cluster.port()).into());
    let through_proxy = url(&f.cluster).replace(
        &format!("port={}", f.cluster.port()),
        &format!("port={}", proxy.port()),
    );
    let mut hung = Relay::start_url(&f.cluster, "hung", &through_proxy, &[]);
    let hung_pid = f.wait_for_relay(None, Duration::from_secs(20));
    let standing_by = Relay::start(&f.cluster, "standing-by", &[]);
    standing_by.wait_for_log("standing by", Duration::from_secs(20));
    let first = bodies("first", 0..50);
    f.publish(&first);
    let mut expected: HashSet<String> = first.into_iter().collect();
    f.wait_delivered(&expected, Duration::from_secs(30));

    // Every byte between the active relay and PostgreSQL held, no connection closed: the server
    // sees a live peer (its keepalives are answered), so the lock stays with the hung session
    // and nothing is delivered meanwhile; nothing is lost either.
    proxy.set_mode(ProxyMode::Stall);
    let second = bodies("second", 0..50);
    f.publish(&second);
    expected.extend(second);
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(
        f.relay_pid(),
        Some(hung_pid),
        "the lock moved while its session lived"
    );

    // The server ends the dead session (here the hung connections are cut, as the server's TCP
    // keepalive does when packets are dropped, or a restart): the standing-by relay takes over
    // and delivers what waited.
    proxy.cut();
    proxy.set_mode(ProxyMode::Refuse);
    let took_over = f.wait_for_relay(Some(hung_pid), Duration::from_secs(20));
    assert_ne!(took_over, hung_pid);
    let delivered = f.wait_delivered(&expected, Duration::from_secs(30));
    for (body, copies) in &delivered {
        assert!(copies.len() <= 2, "{body} arrived {} times", copies.len());
    }
    // The hung relay lives on, and stands by once it reaches the database again.
    proxy.set_mode(ProxyMode::Pass);
    eventually(
        Duration::from_secs(30),
        "the hung relay standing by again",
        || {
            let log = hung.log();
            if log.matches("standing by").count() >= 1 && log.contains("lost the lease") {
                Ok(())
            } else {
                Err(log)
            }
        },
    );
    assert!(hung.is_running(), "the hung relay exited:\n{}", hung.log());
}

#[test]
fn the_relay_follows_a_failover_to_the_promoted_standby() {
    use amqp_outbox_e2e::chaos::Standby;
    use amqp_outbox_e2e::StopMode;
    let mut f = Fixture::new("relay_failover");
    let standby = Standby::create(&f.cluster, &[("hot_standby", "on")])
        .unwrap_or_else(|e| panic!("cannot create the standby: {e}"));
    eventually(
        Duration::from_secs(30),
        "the standby accepting connections",
        || standby.client(DB),
    );
    // Both servers in one connection string; the relay connects to the one that takes writes.
    let both = format!(
        "host=127.0.0.1,127.0.0.1 port={},{} user={OWNER} dbname={DB} connect_timeout=3 \
         target_session_attrs=read-write",
        f.cluster.port(),
        standby.port()
    );
    let _relay = Relay::start_url(&f.cluster, "a", &both, &[]);
    f.wait_for_relay(None, Duration::from_secs(20));
    let before = bodies("before", 0..50);
    f.publish(&before);
    let mut expected: HashSet<String> = before.into_iter().collect();
    f.wait_delivered(&expected, Duration::from_secs(30));
    f.wait_drained();
    // The standby has everything (the deletes of delivered rows too), then the primary dies.
    let lsn: String = f
        .owner
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .expect("lsn")
        .get(0);
    let mut sc = standby.client(DB).expect("the standby");
    eventually(Duration::from_secs(30), "the standby caught up", || {
        let caught: bool = sc
            .query_one(
                "SELECT pg_last_wal_replay_lsn() >= $1::text::pg_lsn",
                &[&lsn],
            )
            .map_err(|e| e.to_string())?
            .get(0);
        if caught {
            Ok(())
        } else {
            Err("behind".into())
        }
    });
    f.cluster.stop(StopMode::Immediate);
    standby.promote().expect("promote");
    let mut promoted = eventually(Duration::from_secs(30), "the promoted standby", || {
        let mut c = Client::connect(
            &standby
                .connection_string(DB)
                .replace("user=postgres", &format!("user={OWNER}")),
            postgres::NoTls,
        )
        .map_err(|e| e.to_string())?;
        let ro: String = c
            .query_one("SHOW transaction_read_only", &[])
            .map_err(|e| e.to_string())?
            .get(0);
        if ro == "off" {
            Ok(c)
        } else {
            Err("still read-only".into())
        }
    });
    let after = bodies("after", 0..50);
    let mut t = promoted.transaction().expect("BEGIN");
    for b in &after {
        t.execute("SELECT amqp.publish(1, '', $1, $2)", &[&f.route.queue, b])
            .expect("publish on the promoted standby");
    }
    t.commit().expect("COMMIT");
    expected.extend(after);
    let delivered = f.wait_delivered(&expected, Duration::from_secs(60));
    for (body, copies) in &delivered {
        assert_eq!(copies.len(), 1, "{body} arrived {} times", copies.len());
    }
    wait_drained(&mut promoted);
}

#[test]
fn a_broker_restart_under_the_relay_loses_nothing_and_handles_nothing_twice() {
    use amqp_outbox_e2e::PrivateRabbit;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let mut node = PrivateRabbit::start();
    let mut route = node.rabbit().declare_queue("relay_churn");
    route.delete_on_drop = false; // the node goes away with its data
    let cluster = installed();
    let mut owner = owner_client(&cluster);
    owner
        .execute(
            "INSERT INTO amqp.broker (broker_id, host, port) VALUES (1, '127.0.0.1', $1)",
            &[&i32::from(node.port())],
        )
        .expect("broker");
    app_subscription(&mut owner, &route.queue);
    let _relay = Relay::start(
        &cluster,
        "a",
        &["retry_backoff_min=100ms", "retry_backoff_max=1s"],
    );
    eventually(Duration::from_secs(20), "the relay serving", || {
        owner
            .query_one(
                "SELECT worker_pid FROM amqp.worker_status WHERE state = 'running'",
                &[],
            )
            .map_err(|e| e.to_string())
            .map(drop)
    });

    // Ten messages a transaction, through the outbox to the subscription's queue, until told.
    let stop = Arc::new(AtomicBool::new(false));
    let producer = {
        let stop = stop.clone();
        let mut c = owner_client(&cluster);
        let queue = route.queue.clone();
        std::thread::spawn(move || {
            let mut batches = 0;
            while !stop.load(Ordering::Relaxed) {
                let mut t = c.transaction().expect("BEGIN");
                for i in 0..10 {
                    let body = format!("m-{batches}-{i}");
                    t.execute("SELECT amqp.publish(1, '', $1, $2)", &[&queue, &body])
                        .expect("publish");
                }
                t.commit().expect("COMMIT");
                batches += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            batches
        })
    };
    let wait_more = |owner: &mut Client, more: i64, what: &str| {
        let from = handled(owner, "m-%").0;
        eventually(Duration::from_secs(60), what, || {
            let (n, _) = handled(owner, "m-%");
            if n >= from + more {
                Ok(())
            } else {
                Err(format!("{} more", n - from))
            }
        });
    };
    wait_more(&mut owner, 200, "200 handled before the restart");
    node.stop();
    std::thread::sleep(Duration::from_secs(2));
    node.boot();
    wait_more(&mut owner, 200, "200 more handled after the restart");
    stop.store(true, Ordering::Relaxed);
    let batches = producer.join().expect("producer");
    let total = i64::from(batches) * 10;
    eventually(
        Duration::from_secs(60),
        "every message handled",
        || match handled(&mut owner, "m-%") {
            (n, d) if n == total && d == total => Ok(()),
            other => Err(format!("{other:?} of {total}")),
        },
    );
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(handled(&mut owner, "m-%"), (total, total), "none twice");
    eprintln!("{total} messages across a broker restart");
}

#[test]
fn a_subscription_with_a_parallelism_is_handled_by_several_lanes_each_message_once() {
    let mut f = Fixture::new("relay_lanes");
    let sub_queue = Rabbit::shared().declare_queue("relay_lanes_sub");
    app_subscription(&mut f.owner, &sub_queue.queue);
    let wide_queue = Rabbit::shared().declare_queue("relay_lanes_wide");
    f.owner
        .batch_execute(&format!(
            "CREATE TABLE app.lanes (body text, backend int); \
             GRANT INSERT ON app.lanes TO relay_app; \
             CREATE FUNCTION app.slow(d amqp.delivery) RETURNS void LANGUAGE sql AS $$ \
                 SELECT pg_sleep(0.2); \
                 INSERT INTO app.lanes VALUES (amqp.body_text(d), pg_backend_pid()) $$; \
             ALTER FUNCTION app.slow(amqp.delivery) OWNER TO relay_app; \
             SELECT amqp.subscribe('wide', 1, '{q}', 'app.slow(amqp.delivery)', \
                                   parallelism => 4); \
             UPDATE amqp.subscription SET owner = 'relay_app' WHERE subscription = 'wide';",
            q = wide_queue.queue
        ))
        .expect("a subscription with parallelism 4");
    let _relay = Relay::start(&f.cluster, "a", &[]);
    f.wait_for_relay(None, Duration::from_secs(20));
    let mut t = f.owner.transaction().expect("BEGIN");
    for i in 0..24 {
        t.execute(
            "SELECT amqp.publish(1, '', $1, $2)",
            &[&wide_queue.queue, &format!("w-{i}")],
        )
        .expect("publish");
    }
    t.commit().expect("COMMIT");
    let (rows, distinct, backends) = eventually(Duration::from_secs(60), "24 handled", || {
        let r = f
            .owner
            .query_one(
                "SELECT count(*), count(DISTINCT body), count(DISTINCT backend) FROM app.lanes",
                &[],
            )
            .map_err(|e| e.to_string())?;
        let (rows, distinct, backends): (i64, i64, i64) = (r.get(0), r.get(1), r.get(2));
        if rows >= 24 {
            Ok((rows, distinct, backends))
        } else {
            Err(format!("{rows}"))
        }
    });
    assert_eq!((rows, distinct), (24, 24), "each message handled once");
    assert!(backends >= 2, "handled by {backends} session(s): no lanes");
    eventually(Duration::from_secs(10), "nothing left waiting", || {
        let n: i64 = f
            .owner
            .query_one("SELECT count(*) FROM amqp.inbox_waiting", &[])
            .map_err(|e| e.to_string())?
            .get(0);
        if n == 0 {
            Ok(())
        } else {
            Err(format!("{n}"))
        }
    });
}

#[test]
fn a_message_answered_through_the_relay_completes_its_reconciliation() {
    let mut f = Fixture::new("relay_reconcile");
    let sub_queue = Rabbit::shared().declare_queue("relay_reconcile_sub");
    app_subscription(&mut f.owner, &sub_queue.queue);
    // Receipts go to an exchange of this test's, collected back into this database.
    let receipts = format!("{}.receipts", sub_queue.queue);
    let mut admin = f.cluster.client_db(DB);
    admin
        .batch_execute(&format!(
            "ALTER DATABASE {DB} SET amqp_outbox.receipts_exchange = '{receipts}'"
        ))
        .expect("the receipts exchange");
    f.owner
        .batch_execute(&format!(
            "SELECT amqp.collect_receipts(1, '{receipts}', '{receipts}'); \
             INSERT INTO amqp.monitor_rule (business_type, consumers, late_after, lost_after, action) \
             VALUES ('relay.paid', '{{orders}}', '5 seconds', '60 seconds', 'report');"
        ))
        .expect("collect receipts and a rule");
    let _relay = Relay::start(&f.cluster, "a", &[]);
    f.wait_for_relay(None, Duration::from_secs(20));
    let id: String = {
        let mut owner = owner_client(&f.cluster);
        let mut t = owner.transaction().expect("BEGIN");
        t.execute(
            "SELECT amqp.publish_message(1, '', $1, 'paid', business_type => 'relay.paid')",
            &[&sub_queue.queue],
        )
        .expect("publish");
        let id: String = t
            .query_one(
                "SELECT message_id FROM amqp.message ORDER BY id DESC LIMIT 1",
                &[],
            )
            .expect("its message_id")
            .get(0);
        t.commit().expect("COMMIT");
        id
    };
    // Handled by "orders", answered with a receipt through the outbox, the receipt consumed
    // back and recorded: the message is complete.
    eventually(Duration::from_secs(30), "the message complete", || {
        let r = f
            .owner
            .query_opt(
                "SELECT outcome, answered_ok FROM amqp.produced WHERE message_id = $1",
                &[&id],
            )
            .map_err(|e| e.to_string())?;
        match r.map(|r| {
            (
                r.get::<_, Option<String>>(0),
                r.get::<_, Option<Vec<String>>>(1),
            )
        }) {
            Some((Some(outcome), Some(ok))) if outcome == "complete" && ok == ["orders"] => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    assert_eq!(handled(&mut f.owner, "paid"), (1, 1));
    let amqp = AmqpAdmin::connect(&AmqpEndpoint::shared().uri()).expect("AMQP client");
    let _ = amqp.delete_queue(&receipts);
    let _ = amqp.delete_exchange(&receipts);
}

#[test]
fn messages_waiting_in_the_plain_sql_install_move_to_the_extension_and_its_worker_delivers_them() {
    // The plain-SQL install, no relay running: messages waiting, one of them delayed.
    let source = installed();
    let mut src = owner_client(&source);
    src.batch_execute("INSERT INTO amqp.broker (broker_id, host) VALUES (1, '127.0.0.1')")
        .expect("broker");
    let rabbit = Rabbit::shared();
    let route = rabbit.declare_queue("relay_move_back");
    let mut ids = HashMap::new();
    for i in 0..40 {
        let body = format!("back-{i}");
        let id: i64 = src
            .query_one(
                "SELECT amqp.publish_message(1, '', $1, $2)",
                &[&route.queue, &body],
            )
            .expect("publish")
            .get(0);
        let message_id: String = src
            .query_one("SELECT message_id FROM amqp.message WHERE id = $1", &[&id])
            .expect("its message id")
            .get(0);
        ids.insert(body, message_id);
    }
    src.execute(
        "SELECT amqp.publish_message(1, '', $1, 'back-later', deliver_after => '2 seconds')",
        &[&route.queue],
    )
    .expect("delayed publish");
    // As the docs say: the data without the install's own tables.
    let path = source.dir().join("outbox.sql").display().to_string();
    source
        .run_client(
            "pg_dump",
            &[
                "--data-only",
                "--exclude-table=amqp._relay_*",
                "--exclude-table=amqp._consumed_since",
                "-f",
                &path,
                DB,
            ],
        )
        .unwrap_or_else(|e| panic!("{e}"));

    // Restored into a database where the extension is installed, its worker off meanwhile.
    let target =
        PgCluster::new(amqp_outbox_e2e::PgConfig::default().setting("amqp_outbox.enabled", "off"));
    let mut t = target.client();
    t.batch_execute("CREATE EXTENSION amqp_outbox")
        .expect("the extension");
    target
        .run_client(
            "psql",
            &[
                "-X",
                "-q",
                "-v",
                "ON_ERROR_STOP=1",
                "-d",
                &target.config().database,
                "-f",
                &path,
            ],
        )
        .unwrap_or_else(|e| panic!("restore into the extension's database: {e}"));
    let collector = rabbit.consume_connected(&route);
    // One statement each: ALTER SYSTEM refuses a transaction block.
    for statement in [
        "ALTER SYSTEM SET amqp_outbox.enabled = on",
        "SELECT pg_reload_conf()",
    ] {
        t.batch_execute(statement).expect("the worker on");
    }
    let mut expected: HashSet<String> = ids.keys().cloned().collect();
    expected.insert("back-later".into());
    let arrived = eventually(Duration::from_secs(30), "the moved messages", || {
        let mut seen: HashMap<String, Option<String>> = HashMap::new();
        for d in collector.deliveries() {
            seen.insert(d.text(), d.message_id.clone());
        }
        let missing = expected.iter().filter(|b| !seen.contains_key(*b)).count();
        if missing == 0 {
            Ok(seen)
        } else {
            Err(format!("{missing} missing"))
        }
    });
    for (body, message_id) in &ids {
        assert_eq!(
            arrived[body].as_deref(),
            Some(message_id.as_str()),
            "{body} keeps its message id"
        );
    }
    wait_drained(&mut t);
}

#[test]
fn two_relays_started_together_serve_the_database_one_at_a_time() {
    let mut f = Fixture::new("relay_race");
    let a = Relay::start(&f.cluster, "a", &[]);
    let b = Relay::start(&f.cluster, "b", &[]);
    f.wait_for_relay(None, Duration::from_secs(20));
    eventually(
        Duration::from_secs(20),
        "one serving, one standing by",
        || {
            let (la, lb) = (a.log(), b.log());
            let serving = [&la, &lb]
                .iter()
                .filter(|l| l.contains("serving this database"))
                .count();
            let standing = [&la, &lb]
                .iter()
                .filter(|l| l.contains("standing by"))
                .count();
            if serving == 1 && standing == 1 {
                Ok(())
            } else {
                Err(format!("{serving} serving, {standing} standing by"))
            }
        },
    );
    let sent = bodies("race", 0..100);
    for chunk in sent.chunks(10) {
        f.publish(chunk);
    }
    let delivered = f.wait_delivered(&sent.iter().cloned().collect(), Duration::from_secs(30));
    for (body, copies) in &delivered {
        assert_eq!(copies.len(), 1, "{body} arrived {} times", copies.len());
    }
    f.wait_drained();
}
