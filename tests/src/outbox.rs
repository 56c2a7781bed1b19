//! Helpers around the extension's SQL API: installing it, pointing it at a broker, watching
//! the outbox table, and producer threads that publish while recording into a [`Ledger`].

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use postgres::Client;
use rand::Rng;

use crate::ledger::{Ledger, MessageKey};
use crate::rabbit::AmqpEndpoint;
use crate::{eventually, PgCluster};

/// The extension installed in a test database, and one broker row.
pub struct Outbox {
    pub broker_id: i32,
}

impl Outbox {
    /// `CREATE EXTENSION amqp_outbox` and one `amqp.broker` row for `endpoint`.
    pub fn install(client: &mut Client, endpoint: &AmqpEndpoint) -> Outbox {
        create_extension(client);
        Outbox {
            broker_id: add_broker(client, endpoint),
        }
    }

    /// Rows in `amqp.message` that are not parked (still to be delivered).
    pub fn pending(client: &mut Client) -> Result<i64, String> {
        client
            .query_one(
                "SELECT count(*) FROM amqp.message WHERE parked_at IS NULL",
                &[],
            )
            .map(|r| r.get(0))
            .map_err(|e| format!("counting amqp.message: {e}"))
    }

    /// Rows to `exchange` the broker refused with 404 (tried, waiting for their retry).
    pub fn refused_with_404(client: &mut Client, exchange: &str) -> Result<i64, String> {
        client
            .query_one(
                "SELECT count(*) FROM amqp.message WHERE exchange = $1 AND attempts > 0 \
                    AND last_error LIKE '%404%'",
                &[&exchange],
            )
            .map(|r| r.get(0))
            .map_err(|e| format!("counting refused rows to {exchange}: {e}"))
    }

    /// All rows in `amqp.message`.
    pub fn rows(client: &mut Client) -> Result<i64, String> {
        client
            .query_one("SELECT count(*) FROM amqp.message", &[])
            .map(|r| r.get(0))
            .map_err(|e| format!("counting amqp.message: {e}"))
    }

    /// Waits until no unparked row is left (everything delivered and deleted).
    pub fn wait_drained(client: &mut Client, timeout: Duration) {
        eventually(
            timeout,
            "amqp.message to drain (no unparked rows)",
            || match Outbox::pending(client)? {
                0 => Ok(()),
                n => Err(format!("{n} rows pending")),
            },
        );
    }

    /// `amqp.publish(broker_id, exchange, routing_key, body)`, committed on its own.
    pub fn publish(&self, client: &mut Client, exchange: &str, routing_key: &str, body: &str) {
        client
            .execute(
                "SELECT amqp.publish($1, $2, $3, $4)",
                &[&self.broker_id, &exchange, &routing_key, &body],
            )
            .unwrap_or_else(|e| panic!("amqp.publish({exchange}, {routing_key}, {body}): {e}"));
    }
}

/// One row of `amqp.worker_status`: the worker's pid and its counters since the server started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerStatus {
    pub worker_pid: Option<i32>,
    pub published: i64,
    pub confirmed: i64,
    pub acknowledged: i64,
    pub resent_lost: i64,
    pub resent_timeout: i64,
    pub failed: i64,
    pub parked: i64,
    pub steps: i64,
    pub commit_wakeups: i64,
}

/// One row of `amqp.message_status`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MessageStatus {
    pub id: i64,
    /// pending, in_flight, awaiting_ack, retry_wait or parked.
    pub state: String,
    pub attempts: i32,
    pub last_error: Option<String>,
}

impl Outbox {
    /// This database's row of `amqp.worker_status`.
    pub fn worker_status(client: &mut Client) -> Result<WorkerStatus, String> {
        let row = client
            .query_one(
                "SELECT worker_pid, published, confirmed, acknowledged, resent_lost, \
                        resent_timeout, failed, parked, steps, commit_wakeups \
                   FROM amqp.worker_status WHERE database = current_database()",
                &[],
            )
            .map_err(|e| format!("amqp.worker_status: {e}"))?;
        Ok(WorkerStatus {
            worker_pid: row.get(0),
            published: row.get(1),
            confirmed: row.get(2),
            acknowledged: row.get(3),
            resent_lost: row.get(4),
            resent_timeout: row.get(5),
            failed: row.get(6),
            parked: row.get(7),
            steps: row.get(8),
            commit_wakeups: row.get(9),
        })
    }

    /// The row of `amqp.message_status` for this message id, if it is still in the outbox.
    pub fn message_status(client: &mut Client, id: i64) -> Result<Option<MessageStatus>, String> {
        let row = client
            .query_opt(
                "SELECT id, state, attempts, last_error FROM amqp.message_status WHERE id = $1",
                &[&id],
            )
            .map_err(|e| format!("amqp.message_status: {e}"))?;
        Ok(row.map(|r| MessageStatus {
            id: r.get(0),
            state: r.get(1),
            attempts: r.get(2),
            last_error: r.get(3),
        }))
    }

    /// Every row of `amqp.message_status`, by id.
    pub fn message_statuses(client: &mut Client) -> Result<Vec<MessageStatus>, String> {
        let rows = client
            .query(
                "SELECT id, state, attempts, last_error FROM amqp.message_status ORDER BY id",
                &[],
            )
            .map_err(|e| format!("amqp.message_status: {e}"))?;
        Ok(rows
            .iter()
            .map(|r| MessageStatus {
                id: r.get(0),
                state: r.get(1),
                attempts: r.get(2),
                last_error: r.get(3),
            })
            .collect())
    }

    /// The name of this database's acknowledgement queue on the broker:
    /// `amqp_outbox.ack.<system identifier, hex>.<database oid, hex>`.
    pub fn ack_queue_name(client: &mut Client) -> String {
        client
            .query_one(
                "SELECT 'amqp_outbox.ack.' || to_hex(s.system_identifier) || '.' || \
                        to_hex(d.oid::bigint) \
                   FROM pg_catalog.pg_control_system() s, pg_catalog.pg_database d \
                  WHERE d.datname = pg_catalog.current_database()",
                &[],
            )
            .map(|r| r.get(0))
            .unwrap_or_else(|e| panic!("computing the acknowledgement queue name: {e}"))
    }
}

pub fn create_extension(client: &mut Client) {
    client
        .batch_execute("CREATE EXTENSION amqp_outbox")
        .unwrap_or_else(|e| panic!("CREATE EXTENSION amqp_outbox: {e}"));
}

/// Inserts an `amqp.broker` row with this `proof` ('ack_queue' or 'confirm'); returns its
/// broker_id.
pub fn add_broker_with_proof(client: &mut Client, endpoint: &AmqpEndpoint, proof: &str) -> i32 {
    let port = i32::from(endpoint.port);
    client
        .query_one(
            "INSERT INTO amqp.broker (host, port, vhost, username, password, proof) \
             VALUES ($1, $2, $3, $4, $5, $6) RETURNING broker_id",
            &[
                &endpoint.host,
                &port,
                &endpoint.vhost,
                &endpoint.username,
                &endpoint.password,
                &proof,
            ],
        )
        .map(|r| r.get(0))
        .unwrap_or_else(|e| panic!("INSERT INTO amqp.broker (proof {proof}): {e}"))
}

/// Inserts an `amqp.broker` row; returns its broker_id.
pub fn add_broker(client: &mut Client, endpoint: &AmqpEndpoint) -> i32 {
    let port = i32::from(endpoint.port);
    client
        .query_one(
            "INSERT INTO amqp.broker (host, port, vhost, username, password) \
             VALUES ($1, $2, $3, $4, $5) RETURNING broker_id",
            &[
                &endpoint.host,
                &port,
                &endpoint.vhost,
                &endpoint.username,
                &endpoint.password,
            ],
        )
        .map(|r| r.get(0))
        .unwrap_or_else(|e| panic!("INSERT INTO amqp.broker: {e}"))
}

/// How a [`Producer`] publishes.
#[derive(Clone, Debug)]
pub struct ProducerConfig {
    /// The producer part of every [`MessageKey`] (unique per producer).
    pub name: String,
    pub broker_id: i32,
    pub exchange: String,
    pub routing_key: String,
    /// Stop after this many committed messages (aborted ones do not count).
    pub max_messages: u64,
    /// Each transaction publishes 1..=max_batch messages.
    pub max_batch: usize,
    /// Probability that a transaction ends in ROLLBACK instead of COMMIT.
    pub rollback_ratio: f64,
    /// Pause between transactions (to spread a stream over time; not a synchronisation).
    pub pause: Duration,
}

impl ProducerConfig {
    /// 1000 messages in transactions of 1..=10, no rollbacks, no pause.
    pub fn new(name: &str, broker_id: i32, exchange: &str, routing_key: &str) -> ProducerConfig {
        ProducerConfig {
            name: name.to_string(),
            broker_id,
            exchange: exchange.to_string(),
            routing_key: routing_key.to_string(),
            max_messages: 1000,
            max_batch: 10,
            rollback_ratio: 0.0,
            pause: Duration::ZERO,
        }
    }
}

#[derive(Clone, Copy, Debug, Default)]
pub struct ProducerStats {
    pub committed: u64,
    pub aborted: u64,
    pub unknown: u64,
    pub transactions: u64,
    pub reconnects: u64,
}

/// A thread that publishes `producer:seq` bodies in transactions and records every outcome in
/// the ledger. Ends after `max_messages` committed messages, or when stopped.
pub struct Producer {
    handle: Option<JoinHandle<Result<ProducerStats, String>>>,
    stop: Arc<AtomicBool>,
    published: Arc<AtomicU64>,
    pub name: String,
}

impl Producer {
    pub fn spawn(cluster: &PgCluster, config: ProducerConfig, ledger: Arc<Ledger>) -> Producer {
        let conninfo = cluster.connection_string(&cluster.config().database);
        cluster
            .client()
            .batch_execute(crate::ledger::CREATE_COMMIT_TOKENS)
            .unwrap_or_else(|e| panic!("creating the producers' commit-token table: {e}"));
        let stop = Arc::new(AtomicBool::new(false));
        let published = Arc::new(AtomicU64::new(0));
        let name = config.name.clone();
        let handle = {
            let stop = stop.clone();
            let published = published.clone();
            std::thread::Builder::new()
                .name(format!("producer-{}", config.name))
                .spawn(move || produce(&conninfo, &config, &ledger, &stop, &published))
                .expect("spawn producer thread")
        };
        Producer {
            handle: Some(handle),
            stop,
            published,
            name,
        }
    }

    /// `n` producers with `template`'s settings, named `<template.name>0`, `<template.name>1`, …
    pub fn spawn_group(
        cluster: &PgCluster,
        template: &ProducerConfig,
        n: usize,
        ledger: &Arc<Ledger>,
    ) -> Vec<Producer> {
        (0..n)
            .map(|i| {
                let config = ProducerConfig {
                    name: format!("{}{i}", template.name),
                    ..template.clone()
                };
                Producer::spawn(cluster, config, ledger.clone())
            })
            .collect()
    }

    /// Messages whose transaction has ended (any outcome) so far.
    pub fn published(&self) -> u64 {
        self.published.load(Ordering::Relaxed)
    }

    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    pub fn is_finished(&self) -> bool {
        self.handle.as_ref().is_none_or(|h| h.is_finished())
    }

    /// Stops (if still running) and waits; panics if the producer failed.
    pub fn join(mut self) -> ProducerStats {
        self.finish()
    }

    /// Waits for the producer to end by itself (after `max_messages`).
    pub fn wait(mut self) -> ProducerStats {
        match self.handle.take().map(|h| h.join()) {
            Some(Ok(Ok(stats))) => stats,
            Some(Ok(Err(e))) => panic!("producer {} failed: {e}", self.name),
            Some(Err(_)) => panic!("producer {} panicked", self.name),
            None => ProducerStats::default(),
        }
    }

    fn finish(&mut self) -> ProducerStats {
        self.stop();
        match self.handle.take().map(|h| h.join()) {
            Some(Ok(Ok(stats))) => stats,
            Some(Ok(Err(e))) => panic!("producer {} failed: {e}", self.name),
            Some(Err(_)) => panic!("producer {} panicked", self.name),
            None => ProducerStats::default(),
        }
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        self.stop();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn connect_retrying(conninfo: &str, stop: &AtomicBool) -> Result<Client, String> {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        match Client::connect(conninfo, postgres::NoTls) {
            Ok(c) => return Ok(c),
            Err(e) => {
                if std::time::Instant::now() > deadline || stop.load(Ordering::Relaxed) {
                    return Err(format!("cannot (re)connect: {e}"));
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

fn produce(
    conninfo: &str,
    cfg: &ProducerConfig,
    ledger: &Ledger,
    stop: &AtomicBool,
    published: &AtomicU64,
) -> Result<ProducerStats, String> {
    let mut stats = ProducerStats::default();
    let mut rng = rand::thread_rng();
    let mut client = connect_retrying(conninfo, stop)?;
    let mut seq: u64 = 0;
    // Prepared once per connection (forgotten on reconnect).
    let mut stmt: Option<(postgres::Statement, postgres::Statement)> = None;
    while stats.committed < cfg.max_messages && !stop.load(Ordering::Relaxed) {
        let n = rng
            .gen_range(1..=cfg.max_batch.max(1))
            .min((cfg.max_messages - stats.committed) as usize);
        let keys: Vec<MessageKey> = (0..n as u64)
            .map(|i| MessageKey::new(&cfg.name, seq + i))
            .collect();
        seq += n as u64;
        let rollback = rng.gen_bool(cfg.rollback_ratio.clamp(0.0, 1.0));
        // The transaction's token (see Outcome::Unknown): its first key.
        let token = keys[0].to_string();
        // Everything up to COMMIT: an error here means the transaction did not commit.
        let body = (|| -> Result<Option<String>, postgres::Error> {
            client.batch_execute("BEGIN")?;
            let xid: String = client
                .query_one("SELECT pg_catalog.pg_current_xact_id()::text", &[])?
                .get(0);
            if stmt.is_none() {
                stmt = Some((
                    client.prepare("SELECT amqp.publish($1, $2, $3, $4)")?,
                    client.prepare(crate::ledger::INSERT_COMMIT_TOKEN)?,
                ));
            }
            let (st, token_st) = stmt.as_ref().expect("prepared above");
            client.execute(token_st, &[&token])?;
            for k in &keys {
                client.execute(
                    st,
                    &[&cfg.broker_id, &cfg.exchange, &cfg.routing_key, &k.body()],
                )?;
            }
            Ok(Some(xid))
        })();
        stats.transactions += 1;
        match body {
            Err(e) => {
                ledger.aborted(&keys);
                stats.aborted += n as u64;
                if client.is_closed() {
                    client = connect_retrying(conninfo, stop)?;
                    stmt = None;
                    stats.reconnects += 1;
                } else {
                    let _ = client.batch_execute("ROLLBACK");
                    if e.as_db_error().is_none() {
                        return Err(format!("publishing {}: {e}", keys[0]));
                    }
                }
            }
            Ok(xid) => {
                if rollback {
                    match client.batch_execute("ROLLBACK") {
                        Ok(()) => {}
                        Err(_) if client.is_closed() => {
                            client = connect_retrying(conninfo, stop)?;
                            stmt = None;
                            stats.reconnects += 1;
                        }
                        Err(e) => return Err(format!("ROLLBACK: {e}")),
                    }
                    ledger.aborted(&keys);
                    stats.aborted += n as u64;
                } else {
                    match client.batch_execute("COMMIT") {
                        Ok(()) => {
                            ledger.committed(&keys);
                            stats.committed += n as u64;
                        }
                        Err(e) if e.as_db_error().is_some() && !client.is_closed() => {
                            // The server answered COMMIT with an error: rolled back.
                            ledger.aborted(&keys);
                            stats.aborted += n as u64;
                        }
                        Err(_) => {
                            ledger.unknown(&keys, xid, Some(token));
                            stats.unknown += n as u64;
                            client = connect_retrying(conninfo, stop)?;
                            stmt = None;
                            stats.reconnects += 1;
                        }
                    }
                }
            }
        }
        published.fetch_add(n as u64, Ordering::Relaxed);
        if !cfg.pause.is_zero() {
            std::thread::sleep(cfg.pause);
        }
    }
    Ok(stats)
}
