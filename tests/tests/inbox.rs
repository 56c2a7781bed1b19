//! End-to-end tests of the consuming side: `amqp.consume_once()`, subscriptions run by the
//! per-database subscription worker (backend_type `amqp_outbox subscriptions`), failed
//! deliveries in `amqp.inbox_failed`, dead-lettering, receipts and the retention of the
//! consumption records.
//!
//! Most tests run one private cluster serving two databases (`amqp_outbox.database =
//! 'producer, consumer'`): the producer publishes through its outbox, the consumer's
//! subscription handles the queue with a SQL handler that writes its effect into a table, and
//! the effects are checked against what the producer committed (count and sum). Brokers: the
//! shared RabbitMQ (unique names, deleted after), or a private node for the test that restarts
//! the broker.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use amqp_outbox_e2e::chaos::send_signal;
use amqp_outbox_e2e::outbox::create_extension;
use amqp_outbox_e2e::raw_amqp::publish_with_message_id;
use amqp_outbox_e2e::{eventually, unique_name, PgCluster, PrivateRabbit, Rabbit, Route};
use amqp_outbox_testkit::amqp_admin::AmqpAdmin;
use lapin::types::FieldTable;
use lapin::{BasicProperties, ExchangeKind};
use postgres::error::SqlState;
use postgres::{Client, NoTls};
use serde_json::Value;

mod rig;
use rig::*;

// ------------------------------------------------------------------------------------------
// 1. exactly-once effects under duplicates and redeliveries
// ------------------------------------------------------------------------------------------

#[test]
fn effects_are_exactly_once_with_duplicates() {
    const TOTAL: i32 = 10_000;
    const BATCH: i32 = 100;
    const INJECTED: i64 = 300;
    let rabbit = Rabbit::shared();
    let route = rabbit.declare_route("inbox-eo");
    let mut pair = Pair::new(rabbit.endpoint(), &[]);
    pair.consumer
        .batch_execute(EFFECT_SCHEMA)
        .expect("effect schema");
    let broker = pair.consumer_broker;
    subscribe(
        &mut pair.consumer,
        "eo",
        broker,
        &route.queue,
        "public.apply_effect(amqp.delivery)",
        10,
        None,
    );
    wait_state(&mut pair, "eo", "consuming");

    // The producer publishes in transactions of BATCH on its own connection.
    let producer = {
        let conninfo = pair.conninfo(PRODUCER);
        let (b, ex, rk) = (
            pair.producer_broker,
            route.exchange.clone(),
            route.routing_key.clone(),
        );
        thread::spawn(move || -> Result<(), String> {
            let mut c = Client::connect(&conninfo, NoTls).map_err(|e| e.to_string())?;
            for from in (0..TOTAL).step_by(BATCH as usize) {
                publish_range(&mut c, b, &ex, &rk, from, from + BATCH)?;
            }
            Ok(())
        })
    };

    // Mid-stream: pause (the consumer closes; unacknowledged deliveries go back to the queue,
    // redelivered), then resume.
    let wait_effects = |pair: &mut Pair, n: i64, what: &str| {
        eventually(BULK, what, || {
            let t = effect_totals(&mut pair.consumer)?;
            if t.0 >= n {
                Ok(())
            } else {
                Err(format!("{t:?}; {:?}", sub_status(&mut pair.consumer, "eo")))
            }
        })
    };
    wait_effects(&mut pair, 2000, "2000 effects before the pause");
    pair.consumer
        .execute("SELECT amqp.pause_subscription('eo')", &[])
        .expect("pause_subscription");
    wait_state(&mut pair, "eo", "paused");
    eventually(
        ARRIVAL,
        "the paused subscription's consumer gone",
        || match rabbit.queue_counts(&route.queue)? {
            Some(q) if q.consumers == 0 => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    pair.consumer
        .execute("SELECT amqp.resume_subscription('eo')", &[])
        .expect("resume_subscription");
    wait_state(&mut pair, "eo", "consuming");

    // Inject duplicates: copies of already handled messages, same message_id, straight to the
    // queue.
    wait_effects(&mut pair, 4000, "4000 effects before injecting duplicates");
    let copies: Vec<(String, i32, i64)> = pair
        .consumer
        .query(
            "SELECT message_id, n, amount FROM public.effect ORDER BY random() LIMIT $1",
            &[&INJECTED],
        )
        .expect("picking handled messages")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(copies.len() as i64, INJECTED);
    let admin = AmqpAdmin::connect(&rabbit.endpoint().uri()).expect("AMQP client");
    for (message_id, n, amount) in &copies {
        let body = serde_json::json!({"n": n, "amount": amount}).to_string();
        let props = BasicProperties::default()
            .with_message_id(message_id.as_str().into())
            .with_delivery_mode(2);
        admin
            .publish(&route.exchange, &route.routing_key, body.as_bytes(), props)
            .unwrap_or_else(|e| panic!("re-publishing {message_id}: {e}"));
    }
    producer
        .join()
        .expect("producer thread")
        .unwrap_or_else(|e| panic!("producer: {e}"));

    let (count, sum) = expected_totals(i64::from(TOTAL));
    let mut last_status = SubStatus::default();
    let r = amqp_outbox_e2e::try_eventually(BULK, || {
        let t = effect_totals(&mut pair.consumer)?;
        let s = sub_status(&mut pair.consumer, "eo")?;
        last_status = s.clone();
        let ready = rabbit
            .queue_counts(&route.queue)?
            .map(|q| q.messages)
            .unwrap_or(u32::MAX);
        if t.0 >= count && s.duplicates >= INJECTED && ready == 0 {
            Ok(t)
        } else {
            Err(format!("effects {t:?}; queue ready {ready}; {s:?}"))
        }
    });
    let totals = r.unwrap_or_else(|e| {
        panic!(
            "the stream did not complete: {e}\n--- server log ---\n{}",
            pair.server_log()
        )
    });
    let dups = effect_duplicates(&mut pair.consumer);
    assert!(dups.is_empty(), "messages applied twice: {dups:?}");
    assert_eq!(
        totals,
        (count, count, count, sum),
        "effects (rows, distinct ids, distinct n, sum) vs. the producer's ledger"
    );
    let s = sub_status(&mut pair.consumer, "eo").expect("status");
    eprintln!("subscription status at the end: {s:?}");
    assert!(s.duplicates >= INJECTED, "{s:?}");
    assert_eq!(s.handled, count, "handled counter: {s:?}");
    wait_lag_zero(&mut pair.consumer, "eo");
    assert_eq!(s.failed, 0, "{s:?}");
    assert_eq!(
        scalar_i64(&mut pair.consumer, "SELECT count(*) FROM amqp.inbox_failed").unwrap(),
        0
    );
    // Every consumption record once, under the subscription's name.
    assert_eq!(
        scalar_i64(
            &mut pair.consumer,
            "SELECT count(*) FROM amqp.consumption WHERE consumer = 'subscription:eo'"
        )
        .unwrap(),
        count
    );
}

// ------------------------------------------------------------------------------------------
// 2. failures: retried, dead-lettered, retried by hand
// ------------------------------------------------------------------------------------------

#[test]
fn failing_handler_is_retried_dead_lettered_and_retried_by_hand() {
    let rabbit = Rabbit::shared();
    let route = rabbit.declare_route("inbox-fail");
    let dlx = rabbit.declare_route_kind("inbox-dlx", ExchangeKind::Fanout, "");
    let dead_letters = rabbit.consume_connected(&dlx);
    let mut pair = Pair::new(
        rabbit.endpoint(),
        &[
            ("amqp_outbox.retry_backoff_min", "10".into()),
            ("amqp_outbox.retry_backoff_max", "50".into()),
        ],
    );
    pair.consumer
        .batch_execute(APPLIED_SCHEMA)
        .expect("applied schema");
    let broker = pair.consumer_broker;
    subscribe(
        &mut pair.consumer,
        "fail",
        broker,
        &route.queue,
        "public.apply_text(amqp.delivery)",
        3,
        Some(&dlx.exchange),
    );
    wait_state(&mut pair, "fail", "consuming");

    let mut bodies = Vec::new();
    for i in 0..25 {
        bodies.push(if i % 5 == 2 {
            format!("bad:{i}")
        } else {
            format!("good:{i}")
        });
    }
    let bad: BTreeSet<String> = bodies
        .iter()
        .filter(|b| b.starts_with("bad:"))
        .cloned()
        .collect();
    let good: BTreeSet<String> = bodies
        .iter()
        .filter(|b| b.starts_with("good:"))
        .cloned()
        .collect();
    pair.publish_bodies(&route.exchange, &route.routing_key, &bodies);

    let applied = |c: &mut Client| -> Result<Vec<String>, String> {
        c.query("SELECT body FROM public.applied ORDER BY body", &[])
            .map(|rows| rows.iter().map(|r| r.get(0)).collect())
            .map_err(|e| e.to_string())
    };
    eventually(ARRIVAL, "good messages applied, bad ones dead", || {
        let a = applied(&mut pair.consumer)?;
        let dead = scalar_i64(
            &mut pair.consumer,
            "SELECT count(*) FROM amqp.inbox_failed WHERE dead_lettered_at IS NOT NULL",
        )?;
        if a.len() >= good.len() && dead >= bad.len() as i64 {
            Ok(())
        } else {
            Err(format!(
                "{} applied, {dead} dead; {:?}",
                a.len(),
                sub_status(&mut pair.consumer, "fail")
            ))
        }
    });
    let a = applied(&mut pair.consumer).unwrap();
    assert_eq!(
        a.iter().cloned().collect::<BTreeSet<_>>(),
        good,
        "good messages unaffected"
    );
    assert_eq!(a.len(), good.len(), "each good message once: {a:?}");

    // The failed rows: three attempts, dead, the error kept.
    let rows = pair
        .consumer
        .query(
            "SELECT message_id, convert_from(body, 'UTF8'), attempts, last_error, last_sqlstate, \
                    dead_lettered_at IS NOT NULL, next_attempt_at IS NOT NULL \
               FROM amqp.inbox_failed WHERE subscription = 'fail' ORDER BY 2",
            &[],
        )
        .expect("inbox_failed");
    let mut failed_ids = BTreeMap::new();
    for r in &rows {
        let (id, body, attempts, error, sqlstate, dead): (
            String,
            String,
            i32,
            String,
            Option<String>,
            bool,
        ) = (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5));
        assert!(bad.contains(&body), "unexpected failed message {body}");
        assert_eq!(attempts, 3, "{body}: attempts");
        assert!(dead, "{body}: dead_lettered_at");
        assert!(error.contains("e2e refuses"), "{body}: last_error {error}");
        assert_eq!(sqlstate.as_deref(), Some("P0001"), "{body}: last_sqlstate");
        failed_ids.insert(id, body);
    }
    assert_eq!(failed_ids.len(), bad.len(), "one row per bad message");

    // Dead letters on the DLX, through the consumer's outbox, with the headers.
    let letters = dead_letters.wait_for_count(bad.len(), ARRIVAL);
    let mut seen = BTreeSet::new();
    for d in &letters {
        let original = header_str(d, "x-amqp-outbox-original-message-id");
        let body = failed_ids
            .get(&original)
            .unwrap_or_else(|| panic!("dead letter for unknown message {original}: {d:?}"));
        assert_eq!(&d.text(), body, "dead letter body");
        assert!(
            header_str(d, "x-amqp-outbox-error").contains("e2e refuses"),
            "{:?}",
            d.headers
        );
        assert_eq!(
            header_i64(d, "x-amqp-outbox-attempts"),
            3,
            "{:?}",
            d.headers
        );
        assert!(
            seen.insert(original.clone()),
            "{original} dead-lettered twice"
        );
    }
    let s = sub_status(&mut pair.consumer, "fail").unwrap();
    assert_eq!(s.dead, bad.len() as i64, "{s:?}");
    assert_eq!(s.retrying, 0, "{s:?}");
    assert_eq!(s.dead_lettered, bad.len() as i64, "{s:?}");
    assert_eq!(
        s.failed,
        3 * bad.len() as i64,
        "three failed attempts each: {s:?}"
    );

    // Fix the handler and retry by hand: each applied exactly once, the table empty.
    pair.consumer.batch_execute(FIXED_HANDLER).expect("fix");
    let n: i64 = pair
        .consumer
        .query_one("SELECT amqp.inbox_retry('fail')", &[])
        .expect("inbox_retry")
        .get(0);
    assert_eq!(n, bad.len() as i64, "inbox_retry's count");
    let t = Instant::now();
    eventually(ARRIVAL, "the retried messages applied", || {
        let left = scalar_i64(&mut pair.consumer, "SELECT count(*) FROM amqp.inbox_failed")?;
        let a = applied(&mut pair.consumer)?;
        if left == 0 && a.len() >= bodies.len() {
            Ok(())
        } else {
            Err(format!("{left} rows in inbox_failed, {} applied", a.len()))
        }
    });
    eprintln!("inbox_retry took effect in {:?}", t.elapsed());
    let a = applied(&mut pair.consumer).unwrap();
    let all: BTreeSet<String> = bodies.iter().cloned().collect();
    assert_eq!(a.len(), bodies.len(), "each message applied once: {a:?}");
    assert_eq!(a.into_iter().collect::<BTreeSet<_>>(), all);
    let s = sub_status(&mut pair.consumer, "fail").unwrap();
    assert_eq!((s.dead, s.retrying), (0, 0), "{s:?}");
    assert_eq!(dead_letters.len(), bad.len(), "no more dead letters");

    // Unsubscribed: the consumer leaves the queue, the subscription is gone.
    pair.consumer
        .execute("SELECT amqp.unsubscribe('fail')", &[])
        .expect("unsubscribe");
    eventually(ARRIVAL, "the consumer gone from the queue", || match rabbit
        .queue_counts(&route.queue)?
    {
        Some(q) if q.consumers == 0 => Ok(()),
        other => Err(format!("{other:?}")),
    });
    assert!(sub_status(&mut pair.consumer, "fail").is_err());
    expect_sqlstate(
        &mut pair.consumer,
        "SELECT amqp.inbox_retry('fail')",
        &SqlState::UNDEFINED_OBJECT,
    );
}

// ------------------------------------------------------------------------------------------
// 3. the subscription worker killed and the broker restarted mid-stream
// ------------------------------------------------------------------------------------------

#[test]
fn worker_killed_and_rabbit_restarted_mid_stream() {
    // A missing prerequisite fails the test: scripts/setup.sh installs it.
    assert!(
        amqp_outbox_testkit::rabbitmq_installed(),
        "rabbitmq-server is not installed (scripts/setup.sh installs it)"
    );
    let mut node = PrivateRabbit::try_prepare()
        .and_then(|mut n| n.try_boot().map(|()| n))
        .unwrap_or_else(|e| panic!("cannot start a private RabbitMQ node: {e}"));
    // About 100 messages a second until the broker is back: a few thousand in all.
    const PER: i32 = 10;
    const MAX_BATCHES: i32 = 2000;
    let rabbit = node.rabbit();
    let mut route = rabbit.declare_route("inbox-crash");
    route.delete_on_drop = false; // the node goes away with its data
    drop(rabbit);
    let mut pair = Pair::new(
        &node.endpoint(),
        &[
            ("amqp_outbox.retry_backoff_min", "100".into()),
            ("amqp_outbox.retry_backoff_max", "1000".into()),
        ],
    );
    pair.consumer
        .batch_execute(EFFECT_SCHEMA)
        .expect("effect schema");
    pair.producer
        .batch_execute("CREATE TABLE public.sent (batch integer PRIMARY KEY)")
        .expect("sent table");
    let broker = pair.consumer_broker;
    subscribe(
        &mut pair.consumer,
        "crash",
        broker,
        &route.queue,
        "public.apply_effect(amqp.delivery)",
        10,
        None,
    );
    wait_state(&mut pair, "crash", "consuming");
    let stop = Arc::new(AtomicBool::new(false));
    let producer = produce_idempotently(
        pair.conninfo(PRODUCER),
        PUBLISH_PLAIN,
        pair.producer_broker,
        route.exchange.clone(),
        route.routing_key.clone(),
        PER,
        MAX_BATCHES,
        stop.clone(),
    );

    let effects_now = |pair: &mut Pair| -> Result<i64, String> {
        let cluster = &pair.cluster;
        let c = &mut pair.consumer;
        match effect_totals(c) {
            Ok(t) => Ok(t.0),
            Err(e) => {
                if let Ok(n) = cluster.try_client_db(CONSUMER) {
                    *c = n;
                }
                Err(e)
            }
        }
    };
    let wait_more = |pair: &mut Pair, more: i64, what: &str| {
        let from = eventually(UP, "reading the effects", || effects_now(pair));
        eventually(BULK, what, || {
            let n = effects_now(pair)?;
            if n >= from + more {
                Ok(n)
            } else {
                Err(format!(
                    "{} new effects; {:?}",
                    n - from,
                    sub_status(&mut pair.consumer, "crash")
                ))
            }
        })
    };

    // kill -9 of the subscription worker: the postmaster restarts the cluster (crash recovery).
    wait_more(&mut pair, 500, "500 effects before the kill");
    let pid = pair.wait_sub_worker(None);
    send_signal(pid, libc::SIGKILL).expect("SIGKILL the subscription worker");
    pair.reconnect();
    let new_pid = pair.wait_sub_worker(Some(pid));
    // A connection made in the instant before the postmaster noticed the kill is closed by the
    // restart; with the new worker up, the restart is over.
    pair.reconnect();
    eprintln!("subscription worker {pid} killed; now {new_pid}");
    wait_more(&mut pair, 300, "effects again after the kill");

    // RabbitMQ stopped and started again while the producer goes on.
    node.stop();
    let during = effects_now(&mut pair).unwrap_or(0);
    node.boot();
    eprintln!("RabbitMQ restarted at {during} effects");
    wait_more(&mut pair, 300, "effects again after the broker restart");

    let ended_early = producer.is_finished();
    stop.store(true, Ordering::Relaxed);
    let (batches, reconnects) = producer
        .join()
        .expect("producer thread")
        .unwrap_or_else(|e| panic!("producer: {e}"));
    assert!(
        !ended_early,
        "the producer ended ({batches} batches) before the faults were over: not mid-stream"
    );
    let sent = scalar_i64(&mut pair.producer, "SELECT count(*) FROM public.sent").unwrap();
    assert_eq!(sent, i64::from(batches), "every batch committed once");
    let total = i64::from(batches * PER);
    eprintln!("{total} messages in {batches} transactions");
    let (count, sum) = expected_totals(total);
    let admin = node.rabbit();
    let r = amqp_outbox_e2e::try_eventually(BULK, || {
        let t = effect_totals(&mut pair.consumer)?;
        let ready = admin
            .queue_counts(&route.queue)?
            .map(|q| q.messages)
            .unwrap_or(u32::MAX);
        if t.0 >= count && ready == 0 {
            Ok(t)
        } else {
            Err(format!(
                "effects {t:?}; queue ready {ready}; {:?}",
                sub_status(&mut pair.consumer, "crash")
            ))
        }
    });
    let totals = r.unwrap_or_else(|e| {
        panic!(
            "the stream did not complete: {e}\n--- server log ---\n{}",
            pair.server_log()
        )
    });
    let dups = effect_duplicates(&mut pair.consumer);
    assert!(dups.is_empty(), "messages applied twice: {dups:?}");
    assert_eq!(
        totals,
        (count, count, count, sum),
        "effects (rows, distinct ids, distinct n, sum) vs. the producer's ledger"
    );
    let s = sub_status(&mut pair.consumer, "crash").unwrap();
    eprintln!("producer reconnects {reconnects}; status at the end: {s:?}");
    assert_eq!(s.failed, 0, "{s:?}");
    wait_lag_zero(&mut pair.consumer, "crash");
}

// ------------------------------------------------------------------------------------------
// 4. consume_once: racing sessions
// ------------------------------------------------------------------------------------------

fn consume_once(c: &mut Client, consumer: &str, id: &str) -> Result<bool, postgres::Error> {
    c.query_one("SELECT amqp.consume_once($1, $2)", &[&consumer, &id])
        .map(|r| r.get(0))
}

/// Waits until backend `pid` waits for a lock (the second session blocked on the first's
/// uncommitted record).
fn wait_blocked(watch: &mut Client, pid: i32) {
    eventually(ARRIVAL, "the second session to wait for a lock", || {
        watch
            .batch_execute("SELECT pg_catalog.pg_stat_clear_snapshot()")
            .map_err(|e| e.to_string())?;
        let row = watch
            .query_one(
                "SELECT wait_event_type, state FROM pg_stat_activity WHERE pid = $1",
                &[&pid],
            )
            .map_err(|e| e.to_string())?;
        let (wait, state): (Option<String>, Option<String>) = (row.get(0), row.get(1));
        if wait.as_deref() == Some("Lock") {
            Ok(())
        } else {
            Err(format!("wait_event_type {wait:?}, state {state:?}"))
        }
    });
}

#[test]
fn consume_once_race_gives_exactly_one_true() {
    let cluster = PgCluster::with_defaults();
    let mut watch = cluster.client();
    create_extension(&mut watch);
    let conninfo = cluster.connection_string(&cluster.config().database);

    // Sequential: the second waits for the first; commit → false, rollback → true.
    for first_commits in [true, false] {
        let key = unique_name("race-seq");
        let mut a = cluster.client();
        let mut b = cluster.client();
        let b_pid: i32 = b.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
        a.batch_execute("BEGIN").unwrap();
        assert!(consume_once(&mut a, "seq", &key).unwrap(), "first call");
        let k = key.clone();
        let second = thread::spawn(move || {
            b.batch_execute("BEGIN").unwrap();
            let r = consume_once(&mut b, "seq", &k).expect("second consume_once");
            b.batch_execute("COMMIT").unwrap();
            r
        });
        wait_blocked(&mut watch, b_pid);
        assert!(!second.is_finished(), "the second session must wait");
        a.batch_execute(if first_commits { "COMMIT" } else { "ROLLBACK" })
            .unwrap();
        let r = second.join().expect("second session");
        assert_eq!(
            r,
            !first_commits,
            "second session after the first's {}",
            if first_commits { "commit" } else { "rollback" }
        );
        // Recorded once either way: a third call is a duplicate.
        assert!(!consume_once(&mut watch, "seq", &key).unwrap());
    }

    // Business keys: a second message_id with a consumed business key is a duplicate.
    let bk = unique_name("bk");
    let one: bool = watch
        .query_one("SELECT amqp.consume_once('bk', 'm1', $1)", &[&bk])
        .unwrap()
        .get(0);
    let two: bool = watch
        .query_one("SELECT amqp.consume_once('bk', 'm2', $1)", &[&bk])
        .unwrap()
        .get(0);
    assert_eq!((one, two), (true, false), "business key {bk}");

    // Concurrent: two threads race on the same key, 50 times; the first thread rolls back
    // every other time. Among committed calls exactly one is true.
    const ROUNDS: usize = 50;
    let barrier = Arc::new(Barrier::new(2));
    let (key_tx_a, key_rx_a) = mpsc::channel::<String>();
    let (key_tx_b, key_rx_b) = mpsc::channel::<String>();
    let spawn = |rx: mpsc::Receiver<String>, commits: fn(usize) -> bool| {
        let conninfo = conninfo.clone();
        let barrier = barrier.clone();
        thread::spawn(move || -> Vec<(bool, bool)> {
            let mut c = Client::connect(&conninfo, NoTls).expect("connect");
            let mut out = Vec::new();
            for (i, key) in rx.iter().enumerate() {
                barrier.wait();
                c.batch_execute("BEGIN").unwrap();
                let r = consume_once(&mut c, "conc", &key).expect("consume_once");
                let commit = commits(i);
                c.batch_execute(if commit { "COMMIT" } else { "ROLLBACK" })
                    .unwrap();
                out.push((r, commit));
            }
            out
        })
    };
    let ta = spawn(key_rx_a, |i| i % 2 == 0);
    let tb = spawn(key_rx_b, |_| true);
    let keys: Vec<String> = (0..ROUNDS).map(|_| unique_name("race-conc")).collect();
    for k in &keys {
        key_tx_a.send(k.clone()).unwrap();
        key_tx_b.send(k.clone()).unwrap();
    }
    drop((key_tx_a, key_tx_b));
    let ra = ta.join().expect("thread a");
    let rb = tb.join().expect("thread b");
    assert_eq!((ra.len(), rb.len()), (ROUNDS, ROUNDS));
    for i in 0..ROUNDS {
        let (a, a_committed) = ra[i];
        let (b, _) = rb[i];
        let committed_trues = usize::from(a && a_committed) + usize::from(b);
        assert_eq!(
            committed_trues,
            1,
            "round {i}: a = {a} ({}), b = {b} (committed)",
            if a_committed {
                "committed"
            } else {
                "rolled back"
            }
        );
    }
    for k in &keys {
        assert!(!consume_once(&mut watch, "conc", k).unwrap(), "{k} again");
    }
    for t in ["_consumed_a", "_consumed_b"] {
        let n = scalar_i64(
            &mut watch,
            &format!("SELECT count(*) FROM amqp.{t} WHERE consumer = 'conc'"),
        )
        .unwrap();
        assert_eq!(n, ROUNDS as i64, "records in amqp.{t}");
    }
}

// ------------------------------------------------------------------------------------------
// 5. retention without DELETE
// ------------------------------------------------------------------------------------------

#[test]
fn retention_moves_old_records_without_delete() {
    let cluster = PgCluster::with_defaults();
    // A database no worker serves: nothing rotates behind the test's back.
    cluster
        .client_db("postgres")
        .batch_execute("CREATE DATABASE retention")
        .expect("CREATE DATABASE retention");
    let mut c = cluster.client_db("retention");
    create_extension(&mut c);
    let ids = |c: &mut Client, n: i32| -> Vec<String> {
        c.query(
            "SELECT amqp._new_message_id() FROM generate_series(1, $1)",
            &[&n],
        )
        .expect("_new_message_id")
        .iter()
        .map(|r| r.get(0))
        .collect()
    };
    let consume_all = |c: &mut Client, ids: &[String]| -> i64 {
        c.query_one(
            "SELECT count(*) FILTER (WHERE amqp.consume_once('ret', id)) FROM unnest($1::text[]) id",
            &[&ids],
        )
        .expect("consume_once")
        .get(0)
    };
    let since = |c: &mut Client, hot: &str| -> f64 {
        c.query_one(
            "SELECT extract(epoch FROM since)::float8 FROM amqp._consumed_since WHERE hot = $1",
            &[&hot],
        )
        .expect("_consumed_since")
        .get(0)
    };
    let count =
        |c: &mut Client, t: &str| scalar_i64(c, &format!("SELECT count(*) FROM amqp.{t}")).unwrap();
    let rotate = |c: &mut Client| -> String {
        c.query_one("SELECT amqp.rotate_consumption()", &[])
            .expect("rotate_consumption")
            .get(0)
    };
    let now = |c: &mut Client| -> f64 {
        c.query_one("SELECT extract(epoch FROM clock_timestamp())::float8", &[])
            .unwrap()
            .get(0)
    };

    let never_consumed = ids(&mut c, 1).remove(0);
    let old = ids(&mut c, 200);
    assert_eq!(consume_all(&mut c, &old), 200);
    let plain: Vec<String> = (0..50).map(|i| format!("plain-{i}")).collect();
    assert_eq!(consume_all(&mut c, &plain), 50);
    assert_eq!(
        (count(&mut c, "_consumed_a"), count(&mut c, "_consumed_b")),
        (250, 250)
    );

    // Both tables past the window (dedup_window 15 days by default): a is the older one.
    c.batch_execute(
        "UPDATE amqp._consumed_since SET since = now() - interval '40 days' WHERE hot = 'a';
         UPDATE amqp._consumed_since SET since = now() - interval '30 days' WHERE hot = 'b';",
    )
    .unwrap();
    let before = now(&mut c);
    let r1 = rotate(&mut c);
    assert!(
        r1.contains("0 records archived") && r1.contains("hot table a emptied"),
        "first rotation: {r1}"
    );
    assert_eq!(
        (count(&mut c, "_consumed_a"), count(&mut c, "_consumed_b")),
        (0, 250)
    );
    let a_since = since(&mut c, "a");
    assert!(a_since >= before, "a's since moved: {a_since} < {before}");

    // Records made after a was emptied are in both tables.
    let young = ids(&mut c, 100);
    assert_eq!(consume_all(&mut c, &young), 100);
    // a has covered the window (pretend): b's own records go to the archive, b is emptied.
    c.batch_execute(
        "UPDATE amqp._consumed_since SET since = now() - interval '16 days' WHERE hot = 'a'",
    )
    .unwrap();
    let before = now(&mut c);
    let r2 = rotate(&mut c);
    assert!(
        r2.contains("250 records archived") && r2.contains("hot table b emptied"),
        "second rotation: {r2}"
    );
    assert_eq!(
        (count(&mut c, "_consumed_a"), count(&mut c, "_consumed_b")),
        (100, 0)
    );
    let b_since = since(&mut c, "b");
    assert!(b_since >= before, "b's since moved: {b_since} < {before}");
    // Back to what a really covers: every record since it was emptied (after `old` was made).
    c.execute(
        "UPDATE amqp._consumed_since SET since = to_timestamp($1) WHERE hot = 'a'",
        &[&a_since],
    )
    .unwrap();

    assert_eq!(
        scalar_i64(
            &mut c,
            "SELECT count(*) FROM amqp.consumption_archive WHERE consumer = 'ret'"
        )
        .unwrap(),
        250
    );
    let storage: BTreeMap<String, i64> = c
        .query(
            "SELECT storage, count(*) FROM amqp.consumption WHERE consumer = 'ret' GROUP BY 1",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        storage,
        BTreeMap::from([("archive".to_string(), 250), ("hot".to_string(), 100)])
    );
    let partition = scalar_i64(
        &mut c,
        "SELECT count(*) FROM pg_inherits i JOIN pg_class p ON p.oid = i.inhrelid \
          WHERE i.inhparent = 'amqp.consumption_archive'::regclass \
            AND p.relname = 'consumption_archive_' || to_char(now() AT TIME ZONE 'UTC', 'YYYYMMDD')",
    )
    .unwrap();
    assert_eq!(partition, 1, "today's archive partition");

    // Archived UUIDv7 ids are still duplicates; the young ones are (hot); a never consumed id
    // as old as the archived ones is not.
    c.batch_execute("BEGIN").unwrap();
    let again_old = consume_all(&mut c, &old);
    let again_young = consume_all(&mut c, &young);
    let fresh = consume_once(&mut c, "ret", &never_consumed).unwrap();
    c.batch_execute("ROLLBACK").unwrap();
    assert_eq!(again_old, 0, "archived ids reported new by consume_once");
    assert_eq!(again_young, 0, "hot ids reported new by consume_once");
    assert!(fresh, "an old id never consumed is new");

    // No row was ever DELETEd from the hot tables. The sentinel's DELETE shows that this
    // backend's statistics have been flushed.
    c.batch_execute(
        "CREATE TABLE public.sentinel (x int); INSERT INTO public.sentinel VALUES (1); \
         DELETE FROM public.sentinel",
    )
    .unwrap();
    let stats = |c: &mut Client| -> Result<BTreeMap<String, (i64, i64)>, String> {
        c.batch_execute("SELECT pg_stat_force_next_flush(); SELECT pg_stat_clear_snapshot()")
            .map_err(|e| e.to_string())?;
        c.query(
            "SELECT relname::text, n_tup_ins, n_tup_del FROM pg_stat_user_tables \
              WHERE relname IN ('_consumed_a', '_consumed_b', 'sentinel')",
            &[],
        )
        .map(|rows| {
            rows.iter()
                .map(|r| (r.get(0), (r.get(1), r.get(2))))
                .collect()
        })
        .map_err(|e| e.to_string())
    };
    let st = eventually(ARRIVAL, "the statistics flushed", || {
        let s = stats(&mut c)?;
        if s.get("sentinel").map(|v| v.1) == Some(1) && s.len() == 3 {
            Ok(s)
        } else {
            Err(format!("{s:?}"))
        }
    });
    for t in ["_consumed_a", "_consumed_b"] {
        let (ins, del) = st[t];
        assert_eq!(del, 0, "rows deleted from amqp.{t}: {st:?}");
        assert!(ins > 0, "amqp.{t}: no inserts counted: {st:?}");
    }
}

// ------------------------------------------------------------------------------------------
// 6. bad input, a missing queue, a stuck handler
// ------------------------------------------------------------------------------------------

#[test]
fn subscription_bad_input_and_missing_queue() {
    let rabbit = Rabbit::shared();
    let slow_route = rabbit.declare_route("inbox-slow");
    let owner_route = rabbit.declare_route("inbox-owner");
    let mut pair = Pair::new(
        rabbit.endpoint(),
        &[
            ("amqp_outbox.handler_timeout", "500".into()),
            ("amqp_outbox.retry_backoff_min", "100".into()),
            ("amqp_outbox.retry_backoff_max", "2000".into()),
        ],
    );
    let broker = pair.consumer_broker;
    let c = &mut pair.consumer;
    c.batch_execute(APPLIED_SCHEMA).expect("applied schema");
    c.batch_execute(
        "CREATE FUNCTION public.wrong_arg(t text) RETURNS void LANGUAGE sql AS 'SELECT';
         CREATE FUNCTION public.wrong_ret(d amqp.delivery) RETURNS integer LANGUAGE sql AS 'SELECT 1';
         CREATE FUNCTION public.sleepy(d amqp.delivery) RETURNS void LANGUAGE plpgsql AS $fn$
         BEGIN
             IF amqp.body_text(d) = 'sleep' THEN
                 PERFORM pg_sleep(30);
             END IF;
             INSERT INTO public.applied VALUES (d.subscription, d.message_id, amqp.body_text(d), d.attempt);
         END
         $fn$;",
    )
    .expect("handlers");

    // Bad input.
    let h = "'public.apply_text(amqp.delivery)'::regprocedure";
    expect_sqlstate(
        c,
        &format!("SELECT amqp.subscribe('s', 999999, 'q', {h})"),
        &SqlState::UNDEFINED_OBJECT,
    );
    expect_sqlstate(
        c,
        &format!(
            "SELECT amqp.subscribe('s', {broker}, 'q', 'public.wrong_arg(text)'::regprocedure)"
        ),
        &SqlState::INVALID_FUNCTION_DEFINITION,
    );
    expect_sqlstate(
        c,
        &format!(
            "SELECT amqp.subscribe('s', {broker}, 'q', 'public.wrong_ret(amqp.delivery)'::regprocedure)"
        ),
        &SqlState::INVALID_FUNCTION_DEFINITION,
    );
    expect_sqlstate(
        c,
        &format!("SELECT amqp.subscribe(NULL, {broker}, 'q', {h})"),
        &SqlState::NULL_VALUE_NOT_ALLOWED,
    );
    expect_sqlstate(
        c,
        &format!("SELECT amqp.subscribe('s', {broker}, NULL, {h})"),
        &SqlState::NULL_VALUE_NOT_ALLOWED,
    );
    expect_sqlstate(
        c,
        &format!("SELECT amqp.subscribe('s', {broker}, 'q', NULL)"),
        &SqlState::NULL_VALUE_NOT_ALLOWED,
    );
    expect_sqlstate(
        c,
        &format!("SELECT amqp.subscribe('s', {broker}, 'q', {h}, prefetch => 0)"),
        &SqlState::INVALID_PARAMETER_VALUE,
    );
    expect_sqlstate(
        c,
        "SELECT amqp.consume_once(NULL, 'm')",
        &SqlState::NULL_VALUE_NOT_ALLOWED,
    );
    expect_sqlstate(
        c,
        "SELECT amqp.consume_once('c', NULL)",
        &SqlState::NULL_VALUE_NOT_ALLOWED,
    );
    expect_sqlstate(
        c,
        "SELECT amqp.consume_once('', 'm')",
        &SqlState::INVALID_PARAMETER_VALUE,
    );
    expect_sqlstate(
        c,
        "SELECT amqp.pause_subscription('no such subscription')",
        &SqlState::UNDEFINED_OBJECT,
    );
    assert_eq!(
        scalar_i64(c, "SELECT count(*) FROM amqp.subscription").unwrap(),
        0,
        "nothing subscribed by the refused calls"
    );

    // A queue that does not exist yet: error, then consuming once it is declared.
    let missing = format!("{}.q", unique_name("inbox-missing"));
    subscribe(
        c,
        "missing",
        broker,
        &missing,
        "public.apply_text(amqp.delivery)",
        10,
        None,
    );
    expect_sqlstate(
        c,
        &format!("SELECT amqp.subscribe('missing', {broker}, 'q', {h})"),
        &SqlState::DUPLICATE_OBJECT,
    );
    wait_missing_queue_error(&mut pair, "missing");
    // Declared now (deleted with this guard).
    let _missing_guard = Route {
        endpoint: rabbit.endpoint().clone(),
        exchange: String::new(),
        queue: missing.clone(),
        routing_key: missing.clone(),
        delete_on_drop: true,
    };
    AmqpAdmin::connect(&rabbit.endpoint().uri())
        .and_then(|a| a.declare_queue(&missing, true, FieldTable::default()))
        .expect("declaring the missing queue");
    wait_state(&mut pair, "missing", "consuming");
    pair.publish_bodies("", &missing, &["hello-missing".to_string()]);
    eventually(ARRIVAL, "the message on the late queue handled", || {
        let n = scalar_i64(
            &mut pair.consumer,
            "SELECT count(*) FROM public.applied WHERE body = 'hello-missing'",
        )?;
        if n == 1 {
            Ok(())
        } else {
            Err(format!("{n} applied"))
        }
    });

    // Without a message_id the key is a digest of the content: the same message twice (as a
    // redelivery brings it) is handled once.
    let admin = AmqpAdmin::connect(&rabbit.endpoint().uri()).expect("AMQP client");
    for _ in 0..2 {
        admin
            .publish(
                "",
                &missing,
                b"no-id",
                BasicProperties::default().with_delivery_mode(2),
            )
            .expect("publishing without message_id");
    }
    let key: String = eventually(ARRIVAL, "the message without message_id, once", || {
        let s = sub_status(&mut pair.consumer, "missing")?;
        let rows = pair
            .consumer
            .query(
                "SELECT message_id FROM public.applied WHERE body = 'no-id'",
                &[],
            )
            .map_err(|e| e.to_string())?;
        if rows.len() == 1 && s.duplicates >= 1 {
            Ok(rows[0].get(0))
        } else {
            Err(format!("{} applied; {s:?}", rows.len()))
        }
    });
    assert!(key.starts_with("sha256:"), "derived key {key}");

    // A stuck handler is cancelled after handler_timeout (57014); the others go on.
    subscribe(
        &mut pair.consumer,
        "slow",
        broker,
        &slow_route.queue,
        "public.sleepy(amqp.delivery)",
        2,
        None,
    );
    wait_state(&mut pair, "slow", "consuming");
    let worker = pair.wait_sub_worker(None);
    let mut bodies = vec!["sleep".to_string()];
    bodies.extend((0..10).map(|i| format!("fast-{i}")));
    let t = Instant::now();
    pair.publish_bodies(&slow_route.exchange, &slow_route.routing_key, &bodies);
    let row = eventually(
        Duration::from_secs(25),
        "the stuck handler cancelled and the others handled",
        || {
            let fast = scalar_i64(
                &mut pair.consumer,
                "SELECT count(*) FROM public.applied WHERE subscription = 'slow' AND body LIKE 'fast-%'",
            )?;
            let failed = pair
                .consumer
                .query_opt(
                    "SELECT last_sqlstate, last_error, attempts FROM amqp.inbox_failed \
                      WHERE subscription = 'slow' AND convert_from(body, 'UTF8') = 'sleep'",
                    &[],
                )
                .map_err(|e| e.to_string())?;
            match failed {
                Some(r) if fast == 10 => Ok((
                    r.get::<_, Option<String>>(0),
                    r.get::<_, String>(1),
                    r.get::<_, i32>(2),
                )),
                other => Err(format!(
                    "{fast} fast ones applied; failed row {:?}; {:?}",
                    other.map(|r| (r.get::<_, Option<String>>(0), r.get::<_, String>(1))),
                    sub_status(&mut pair.consumer, "slow")
                )),
            }
        },
    );
    eprintln!("stuck handler: {row:?} after {:?}", t.elapsed());
    assert_eq!(row.0.as_deref(), Some("57014"), "last_sqlstate: {row:?}");
    assert_eq!(
        scalar_i64(
            &mut pair.consumer,
            "SELECT count(*) FROM public.applied WHERE body = 'sleep'"
        )
        .unwrap(),
        0
    );
    // The same worker: the cancel did not take it down.
    assert_eq!(
        pair.wait_sub_worker(None),
        worker,
        "the subscription worker restarted"
    );

    // The handler runs with the rights of the role that subscribed, not the worker's.
    pair.consumer
        .batch_execute(
            "CREATE ROLE e2e_owner NOLOGIN;
             GRANT amqp_outbox_admin TO e2e_owner;
             CREATE TABLE public.who (subscription text, role_name text);
             GRANT INSERT ON public.who TO e2e_owner;
             CREATE FUNCTION public.record_who(d amqp.delivery) RETURNS void
                 LANGUAGE plpgsql AS $fn$
             BEGIN
                 INSERT INTO public.who VALUES (d.subscription, current_user);
             END
             $fn$;
             SET ROLE e2e_owner;",
        )
        .expect("a subscribing role");
    subscribe(
        &mut pair.consumer,
        "owned",
        broker,
        &owner_route.queue,
        "public.record_who(amqp.delivery)",
        2,
        None,
    );
    pair.consumer.batch_execute("RESET ROLE").unwrap();
    let owner: String = pair
        .consumer
        .query_one(
            "SELECT owner::text FROM amqp.subscription_status WHERE subscription = 'owned'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(owner, "e2e_owner");
    wait_state(&mut pair, "owned", "consuming");
    pair.publish_bodies(
        &owner_route.exchange,
        &owner_route.routing_key,
        &["who".to_string()],
    );
    let who: String = eventually(ARRIVAL, "the owned subscription's handler", || {
        pair.consumer
            .query_opt("SELECT role_name FROM public.who", &[])
            .map_err(|e| e.to_string())?
            .map(|r| r.get(0))
            .ok_or_else(|| format!("{:?}", sub_status(&mut pair.consumer, "owned")))
    });
    assert_eq!(who, "e2e_owner", "current_user in the handler");
}

// ------------------------------------------------------------------------------------------
// 7. receipts
// ------------------------------------------------------------------------------------------

#[test]
fn receipts_are_sent_only_for_committed_work() {
    let rabbit = Rabbit::shared();
    let route = rabbit.declare_route("inbox-rcpt");
    let receipts_route = rabbit.declare_route_kind("inbox-receipts", ExchangeKind::Topic, "#");
    let receipts = rabbit.consume_connected(&receipts_route);
    let mut pair = Pair::new(
        rabbit.endpoint(),
        &[
            (
                "amqp_outbox.receipts_exchange",
                format!("'{}'", receipts_route.exchange),
            ),
            ("amqp_outbox.retry_backoff_min", "10".into()),
            ("amqp_outbox.retry_backoff_max", "50".into()),
        ],
    );
    pair.consumer
        .batch_execute(APPLIED_SCHEMA)
        .expect("applied schema");
    let broker = pair.consumer_broker;
    subscribe(
        &mut pair.consumer,
        "rcpt",
        broker,
        &route.queue,
        "public.apply_text(amqp.delivery)",
        2,
        None,
    );
    wait_state(&mut pair, "rcpt", "consuming");
    let bodies: Vec<String> = (0..13)
        .map(|i| {
            if i % 4 == 1 {
                format!("bad:{i}")
            } else {
                format!("good:{i}")
            }
        })
        .collect();
    let n_bad = bodies.iter().filter(|b| b.starts_with("bad:")).count();
    let n_good = bodies.len() - n_bad;
    pair.publish_bodies(&route.exchange, &route.routing_key, &bodies);
    eventually(ARRIVAL, "good applied and bad dead", || {
        let a = scalar_i64(&mut pair.consumer, "SELECT count(*) FROM public.applied")?;
        let d = scalar_i64(
            &mut pair.consumer,
            "SELECT count(*) FROM amqp.inbox_failed WHERE dead_lettered_at IS NOT NULL",
        )?;
        if a >= n_good as i64 && d >= n_bad as i64 {
            Ok(())
        } else {
            Err(format!("{a} applied, {d} dead"))
        }
    });
    // A last message: its receipt comes after all the others (one session's outbox order).
    pair.publish_bodies(&route.exchange, &route.routing_key, &["good:last".into()]);
    let last_id: String = eventually(ARRIVAL, "the last message applied", || {
        pair.consumer
            .query_opt(
                "SELECT message_id FROM public.applied WHERE body = 'good:last'",
                &[],
            )
            .map_err(|e| e.to_string())?
            .map(|r| r.get(0))
            .ok_or_else(|| "not yet".to_string())
    });
    eventually(ARRIVAL, "the last message's receipt", || {
        let found = receipts.deliveries().iter().any(|d| {
            serde_json::from_slice::<Value>(&d.body)
                .ok()
                .and_then(|v| v.get("message_id").cloned())
                == Some(Value::String(last_id.clone()))
        });
        if found {
            Ok(())
        } else {
            Err(format!("{} receipts so far", receipts.len()))
        }
    });

    // Receipts sent by hand: only the committed one leaves.
    pair.consumer
        .batch_execute(&format!(
            "BEGIN; SELECT amqp.send_receipt({broker}, 'manual', 'rolled-back'); ROLLBACK; \
             SELECT amqp.send_receipt({broker}, 'manual', 'committed');"
        ))
        .expect("send_receipt by hand");

    let handled: BTreeSet<String> = pair
        .consumer
        .query("SELECT message_id FROM public.applied", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let dead: BTreeSet<String> = pair
        .consumer
        .query(
            "SELECT message_id FROM amqp.inbox_failed WHERE dead_lettered_at IS NOT NULL",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!((handled.len(), dead.len()), (n_good + 1, n_bad));

    eventually(ARRIVAL, "the receipt sent by hand", || {
        let found = receipts.deliveries().iter().any(|d| {
            let v: Value = serde_json::from_slice(&d.body).unwrap_or(Value::Null);
            v["consumer"] == "manual" && v["message_id"] == "committed"
        });
        if found {
            Ok(())
        } else {
            Err(format!("{} receipts so far", receipts.len()))
        }
    });
    // Every receipt names its sender as RabbitMQ checked it: the broker row's user.
    let senders: BTreeSet<Option<String>> = receipts
        .deliveries()
        .iter()
        .map(|d| d.user_id.clone())
        .collect();
    assert_eq!(senders, BTreeSet::from([Some("guest".to_string())]));
    let mut ok = BTreeMap::<String, usize>::new();
    let mut failed = BTreeMap::<String, usize>::new();
    let mut manual = Vec::new();
    for d in receipts.deliveries() {
        let v: Value = serde_json::from_slice(&d.body)
            .unwrap_or_else(|e| panic!("receipt is not JSON ({e}): {}", d.text()));
        let id = v["message_id"].as_str().unwrap_or_default().to_string();
        let consumer = v["consumer"].as_str().unwrap_or_default().to_string();
        assert_eq!(d.routing_key, consumer, "routing key = consumer: {v}");
        assert_eq!(v["v"], Value::from(1), "{v}");
        assert!(v["at"].is_string(), "{v}");
        if consumer == "manual" {
            manual.push(id);
            continue;
        }
        assert_eq!(consumer, "rcpt", "{v}");
        match v["status"].as_str() {
            Some("ok") => {
                assert!(v["error"].is_null(), "{v}");
                *ok.entry(id).or_default() += 1;
            }
            Some("failed") => {
                assert!(
                    v["error"]
                        .as_str()
                        .unwrap_or_default()
                        .contains("e2e refuses"),
                    "{v}"
                );
                *failed.entry(id).or_default() += 1;
            }
            other => panic!("receipt status {other:?}: {v}"),
        }
    }
    assert_eq!(
        ok.keys().cloned().collect::<BTreeSet<_>>(),
        handled,
        "one ok receipt per handled message"
    );
    assert!(
        ok.values().all(|&n| n == 1),
        "ok receipts sent twice: {ok:?}"
    );
    assert_eq!(
        failed.keys().cloned().collect::<BTreeSet<_>>(),
        dead,
        "one failed receipt per dead message (none for the earlier attempts)"
    );
    assert!(
        failed.values().all(|&n| n == 1),
        "failed receipts sent more than once: {failed:?}"
    );
    assert_eq!(manual, vec!["committed".to_string()], "manual receipts");
}

// ------------------------------------------------------------------------------------------
// Hostile deliveries, and handlers that can no longer run
// ------------------------------------------------------------------------------------------

/// A pair whose failed messages come back quickly (backoff 100 ms to 1 s), with `extra`
/// settings, and the `applied` table and handler in the consumer database.
fn applied_pair(rabbit: &Rabbit, extra: &[(&str, String)]) -> Pair {
    let mut settings = vec![
        ("amqp_outbox.retry_backoff_min", "100".to_string()),
        ("amqp_outbox.retry_backoff_max", "1000".to_string()),
    ];
    settings.extend(extra.iter().cloned());
    let mut pair = Pair::new(rabbit.endpoint(), &settings);
    pair.consumer
        .batch_execute(APPLIED_SCHEMA)
        .expect("applied schema");
    pair
}

fn count(c: &mut Client, sql: &str) -> i64 {
    scalar_i64(c, sql).unwrap_or_else(|e| panic!("{e}"))
}

fn wait_count(c: &mut Client, sql: &str, want: i64) {
    eventually(ARRIVAL, sql, || match scalar_i64(c, sql)? {
        n if n == want => Ok(()),
        n => Err(format!("{n}, not {want}")),
    });
}

/// Whatever a delivery carries it is handled: NUL characters (which PostgreSQL text and jsonb
/// cannot hold) in a header value, a header name, the message_id and the correlation id, beside
/// good messages, without the subscription worker restarting. Before, a NUL in a header value
/// raised an error outside the message's subtransaction: the worker restarted every few
/// seconds and no subscription of the database handled anything.
///
/// A handler that cannot run any more (its function dropped, its owner's EXECUTE revoked) stops
/// its subscription, which then says why, and its messages stay in the queue, no attempt used
/// up; once fixed, they are handled. Before, each message failed (42883, 42501) into
/// `amqp.inbox_failed` and was eventually dead-lettered.
#[test]
fn hostile_deliveries_and_handlers_that_cannot_run_stop_nothing() {
    let rabbit = Rabbit::shared();
    let nul = rabbit.declare_queue("inbox-nul");
    let dropped = rabbit.declare_queue("inbox-dropped");
    let owned = rabbit.declare_queue("inbox-owned");
    let mut pair = applied_pair(&rabbit, &[]);
    let broker = pair.consumer_broker;
    let c = &mut pair.consumer;
    c.batch_execute(
        "CREATE FUNCTION public.apply_dropped(d amqp.delivery) RETURNS void LANGUAGE sql AS
         $$ INSERT INTO public.applied VALUES (d.subscription, d.message_id, amqp.body_text(d), d.attempt) $$;
         CREATE FUNCTION public.apply_owned(d amqp.delivery) RETURNS void LANGUAGE sql AS
         $$ INSERT INTO public.applied VALUES (d.subscription, d.message_id, amqp.body_text(d), d.attempt) $$;
         CREATE ROLE e2e_owner IN ROLE amqp_outbox_admin;
         GRANT INSERT ON public.applied TO e2e_owner;
         CREATE TABLE public.seen_headers (message_id text, correlation_id text, headers jsonb);
         GRANT INSERT ON public.seen_headers TO e2e_owner;
         CREATE FUNCTION public.apply_nul(d amqp.delivery) RETURNS void LANGUAGE sql AS
         $$ INSERT INTO public.applied VALUES (d.subscription, d.message_id, amqp.body_text(d), d.attempt);
            INSERT INTO public.seen_headers VALUES (d.message_id, d.correlation_id, d.headers) $$;",
    )
    .expect("handlers");
    subscribe(
        c,
        "nul",
        broker,
        &nul.queue,
        "public.apply_nul(amqp.delivery)",
        3,
        None,
    );
    subscribe(
        c,
        "dropped",
        broker,
        &dropped.queue,
        "public.apply_dropped(amqp.delivery)",
        3,
        None,
    );
    c.batch_execute("SET ROLE e2e_owner").expect("SET ROLE");
    subscribe(
        c,
        "owned",
        broker,
        &owned.queue,
        "public.apply_owned(amqp.delivery)",
        3,
        None,
    );
    c.batch_execute("RESET ROLE").expect("RESET ROLE");
    for s in ["nul", "dropped", "owned"] {
        wait_state(&mut pair, s, "consuming");
    }
    let worker = pair.wait_sub_worker(None);

    // NUL characters, beside good messages.
    let admin = AmqpAdmin::connect(&rabbit.endpoint().uri()).expect("AMQP client");
    let mut headers = FieldTable::default();
    headers.insert(
        "k".into(),
        lapin::types::AMQPValue::LongString("a\0b".into()),
    );
    headers.insert(
        "n\0ame".into(),
        lapin::types::AMQPValue::LongString("v".into()),
    );
    for (i, body) in ["good-1", "nul-1", "good-2"].iter().enumerate() {
        let mut props = BasicProperties::default()
            .with_message_id(format!("id-{i}").into())
            .with_delivery_mode(2);
        if body.starts_with("nul") {
            props = props
                .with_message_id("id\0nul".into())
                .with_correlation_id("corr\0id".into())
                .with_headers(headers.clone());
        }
        admin
            .publish("", &nul.queue, body.as_bytes(), props)
            .unwrap_or_else(|e| panic!("publishing {body}: {e}"));
    }
    wait_count(
        &mut pair.consumer,
        "SELECT count(*) FROM public.applied WHERE subscription = 'nul'",
        3,
    );
    let row = pair
        .consumer
        .query_one(
            "SELECT message_id, correlation_id, headers::text FROM public.seen_headers \
              WHERE correlation_id IS NOT NULL",
            &[],
        )
        .expect("the NUL message's delivery");
    let (id, corr, h): (String, String, String) = (row.get(0), row.get(1), row.get(2));
    let h: Value = serde_json::from_str(&h).expect("headers as JSON");
    assert_eq!(id, "id\u{FFFD}nul");
    assert_eq!(corr, "corr\u{FFFD}id");
    assert_eq!(
        h,
        serde_json::json!({"k": {"$bytes": "YQBi"}, "n\u{FFFD}ame": "v"}),
        "header values keep their bytes, names lose only the NUL"
    );
    assert_eq!(pair.wait_sub_worker(None), worker, "the worker restarted");

    // Bytes that are not UTF-8 in a message_id (RabbitMQ forwards them as they are; lapin
    // refused the whole frame and the connection with it, forever): handled like the NUL, with
    // the message after it, on the same consumer connection.
    let since = |c: &mut Client| -> Option<std::time::SystemTime> {
        c.query_one(
            "SELECT state_since FROM amqp.subscription_status WHERE subscription = 'nul'",
            &[],
        )
        .ok()
        .map(|r| r.get(0))
    };
    let connected_since = since(&mut pair.consumer);
    for (id, body) in [
        (&b"bad\xff\xfeid"[..], "not-utf8"),
        (&b"id-after"[..], "good-3"),
    ] {
        publish_with_message_id(rabbit.endpoint(), "", &nul.queue, id, body.as_bytes())
            .unwrap_or_else(|e| panic!("publishing {body} raw: {e}"));
    }
    wait_count(
        &mut pair.consumer,
        "SELECT count(*) FROM public.applied WHERE subscription = 'nul'",
        5,
    );
    let id: String = pair
        .consumer
        .query_one(
            "SELECT message_id FROM public.applied WHERE body = 'not-utf8'",
            &[],
        )
        .expect("the message with bad bytes")
        .get(0);
    assert_eq!(id, "bad\u{FFFD}\u{FFFD}id");
    assert_eq!(
        since(&mut pair.consumer),
        connected_since,
        "the consumer connected again"
    );
    assert_eq!(pair.wait_sub_worker(None), worker, "the worker restarted");

    // The handler function dropped: the subscription stops and says why; the messages wait in
    // the queue, not in inbox_failed.
    pair.consumer
        .batch_execute("DROP FUNCTION public.apply_dropped(amqp.delivery)")
        .expect("DROP FUNCTION");
    let bodies: Vec<String> = (0..3).map(|i| format!("dropped-{i}")).collect();
    pair.publish_bodies("", &dropped.queue, &bodies);
    let (s, _) = wait_status(&mut pair, "dropped", "said its handler is gone", |s| {
        s.state == "error"
            && s.last_error
                .as_deref()
                .is_some_and(|e| e.contains("no longer exists"))
    });
    assert_eq!(s.failed, 0, "{s:?}");
    assert_eq!(
        count(
            &mut pair.consumer,
            "SELECT count(*) FROM amqp.inbox_failed WHERE subscription = 'dropped'"
        ),
        0
    );
    // Created again (a new function) and set as the handler: the waiting messages are handled.
    pair.consumer
        .batch_execute(
            "CREATE FUNCTION public.apply_dropped(d amqp.delivery) RETURNS void LANGUAGE sql AS
             $$ INSERT INTO public.applied VALUES (d.subscription, d.message_id, amqp.body_text(d), d.attempt) $$;
             UPDATE amqp.subscription SET handler = 'public.apply_dropped(amqp.delivery)'
              WHERE subscription = 'dropped'",
        )
        .expect("CREATE FUNCTION again");
    wait_count(
        &mut pair.consumer,
        "SELECT count(*) FROM public.applied WHERE subscription = 'dropped' AND attempt = 1",
        3,
    );

    // The owner's EXECUTE revoked: checked when the handler runs, not only when subscribed.
    pair.consumer
        .batch_execute("REVOKE EXECUTE ON FUNCTION public.apply_owned(amqp.delivery) FROM PUBLIC")
        .expect("REVOKE");
    let bodies: Vec<String> = (0..3).map(|i| format!("owned-{i}")).collect();
    pair.publish_bodies("", &owned.queue, &bodies);
    let (s, _) = wait_status(
        &mut pair,
        "owned",
        "said its owner may not run the handler",
        |s| {
            s.state == "error"
                && s.last_error
                    .as_deref()
                    .is_some_and(|e| e.contains("may not execute"))
        },
    );
    assert_eq!(s.failed, 0, "{s:?}");
    pair.consumer
        .batch_execute("GRANT EXECUTE ON FUNCTION public.apply_owned(amqp.delivery) TO e2e_owner")
        .expect("GRANT");
    wait_count(
        &mut pair.consumer,
        "SELECT count(*) FROM public.applied WHERE subscription = 'owned' AND attempt = 1",
        3,
    );
    assert_eq!(pair.wait_sub_worker(None), worker, "the worker restarted");
}

/// FAULTS.md case 25: what used to fail outside a message's subtransaction, rolling back the
/// whole batch and restarting the worker into the same work (a loop in which no subscription
/// of the database handled anything): a dead letter the outbox refuses (its body over
/// `amqp_outbox.max_message_size`), a handler whose deferred foreign key fails at COMMIT (and
/// valid rows under the same deferred key, which could not commit at all), and the retention
/// of consumption records waiting for a session that holds the older table. Now each message
/// is judged alone, the retention waits its turn, and the worker never restarts.
#[test]
fn no_dead_letter_constraint_or_lock_restarts_the_subscription_worker() {
    let rabbit = Rabbit::shared();
    let q_dl = rabbit.declare_queue("inbox-dl");
    let q_fk = rabbit.declare_queue("inbox-fk");
    let dlx = rabbit.declare_route("inbox-dlx");
    let mut pair = applied_pair(&rabbit, &[("amqp_outbox.max_message_size", "1000".into())]);
    let broker = pair.consumer_broker;
    let c = &mut pair.consumer;
    c.batch_execute(
        "CREATE TABLE public.parent (id integer PRIMARY KEY);
         INSERT INTO public.parent VALUES (1);
         CREATE TABLE public.child (
             body text NOT NULL,
             parent integer REFERENCES public.parent DEFERRABLE INITIALLY DEFERRED);
         CREATE FUNCTION public.apply_child(d amqp.delivery) RETURNS void LANGUAGE sql AS
         $$ INSERT INTO public.child VALUES (amqp.body_text(d),
                CASE WHEN amqp.body_text(d) LIKE 'orphan%' THEN 999 ELSE 1 END) $$;",
    )
    .expect("handlers");
    subscribe(
        c,
        "dl",
        broker,
        &q_dl.queue,
        "public.apply_text(amqp.delivery)",
        1,
        Some(&dlx.exchange),
    );
    subscribe(
        c,
        "fk",
        broker,
        &q_fk.queue,
        "public.apply_child(amqp.delivery)",
        1,
        None,
    );
    for s in ["dl", "fk"] {
        wait_state(&mut pair, s, "consuming");
    }
    let worker = pair.wait_sub_worker(None);
    let admin = AmqpAdmin::connect(&rabbit.endpoint().uri()).expect("AMQP client");
    let send = |queue: &str, body: &[u8]| {
        admin
            .publish(
                "",
                queue,
                body,
                BasicProperties::default().with_delivery_mode(2),
            )
            .unwrap_or_else(|e| panic!("publishing to {queue}: {e}"));
    };

    // A poison message whose dead letter is refused, among good ones.
    let big = format!("bad:{}", "x".repeat(2000));
    send(&q_dl.queue, b"good-1");
    send(&q_dl.queue, big.as_bytes());
    send(&q_dl.queue, b"good-2");
    // Valid and invalid rows under a deferred foreign key.
    for body in ["child-1", "orphan-1", "child-2"] {
        send(&q_fk.queue, body.as_bytes());
    }
    wait_count(
        &mut pair.consumer,
        "SELECT count(*) FROM public.applied WHERE body LIKE 'good-%'",
        2,
    );
    wait_count(&mut pair.consumer, "SELECT count(*) FROM public.child", 2);
    let c = &mut pair.consumer;
    let dead: String = c
        .query_one(
            "SELECT last_error FROM amqp.inbox_failed \
              WHERE subscription = 'dl' AND dead_lettered_at IS NOT NULL",
            &[],
        )
        .map(|r| r.get(0))
        .expect("the refused dead letter stays in inbox_failed");
    assert!(dead.contains("not dead-lettered"), "{dead}");
    let orphan: String = c
        .query_one(
            "SELECT last_sqlstate FROM amqp.inbox_failed WHERE subscription = 'fk'",
            &[],
        )
        .map(|r| r.get(0))
        .expect("the orphan row's failure");
    assert_eq!(
        orphan, "23503",
        "a foreign key violation, judged for that message alone"
    );
    assert_eq!(pair.wait_sub_worker(None), worker, "the worker restarted");

    // Retention due while a session holds the older hot table: the worker (started again, so
    // that the retention runs at once) keeps handling.
    let c = &mut pair.consumer;
    c.batch_execute("UPDATE amqp._consumed_since SET since = since - interval '2 days'")
        .expect("retention due");
    let mut holder = pair.cluster.client_db(CONSUMER);
    holder
        .batch_execute("BEGIN; SELECT amqp.consume_once('holder', 'hold-1')")
        .expect("holding the hot tables");
    pair.consumer
        .execute("SELECT pg_terminate_backend($1)", &[&worker])
        .expect("terminating the subscription worker");
    let worker = pair.wait_sub_worker(Some(worker));
    for i in 3..13 {
        send(&q_dl.queue, format!("good-{i}").as_bytes());
    }
    wait_count(
        &mut pair.consumer,
        "SELECT count(*) FROM public.applied WHERE body LIKE 'good-%'",
        12,
    );
    holder.batch_execute("COMMIT").expect("COMMIT");
    assert_eq!(pair.wait_sub_worker(None), worker, "the worker restarted");
    drop(dlx);
}

/// A handler that catches the cancel of `amqp_outbox.handler_timeout` (`EXCEPTION WHEN
/// query_canceled`) and goes on is ended at twice the timeout, and `pg_terminate_backend()`
/// of the worker ends a handler that never returns within a second or so: the worker exits, the
/// next one records that message as failed instead of running it again, and the others are
/// handled. Before, such a handler held the database's subscriptions until it chose to return
/// (with an endless loop, until the server restarted).
#[test]
fn a_handler_that_traps_the_cancel_is_ended_and_its_message_recorded_as_failed() {
    let rabbit = Rabbit::shared();
    let q = rabbit.declare_queue("inbox-stubborn");
    let mut pair = applied_pair(&rabbit, &[("amqp_outbox.handler_timeout", "500".into())]);
    let broker = pair.consumer_broker;
    let c = &mut pair.consumer;
    c.batch_execute(
        "CREATE FUNCTION public.stubborn(d amqp.delivery) RETURNS void LANGUAGE plpgsql AS $fn$
         BEGIN
             IF amqp.body_text(d) LIKE 'stubborn%' THEN
                 LOOP
                     BEGIN
                         PERFORM pg_sleep(0.05);
                     EXCEPTION WHEN query_canceled THEN NULL;
                     END;
                 END LOOP;
             END IF;
             INSERT INTO public.applied VALUES (d.subscription, d.message_id, amqp.body_text(d), d.attempt);
         END
         $fn$;",
    )
    .expect("handler");
    subscribe(
        c,
        "stub",
        broker,
        &q.queue,
        "public.stubborn(amqp.delivery)",
        1,
        None,
    );
    wait_state(&mut pair, "stub", "consuming");
    let first = pair.wait_sub_worker(None);
    let bodies: Vec<String> = ["good-1", "stubborn-1", "good-2"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    pair.publish_bodies("", &q.queue, &bodies);
    wait_count(
        &mut pair.consumer,
        "SELECT count(*) FROM public.applied WHERE body LIKE 'good-%'",
        2,
    );
    let failed = |c: &mut Client, body: &str| -> Result<String, String> {
        c.query_opt(
            "SELECT last_error FROM amqp.inbox_failed \
              WHERE subscription = 'stub' AND convert_from(body, 'UTF8') = $1 \
                AND dead_lettered_at IS NOT NULL",
            &[&body],
        )
        .map_err(|e| e.to_string())?
        .map(|r| r.get(0))
        .ok_or_else(|| format!("{body} not dead in amqp.inbox_failed"))
    };
    let error = eventually(ARRIVAL, "stubborn-1 recorded as failed", || {
        failed(&mut pair.consumer, "stubborn-1")
    });
    assert!(error.contains("handler_timeout"), "{error}");
    let second = pair.wait_sub_worker(None);
    assert_ne!(second, first, "the worker was not ended");

    // No timeout at all: pg_terminate_backend() still ends the handler.
    pair.cluster.set_setting("amqp_outbox.handler_timeout", "0");
    pair.cluster.reload();
    // The worker takes the reload at its next turn; stubborn-2 must not reach it before (a
    // loaded machine has delayed the postmaster's signal past the delivery, and the old 500 ms
    // timeout then ended the handler instead of pg_terminate_backend()).
    std::thread::sleep(Duration::from_secs(1));
    pair.publish_bodies("", &q.queue, &["stubborn-2".to_string()]);
    let c = &mut pair.consumer;
    eventually(ARRIVAL, "the handler of stubborn-2 running", || {
        let n = scalar_i64(
            c,
            "SELECT count(*) FROM pg_stat_activity \
              WHERE backend_type = 'amqp_outbox subscriptions' AND wait_event = 'PgSleep'",
        )?;
        c.batch_execute("SELECT pg_stat_clear_snapshot()")
            .map_err(|e| e.to_string())?;
        if n == 1 {
            Ok(())
        } else {
            Err("not sleeping in the handler".into())
        }
    });
    c.execute("SELECT pg_terminate_backend($1)", &[&second])
        .expect("pg_terminate_backend");
    let third = pair.wait_sub_worker(Some(second));
    let error = eventually(ARRIVAL, "stubborn-2 recorded as failed", || {
        failed(&mut pair.consumer, "stubborn-2")
    });
    assert!(error.contains("terminated"), "{error}");
    pair.publish_bodies("", &q.queue, &["good-3".to_string()]);
    wait_count(
        &mut pair.consumer,
        "SELECT count(*) FROM public.applied WHERE body LIKE 'good-%'",
        3,
    );
    assert_eq!(pair.wait_sub_worker(None), third);
}

/// `consume_once()` in a REPEATABLE READ transaction whose snapshot predates a rotation: the
/// rotation's TRUNCATE is not MVCC-safe, so the emptied table looked empty and the records it
/// archived invisible, and a message consumed long before was reported new (true). Now the
/// caller gets a serialization failure (40001), as for any conflict in that isolation level.
#[test]
fn consume_once_under_repeatable_read_never_reports_a_rotated_record_new() {
    let cluster = PgCluster::with_defaults();
    // A database no worker serves: rotations happen only when the test runs them.
    cluster
        .client_db("postgres")
        .batch_execute("CREATE DATABASE rr")
        .expect("CREATE DATABASE rr");
    let mut c = cluster.client_db("rr");
    create_extension(&mut c);
    let old_id: String = c
        .query_one("SELECT amqp._new_message_id()", &[])
        .expect("_new_message_id")
        .get(0);
    assert!(consume_once(&mut c, "rr", &old_id).expect("first consume_once"));
    // A rotation that empties a: the record then lives in b only.
    c.batch_execute(
        "UPDATE amqp._consumed_since SET since = now() - interval '40 days' WHERE hot = 'a';
         UPDATE amqp._consumed_since SET since = now() - interval '30 days' WHERE hot = 'b';
         SELECT amqp.rotate_consumption();",
    )
    .expect("first rotation");
    let mut reader = cluster.client_db("rr");
    // The snapshot, without touching the hot tables (a lock on them would hold the rotation).
    reader
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1")
        .expect("a snapshot");
    // Another rotation, after the snapshot, moves the record to the archive and empties b.
    c.batch_execute(
        "UPDATE amqp._consumed_since SET since = now() - interval '40 days' WHERE hot = 'b';
         UPDATE amqp._consumed_since SET since = now() - interval '20 days' WHERE hot = 'a';
         SELECT amqp.rotate_consumption();",
    )
    .expect("second rotation");
    let archived: i64 = c
        .query_one(
            "SELECT count(*) FROM amqp.consumption_archive WHERE consumer = 'rr'",
            &[],
        )
        .expect("archive")
        .get(0);
    assert_eq!(archived, 1, "the setup did not archive the record");
    match consume_once(&mut reader, "rr", &old_id) {
        Ok(new) => panic!("consume_once returned {new} for a record the snapshot cannot see"),
        Err(e) => assert_eq!(e.code(), Some(&SqlState::T_R_SERIALIZATION_FAILURE), "{e}"),
    }
    reader.batch_execute("ROLLBACK").expect("ROLLBACK");
}

/// A handler that calls `amqp.unsubscribe()` on its own subscription: its message is handled,
/// and the other messages of its batch go back to the queue instead of being handled (and
/// acknowledged, or recorded as failed) for a subscription that is gone once the batch commits.
#[test]
fn a_handler_that_unsubscribes_its_subscription_leaves_the_rest_in_the_queue() {
    let rabbit = Rabbit::shared();
    let q = rabbit.declare_queue("inbox-selfstop");
    let mut pair = applied_pair(&rabbit, &[]);
    let broker = pair.consumer_broker;
    let c = &mut pair.consumer;
    c.batch_execute(
        "CREATE FUNCTION public.selfstop(d amqp.delivery) RETURNS void LANGUAGE plpgsql AS $fn$
         BEGIN
             IF amqp.body_text(d) = 'stop' THEN
                 PERFORM amqp.unsubscribe(d.subscription);
             END IF;
             INSERT INTO public.applied VALUES (d.subscription, d.message_id, amqp.body_text(d), d.attempt);
         END
         $fn$;",
    )
    .expect("handler");
    // All in the queue before the subscription starts: they come in one batch.
    let bodies: Vec<String> = ["a", "b", "stop", "c", "d", "e"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    pair.publish_bodies("", &q.queue, &bodies);
    eventually(ARRIVAL, "the six messages in the queue", || {
        match rabbit.queue_counts(&q.queue)?.map(|c| c.messages) {
            Some(6) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    let c = &mut pair.consumer;
    subscribe(
        c,
        "selfstop",
        broker,
        &q.queue,
        "public.selfstop(amqp.delivery)",
        3,
        None,
    );
    eventually(
        ARRIVAL,
        "the subscription gone and the rest back in the queue",
        || {
            let subs = scalar_i64(&mut pair.consumer, "SELECT count(*) FROM amqp.subscription")?;
            let ready = rabbit.queue_counts(&q.queue)?.map(|c| c.messages);
            if subs == 0 && ready == Some(3) {
                Ok(())
            } else {
                Err(format!("{subs} subscription(s), {ready:?} ready"))
            }
        },
    );
    let applied: BTreeSet<String> = pair
        .consumer
        .query("SELECT body FROM public.applied", &[])
        .expect("applied")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        applied,
        ["a", "b", "stop"].iter().map(|s| s.to_string()).collect()
    );
    assert_eq!(
        count(&mut pair.consumer, "SELECT count(*) FROM amqp.inbox_failed"),
        0
    );
}
