//! High availability against a three-node RabbitMQ cluster on this machine.
//!
//! One broker (`broker_id`) with three `amqp.broker` rows, one per node; a quorum business queue
//! (declared with `amqp.queue_declare(..., '{"x-queue-type": "quorum"}')`) bound to a direct
//! exchange; the acknowledgement queue a quorum queue too (`amqp_outbox.ack_queue_quorum = on`);
//! a producer committing (and rolling back) steadily in PostgreSQL, recorded in a ledger; a
//! consumer that fails over between the nodes. Then, one after the other, with the killed nodes
//! restarted (and the queues back to three members) before the next step:
//!
//! 1. SIGKILL of the node the worker is connected to (`amqp.broker_status.host`),
//! 2. SIGKILL of the business quorum queue's leader,
//! 3. SIGKILL of a minority: one node that is neither the worker's nor the leader (when there
//!    is one),
//! 4. SIGKILL of a majority (two of three): publishing must stall — no message committed after
//!    the kill is delivered, they wait in the outbox, the worker does not spin — and resume once
//!    the majority is back.
//!
//! After each step the time to resume is measured from the kill: until the worker is connected
//! again (to another node), until the first message committed after the kill is delivered, and
//! until every message committed before the kill has arrived. At the end the ledger checker
//! must find lost = 0, phantom = 0 and every duplicate sharing one `message_id`. Each step
//! prints an `HA RESULT:` line.
//!
//! `ha_short_failover_and_majority_loss` (steps 1 and 4, short windows) runs in `make test`;
//! `ha_full_cluster_failures` (all four steps, longer windows, more volume) is `#[ignore]` and
//! runs in `make chaos` (or `cargo test -p amqp_outbox_e2e --test ha -- --include-ignored
//! --nocapture`).
//!
//! Settings: the extension's defaults, except `ack_queue_quorum = on` and `retry_backoff_max =
//! 5s` (so a reconnect after the majority comes back is not delayed by a full minute of backoff).

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use amqp_outbox_e2e::chaos::proc_stat_field;
use amqp_outbox_e2e::outbox::create_extension;
use amqp_outbox_e2e::{
    eventually, try_eventually, unique_name, Collector, Ledger, MessageKey, Outbox, PgCluster,
    PgConfig, Producer, ProducerConfig, RabbitCluster, Received,
};
use postgres::Client;

/// Generous: two cores shared with other tests, three Erlang nodes.
const RESUME_TIMEOUT: Duration = Duration::from_secs(180);
const SETTLE_TIMEOUT: Duration = Duration::from_secs(180);
/// The extension's `max_in_flight` (default): the documented duplicate bound per fault.
const MAX_IN_FLIGHT: usize = 2000;
/// The consumer's prefetch: what it may get twice when its own node dies.
const CONSUMER_PREFETCH: usize = 500;
const PRODUCER: &str = "ha";

/// What one step measured.
#[derive(Debug, Default)]
struct Step {
    name: String,
    killed: Vec<String>,
    /// From the kill until the worker reported itself connected to a surviving node.
    reconnected: Option<Duration>,
    /// From the kill (or, for the majority step, from the restart) until the first message
    /// committed after that instant was delivered.
    first_new_delivery: Option<Duration>,
    /// From the same instant until every message committed before it had been delivered.
    caught_up: Option<Duration>,
    note: String,
}

impl Step {
    fn print(&self) {
        let s = |d: Option<Duration>| {
            d.map(|d| format!("{:.2}s", d.as_secs_f64()))
                .unwrap_or_else(|| "-".into())
        };
        eprintln!(
            "HA RESULT: {:<34} killed {:<40} reconnected {:>8}  first new delivery {:>8}  \
             all earlier delivered {:>8}  {}",
            self.name,
            self.killed.join(","),
            s(self.reconnected),
            s(self.first_new_delivery),
            s(self.caught_up),
            self.note
        );
    }
}

/// Times measured by [`Ha::measure_resume`], from its starting instant.
#[derive(Debug, Default)]
struct Resume {
    reconnected: Option<Duration>,
    first: Option<Duration>,
    caught: Option<Duration>,
    port_open: Option<Duration>,
}

/// The test's world. Fields drop in order: producer (stopped and joined), consumer, database
/// client, PostgreSQL, then the RabbitMQ cluster.
struct Ha {
    producer: Option<Producer>,
    collector: Collector,
    client: Client,
    pg: PgCluster,
    cluster: RabbitCluster,
    ledger: Arc<Ledger>,
    broker_id: i32,
    queue: String,
    ack_queue: String,
    steps: Vec<Step>,
    /// Keys delivered so far and how far into the collector's log they were read.
    delivered: HashSet<MessageKey>,
    delivered_upto: usize,
    /// Requirements a step broke; the test goes on (to measure the rest) and fails at the end.
    violations: Vec<String>,
}

/// The worker's connection as `amqp.broker_status` shows it.
#[derive(Debug, Clone)]
struct Conn {
    connected: bool,
    port: Option<u16>,
    channel: i64,
    /// The worker's last connection error (shown in failure messages).
    #[allow(dead_code)]
    last_error: Option<String>,
}

/// `user@host:port/vhost` → port.
fn port_of_host(host: &str) -> Option<u16> {
    let after_at = host.rsplit_once('@').map_or(host, |(_, h)| h);
    let host_port = after_at.split('/').next()?;
    host_port.rsplit_once(':')?.1.parse().ok()
}

/// utime + stime of a process, in seconds.
fn cpu_seconds(pid: i32) -> Option<f64> {
    let utime = proc_stat_field(pid, 14)? as f64;
    let stime = proc_stat_field(pid, 15)? as f64;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Some((utime + stime) / hz)
}

impl Ha {
    fn new(producer_pause: Duration) -> Ha {
        let t = Instant::now();
        let cluster = RabbitCluster::start(3);
        eprintln!(
            "HA: cluster of {} up in {:.1}s: {}",
            cluster.len(),
            t.elapsed().as_secs_f64(),
            cluster
                .nodes()
                .iter()
                .map(|n| format!("{} (port {})", n.name(), n.port()))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let pg = PgCluster::new(
            PgConfig::default()
                .setting("amqp_outbox.ack_queue_quorum", "on")
                .setting("amqp_outbox.retry_backoff_max", 5000),
        );
        let mut client = pg.client();
        create_extension(&mut client);
        let eps = cluster.endpoints();
        let broker_id: i32 = client
            .query_one(
                "INSERT INTO amqp.broker (host, port) VALUES ($1, $2) RETURNING broker_id",
                &[&eps[0].host, &i32::from(eps[0].port)],
            )
            .expect("first broker row")
            .get(0);
        for ep in &eps[1..] {
            client
                .execute(
                    "INSERT INTO amqp.broker (broker_id, host, port) VALUES ($1, $2, $3)",
                    &[&broker_id, &ep.host, &i32::from(ep.port)],
                )
                .expect("another host of the broker");
        }
        let exchange = unique_name("ha.x");
        let queue = unique_name("ha.q");
        client
            .execute(
                "SELECT amqp.exchange_declare($1, $2, 'direct', false, true, false)",
                &[&broker_id, &exchange],
            )
            .expect("exchange_declare");
        client
            .execute(
                "SELECT amqp.queue_declare($1, $2, true, false, '{\"x-queue-type\": \"quorum\"}')",
                &[&broker_id, &queue],
            )
            .expect("queue_declare");
        client
            .execute(
                "SELECT amqp.queue_bind($1, $2, $3, 'rk')",
                &[&broker_id, &queue, &exchange],
            )
            .expect("queue_bind");
        let ack_queue = Outbox::ack_queue_name(&mut client);
        pg.wait_for_worker(&mut client, Duration::from_secs(60));
        let collector = Collector::start_failover(eps, queue.clone());
        let mut ha = Ha {
            producer: None,
            collector,
            client,
            pg,
            cluster,
            ledger: Arc::new(Ledger::new()),
            broker_id,
            queue,
            ack_queue,
            steps: Vec::new(),
            delivered: HashSet::new(),
            delivered_upto: 0,
            violations: Vec::new(),
        };
        ha.wait_settled("the worker to connect and declare both quorum queues");
        let mut cfg = ProducerConfig::new(PRODUCER, broker_id, &exchange, "rk");
        cfg.max_messages = u64::MAX;
        cfg.max_batch = 5;
        cfg.rollback_ratio = 0.1;
        cfg.pause = producer_pause;
        ha.producer = Some(Producer::spawn(&ha.pg, cfg, ha.ledger.clone()));
        ha.wait_flowing(200);
        ha
    }

    fn conn(&mut self) -> Result<Conn, String> {
        let row = self
            .client
            .query_opt(
                "SELECT connected, host, channel, last_error FROM amqp.broker_status \
                  WHERE broker_id = $1",
                &[&self.broker_id],
            )
            .map_err(|e| format!("amqp.broker_status: {e}"))?
            .ok_or("no amqp.broker_status row yet")?;
        let host: Option<String> = row.get(1);
        Ok(Conn {
            connected: row.get(0),
            port: host.as_deref().and_then(port_of_host),
            channel: row.get(2),
            last_error: row.get(3),
        })
    }

    /// The node index the worker is connected to.
    fn worker_node(&mut self) -> Result<usize, String> {
        let c = self.conn()?;
        if !c.connected {
            return Err(format!("not connected: {c:?}"));
        }
        c.port
            .and_then(|p| self.cluster.index_of_port(p))
            .ok_or_else(|| format!("connected to no node of the cluster: {c:?}"))
    }

    fn pending(&mut self) -> i64 {
        Outbox::pending(&mut self.client).unwrap_or(-1)
    }

    /// `state: count (attempts max, a last_error)` of the outbox rows, for diagnostics.
    fn outbox_states(&mut self) -> String {
        match self.client.query(
            "SELECT state, count(*), max(attempts), max(last_error) FROM amqp.message_status \
              GROUP BY state ORDER BY state",
            &[],
        ) {
            Ok(rows) => rows
                .iter()
                .map(|r| {
                    let state: String = r.get(0);
                    let n: i64 = r.get(1);
                    let attempts: Option<i32> = r.get(2);
                    let err: Option<String> = r.get(3);
                    format!("{state}: {n} (attempts up to {attempts:?}, e.g. {err:?})")
                })
                .collect::<Vec<_>>()
                .join("; "),
            Err(e) => format!("amqp.message_status: {e}"),
        }
    }

    /// Waits until every running node is in both quorum queues (with a leader) and the worker
    /// is connected.
    fn wait_settled(&mut self, what: &str) {
        let members = self.cluster.running().len();
        let t = Instant::now();
        for q in [self.queue.clone(), self.ack_queue.clone()] {
            // The queues exist only once the worker has connected and declared them.
            eventually(SETTLE_TIMEOUT, &format!("{what}: quorum queue {q}"), || {
                let st = self.cluster.quorum_queue_state(&q)?;
                if st.leader.is_some() && st.online.len() >= members {
                    Ok(())
                } else {
                    Err(format!("{st:?}"))
                }
            });
        }
        eventually(SETTLE_TIMEOUT, &format!("{what}: worker connected"), || {
            self.worker_node().map(drop)
        });
        eprintln!("HA: settled ({what}) in {:.1}s", t.elapsed().as_secs_f64());
    }

    /// Waits until `n` more messages have arrived.
    fn wait_flowing(&self, n: usize) {
        let from = self.collector.len();
        eventually(SETTLE_TIMEOUT, &format!("{n} more deliveries"), || {
            match self.collector.len() - from {
                k if k >= n => Ok(()),
                k => Err(format!(
                    "{k} so far; consumer error {:?}",
                    self.collector.last_error()
                )),
            }
        });
    }

    /// The highest sequence number the producer has committed so far.
    fn committed_max_seq(&self) -> Option<u64> {
        self.ledger
            .committed_keys()
            .into_iter()
            .filter(|k| k.producer == PRODUCER)
            .map(|k| k.seq)
            .max()
    }

    /// Folds new deliveries into `delivered`; returns the first new one (from `from` on) whose
    /// sequence number is above `after`.
    fn absorb(&mut self) {
        let all = self.collector.deliveries();
        for d in &all[self.delivered_upto..] {
            if let Some(k) = MessageKey::of(d) {
                self.delivered.insert(k);
            }
        }
        self.delivered_upto = all.len();
    }

    fn first_after(&self, from: usize, after: Option<u64>) -> Option<Received> {
        self.collector.find_from(from, |d| {
            MessageKey::of(d).is_some_and(|k| after.is_none_or(|a| k.seq > a))
        })
    }

    /// Kills `nodes`, then measures (from the kill) the reconnect, the first delivery of a
    /// message committed after the kill, and the delivery of everything committed before it.
    fn kill_and_measure(&mut self, name: &str, nodes: &[usize]) -> Step {
        let killed_ports: Vec<u16> = nodes.iter().map(|&i| self.cluster.node(i).port()).collect();
        let before_keys: BTreeSet<MessageKey> = self.ledger.committed_keys();
        let from = self.collector.len();
        let t0 = Instant::now();
        self.cluster.kill_many(nodes);
        let after = self.committed_max_seq();
        let killed = self.node_names(nodes);
        eprintln!(
            "HA: {name}: killed {killed:?} ({:.2}s to reap)",
            t0.elapsed().as_secs_f64()
        );
        let mut step = Step {
            name: name.to_string(),
            killed,
            ..Step::default()
        };
        let deadline = t0 + RESUME_TIMEOUT;
        loop {
            if step.reconnected.is_none() {
                if let Ok(c) = self.conn() {
                    if c.connected && c.port.is_some_and(|p| !killed_ports.contains(&p)) {
                        step.reconnected = Some(t0.elapsed());
                    }
                }
            }
            if step.first_new_delivery.is_none() {
                if let Some(d) = self.first_after(from, after) {
                    step.first_new_delivery = Some(d.received_at.saturating_duration_since(t0));
                }
            }
            if step.caught_up.is_none() {
                self.absorb();
                if before_keys.iter().all(|k| self.delivered.contains(k)) {
                    step.caught_up = Some(t0.elapsed());
                }
            }
            if step.reconnected.is_some()
                && step.first_new_delivery.is_some()
                && step.caught_up.is_some()
            {
                break;
            }
            if Instant::now() > deadline {
                let probe = self.probe_disconnect(from, after);
                let missing = before_keys
                    .iter()
                    .filter(|k| !self.delivered.contains(k))
                    .count();
                panic!(
                    "{name}: publishing did not resume within {RESUME_TIMEOUT:?}: {step:?}; \
                     {missing} earlier messages not delivered; worker {:?}; pending {}; \
                     consumer error {:?}; {probe}\nserver log:\n{}",
                    self.conn(),
                    self.pending(),
                    self.collector.last_error(),
                    self.pg.log_tail(30)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        step
    }

    /// Restarts `nodes` and waits until the cluster and both queues are whole again and
    /// messages flow.
    fn restore(&mut self, nodes: &[usize]) {
        let t = Instant::now();
        self.cluster.boot_many(nodes);
        eprintln!(
            "HA: restarted {:?} in {:.1}s",
            self.node_names(nodes),
            t.elapsed().as_secs_f64()
        );
        self.wait_settled("after the restart");
        self.wait_flowing(50);
    }

    /// The nodes' names, for log lines and the results.
    fn node_names(&self, nodes: &[usize]) -> Vec<String> {
        nodes
            .iter()
            .map(|&i| self.cluster.node(i).name().to_string())
            .collect()
    }

    fn leader(&self, queue: &str) -> usize {
        let q = queue.to_string();
        eventually(SETTLE_TIMEOUT, &format!("a leader of {q}"), || {
            self.cluster
                .quorum_queue_state(&q)?
                .leader
                .ok_or_else(|| "no leader".to_string())
        })
    }

    fn roles(&mut self) -> (usize, usize, usize) {
        let worker = eventually(SETTLE_TIMEOUT, "the worker's node", || self.worker_node());
        let leader = self.leader(&self.queue.clone());
        let ack_leader = self.leader(&self.ack_queue.clone());
        eprintln!(
            "HA: worker on {}, business queue leader {}, ack queue leader {}",
            self.cluster.node(worker).name(),
            self.cluster.node(leader).name(),
            self.cluster.node(ack_leader).name()
        );
        (worker, leader, ack_leader)
    }

    fn describe(&self, i: usize, worker: usize, leader: usize, ack_leader: usize) -> String {
        let mut roles = Vec::new();
        if i == worker {
            roles.push("worker's node");
        }
        if i == leader {
            roles.push("queue leader");
        }
        if i == ack_leader {
            roles.push("ack queue leader");
        }
        if roles.is_empty() {
            roles.push("follower, no client");
        }
        format!("{}: {}", self.cluster.node(i).name(), roles.join(" + "))
    }

    /// Step: kill the node the worker is connected to, measure, restart it.
    fn kill_workers_node(&mut self) {
        let (w, l, a) = self.roles();
        self.kill_one("1 worker's node killed", w, (w, l, a));
    }

    /// Step: kill the business queue's leader, measure, restart it.
    fn kill_leader(&mut self) {
        let (w, l, a) = self.roles();
        self.kill_one("2 quorum queue leader killed", l, (w, l, a));
    }

    /// Step: kill one node that is neither the worker's nor a leader (if there is one).
    fn kill_minority(&mut self) {
        let (w, l, a) = self.roles();
        let victim = (0..self.cluster.len())
            .find(|&i| i != w && i != l && i != a)
            .or_else(|| (0..self.cluster.len()).find(|&i| i != w && i != l))
            .or_else(|| (0..self.cluster.len()).find(|&i| i != w))
            .expect("three nodes");
        self.kill_one("3 minority (1 of 3) killed", victim, (w, l, a));
    }

    /// Kills `victim`, measures (the step's note names its roles, from `roles`), records the
    /// step and restarts the node.
    fn kill_one(&mut self, name: &str, victim: usize, roles: (usize, usize, usize)) {
        let (w, l, a) = roles;
        let mut step = self.kill_and_measure(name, &[victim]);
        step.note = self.describe(victim, w, l, a);
        step.print();
        self.steps.push(step);
        self.restore(&[victim]);
    }

    /// Step: kill two of three nodes (the worker's and the leader's, or the worker's and
    /// another): publishing stalls for `window`; then restart them and measure the resume.
    fn kill_majority(&mut self, window: Duration) {
        let (w, l, a) = self.roles();
        let second = if l != w {
            l
        } else {
            (0..self.cluster.len())
                .find(|&i| i != w)
                .expect("three nodes")
        };
        let victims = [w, second];
        let survivor = (0..self.cluster.len())
            .find(|i| !victims.contains(i))
            .expect("three nodes");
        let t0 = Instant::now();
        self.cluster.kill_many(&victims);
        let after = self.committed_max_seq();
        let from = self.collector.len();
        let names = self.node_names(&victims);
        eprintln!(
            "HA: 4 majority: killed {names:?} ({:.2}s to reap), {} survives",
            t0.elapsed().as_secs_f64(),
            self.cluster.node(survivor).name()
        );
        // Let the worker notice (its connection was on a killed node) before watching it.
        let worker_pid = self.pg.worker_pid(&mut self.client).ok().flatten();
        let pending0 = self.pending();
        let conn0 = self.conn().ok();
        let cpu0 = worker_pid.and_then(cpu_seconds);
        let status0 = Outbox::worker_status(&mut self.client).ok();
        let w0 = Instant::now();
        // The stall: no message committed after the kill is delivered during the window (an
        // observation window, not a synchronisation).
        while w0.elapsed() < window {
            if let Some(d) = self.first_after(from, after) {
                panic!(
                    "publishing went on with a majority down: {} delivered {:.2}s after the kill",
                    d.text(),
                    d.received_at.saturating_duration_since(t0).as_secs_f64()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let stalled_for = w0.elapsed();
        let cpu1 = worker_pid.and_then(cpu_seconds);
        let pending1 = self.pending();
        let conn1 = self.conn().ok();
        let status = Outbox::worker_status(&mut self.client).ok();
        let cpu_share = match (cpu0, cpu1) {
            (Some(a), Some(b)) => Some((b - a) / stalled_for.as_secs_f64()),
            _ => None,
        };
        let new_channels = match (&conn0, &conn1) {
            (Some(a), Some(b)) => Some(b.channel - a.channel),
            _ => None,
        };
        eprintln!(
            "HA: 4 majority: stalled {:.1}s: outbox pending {pending0} -> {pending1}, worker CPU \
             {:?} of a core, {new_channels:?} new channels, connection {conn1:?}, counters \
             {status:?}",
            stalled_for.as_secs_f64(),
            cpu_share
        );
        let states = self.outbox_states();
        eprintln!("HA: 4 majority: outbox by state after the stall: {states}");
        if !(pending1 > pending0 && pending1 > 0) {
            self.violations.push(format!(
                "committed messages must wait in the outbox while the majority is down \
                 (pending {pending0} -> {pending1})"
            ));
        }
        if let Some(share) = cpu_share {
            if share >= 0.5 {
                self.violations.push(format!(
                    "the worker used {:.0}% of a core while the majority was down (a hot loop); \
                     outbox: {states}",
                    share * 100.0
                ));
            }
        }
        if let Some(n) = new_channels {
            // A reconnect per confirm timeout (15 s) or per backoff round (≤ 5 s) is expected;
            // one per few milliseconds is a storm.
            let bound = 5 + (stalled_for.as_secs() as i64);
            if n > bound {
                self.violations.push(format!(
                    "{n} new channels in {stalled_for:?} with the majority down: a reconnect storm"
                ));
            }
        }
        if let (Some(a), Some(b)) = (status0, status) {
            if b.parked > a.parked {
                self.violations.push(format!(
                    "{} messages were parked while the majority was down (an outage is not a \
                     refusal); outbox: {states}",
                    b.parked - a.parked
                ));
            }
        }
        // Bring the majority back and measure the resume from the moment the restart begins.
        let before_keys = self.ledger.committed_keys();
        let after_restart_from = self.collector.len();
        let after_restart = self.committed_max_seq();
        let t1 = Instant::now();
        self.cluster
            .start_nodes(&victims)
            .unwrap_or_else(|e| panic!("restarting {victims:?}: {e}"));
        let times = self.measure_resume(
            t1,
            after_restart_from,
            after_restart,
            &before_keys,
            &victims,
        );
        self.cluster
            .await_nodes(&victims)
            .unwrap_or_else(|e| panic!("restarting {victims:?}: {e}"));
        let mut step = Step {
            name: "4 majority (2 of 3) killed".into(),
            killed: names,
            reconnected: times.reconnected,
            first_new_delivery: times.first,
            caught_up: times.caught,
            ..Step::default()
        };
        let secs = |d: Option<Duration>| {
            d.map(|d| format!("{:.1}s", d.as_secs_f64()))
                .unwrap_or_else(|| "?".into())
        };
        step.note = format!(
            "stalled {:.0}s (pending {pending0}->{pending1}, worker CPU {}, {} new channels); \
             times from the restart; first restarted node accepted AMQP after {}, so the first \
             new delivery came {} after the majority was back; {}",
            stalled_for.as_secs_f64(),
            cpu_share
                .map(|s| format!("{:.1}%", s * 100.0))
                .unwrap_or_else(|| "?".into()),
            new_channels
                .map(|n| n.to_string())
                .unwrap_or_else(|| "?".into()),
            secs(times.port_open),
            secs(
                times
                    .first
                    .zip(times.port_open)
                    .map(|(f, p)| f.saturating_sub(p))
            ),
            self.describe(w, w, l, a)
        );
        step.print();
        self.steps.push(step);
        self.wait_settled("after the majority returned");
        self.wait_flowing(50);
    }

    /// Diagnosis when publishing is stuck: asks the worker for a fresh connection (and so a
    /// fresh channel) with `amqp.disconnect()`, and says whether messages then flow.
    fn probe_disconnect(&mut self, from: usize, after: Option<u64>) -> String {
        let t = Instant::now();
        if let Err(e) = self
            .client
            .execute("SELECT amqp.disconnect($1)", &[&self.broker_id])
        {
            return format!("amqp.disconnect() failed: {e}");
        }
        let from_now = self.collector.len().max(from);
        match try_eventually(Duration::from_secs(60), || {
            self.first_after(from_now, after)
                .ok_or_else(|| "nothing new".to_string())
        }) {
            Ok(d) => format!(
                "after amqp.disconnect() (a fresh connection and channel) messages flowed again \
                 within {:.2}s ({})",
                d.received_at.saturating_duration_since(t).as_secs_f64(),
                d.text()
            ),
            Err(_) => "amqp.disconnect() did not help within 60s".into(),
        }
    }

    /// From `t`: the worker connected, the first message committed after `t` delivered,
    /// everything in `before` delivered, and the first of `nodes` accepting AMQP connections.
    fn measure_resume(
        &mut self,
        t: Instant,
        from: usize,
        after: Option<u64>,
        before: &BTreeSet<MessageKey>,
        nodes: &[usize],
    ) -> Resume {
        let mut r = Resume::default();
        let deadline = Instant::now() + RESUME_TIMEOUT;
        while r.reconnected.is_none() || r.first.is_none() || r.caught.is_none() {
            if r.port_open.is_none() && nodes.iter().any(|&i| self.cluster.port_open(i)) {
                r.port_open = Some(t.elapsed());
            }
            if r.reconnected.is_none() && self.conn().is_ok_and(|c| c.connected) {
                r.reconnected = Some(t.elapsed());
            }
            if r.first.is_none() {
                r.first = self
                    .first_after(from, after)
                    .map(|d| d.received_at.saturating_duration_since(t));
            }
            if r.caught.is_none() {
                self.absorb();
                if before.iter().all(|k| self.delivered.contains(k)) {
                    r.caught = Some(t.elapsed());
                }
            }
            assert!(
                Instant::now() < deadline,
                "publishing did not resume within {RESUME_TIMEOUT:?} after the majority \
                 returned: {r:?}; worker {:?}; pending {}\nserver log:\n{}",
                self.conn(),
                self.pending(),
                self.pg.log_tail(30)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        r
    }

    /// Stops the producer, drains, and checks the ledger.
    fn finish(mut self, case: &str) {
        let stats = self.producer.take().expect("producer").join();
        eprintln!("HA: producer: {stats:?}");
        self.ledger
            .resolve_unknown(&mut self.client)
            .unwrap_or_else(|e| panic!("resolving unknown outcomes: {e}"));
        Outbox::wait_drained(&mut self.client, Duration::from_secs(300));
        let committed = self.ledger.committed_keys();
        let r = try_eventually(Duration::from_secs(300), || {
            self.absorb();
            let missing = committed
                .iter()
                .filter(|k| !self.delivered.contains(k))
                .count();
            let parked: i64 = self
                .client
                .query_one(
                    "SELECT count(*) FROM amqp.message WHERE parked_at IS NOT NULL",
                    &[],
                )
                .map(|r| r.get(0))
                .unwrap_or(0);
            // Parked rows are not published again: do not wait for them.
            if missing as i64 <= parked {
                Ok(())
            } else {
                Err(format!("{missing} committed messages not delivered yet"))
            }
        });
        let report = self.ledger.check(&self.collector.deliveries());
        let status = Outbox::worker_status(&mut self.client).ok();
        eprintln!("HA: ledger report:\n{report}\nworker counters: {status:?}");
        eprintln!("HA: consumer connections: {}", self.collector.connections());
        for s in &self.steps {
            s.print();
        }
        if let Err(e) = &r {
            eprintln!("HA: not everything arrived: {e}");
        }
        let log = self.pg.log();
        let worker_lines: Vec<&str> = log.lines().filter(|l| l.contains("amqp_outbox")).collect();
        eprintln!(
            "HA: the worker's log lines ({} in all, the last 60):\n{}",
            worker_lines.len(),
            worker_lines[worker_lines.len().saturating_sub(60)..].join("\n")
        );
        self.record_row(case, &report, r.is_ok());
        eprintln!("HA: outbox left: {}", self.outbox_states());
        let faults = self.steps.len().max(1);
        assert!(
            self.violations.is_empty(),
            "high-availability requirements broken:\n- {}\n{report}",
            self.violations.join("\n- ")
        );
        report.assert_at_least_once(faults * (MAX_IN_FLIGHT + CONSUMER_PREFETCH));
        eprintln!(
            "HA RESULT: ledger: {} committed, {} aborted, {} unknown; {} deliveries; lost {}, \
             phantom {}, {} extra copies ({} messages duplicated, all sharing their message_id), \
             {} order violations",
            report.committed,
            report.aborted,
            report.unknown,
            report.delivered,
            report.lost.len(),
            report.phantom.len(),
            report.extra_copies(),
            report.duplicates.len(),
            report.order_violations.len()
        );
    }
}

impl Ha {
    /// Appends a row to the fault suite's results table when `AMQP_OUTBOX_CHAOS_RESULTS` names
    /// it (as `make chaos` does), in its tab-separated format: case, messages, committed, lost,
    /// phantom, extra copies, order violations, heal (the slowest resume), peak memory, rows
    /// left, status, note (every step's resume times).
    fn record_row(&mut self, case: &str, report: &amqp_outbox_e2e::Report, all_arrived: bool) {
        let Some(path) = std::env::var_os("AMQP_OUTBOX_CHAOS_RESULTS") else {
            return;
        };
        let slowest = self.steps.iter().filter_map(|s| s.first_new_delivery).max();
        let notes: Vec<String> = self
            .steps
            .iter()
            .map(|s| {
                format!(
                    "{}: first new delivery {}",
                    s.name,
                    s.first_new_delivery
                        .map(|d| format!("{:.2}s", d.as_secs_f64()))
                        .unwrap_or_else(|| "-".into())
                )
            })
            .collect();
        let ok = all_arrived
            && report.lost.is_empty()
            && report.phantom.is_empty()
            && report.duplicates_with_differing_ids().is_empty();
        let line = format!(
            "{case} ({} steps)\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t-\t{}\t{}\t{}\n",
            self.steps.len(),
            report.committed + report.aborted + report.unknown,
            report.committed,
            report.lost.len(),
            report.phantom.len(),
            report.extra_copies(),
            report.order_violations.len(),
            slowest
                .map(|d| format!("{:.1}s", d.as_secs_f64()))
                .unwrap_or_else(|| "-".into()),
            Outbox::rows(&mut self.client)
                .map(|n| n.to_string())
                .unwrap_or_else(|_| "-".into()),
            if ok { "PASS" } else { "FAIL" },
            notes.join("; ")
        );
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
        {
            let _ = f.write_all(line.as_bytes());
        }
    }
}

/// The worker's node killed (failover), then a majority down (stall) and back: about 75 s.
/// Runs in `make test`.
#[test]
fn ha_short_failover_and_majority_loss() {
    let mut ha = Ha::new(Duration::from_millis(20));
    ha.kill_workers_node();
    ha.kill_majority(Duration::from_secs(10));
    ha.finish("HA short: failover, majority loss");
}

/// In `make chaos`: the worker's node, the quorum queue's leader, a minority, a majority.
#[test]
#[ignore = "slow (several minutes: four node failures of a three-node cluster); run by make chaos"]
fn ha_full_cluster_failures() {
    let mut ha = Ha::new(Duration::from_millis(10));
    ha.kill_workers_node();
    ha.kill_leader();
    ha.kill_minority();
    ha.kill_majority(Duration::from_secs(30));
    // Once more, after everything has moved around.
    ha.kill_workers_node();
    ha.finish("HA full: node, leader, minority, majority");
}
