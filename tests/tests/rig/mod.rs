//! The rig the subscription tests share (tests/tests/inbox.rs, tests/tests/lanes.rs): one
//! private cluster serving a producer and a consumer database, the effect tables and their
//! handlers, and the waits and readings the tests use.
#![allow(dead_code)] // each test file uses its part

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use amqp_outbox_e2e::outbox::{add_broker, create_extension};
use amqp_outbox_e2e::{eventually, AmqpEndpoint, Outbox, PgCluster, PgConfig, Rabbit, Received};
use postgres::error::SqlState;
use postgres::{Client, NoTls};
use serde_json::Value;

pub const PRODUCER: &str = "producer";
pub const CONSUMER: &str = "consumer";
/// The subscription worker's backend_type.
pub const SUB_WORKER: &str = "amqp_outbox subscriptions";

pub const UP: Duration = Duration::from_secs(40);
pub const ARRIVAL: Duration = Duration::from_secs(30);
pub const BULK: Duration = Duration::from_secs(240);

// ------------------------------------------------------------------------------------------
// The rig: one cluster, a producer and a consumer database.
// ------------------------------------------------------------------------------------------

/// Deletes the databases' acknowledgement queues from the broker when dropped (after the
/// cluster stopped, so no worker declares them again).
pub struct AckQueues {
    pub endpoint: AmqpEndpoint,
    pub names: Vec<String>,
}

impl Drop for AckQueues {
    fn drop(&mut self) {
        if let Ok(r) = Rabbit::connect(self.endpoint.clone()) {
            for n in &self.names {
                let _ = r.delete_queue(n);
            }
        }
    }
}

/// A cluster serving `producer` and `consumer`, the extension and one broker row in each.
/// Fields drop in order: clients, cluster (stopped), then the acknowledgement queues.
pub struct Pair {
    pub producer: Client,
    pub consumer: Client,
    pub cluster: PgCluster,
    pub _acks: AckQueues,
    pub producer_broker: i32,
    pub consumer_broker: i32,
}

impl Pair {
    pub fn new(endpoint: &AmqpEndpoint, settings: &[(&str, String)]) -> Pair {
        let mut config = PgConfig {
            database: PRODUCER.to_string(),
            ..PgConfig::default()
        }
        // Written after the harness's own `amqp_outbox.database` line: the last one wins.
        .setting("amqp_outbox.database", format!("'{PRODUCER}, {CONSUMER}'"));
        for (name, value) in settings {
            config = config.setting(name, value);
        }
        let cluster = PgCluster::new(config);
        cluster
            .client_db("postgres")
            .batch_execute(&format!("CREATE DATABASE {CONSUMER}"))
            .expect("CREATE DATABASE consumer");
        let mut producer = cluster.client_db(PRODUCER);
        let mut consumer = cluster.client_db(CONSUMER);
        create_extension(&mut producer);
        create_extension(&mut consumer);
        let producer_broker = add_broker(&mut producer, endpoint);
        let consumer_broker = add_broker(&mut consumer, endpoint);
        let acks = AckQueues {
            endpoint: endpoint.clone(),
            names: vec![
                Outbox::ack_queue_name(&mut producer),
                Outbox::ack_queue_name(&mut consumer),
            ],
        };
        let mut pair = Pair {
            producer,
            consumer,
            cluster,
            _acks: acks,
            producer_broker,
            consumer_broker,
        };
        pair.wait_sub_worker(None);
        pair
    }

    pub fn conninfo(&self, db: &str) -> String {
        self.cluster.connection_string(db)
    }

    /// The subscription worker of the consumer database, once it is up (and not `not`).
    pub fn wait_sub_worker(&mut self, not: Option<i32>) -> i32 {
        let cluster = &self.cluster;
        let client = &mut self.consumer;
        eventually(
            UP,
            "the consumer database's subscription worker in pg_stat_activity",
            || {
                reconnect_if_closed(cluster, client, CONSUMER)?;
                match sub_worker_pid(client, CONSUMER) {
                    Ok(Some(p)) if Some(p) != not => Ok(p),
                    Ok(other) => Err(format!(
                        "worker {other:?}; log tail:\n{}",
                        cluster.log_tail(8)
                    )),
                    Err(e) => {
                        if let Ok(c) = cluster.try_client_db(CONSUMER) {
                            *client = c;
                        }
                        Err(e)
                    }
                }
            },
        )
    }

    /// Reconnects both clients (after a crash restart of the cluster).
    pub fn reconnect(&mut self) {
        let cluster = &self.cluster;
        let (p, c) = (&mut self.producer, &mut self.consumer);
        eventually(UP, "connections to both databases again", || {
            *p = cluster.try_client_db(PRODUCER)?;
            *c = cluster.try_client_db(CONSUMER)?;
            p.batch_execute("SELECT 1").map_err(|e| e.to_string())?;
            c.batch_execute("SELECT 1").map_err(|e| e.to_string())
        });
    }

    /// Publishes `bodies` as text from the producer database, in one transaction.
    pub fn publish_bodies(&mut self, ex: &str, rk: &str, bodies: &[String]) {
        self.producer
            .query_one(
                "SELECT count(amqp.publish($1, $2, $3, b)) FROM unnest($4::text[]) b",
                &[&self.producer_broker, &ex, &rk, &bodies],
            )
            .unwrap_or_else(|e| panic!("publishing {} bodies: {e}", bodies.len()));
    }

    pub fn server_log(&self) -> String {
        self.cluster.log_tail(40)
    }
}

pub fn reconnect_if_closed(
    cluster: &PgCluster,
    client: &mut Client,
    db: &str,
) -> Result<(), String> {
    if client.is_closed() {
        *client = cluster.try_client_db(db)?;
    }
    Ok(())
}

/// The pid of `db`'s subscription worker, if it is in `pg_stat_activity`.
pub fn sub_worker_pid(client: &mut Client, db: &str) -> Result<Option<i32>, String> {
    client
        .batch_execute("SELECT pg_catalog.pg_stat_clear_snapshot()")
        .map_err(|e| e.to_string())?;
    let rows = client
        .query(
            "SELECT pid FROM pg_catalog.pg_stat_activity WHERE backend_type = $1 AND datname = $2",
            &[&SUB_WORKER, &db],
        )
        .map_err(|e| format!("pg_stat_activity: {e}"))?;
    match rows.len() {
        0 => Ok(None),
        1 => Ok(Some(rows[0].get(0))),
        n => Err(format!("{n} subscription workers for database {db}")),
    }
}

/// The amount carried by message `n`.
pub fn amount(n: i64) -> i64 {
    (n * 7919) % 1000 + 1
}

pub fn publish_range(
    client: &mut Client,
    broker: i32,
    ex: &str,
    rk: &str,
    from: i32,
    to: i32,
) -> Result<(), String> {
    client
        .query_one(
            "SELECT count(amqp.publish($1, $2, $3, \
                 json_build_object('n', g, 'amount', (g::bigint * 7919) % 1000 + 1)::text)) \
               FROM generate_series($4::int, $5::int - 1) g",
            &[&broker, &ex, &rk, &from, &to],
        )
        .map(drop)
        .map_err(|e| format!("publishing {from}..{to}: {e}"))
}

/// The effect table and the handler that fills it (one row per handler call: a duplicate call
/// would show as a second row).
pub const EFFECT_SCHEMA: &str = "
    CREATE TABLE public.effect (
        message_id text NOT NULL,
        n integer NOT NULL,
        amount bigint NOT NULL,
        redelivered boolean,
        attempt integer,
        at timestamptz NOT NULL DEFAULT clock_timestamp()
    );
    CREATE FUNCTION public.apply_effect(d amqp.delivery) RETURNS void
        LANGUAGE plpgsql AS $fn$
    DECLARE
        b jsonb := amqp.body_text(d)::jsonb;
    BEGIN
        INSERT INTO public.effect (message_id, n, amount, redelivered, attempt)
        VALUES (d.message_id, (b->>'n')::integer, (b->>'amount')::bigint, d.redelivered, d.attempt);
    END
    $fn$;";

/// Text bodies, one row per handler call; `bad:` bodies fail (until the handler is replaced).
pub const APPLIED_SCHEMA: &str = "
    CREATE TABLE public.applied (
        subscription text NOT NULL,
        message_id text NOT NULL,
        body text NOT NULL,
        attempt integer
    );
    CREATE FUNCTION public.apply_text(d amqp.delivery) RETURNS void
        LANGUAGE plpgsql AS $fn$
    BEGIN
        IF amqp.body_text(d) LIKE 'bad:%' THEN
            RAISE EXCEPTION 'e2e refuses %', amqp.body_text(d);
        END IF;
        INSERT INTO public.applied VALUES (d.subscription, d.message_id, amqp.body_text(d), d.attempt);
    END
    $fn$;";

/// The handler without its refusal.
pub const FIXED_HANDLER: &str = "
    CREATE OR REPLACE FUNCTION public.apply_text(d amqp.delivery) RETURNS void
        LANGUAGE plpgsql AS $fn$
    BEGIN
        INSERT INTO public.applied VALUES (d.subscription, d.message_id, amqp.body_text(d), d.attempt);
    END
    $fn$;";

pub fn subscribe(
    c: &mut Client,
    name: &str,
    broker: i32,
    queue: &str,
    handler: &str,
    max_attempts: i32,
    dlx: Option<&str>,
) {
    c.execute(
        "SELECT amqp.subscribe($1, $2, $3, $4::text::regprocedure, \
                               max_attempts => $5, dead_letter_exchange => $6)",
        &[&name, &broker, &queue, &handler, &max_attempts, &dlx],
    )
    .unwrap_or_else(|e| panic!("amqp.subscribe({name}, {queue}, {handler}): {e:?}"));
}

/// One row of `amqp.subscription_status`.
#[derive(Clone, Debug, Default)]
#[allow(dead_code)] // fields are read through Debug in failure messages
pub struct SubStatus {
    pub state: String,
    pub consumer_connected: bool,
    pub delivered: i64,
    pub handled: i64,
    pub duplicates: i64,
    pub failed: i64,
    pub dead_lettered: i64,
    pub retrying: i64,
    pub dead: i64,
    pub last_error: Option<String>,
    pub lag: Option<i64>,
}

pub fn sub_status(c: &mut Client, name: &str) -> Result<SubStatus, String> {
    let row = c
        .query_opt(
            "SELECT state, consumer_connected, delivered, handled, duplicates, failed, \
                    dead_lettered, retrying, dead, last_error, lag \
               FROM amqp.subscription_status WHERE subscription = $1",
            &[&name],
        )
        .map_err(|e| format!("amqp.subscription_status: {e}"))?
        .ok_or_else(|| format!("no subscription {name} in amqp.subscription_status"))?;
    Ok(SubStatus {
        state: row.get(0),
        consumer_connected: row.get(1),
        delivered: row.get(2),
        handled: row.get(3),
        duplicates: row.get(4),
        failed: row.get(5),
        dead_lettered: row.get(6),
        retrying: row.get(7),
        dead: row.get(8),
        last_error: row.get(9),
        lag: row.get(10),
    })
}

pub fn wait_state(pair: &mut Pair, name: &str, state: &str) -> SubStatus {
    wait_status(pair, name, &format!("became {state}"), |s| s.state == state).0
}

/// Waits until the subscription's status passes `done`; returns it with the states (state and
/// last error) seen before it, in order. On a timeout, fails with those, the last status and the
/// server's log.
pub fn wait_status(
    pair: &mut Pair,
    name: &str,
    what: &str,
    done: impl Fn(&SubStatus) -> bool,
) -> (SubStatus, Vec<String>) {
    let mut last = SubStatus::default();
    let mut seen: Vec<String> = Vec::new();
    let r = amqp_outbox_e2e::try_eventually(UP, || {
        let s = sub_status(&mut pair.consumer, name)?;
        last = s.clone();
        if done(&s) {
            return Ok(s);
        }
        let now = format!("{} / {:?}", s.state, s.last_error);
        if seen.last() != Some(&now) {
            seen.push(now);
        }
        Err(format!("{s:?}"))
    });
    match r {
        Ok(s) => (s, seen),
        Err(e) => panic!(
            "subscription {name} never {what}: {e}\nlast: {last:?}\nstates seen: {seen:#?}\n\
             --- server log ---\n{}",
            pair.server_log()
        ),
    }
}

/// Waits until the subscription is in `error` saying that its queue is missing. The status is
/// written by the worker as it goes, and only this end state is the contract: another error
/// seen on the way is printed, not failed on.
pub fn wait_missing_queue_error(pair: &mut Pair, name: &str) {
    let (_, seen) = wait_status(pair, name, "said its queue is missing", |s| {
        let err = s.last_error.clone().unwrap_or_default().to_lowercase();
        s.state == "error"
            && (err.contains("not_found") || err.contains("404") || err.contains("no queue"))
    });
    if seen.iter().any(|st| st.starts_with("error")) {
        eprintln!("subscription {name}: other errors before the missing queue: {seen:?}");
    }
}

/// Waits until `lag` (the queue's ready count as the broker last reported it, every few
/// seconds) shows the drained queue.
pub fn wait_lag_zero(c: &mut Client, name: &str) {
    eventually(
        ARRIVAL,
        "subscription_status.lag to show the empty queue",
        || {
            let s = sub_status(c, name)?;
            if s.lag == Some(0) {
                Ok(())
            } else {
                Err(format!("{s:?}"))
            }
        },
    );
}

pub fn scalar_i64(c: &mut Client, sql: &str) -> Result<i64, String> {
    c.query_one(sql, &[])
        .map(|r| r.get::<_, Option<i64>>(0).unwrap_or(0))
        .map_err(|e| format!("{sql}: {e}"))
}

/// (rows, distinct message_ids, distinct n, sum of amounts) of `public.effect`.
pub fn effect_totals(c: &mut Client) -> Result<(i64, i64, i64, i64), String> {
    let r = c
        .query_one(
            "SELECT count(*), count(DISTINCT message_id), count(DISTINCT n), \
                    coalesce(sum(amount), 0)::bigint FROM public.effect",
            &[],
        )
        .map_err(|e| format!("reading public.effect: {e}"))?;
    Ok((r.get(0), r.get(1), r.get(2), r.get(3)))
}

/// message_ids (or n) that were applied more than once.
pub fn effect_duplicates(c: &mut Client) -> Vec<(String, i64)> {
    c.query(
        "SELECT message_id, count(*) FROM public.effect GROUP BY message_id HAVING count(*) > 1 \
          ORDER BY 1 LIMIT 20",
        &[],
    )
    .expect("duplicate effects")
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

pub fn expected_totals(total: i64) -> (i64, i64) {
    (total, (0..total).map(amount).sum())
}

pub fn header_i64(d: &Received, name: &str) -> i64 {
    match d.header(name) {
        Some(Value::Number(n)) => n.as_i64().unwrap_or(-1),
        Some(Value::String(s)) => s.parse().unwrap_or(-1),
        other => panic!("header {name}: {other:?}; headers {:?}", d.headers),
    }
}

pub fn header_str(d: &Received, name: &str) -> String {
    match d.header(name) {
        Some(Value::String(s)) => s.clone(),
        other => panic!("header {name}: {other:?}; headers {:?}", d.headers),
    }
}

/// The SQLSTATE of a statement that must fail.
pub fn expect_sqlstate(c: &mut Client, sql: &str, code: &SqlState) {
    match c.batch_execute(sql) {
        Ok(()) => panic!("`{sql}` succeeded; expected SQLSTATE {}", code.code()),
        Err(e) => assert_eq!(
            e.code(),
            Some(code),
            "`{sql}`: expected SQLSTATE {}, got {e:?}",
            code.code()
        ),
    }
}

/// `produce_idempotently`'s statement for plain messages: `n` and an amount per message.
pub const PUBLISH_PLAIN: &str = "SELECT count(amqp.publish($1, $2, $3, \
     json_build_object('n', g, 'amount', (g::bigint * 7919) % 1000 + 1)::text)) \
   FROM generate_series($4::int, $5::int - 1) g";

/// Publishes transactions of `per` messages (`publish`: a statement of the broker, exchange,
/// routing key and the range of message numbers) until `stop` (at most `max_batches`); each also
/// records its batch number in `public.sent`, so that after a lost connection a batch whose
/// COMMIT outcome is unknown is looked up, and published again only if it did not commit.
/// Returns (batches committed, reconnects).
#[allow(clippy::too_many_arguments)]
pub fn produce_idempotently(
    conninfo: String,
    publish: &'static str,
    broker: i32,
    ex: String,
    rk: String,
    per: i32,
    max_batches: i32,
    stop: Arc<AtomicBool>,
) -> thread::JoinHandle<Result<(i32, u64), String>> {
    thread::spawn(move || {
        let connect = || -> Result<Client, String> {
            amqp_outbox_e2e::try_eventually(UP, || {
                let mut c = Client::connect(&conninfo, NoTls).map_err(|e| e.to_string())?;
                c.batch_execute("SELECT 1").map_err(|e| e.to_string())?;
                Ok(c)
            })
        };
        let mut c = connect()?;
        let mut reconnects = 0u64;
        let mut b = 0;
        while b < max_batches && !stop.load(Ordering::Relaxed) {
            loop {
                let r = (|| -> Result<(), postgres::Error> {
                    let mut tx = c.transaction()?;
                    tx.execute("INSERT INTO public.sent VALUES ($1)", &[&b])?;
                    tx.query_one(publish, &[&broker, &ex, &rk, &(b * per), &(b * per + per)])?;
                    tx.commit()
                })();
                match r {
                    Ok(()) => break,
                    Err(_) => {
                        // A lost connection (the cluster's crash restart), or the server
                        // ending the session: whether it committed is looked up.
                        reconnects += 1;
                        c = connect()?;
                        let done: bool = c
                            .query_one(
                                "SELECT EXISTS (SELECT FROM public.sent WHERE batch = $1)",
                                &[&b],
                            )
                            .map_err(|e| e.to_string())?
                            .get(0);
                        if done {
                            break;
                        }
                    }
                }
            }
            b += 1;
            thread::sleep(Duration::from_millis(100)); // spreads the stream (not a sync)
        }
        Ok((b, reconnects))
    })
}
