//! Section 13, the relay (#42): the plain-SQL install in a second cluster that does not load the
//! library (as on a hosted service; the same settings as the bench's), served by
//! `amqp-outbox-relay` (this program started again as the relay, so the figures are of the
//! build under test), beside the extension's worker serving the bench's cluster, in one run:
//!
//! - drain: a backlog committed in one transaction, from the commit until the outbox is empty
//!   (relay ÷ worker, target ≥ 0.8), with each one's CPU per message;
//! - latency: commit → consumer at 200 msg/s, one message per transaction (target for the
//!   relay: p99 ≤ 5 ms), beside the worker's;
//! - publish cost: `amqp.publish()` by pgbench (1 and 8 clients, one message per transaction,
//!   the delivery on), the plain-SQL install's ÷ the extension's;
//! - capacity: the same 8 clients, messages committed and delivered per second (all the run's
//!   messages over the time until the last one left the outbox; target ≥ 0.8 of the worker).
//!
//! The two sides run rotated, the same queue and consumer for both.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use amqp_outbox_e2e::{PgCluster, PgConfig};
use amqp_outbox_relay::connect::describe;
use postgres::Client;

use crate::env::{self, payload, Env};
use crate::pgbench::{self, Load, System};
use crate::phases::{self, broker_cpu, paced_pad, pcts, per_msg_us, rotated, PacedOutbox};
use crate::raw::LatencyConsumer;
use crate::report::{Figure, Target};
use crate::{log, Opts, Run};

/// When set, this program runs as the relay (see [`run_as_relay`]).
pub const RUN_AS_RELAY: &str = "AMQP_OUTBOX_BENCH_RUN_AS_RELAY";

/// Runs the relay's command instead of the benchmark when [`RUN_AS_RELAY`] is set.
pub fn run_as_relay() {
    if std::env::var_os(RUN_AS_RELAY).is_some() {
        std::process::exit(i32::from(amqp_outbox_relay::cli::run()));
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Who {
    Worker,
    Relay,
}

/// The relay process; killed when dropped.
struct RelayProcess(Child);

impl RelayProcess {
    fn start(env: &Env, hosted: &PgCluster) -> Result<RelayProcess, String> {
        let exe = std::env::current_exe().map_err(|e| format!("this program's path: {e}"))?;
        let url = hosted
            .connection_string(env::DATABASE)
            .replace("application_name=amqp_outbox_e2e", "");
        let log = std::fs::File::create(env.out_dir.join("relay.log"))
            .map_err(|e| format!("relay log: {e}"))?;
        let child = Command::new(exe)
            .env(RUN_AS_RELAY, "1")
            .args(["--database", &url])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("start the relay: {e}"))?;
        Ok(RelayProcess(child))
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        // SIGTERM first: it deletes what it delivered and frees its lease.
        // SAFETY: a signal to our own child, not yet reaped.
        unsafe { libc::kill(self.0.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A cluster without the library, with the bench's durability settings, the plain-SQL install
/// in its database and the bench's broker.
fn install(env: &Env) -> Result<(PgCluster, Client), String> {
    let config = PgConfig {
        database: env::DATABASE.to_string(),
        ..PgConfig::default()
    }
    .without_preload()
    .setting("fsync", "on")
    .setting("full_page_writes", "on")
    .setting("synchronous_commit", env::sync_commit())
    .setting("shared_buffers", "'256MB'")
    .setting("max_wal_size", "'2GB'");
    let cluster = PgCluster::try_new(config)?;
    let mut c = cluster.try_client()?;
    c.batch_execute(&format!(
        "BEGIN; {}\nCOMMIT;",
        amqp_outbox_e2e::hosted::script()
    ))
    .map_err(|e| format!("the plain-SQL install: {}", describe(&e)))?;
    c.execute(
        "INSERT INTO amqp.broker (broker_id, host, port) VALUES ($1, $2, $3)",
        &[&env.broker_id, &env.amqp_host, &i32::from(env.amqp_port)],
    )
    .map_err(|e| format!("the relay's broker: {}", describe(&e)))?;
    Ok((cluster, c))
}

/// The relay's session pid once it serves the database and its broker is connected.
fn wait_serving(c: &mut Client, timeout: Duration) -> Result<i32, String> {
    let deadline = Instant::now() + timeout;
    loop {
        let row = c
            .query_one(
                "SELECT (SELECT worker_pid FROM amqp.worker_status WHERE state = 'running'), \
                        coalesce((SELECT bool_and(connected) FROM amqp.broker_status), false)",
                &[],
            )
            .map_err(|e| format!("the relay's status: {e}"))?;
        if let (Some(pid), true) = (row.get::<_, Option<i32>>(0), row.get::<_, bool>(1)) {
            return Ok(pid);
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "no relay served the plain-SQL install within {timeout:?}"
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The relay's process and the server processes of its sessions.
fn relay_processes(c: &mut Client, relay_pid: i32) -> Result<Vec<i32>, String> {
    let mut pids = vec![relay_pid];
    for r in c
        .query(
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'amqp-outbox-relay'",
            &[],
        )
        .map_err(|e| format!("the relay's sessions: {}", describe(&e)))?
    {
        pids.push(r.get(0));
    }
    Ok(pids)
}

fn outbox_empty(c: &mut Client) -> Result<bool, String> {
    Env::outbox_nonempty(c).map(|nonempty| !nonempty)
}

/// Commits `n` messages in one transaction on `c`; returns when the outbox of `watch` is empty
/// again: messages per second from the commit.
fn drain_once(
    c: &mut Client,
    watch: &mut Client,
    broker: i32,
    exchange: &str,
    body: &str,
    n: u64,
) -> Result<f64, String> {
    let k = i32::try_from(n).map_err(|_| "backlog too large".to_string())?;
    c.query_one(
        "SELECT count(amqp.publish($1, $2, '', $3)) FROM generate_series(1, $4::int) g",
        &[&broker, &exchange, &body, &k],
    )
    .map_err(|e| format!("the backlog: {}", describe(&e)))?;
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(600);
    loop {
        if outbox_empty(watch)? {
            return Ok(n as f64 / t0.elapsed().as_secs_f64());
        }
        if Instant::now() >= deadline {
            return Err("the outbox did not drain within 10 minutes".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn relay(env: &mut Env, opts: &Opts, run: &mut Run) -> Result<(), String> {
    let (hosted_cluster, mut hosted) = install(env)?;
    env.set_enabled(true)?;
    env.set_proof("ack_queue")?;
    let relay = RelayProcess::start(env, &hosted_cluster)?;
    wait_serving(&mut hosted, Duration::from_secs(30))?;
    let relay_pid = relay.0.id() as i32;
    let sec = "13 relay";

    // Drain.
    let n = opts.drain_n.min(50_000);
    let body = payload(256);
    let route = env.routes.classic.clone();
    let mut rates = (Vec::new(), Vec::new());
    let mut cpu = (Vec::new(), Vec::new());
    for rep in 0..opts.drain_reps.max(2) {
        for who in rotated(&[Who::Worker, Who::Relay], rep) {
            // The relay's CPU with its two sessions' backends (the worker's statements run in
            // its own process).
            let pids = match who {
                Who::Worker => env.worker_pid()?.into_iter().collect(),
                Who::Relay => relay_processes(&mut hosted, relay_pid)?,
            };
            let cpu_of =
                |pids: &[i32]| -> Option<f64> { pids.iter().map(|p| env::proc_cpu_secs(*p)).sum() };
            let cpu0 = cpu_of(&pids);
            let bcpu0 = broker_cpu(env);
            let rate = match who {
                Who::Worker => {
                    let mut c = env.cluster.try_client()?;
                    drain_once(
                        &mut c,
                        &mut env.admin,
                        env.broker_id,
                        &route.exchange,
                        &body,
                        n,
                    )?
                }
                Who::Relay => {
                    let mut c = hosted_cluster.try_client()?;
                    drain_once(
                        &mut c,
                        &mut hosted,
                        env.broker_id,
                        &route.exchange,
                        &body,
                        n,
                    )?
                }
            };
            let us = per_msg_us(cpu0, cpu_of(&pids), n);
            log(format!(
                "  drain of {n} ({who:?}): {rate:.0} msg/s, {us:.1} µs CPU/msg, RabbitMQ {:.1} µs/msg",
                per_msg_us(bcpu0, broker_cpu(env), n)
            ));
            let (r, c) = match who {
                Who::Worker => (&mut rates.0, &mut cpu.0),
                Who::Relay => (&mut rates.1, &mut cpu.1),
            };
            r.push(rate);
            c.push(us);
            env.purge(&route.queue)?;
        }
    }
    let cfg = format!("{n} messages committed in one transaction, classic durable queue");
    run.fig(
        Figure::new(sec, "drain, relay / in-database worker", &cfg, "msg/s")
            .samples(rates.1)
            .baseline("worker", rates.0)
            .target(Target::RatioAtLeast(0.8)),
    );
    run.fig(
        Figure::new(
            sec,
            "CPU per delivered message (the relay with its sessions' backends), relay / worker",
            &cfg,
            "µs",
        )
        .samples(cpu.1)
        .baseline("worker", cpu.0),
    );

    // Latency at 200 msg/s.
    let route = env.routes.latency.clone();
    env.purge(&route.queue)?;
    let consumer = LatencyConsumer::start(&env.amqp_uri(), &route.queue)?;
    let pad = paced_pad();
    let (warmup, secs) = (
        Duration::from_secs(1),
        Duration::from_secs_f64(opts.lat_secs_low),
    );
    let mut got = (Vec::new(), Vec::new());
    for rep in 0..opts.lat_reps {
        for who in rotated(&[Who::Worker, Who::Relay], rep) {
            consumer.reset();
            let cluster = match who {
                Who::Worker => &env.cluster,
                Who::Relay => &hosted_cluster,
            };
            let sent =
                PacedOutbox::connect_to(cluster, env.broker_id, &route.exchange, None, 200.0)?
                    .run(warmup, secs, &pad)?;
            let samples = consumer.wait_for(sent, Duration::from_secs(30));
            let p = pcts(&samples);
            log(format!(
                "  200/s {who:?}: {} of {sent} received, p50 {:.2} ms, p99 {:.2} ms",
                samples.us.len(),
                p.p50,
                p.p99
            ));
            match who {
                Who::Worker => got.0.push(p),
                Who::Relay => got.1.push(p),
            }
            env.purge(&route.queue)?;
        }
    }
    let cfg = "200 msg/s, 1 msg/txn".to_string();
    let pick = |v: &[phases::Pcts], f: fn(&phases::Pcts) -> f64| v.iter().map(f).collect();
    run.fig(
        Figure::new(sec, "commit→consumer p50, relay / worker", &cfg, "ms")
            .samples(pick(&got.1, |p| p.p50))
            .baseline("worker", pick(&got.0, |p| p.p50)),
    );
    run.fig(
        Figure::new(sec, "commit→consumer p99, relay / worker", &cfg, "ms")
            .samples(pick(&got.1, |p| p.p99))
            .baseline("worker", pick(&got.0, |p| p.p99))
            .target(Target::AtMost(5.0)),
    );
    // Publish cost and capacity; at 8 clients, where each system's CPU goes.
    let body = payload(100);
    let mut publish: [(Vec<f64>, Vec<f64>); 2] = Default::default();
    let mut capacity = (Vec::new(), Vec::new());
    let mut split: (Vec<[f64; 4]>, Vec<[f64; 4]>) = Default::default();
    for (k, clients) in [1u32, 8].into_iter().enumerate() {
        let load = Load {
            clients,
            per_txn: 1,
            size: 100,
            secs: opts.secs,
        };
        for rep in 0..opts.reps.max(2) {
            for who in rotated(&[Who::Worker, Who::Relay], rep) {
                let (cluster, port) = match who {
                    Who::Worker => (&env.cluster, env.cluster.port()),
                    Who::Relay => (&hosted_cluster, hosted_cluster.port()),
                };
                let mut watch = cluster.try_client()?;
                let data_dir = cluster.data_dir();
                // Where the CPU goes, at 8 clients only.
                let delivery = match who {
                    _ if clients != 8 => None,
                    Who::Worker => Some(Delivery {
                        own: None,
                        sessions: env.worker_pid()?.into_iter().collect(),
                    }),
                    Who::Relay => Some(Delivery {
                        own: Some(relay_pid),
                        sessions: relay_processes(&mut hosted, relay_pid)?
                            .into_iter()
                            .filter(|p| *p != relay_pid)
                            .collect(),
                    }),
                };
                let cpu0 = delivery.as_ref().map(|d| cpu_split(env, &data_dir, d));
                let (rows, cap) = publish_once(env, port, &mut watch, &load, &body)?;
                if let (Some(d), Some(cpu0)) = (&delivery, cpu0) {
                    let messages = rows * f64::from(load.secs);
                    let cpu = cpu_split(env, &data_dir, d);
                    let us: [f64; 4] =
                        std::array::from_fn(|i| (cpu[i] - cpu0[i]) * 1e6 / messages.max(1.0));
                    log(format!(
                        "    CPU per message ({who:?}): PostgreSQL but the delivery {:.0} µs, the delivery {:.0}, RabbitMQ {:.0}, pgbench {:.0}",
                        us[0], us[1], us[2], us[3]
                    ));
                    match who {
                        Who::Worker => split.0.push(us),
                        Who::Relay => split.1.push(us),
                    }
                }
                log(format!(
                    "  publish, {clients} client(s) ({who:?} delivering): {rows:.0} rows/s, {cap:.0} committed and delivered/s"
                ));
                let p = &mut publish[k];
                match who {
                    Who::Worker => p.0.push(rows),
                    Who::Relay => p.1.push(rows),
                }
                if clients == 8 {
                    match who {
                        Who::Worker => capacity.0.push(cap),
                        Who::Relay => capacity.1.push(cap),
                    }
                }
                env.purge(&env.routes.publish.queue.clone())?;
            }
        }
    }
    for (k, clients) in [1u32, 8].into_iter().enumerate() {
        let cfg = format!("{clients} client(s), 1 msg/txn, 100 B, the delivery on");
        let (worker, relay) = std::mem::take(&mut publish[k]);
        run.fig(
            Figure::new(
                sec,
                "amqp.publish(), plain-SQL install (relay) / extension (worker)",
                &cfg,
                "rows/s",
            )
            .samples(relay)
            .baseline("worker", worker),
        );
    }
    let parts = [
        "PostgreSQL but the delivery (the publishing sessions, WAL, checkpoints)",
        "the delivery (the worker; the relay and its sessions)",
        "RabbitMQ",
        "pgbench",
    ];
    for (i, part) in parts.iter().enumerate() {
        let pick = |v: &[[f64; 4]]| v.iter().map(|u| u[i]).collect::<Vec<f64>>();
        run.fig(
            Figure::new(
                sec,
                &format!("CPU per message at 8 clients, {part}, relay / worker"),
                "8 clients, 1 msg/txn, 100 B, from the start of the run until the outbox is empty",
                "µs",
            )
            .samples(pick(&split.1))
            .baseline("worker", pick(&split.0)),
        );
    }
    run.fig(
        Figure::new(
            sec,
            "capacity, committed and delivered per second, relay / worker",
            "8 clients, 1 msg/txn, 100 B",
            "msg/s",
        )
        .samples(capacity.1)
        .baseline("worker", capacity.0)
        .target(Target::RatioAtLeast(0.8)),
    );
    drop(relay);
    drop(hosted);
    drop(hosted_cluster);
    Ok(())
}

/// The processes that deliver: `own` outside the cluster (the relay), `sessions` among the
/// cluster's processes (the worker; the relay's sessions' backends).
struct Delivery {
    own: Option<i32>,
    sessions: Vec<i32>,
}

/// CPU seconds so far of: the cluster but the delivery's processes in it, the delivery, the
/// RabbitMQ node, and this program's reaped children (pgbench). NaN where unreadable.
fn cpu_split(env: &Env, data_dir: &std::path::Path, delivery: &Delivery) -> [f64; 4] {
    let nan = f64::NAN;
    let sessions: f64 = delivery
        .sessions
        .iter()
        .map(|p| env::proc_cpu_secs(*p).unwrap_or(nan))
        .sum();
    let own = delivery
        .own
        .map_or(Some(0.0), env::proc_cpu_secs)
        .unwrap_or(nan);
    [
        env::cluster_cpu_secs(data_dir).unwrap_or(nan) - sessions,
        sessions + own,
        broker_cpu(env).unwrap_or(nan),
        env::reaped_children_cpu_secs().unwrap_or(nan),
    ]
}

/// One pgbench run of `amqp.publish()` against the server at `port`, whose outbox `watch`
/// reads; returns the rows committed per second during the run, and the messages committed and
/// delivered per second (the run's messages over the time until the outbox was empty).
fn publish_once(
    env: &Env,
    port: u16,
    watch: &mut Client,
    load: &Load,
    body: &str,
) -> Result<(f64, f64), String> {
    let t0 = Instant::now();
    let out = pgbench::run_on(env, port, System::Publish, load, body)?;
    let deadline = Instant::now() + Duration::from_secs(240);
    while !outbox_empty(watch)? {
        if Instant::now() >= deadline {
            return Err("the outbox did not empty within 4 minutes of the run".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let messages = out.rows_per_sec * f64::from(load.secs);
    Ok((out.rows_per_sec, messages / t0.elapsed().as_secs_f64()))
}
