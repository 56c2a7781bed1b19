//! Delayed publishing (`deliver_after`) and idempotent publishing (`idempotency_key`) end to
//! end: private PostgreSQL clusters with the extension preloaded, publishing to a real RabbitMQ.
//!
//! Delayed messages arrive neither early nor never: through a worker terminated while they
//! wait, a server restart, and a dump restored into another cluster. Sessions racing with one
//! idempotency key publish one message.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use amqp_outbox_e2e::outbox::{add_broker, create_extension};
use amqp_outbox_e2e::pg::wait_for_any_lock_wait;
use amqp_outbox_e2e::{eventually, PgCluster, PgConfig, Rabbit, Received, World};
use postgres::Client;

const WORKER_UP: Duration = Duration::from_secs(30);
const ARRIVAL: Duration = Duration::from_secs(60);

/// Publishes `n` messages due `delay` after `Instant::now()` taken just before the call:
/// (message_id, body, not before).
fn publish_delayed(
    client: &mut Client,
    broker_id: i32,
    exchange: &str,
    routing_key: &str,
    prefix: &str,
    n: usize,
    delay: Duration,
) -> Vec<(String, String, Instant)> {
    let interval = format!("{} milliseconds", delay.as_millis());
    (0..n)
        .map(|i| {
            let body = format!("{prefix}-{i}");
            let not_before = Instant::now() + delay;
            let mut tx = client.transaction().expect("BEGIN");
            let id: i64 = tx
                .query_one(
                    "SELECT amqp.publish_message($1, $2, $3, $4, deliver_after => $5::text::interval)",
                    &[&broker_id, &exchange, &routing_key, &body, &interval],
                )
                .unwrap_or_else(|e| panic!("publish {body}: {e}"))
                .get(0);
            let message_id: String = tx
                .query_one(
                    "SELECT message_id FROM amqp.scheduled_message WHERE id = $1",
                    &[&id],
                )
                .unwrap_or_else(|e| panic!("scheduled row of {body}: {e}"))
                .get(0);
            tx.commit().expect("COMMIT");
            (message_id, body, not_before)
        })
        .collect()
}

/// Every expected message arrived, none before its time, each with its message_id.
fn assert_arrived_on_time(expected: &[(String, String, Instant)], deliveries: &[Received]) {
    let by_body: BTreeMap<&str, &(String, String, Instant)> =
        expected.iter().map(|e| (e.1.as_str(), e)).collect();
    let mut seen = BTreeSet::new();
    for d in deliveries {
        let body = d.text();
        let Some((message_id, _, not_before)) = by_body.get(body.as_str()) else {
            continue;
        };
        assert!(
            d.received_at >= *not_before,
            "{body} arrived {:?} before its deliver_after was over",
            not_before.duration_since(d.received_at)
        );
        assert_eq!(
            d.message_id.as_deref(),
            Some(message_id.as_str()),
            "{body}: the message_id made at publish"
        );
        seen.insert(body);
    }
    let missing: Vec<&str> = by_body
        .keys()
        .filter(|b| !seen.contains(**b))
        .copied()
        .collect();
    assert!(missing.is_empty(), "never arrived: {missing:?}");
}

fn scheduled(client: &mut Client) -> i64 {
    client
        .query_one("SELECT count(*) FROM amqp.scheduled_message", &[])
        .expect("count scheduled")
        .get(0)
}

#[test]
fn delayed_messages_arrive_not_before_their_time_through_a_worker_kill_and_a_restart() {
    let rabbit = Rabbit::shared();
    let mut f = World::new("later", PgConfig::default(), &rabbit);
    f.warm_up();
    let (broker, ex, rk) = (
        f.outbox.broker_id,
        f.route.exchange.clone(),
        f.route.routing_key.clone(),
    );
    let soon = publish_delayed(
        &mut f.client,
        broker,
        &ex,
        &rk,
        "soon",
        30,
        Duration::from_secs(4),
    );
    let later = publish_delayed(
        &mut f.client,
        broker,
        &ex,
        &rk,
        "later",
        30,
        Duration::from_secs(9),
    );
    // Published at once beside them: not held back by the delayed ones.
    f.publish("now");
    f.collector.wait_for_body("now", ARRIVAL);
    assert_eq!(scheduled(&mut f.client), 60, "all 60 still wait");

    // The worker terminated while they wait; it comes back and moves them when due.
    let pid = f.cluster.wait_for_worker(&mut f.client, WORKER_UP);
    let killed: bool = f
        .client
        .query_one("SELECT pg_terminate_backend($1)", &[&pid])
        .expect("pg_terminate_backend")
        .get(0);
    assert!(killed);
    eventually(ARRIVAL, "the first 30 to arrive", || {
        let n = f
            .deliveries()
            .iter()
            .filter(|d| d.text().starts_with("soon-"))
            .count();
        if n >= 30 {
            Ok(())
        } else {
            Err(format!("{n} of 30"))
        }
    });
    // A server restart while the other 30 wait.
    assert!(
        f.deliveries()
            .iter()
            .all(|d| !d.text().starts_with("later-")),
        "a message due in 9 s arrived with those due in 4 s"
    );
    f.cluster.restart();
    f.client = f.cluster.client();
    f.cluster.wait_for_worker(&mut f.client, WORKER_UP);
    eventually(ARRIVAL, "the other 30 to arrive", || {
        let n = f
            .deliveries()
            .iter()
            .filter(|d| d.text().starts_with("later-"))
            .count();
        if n >= 30 {
            Ok(())
        } else {
            Err(format!("{n} of 30"))
        }
    });
    let deliveries = f.deliveries();
    assert_arrived_on_time(&soon, &deliveries);
    assert_arrived_on_time(&later, &deliveries);
    f.settle();
    assert_eq!(scheduled(&mut f.client), 0);
}

#[test]
fn delayed_messages_and_idempotency_keys_survive_a_dump_and_restore() {
    let rabbit = Rabbit::shared();
    let route = rabbit.declare_route("later.dump");
    // The producer's database: worker off, nothing leaves it.
    let source = PgCluster::new(PgConfig::default().setting("amqp_outbox.enabled", "off"));
    let mut src = source.client();
    create_extension(&mut src);
    let broker = add_broker(&mut src, rabbit.endpoint());
    let expected = publish_delayed(
        &mut src,
        broker,
        &route.exchange,
        &route.routing_key,
        "dumped",
        20,
        Duration::from_secs(8),
    );
    let keyed: i64 = src
        .query_one(
            "SELECT amqp.publish_message($1, $2, $3, 'keyed', deliver_after => '1 hour', \
                                         idempotency_key => 'dump-key')",
            &[&broker, &route.exchange, &route.routing_key],
        )
        .expect("keyed publish")
        .get(0);
    let path = source.dir().join("later.dump").display().to_string();
    source
        .run_client("pg_dump", &["-Fc", "-f", &path, "e2e"])
        .unwrap_or_else(|e| panic!("{e}"));
    drop(src);

    let collector = rabbit.consume_connected(&route);
    let target = PgCluster::new(PgConfig::default());
    let mut dst = target.client();
    target
        .run_client("pg_restore", &["--exit-on-error", "-d", "e2e", &path])
        .unwrap_or_else(|e| panic!("{e}"));
    target.wait_for_worker(&mut dst, WORKER_UP);
    assert!(scheduled(&mut dst) >= 1, "the scheduled rows were restored");
    // The key still counts after the restore: the same id, no new message.
    let again: i64 = dst
        .query_one(
            "SELECT amqp.publish_message($1, $2, $3, 'keyed again', idempotency_key => 'dump-key')",
            &[&broker, &route.exchange, &route.routing_key],
        )
        .expect("keyed publish after the restore")
        .get(0);
    assert_eq!(again, keyed);
    let arrived = collector.wait_for_count(expected.len(), ARRIVAL);
    assert_arrived_on_time(&expected, &arrived);
    // The keyed one waits an hour; retry() sends it now, once.
    dst.execute("SELECT amqp.retry($1)", &[&keyed])
        .expect("amqp.retry of the keyed message");
    collector.wait_for_body("keyed", ARRIVAL);
    std::thread::sleep(Duration::from_secs(2));
    let bodies = collector.body_counts();
    assert_eq!(bodies.get("keyed"), Some(&1));
    assert_eq!(bodies.get("keyed again"), None);
    assert_eq!(scheduled(&mut dst), 0);
}

/// Two sessions publish with one key: the second waits at the key for the first's end, then
/// gets the first's id (commit) or publishes itself (rollback). Exactly one message per key.
#[test]
fn racing_sessions_with_one_key_publish_one_message() {
    let rabbit = Rabbit::shared();
    let mut f = World::new("idem", PgConfig::default(), &rabbit);
    f.warm_up();
    let (broker, ex, rk) = (
        f.outbox.broker_id,
        f.route.exchange.clone(),
        f.route.routing_key.clone(),
    );
    let publish_sql = "SELECT amqp.publish_message($1, $2, $3, $4, idempotency_key => $5)";
    for first_commits in [true, false] {
        let key = format!("race-{first_commits}");
        let mut a = f.cluster.client();
        let mut b = f.cluster.client();
        let b_pid: i32 = b
            .query_one("SELECT pg_backend_pid()", &[])
            .expect("pid")
            .get(0);
        a.batch_execute("BEGIN").expect("BEGIN a");
        let a_body = format!("{key}-a");
        let a_id: i64 = a
            .query_one(publish_sql, &[&broker, &ex, &rk, &a_body, &key])
            .expect("publish a")
            .get(0);
        let (ex2, rk2, key2) = (ex.clone(), rk.clone(), key.clone());
        let racer = std::thread::spawn(move || {
            b.batch_execute("BEGIN").expect("BEGIN b");
            let id: i64 = b
                .query_one(
                    publish_sql,
                    &[&broker, &ex2, &rk2, &format!("{key2}-b"), &key2],
                )
                .expect("publish b")
                .get(0);
            b.batch_execute("COMMIT").expect("COMMIT b");
            id
        });
        // b waits at a's uncommitted key.
        wait_for_any_lock_wait(&mut f.client, b_pid, Duration::from_secs(20));
        assert!(!racer.is_finished(), "the second publisher did not wait");
        a.batch_execute(if first_commits { "COMMIT" } else { "ROLLBACK" })
            .expect("end a");
        let b_id = racer.join().expect("racer");
        if first_commits {
            assert_eq!(b_id, a_id, "the second publish returns the first one's id");
        } else {
            assert_ne!(
                b_id, a_id,
                "after a rollback the second publish is the first"
            );
        }
    }
    f.settle();
    let bodies = f.collector.body_counts();
    let race: BTreeMap<&str, usize> = bodies
        .iter()
        .filter(|(b, _)| b.starts_with("race-"))
        .map(|(b, n)| (b.as_str(), *n))
        .collect();
    assert_eq!(
        race,
        BTreeMap::from([("race-true-a", 1), ("race-false-b", 1)]),
        "one message per key: the committed first, or the second after a rollback"
    );

    // Under REPEATABLE READ the second gets a serialization failure to retry.
    let mut a = f.cluster.client();
    let mut b = f.cluster.client();
    b.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1")
        .expect("snapshot b");
    a.query_one(publish_sql, &[&broker, &ex, &rk, &"rr-a", &"rr"])
        .expect("publish a");
    let err = b
        .query_one(publish_sql, &[&broker, &ex, &rk, &"rr-b", &"rr"])
        .expect_err("b must not publish the key a committed after its snapshot");
    assert_eq!(
        err.code().map(|c| c.code()),
        Some("40001"),
        "serialization failure: {err}"
    );

    // Sessions released together onto each fresh key, each publish its own transaction: every
    // key is claimed once and no session gets an error (a lookup and an insert not serialized
    // per key would let two find nothing, and the second fail on the primary key: 23505).
    const SESSIONS: usize = 6;
    const KEYS: usize = 300;
    let start = std::sync::Arc::new(std::sync::Barrier::new(SESSIONS));
    let racers: Vec<_> = (0..SESSIONS)
        .map(|s| {
            let mut c = f.cluster.client();
            let (ex, rk, start) = (ex.clone(), rk.clone(), start.clone());
            std::thread::spawn(move || {
                (0..KEYS)
                    .map(|k| {
                        let key = format!("swarm-{k}");
                        let body = format!("{key}-{s}");
                        start.wait();
                        c.query_one(publish_sql, &[&broker, &ex, &rk, &body, &key])
                            .map(|row| row.get::<_, i64>(0))
                            .map_err(|e| match e.as_db_error() {
                                Some(d) => format!("{}: {}", d.code().code(), d.message()),
                                None => e.to_string(),
                            })
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let ids: Vec<Vec<Result<i64, String>>> = racers
        .into_iter()
        .map(|r| r.join().expect("racer"))
        .collect();
    for k in 0..KEYS {
        let of_key: BTreeSet<&Result<i64, String>> = ids.iter().map(|s| &s[k]).collect();
        assert_eq!(
            of_key.len(),
            1,
            "key swarm-{k}: every session gets one id: {of_key:?}"
        );
        assert!(
            of_key.iter().all(|r| r.is_ok()),
            "key swarm-{k}: {of_key:?}"
        );
    }
    f.settle();
    let swarm: BTreeMap<String, usize> = f
        .collector
        .body_counts()
        .iter()
        .filter(|(b, _)| b.starts_with("swarm-"))
        .fold(BTreeMap::new(), |mut per_key, (body, n)| {
            let key = body.rsplit_once('-').map_or(body.as_str(), |(k, _)| k);
            *per_key.entry(key.to_string()).or_default() += n;
            per_key
        });
    assert_eq!(swarm.len(), KEYS, "every key published");
    assert!(
        swarm.values().all(|n| *n == 1),
        "one message per key: {:?}",
        swarm.iter().filter(|(_, n)| **n != 1).collect::<Vec<_>>()
    );
}

/// A delayed message that `amqp.message` refuses (a trigger a DBA added) stays scheduled with
/// the error, tried again a minute later; the others due with it are delivered.
#[test]
fn a_delayed_message_the_outbox_refuses_holds_back_no_other() {
    let rabbit = Rabbit::shared();
    let mut f = World::new("later.poison", PgConfig::default(), &rabbit);
    f.warm_up();
    f.client
        .batch_execute(
            "CREATE FUNCTION public.refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
               IF convert_from(NEW.body, 'UTF8') = 'poison' THEN
                 RAISE EXCEPTION 'poison refused by a DBA''s trigger';
               END IF;
               RETURN NEW;
             END $$;
             CREATE TRIGGER refuse_poison BEFORE INSERT ON amqp.message
                FOR EACH ROW EXECUTE FUNCTION public.refuse_poison();",
        )
        .expect("trigger");
    let (broker, ex, rk) = (
        f.outbox.broker_id,
        f.route.exchange.clone(),
        f.route.routing_key.clone(),
    );
    let before = publish_delayed(
        &mut f.client,
        broker,
        &ex,
        &rk,
        "good",
        5,
        Duration::from_secs(2),
    );
    let poison_id: i64 = f
        .client
        .query_one(
            "SELECT amqp.publish_message($1, $2, $3, 'poison', deliver_after => '2 seconds')",
            &[&broker, &ex, &rk],
        )
        .expect("publish poison")
        .get(0);
    let after = publish_delayed(
        &mut f.client,
        broker,
        &ex,
        &rk,
        "fine",
        5,
        Duration::from_secs(2),
    );
    eventually(ARRIVAL, "the ten good ones to arrive", || {
        let n = f
            .deliveries()
            .iter()
            .filter(|d| d.text().starts_with("good-") || d.text().starts_with("fine-"))
            .count();
        if n >= 10 {
            Ok(())
        } else {
            Err(format!("{n} of 10"))
        }
    });
    let deliveries = f.deliveries();
    assert_arrived_on_time(&before, &deliveries);
    assert_arrived_on_time(&after, &deliveries);
    assert!(!f.collector.has_body("poison"));
    let (error, later): (Option<String>, bool) = {
        let r = f
            .client
            .query_one(
                "SELECT last_error, deliver_at > now() + '30 seconds' \
                   FROM amqp.scheduled_message WHERE id = $1",
                &[&poison_id],
            )
            .expect("the refused message is still scheduled");
        (r.get(0), r.get(1))
    };
    let error = error.unwrap_or_default();
    assert!(error.contains("poison refused"), "last_error: {error}");
    assert!(later, "tried again a minute later, not at once");
    // The worker is still well: a message published now arrives.
    f.publish("after the poison");
    f.collector.wait_for_body("after the poison", ARRIVAL);
}

/// Keys older than `amqp_outbox.idempotency_window` are deleted by the worker (once a minute,
/// and when it starts), and such a key publishes again.
#[test]
fn keys_older_than_the_window_are_deleted_and_publish_again() {
    let rabbit = Rabbit::shared();
    let mut f = World::new("idem.window", PgConfig::default(), &rabbit);
    f.warm_up();
    let (broker, ex, rk) = (
        f.outbox.broker_id,
        f.route.exchange.clone(),
        f.route.routing_key.clone(),
    );
    let publish = "SELECT amqp.publish_message($1, $2, $3, $4, idempotency_key => $5)";
    let old: i64 = f
        .client
        .query_one(publish, &[&broker, &ex, &rk, &"old-1", &"old"])
        .expect("publish old")
        .get(0);
    let young: i64 = f
        .client
        .query_one(publish, &[&broker, &ex, &rk, &"young-1", &"young"])
        .expect("publish young")
        .get(0);
    f.client
        .execute(
            "UPDATE amqp.idempotency_key SET published_at = now() - interval '25 hours' WHERE key = 'old'",
            &[],
        )
        .expect("age the key");
    // Delivered before the worker is terminated, so that each arrives once.
    f.settle();
    // A new worker expires at once.
    let pid = f.cluster.wait_for_worker(&mut f.client, WORKER_UP);
    f.client
        .execute("SELECT pg_terminate_backend($1)", &[&pid])
        .expect("pg_terminate_backend");
    eventually(ARRIVAL, "the old key to be deleted", || {
        let keys: Vec<String> = f
            .client
            .query("SELECT key FROM amqp.idempotency_key ORDER BY key", &[])
            .map_err(|e| e.to_string())?
            .iter()
            .map(|r| r.get(0))
            .collect();
        if keys == ["young"] {
            Ok(())
        } else {
            Err(format!("keys: {keys:?}"))
        }
    });
    let young_again: i64 = f
        .client
        .query_one(publish, &[&broker, &ex, &rk, &"young-2", &"young"])
        .expect("publish young again")
        .get(0);
    assert_eq!(young_again, young);
    let old_again: i64 = f
        .client
        .query_one(publish, &[&broker, &ex, &rk, &"old-2", &"old"])
        .expect("publish old again")
        .get(0);
    assert_ne!(old_again, old, "a key past the window publishes again");
    // old-2 delivered before the next termination too: in flight then, it would be resent (at
    // least once) and arrive twice.
    f.settle();

    // A session taking an expired key again holds its row until it ends: the worker's expiry
    // skips that row instead of waiting for the session, and delivery goes on meanwhile.
    f.client
        .execute(
            "UPDATE amqp.idempotency_key SET published_at = now() - interval '25 hours' WHERE key = 'young'",
            &[],
        )
        .expect("age the key");
    let mut holder = f.cluster.client();
    holder.batch_execute("BEGIN").expect("BEGIN");
    holder
        .query_one(publish, &[&broker, &ex, &rk, &"young-3", &"young"])
        .expect("publish young within the open transaction");
    let pid = f.cluster.wait_for_worker(&mut f.client, WORKER_UP);
    f.client
        .execute("SELECT pg_terminate_backend($1)", &[&pid])
        .expect("pg_terminate_backend");
    f.cluster.wait_for_worker(&mut f.client, WORKER_UP);
    f.publish("while the key is held");
    f.collector.wait_for_body("while the key is held", ARRIVAL);
    holder.batch_execute("ROLLBACK").expect("ROLLBACK");
    f.settle();
    let bodies = f.collector.body_counts();
    for (body, n) in [("old-1", 1), ("young-1", 1), ("old-2", 1)] {
        assert_eq!(bodies.get(body), Some(&n), "{body}");
    }
    assert_eq!(bodies.get("young-2"), None);
    assert_eq!(bodies.get("young-3"), None, "rolled back");
}
