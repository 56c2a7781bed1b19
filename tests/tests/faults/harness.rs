//! The fault suite's rig: one PostgreSQL cluster and one RabbitMQ node per case, producers,
//! the consumer and the final delivery check.

use std::sync::Arc;
use std::time::{Duration, Instant};

use amqp_outbox_e2e::chaos::{scale, MemWatch, ResultRow};
use amqp_outbox_e2e::{
    eventually, try_eventually, unique_name, AmqpEndpoint, Collector, Ledger, MessageKey, Outbox,
    Outcome, PgCluster, PgConfig, PrivateRabbit, Producer, ProducerConfig, Received, Report, Route,
};
use postgres::Client;

pub(crate) const WORKER_UP: Duration = Duration::from_secs(60);
pub(crate) const ARRIVAL: Duration = Duration::from_secs(90);
/// The documented duplicate bound per fault: `amqp_outbox.max_in_flight` (default 2000).
pub(crate) const MAX_IN_FLIGHT: usize = 2000;
/// What the test consumer may get twice when its own connection breaks (its prefetch).
pub(crate) const CONSUMER_PREFETCH: usize = 500;

pub(crate) fn drain_timeout() -> Duration {
    Duration::from_secs(240) + Duration::from_secs_f64(120.0 * scale())
}

/// Settings every fault test starts from: quick reconnects, a hung connection detected in
/// seconds, resends after 10 s without proof.
pub(crate) fn base_config() -> PgConfig {
    PgConfig::default()
        .setting("amqp_outbox.retry_backoff_min", 100)
        .setting("amqp_outbox.retry_backoff_max", 1000)
        .setting("amqp_outbox.confirm_timeout", 5000)
        .setting("amqp_outbox.resend_after", 10000)
}

/// One fault test's world: its own RabbitMQ node and PostgreSQL cluster, the extension with one
/// broker row, a route and a consumer, a ledger and the worker's memory watch. Fields drop in
/// order: watch, consumer, route, client, cluster, node.
pub(crate) struct Rig {
    pub(crate) case: &'static str,
    pub(crate) mem: MemWatch,
    pub(crate) collector: Collector,
    pub(crate) route: Route,
    pub(crate) client: Client,
    pub(crate) outbox: Outbox,
    pub(crate) cluster: PgCluster,
    pub(crate) node: PrivateRabbit,
    pub(crate) ledger: Arc<Ledger>,
}

impl Rig {
    pub(crate) fn new(case: &'static str, config: PgConfig) -> Rig {
        Rig::with_node(case, config, PrivateRabbit::start(), None)
    }

    /// With a node already booted, and optionally another login than guest for the broker row.
    pub(crate) fn with_node(
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

    pub(crate) fn producer_config(&self, name: &str) -> ProducerConfig {
        ProducerConfig::new(
            name,
            self.outbox.broker_id,
            &self.route.exchange,
            &self.route.routing_key,
        )
    }

    /// `n` producers named `<prefix>0..`, publishing until stopped (or `max` committed each).
    pub(crate) fn producers(
        &self,
        prefix: &str,
        n: usize,
        max: u64,
        pause_ms: u64,
        rollback: f64,
    ) -> Vec<Producer> {
        let mut cfg = self.producer_config(prefix);
        cfg.max_messages = max;
        cfg.max_batch = 10;
        cfg.rollback_ratio = rollback;
        cfg.pause = Duration::from_millis(pause_ms);
        Producer::spawn_group(&self.cluster, &cfg, n, &self.ledger)
    }

    /// A new connection to the test database (after a crash restart), retried.
    pub(crate) fn reconnect(&mut self) {
        let cluster = &self.cluster;
        self.client = eventually(WORKER_UP, "a connection to the test cluster", || {
            cluster.try_client()
        });
    }

    /// Publishes `key` in a transaction of its own and records it as committed.
    pub(crate) fn publish_key(&mut self, key: &MessageKey) {
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
    pub(crate) fn publish_target(&self) -> ((i32, String, String), String) {
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
    pub(crate) fn wait_more_deliveries(&mut self, since: usize, n: usize, what: &str) {
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

    pub(crate) fn in_flight(&mut self) -> i64 {
        self.client
            .query_one(
                "SELECT coalesce(sum(in_flight), 0)::bigint FROM amqp.broker_status",
                &[],
            )
            .map(|r| r.get(0))
            .unwrap_or(0)
    }

    pub(crate) fn worker_pid(&mut self) -> Option<i32> {
        self.cluster.worker_pid(&mut self.client).ok().flatten()
    }

    /// Deliveries that are not `finish()` markers (and not bodies the test excluded).
    pub(crate) fn deliveries(&self, exclude: &[&str]) -> Vec<Received> {
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
    pub(crate) fn finish(
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

    pub(crate) fn outbox_publish_raw(&mut self, body: &str) -> Result<(), String> {
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

/// The last `n` lines of a log, each cut to 300 characters.
pub(crate) fn short_tail(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..]
        .iter()
        .map(|l| l.chars().take(300).collect::<String>())
        .collect::<Vec<_>>()
        .join("\n")
}

/// Joins the producers and logs their statistics (the test's record of what they did).
pub(crate) fn join_all(producers: Vec<Producer>) -> Vec<amqp_outbox_e2e::ProducerStats> {
    let stats: Vec<_> = producers.into_iter().map(Producer::join).collect();
    eprintln!("producers: {stats:?}");
    stats
}

pub(crate) fn published(ps: &[Producer]) -> u64 {
    ps.iter().map(Producer::published).sum()
}

/// Waits until the producers have ended `n` more messages' transactions.
pub(crate) fn wait_published(ps: &[Producer], n: u64, what: &str) {
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

pub(crate) fn sqlstate(e: &postgres::Error) -> String {
    e.code()
        .map(|c| c.code().to_string())
        .unwrap_or_else(|| format!("no SQLSTATE ({e})"))
}

/// A publish through the outbox in its own transaction, returning the SQLSTATE on error.
pub(crate) fn try_sql(client: &mut Client, sql: &str) -> Result<(), String> {
    client.batch_execute(sql).map_err(|e| sqlstate(&e))
}

/// Publishes `keys` of producer `name` in transactions of `chunk` (one statement each).
pub(crate) fn bulk_publish(
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
