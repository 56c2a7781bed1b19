//! End-to-end tests of subscriptions with lanes: a parallelism (messages in progress at once,
//! in lane processes, backend_type `amqp_outbox lane`) and an ordering by key (messages with
//! one key handled one after another in the order they were published; a failed one holds
//! back its key only). Real cluster, real RabbitMQ (a private node where the broker is
//! restarted); the producer publishes through its outbox with business keys, the handler
//! writes its effect with a sequence number, and the order per key is read from it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use amqp_outbox_e2e::chaos::send_signal;
use amqp_outbox_e2e::{eventually, PrivateRabbit, Rabbit};
use postgres::Client;

mod rig;
use rig::*;

/// The lanes' backend_type.
const LANE: &str = "amqp_outbox lane";
/// Room for two databases' workers and up to 8 lanes.
const WORKER_SLOTS: (&str, &str) = ("max_worker_processes", "20");

/// Effects with their key, the handler's process and a sequence in the order the handlers ran:
/// messages of one key must appear in the order of `n`. A body `{"fail_first": true}` fails
/// at its first attempt; a body with `"stuck": true` fails until the handler is replaced.
const KEYED_SCHEMA: &str = "
    CREATE TABLE public.keyed (
        seq bigint GENERATED ALWAYS AS IDENTITY,
        message_id text NOT NULL,
        key text,
        n integer NOT NULL,
        amount bigint NOT NULL,
        pid integer NOT NULL DEFAULT pg_backend_pid(),
        started timestamptz NOT NULL,
        ended timestamptz NOT NULL DEFAULT clock_timestamp()
    );
    CREATE FUNCTION public.apply_keyed(d amqp.delivery) RETURNS void
        LANGUAGE plpgsql AS $fn$
    DECLARE
        b jsonb := amqp.body_text(d)::jsonb;
        t0 timestamptz := clock_timestamp();
    BEGIN
        IF (b->>'stuck')::boolean THEN
            RAISE EXCEPTION 'e2e: message % is stuck', b->>'n';
        END IF;
        IF (b->>'fail_first')::boolean AND d.attempt = 1 THEN
            RAISE EXCEPTION 'e2e: message % fails at its first attempt', b->>'n';
        END IF;
        PERFORM pg_sleep(coalesce((b->>'sleep')::float8, 0));
        INSERT INTO public.keyed (message_id, key, n, amount, started)
        VALUES (d.message_id, d.headers->>'x-amqp-outbox-business-key', (b->>'n')::integer,
                (b->>'amount')::bigint, t0);
    END
    $fn$;";

/// Publishes messages `from..to` in one transaction, message `g` with key `k<g % keys>`;
/// `extra` is merged into each body (SQL jsonb expression over `g`).
fn publish_keyed(
    c: &mut Client,
    broker: i32,
    ex: &str,
    rk: &str,
    (from, to): (i32, i32),
    keys: i32,
    extra: &str,
) -> Result<(), String> {
    c.query_one(
        &format!(
            "SELECT count(amqp.publish_message($1, $2, $3, \
                 (jsonb_build_object('n', g, 'amount', (g::bigint * 7919) % 1000 + 1) \
                  || ({extra}))::text, \
                 business_key => 'k' || (g % $6))) \
               FROM generate_series($4::int, $5::int - 1) g"
        ),
        &[&broker, &ex, &rk, &from, &to, &keys],
    )
    .map(drop)
    .map_err(|e| format!("publishing {from}..{to}: {e}"))
}

/// The stream of the first test, for `produce_idempotently`: 16 keys, every 13th message fails
/// at its first attempt, handlers sleep 2 ms.
const STREAM: &str = "SELECT count(amqp.publish_message($1, $2, $3, \
         jsonb_build_object('n', g, 'amount', (g::bigint * 7919) % 1000 + 1, \
                            'fail_first', g % 13 = 0, 'sleep', 0.002)::text, \
         business_key => 'k' || (g % 16))) \
       FROM generate_series($4::int, $5::int - 1) g";

/// Messages of one key handled out of their order: (key, n, the n handled before it).
fn out_of_order(c: &mut Client) -> Vec<(String, i32, i32)> {
    c.query(
        "SELECT key, n, prev FROM ( \
             SELECT key, n, lag(n) OVER (PARTITION BY key ORDER BY seq) AS prev FROM public.keyed \
         ) s WHERE n < prev ORDER BY key, n LIMIT 20",
        &[],
    )
    .expect("reading the order per key")
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2)))
    .collect()
}

/// (rows, distinct message ids, distinct n, sum of amounts) of `public.keyed`.
fn keyed_totals(c: &mut Client) -> Result<(i64, i64, i64, i64), String> {
    let r = c
        .query_one(
            "SELECT count(*), count(DISTINCT message_id), count(DISTINCT n), \
                    coalesce(sum(amount), 0)::bigint FROM public.keyed",
            &[],
        )
        .map_err(|e| format!("reading public.keyed: {e}"))?;
    Ok((r.get(0), r.get(1), r.get(2), r.get(3)))
}

/// The pids of the consumer database's lanes, by lane number.
fn lane_pids(c: &mut Client) -> Result<Vec<(String, i32)>, String> {
    c.batch_execute("SELECT pg_catalog.pg_stat_clear_snapshot()")
        .map_err(|e| e.to_string())?;
    Ok(c.query(
        "SELECT application_name, pid FROM pg_catalog.pg_stat_activity \
          WHERE backend_type = $1 AND datname = current_database() ORDER BY 1",
        &[&LANE],
    )
    .map_err(|e| format!("pg_stat_activity: {e}"))?
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect())
}

fn wait_lanes(pair: &mut Pair, n: usize, not: &[i32]) -> Vec<(String, i32)> {
    let cluster = &pair.cluster;
    let c = &mut pair.consumer;
    eventually(
        Duration::from_secs(30),
        &format!("{n} lanes in pg_stat_activity (none of {not:?})"),
        || {
            if c.is_closed() {
                *c = cluster.try_client_db(CONSUMER)?;
            }
            let lanes = lane_pids(c)?;
            let fresh = lanes.iter().all(|(_, p)| !not.contains(p));
            let numbered: Vec<String> = (1..=n).map(|i| format!("amqp_outbox lane {i}")).collect();
            let names: Vec<String> = lanes.iter().map(|(a, _)| a.clone()).collect();
            if fresh && names == numbered {
                Ok(lanes)
            } else {
                Err(format!(
                    "lanes {lanes:?}; log tail:\n{}",
                    cluster.log_tail(15)
                ))
            }
        },
    )
}

/// Whether two handler calls of different lanes overlapped in time.
fn lanes_overlapped(c: &mut Client) -> bool {
    c.query_one(
        "SELECT EXISTS (SELECT FROM public.keyed a JOIN public.keyed b \
                           ON a.pid <> b.pid AND a.started < b.ended AND b.started < a.ended)",
        &[],
    )
    .expect("reading overlaps")
    .get(0)
}

fn subscribe_lanes(
    c: &mut Client,
    name: &str,
    broker: i32,
    queue: &str,
    parallelism: i32,
    ordering: &str,
) {
    c.execute(
        "SELECT amqp.subscribe($1, $2, $3, 'public.apply_keyed(amqp.delivery)', \
                               max_attempts => 1000, parallelism => $4, ordering => $5)",
        &[&name, &broker, &queue, &parallelism, &ordering],
    )
    .unwrap_or_else(|e| panic!("amqp.subscribe({name}) with lanes: {e:?}"));
}

#[test]
fn lanes_run_in_parallel_and_keep_each_keys_order_through_kills_and_a_broker_restart() {
    assert!(
        amqp_outbox_testkit::rabbitmq_installed(),
        "rabbitmq-server is not installed (scripts/setup.sh installs it)"
    );
    let mut node = PrivateRabbit::try_prepare()
        .and_then(|mut n| n.try_boot().map(|()| n))
        .unwrap_or_else(|e| panic!("cannot start a private RabbitMQ node: {e}"));
    let rabbit = node.rabbit();
    let mut route = rabbit.declare_route("lanes-order");
    route.delete_on_drop = false; // the node goes away with its data
    drop(rabbit);
    let mut pair = Pair::new(
        &node.endpoint(),
        &[
            ("amqp_outbox.retry_backoff_min", "100".into()),
            ("amqp_outbox.retry_backoff_max", "500".into()),
            (WORKER_SLOTS.0, WORKER_SLOTS.1.into()),
        ],
    );
    pair.consumer
        .batch_execute(KEYED_SCHEMA)
        .expect("keyed schema");
    let broker = pair.consumer_broker;
    subscribe_lanes(
        &mut pair.consumer,
        "ordered",
        broker,
        &route.queue,
        4,
        "business_key",
    );
    wait_state(&mut pair, "ordered", "consuming");
    let lanes = wait_lanes(&mut pair, 4, &[]);
    eprintln!("lanes: {lanes:?}");

    // A stream in transactions of 20 messages over 16 keys (see STREAM); every 13th message
    // fails at its first attempt (its key waits for the retry); handlers take 2 ms, so lanes
    // overlap.
    const PER: i32 = 20;
    pair.producer
        .batch_execute("CREATE TABLE public.sent (batch integer PRIMARY KEY)")
        .expect("sent table");
    let stop = Arc::new(AtomicBool::new(false));
    let producer = produce_idempotently(
        pair.conninfo(PRODUCER),
        STREAM,
        pair.producer_broker,
        route.exchange.clone(),
        route.routing_key.clone(),
        PER,
        2000,
        stop.clone(),
    );
    let wait_more = |pair: &mut Pair, more: i64, what: &str| {
        let from = eventually(UP, "reading the effects", || {
            reconnect_if_closed(&pair.cluster, &mut pair.consumer, CONSUMER)?;
            keyed_totals(&mut pair.consumer)
        })
        .0;
        eventually(BULK, what, || {
            reconnect_if_closed(&pair.cluster, &mut pair.consumer, CONSUMER)?;
            let n = keyed_totals(&mut pair.consumer)?.0;
            if n >= from + more {
                Ok(n)
            } else {
                Err(format!("{} new effects", n - from))
            }
        })
    };

    wait_more(&mut pair, 300, "300 effects before the faults");
    // A lane ended by pg_terminate_backend() comes back.
    let (_, victim) = lanes[1].clone();
    pair.consumer
        .execute("SELECT pg_terminate_backend($1)", &[&victim])
        .expect("terminating a lane");
    let lanes = wait_lanes(&mut pair, 4, &[victim]);
    wait_more(&mut pair, 200, "effects after a lane was terminated");
    // kill -9 of a lane: the postmaster restarts the cluster (crash recovery).
    send_signal(lanes[0].1, libc::SIGKILL).expect("SIGKILL a lane");
    pair.reconnect();
    let lanes = wait_lanes(&mut pair, 4, &[lanes[0].1]);
    pair.reconnect();
    wait_more(&mut pair, 200, "effects after a lane was killed");
    // kill -9 of the subscription worker (which hands the lanes their messages).
    let sub_worker = pair.wait_sub_worker(None);
    send_signal(sub_worker, libc::SIGKILL).expect("SIGKILL the subscription worker");
    pair.reconnect();
    pair.wait_sub_worker(Some(sub_worker));
    wait_lanes(&mut pair, 4, &[lanes[2].1]);
    pair.reconnect();
    wait_more(
        &mut pair,
        200,
        "effects after the subscription worker was killed",
    );
    // RabbitMQ stopped and started again.
    node.stop();
    node.boot();
    wait_more(&mut pair, 200, "effects after the broker restart");

    let ended_early = producer.is_finished();
    stop.store(true, Ordering::Relaxed);
    let (batches, reconnects) = producer
        .join()
        .expect("producer thread")
        .unwrap_or_else(|e| panic!("producer: {e}"));
    let sent = scalar_i64(&mut pair.producer, "SELECT count(*) FROM public.sent").unwrap();
    assert_eq!(sent, i64::from(batches), "every batch committed once");
    assert!(
        !ended_early,
        "the producer ended before the faults were over"
    );
    let total = i64::from(batches * PER);
    let (count, sum) = expected_totals(total);
    let admin = node.rabbit();
    let totals = amqp_outbox_e2e::try_eventually(BULK, || {
        let t = keyed_totals(&mut pair.consumer)?;
        let ready = admin
            .queue_counts(&route.queue)?
            .map(|q| q.messages)
            .unwrap_or(u32::MAX);
        if t.0 >= count && ready == 0 {
            Ok(t)
        } else {
            Err(format!(
                "effects {t:?} of {count}; queue {ready}; {:?}",
                sub_status(&mut pair.consumer, "ordered")
            ))
        }
    })
    .unwrap_or_else(|e| panic!("the stream did not complete: {e}\n{}", pair.server_log()));
    assert_eq!(
        totals,
        (count, count, count, sum),
        "effects (rows, distinct ids, distinct n, sum) vs. what was published"
    );
    let wrong = out_of_order(&mut pair.consumer);
    assert!(
        wrong.is_empty(),
        "messages of one key handled out of their order: {wrong:?}"
    );
    assert!(
        lanes_overlapped(&mut pair.consumer),
        "no two handler calls of different lanes ever overlapped: not parallel"
    );
    let pids: i64 = pair
        .consumer
        .query_one("SELECT count(DISTINCT pid) FROM public.keyed", &[])
        .unwrap()
        .get(0);
    assert!(pids >= 4, "{pids} processes handled messages");
    let failed: i64 = pair
        .consumer
        .query_one(
            "SELECT failed FROM amqp.subscription_status WHERE subscription = 'ordered'",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(failed > 0, "no message failed at its first attempt");
    let waiting: i64 = scalar_i64(
        &mut pair.consumer,
        "SELECT count(*) FROM amqp.inbox_waiting",
    )
    .unwrap();
    assert_eq!(waiting, 0, "messages left waiting for a lane");
    eprintln!(
        "{total} messages in {batches} transactions, {failed} first attempts failed, \
         {reconnects} producer reconnects"
    );
}

#[test]
fn a_blocked_key_holds_back_only_itself_and_health_says_so() {
    let rabbit = Rabbit::shared();
    let route = rabbit.declare_route("lanes-blocked");
    let mut pair = Pair::new(
        rabbit.endpoint(),
        &[
            ("amqp_outbox.retry_backoff_min", "100".into()),
            ("amqp_outbox.retry_backoff_max", "200".into()),
            ("amqp_outbox.blocked_key_warning", "'1s'".into()),
            (WORKER_SLOTS.0, WORKER_SLOTS.1.into()),
        ],
    );
    pair.consumer
        .batch_execute(KEYED_SCHEMA)
        .expect("keyed schema");
    let broker = pair.consumer_broker;
    subscribe_lanes(
        &mut pair.consumer,
        "blocked",
        broker,
        &route.queue,
        2,
        "business_key",
    );
    wait_state(&mut pair, "blocked", "consuming");
    // 400 messages over 8 keys; message 3 (key k3) fails until its handler is replaced: the 49
    // later messages of k3 wait, the 350 of the other keys go through.
    publish_keyed(
        &mut pair.producer,
        pair.producer_broker,
        &route.exchange,
        &route.routing_key,
        (0, 400),
        8,
        "jsonb_build_object('stuck', g = 3)",
    )
    .unwrap();
    let c = &mut pair.consumer;
    eventually(BULK, "every key but k3 handled, k3 waiting", || {
        let done = scalar_i64(c, "SELECT count(*) FROM public.keyed WHERE key <> 'k3'")?;
        let k3 = scalar_i64(c, "SELECT count(*) FROM public.keyed WHERE key = 'k3'")?;
        let waiting = scalar_i64(
            c,
            "SELECT count(*) FROM amqp.inbox_waiting WHERE ordering_key = 'k3'",
        )?;
        if done == 350 && k3 == 0 && waiting == 49 {
            Ok(())
        } else {
            Err(format!(
                "other keys {done}/350, k3 handled {k3}, k3 waiting {waiting}/49"
            ))
        }
    });
    let (keys, waiting): (i64, i64) = {
        let r = c
            .query_one(
                "SELECT blocked_keys, waiting FROM amqp.subscription_status \
                  WHERE subscription = 'blocked'",
                &[],
            )
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!((keys, waiting), (1, 49), "subscription_status");
    eventually(Duration::from_secs(20), "a health warning for k3", || {
        let rows = c
            .query(
                "SELECT status, detail FROM amqp.health() WHERE component = 'blocked keys blocked'",
                &[],
            )
            .map_err(|e| e.to_string())?;
        match rows.first() {
            Some(r) if r.get::<_, String>(0) == "warning" => Ok(()),
            other => Err(format!("{:?}", other.map(|r| r.get::<_, String>(1)))),
        }
    });
    // The handler fixed: the stuck message is retried and k3 drains, in order.
    c.batch_execute(
        "CREATE OR REPLACE FUNCTION public.apply_keyed(d amqp.delivery) RETURNS void
             LANGUAGE plpgsql AS $fn$
         DECLARE
             b jsonb := amqp.body_text(d)::jsonb;
         BEGIN
             INSERT INTO public.keyed (message_id, key, n, amount, started)
             VALUES (d.message_id, d.headers->>'x-amqp-outbox-business-key', (b->>'n')::integer,
                     (b->>'amount')::bigint, clock_timestamp());
         END
         $fn$;",
    )
    .unwrap();
    eventually(BULK, "k3 handled after the fix", || {
        let k3 = scalar_i64(c, "SELECT count(*) FROM public.keyed WHERE key = 'k3'")?;
        let left = scalar_i64(c, "SELECT count(*) FROM amqp.inbox_waiting")?;
        let failed = scalar_i64(c, "SELECT count(*) FROM amqp.inbox_failed")?;
        if k3 == 50 && left == 0 && failed == 0 {
            Ok(())
        } else {
            Err(format!("k3 {k3}/50, waiting {left}, failed {failed}"))
        }
    });
    let wrong = out_of_order(c);
    assert!(wrong.is_empty(), "out of order: {wrong:?}");
    let first_k3: i32 = c
        .query_one(
            "SELECT n FROM public.keyed WHERE key = 'k3' ORDER BY seq LIMIT 1",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(first_k3, 3, "k3 went on before its failed message");
    let rows = c
        .query(
            "SELECT status FROM amqp.health() WHERE component LIKE 'blocked keys%'",
            &[],
        )
        .unwrap();
    assert!(rows.is_empty(), "health still reports blocked keys");
}

#[test]
fn lanes_follow_the_parallelism_and_come_back_when_all_are_terminated() {
    let rabbit = Rabbit::shared();
    let route = rabbit.declare_route("lanes-count");
    let mut pair = Pair::new(
        rabbit.endpoint(),
        &[(WORKER_SLOTS.0, WORKER_SLOTS.1.into())],
    );
    pair.consumer
        .batch_execute(KEYED_SCHEMA)
        .expect("keyed schema");
    let broker = pair.consumer_broker;
    subscribe_lanes(&mut pair.consumer, "count", broker, &route.queue, 3, "none");
    let lanes = wait_lanes(&mut pair, 3, &[]);
    // Every lane at once, as a script that terminates every backend named like ours would.
    pair.consumer
        .execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
              WHERE backend_type = $1",
            &[&LANE],
        )
        .expect("terminating the lanes");
    let pids: Vec<i32> = lanes.iter().map(|(_, p)| *p).collect();
    wait_lanes(&mut pair, 3, &pids);
    // More lanes, then none: the subscription worker asks, the launcher starts and stops them.
    pair.consumer
        .execute(
            "SELECT amqp.alter_subscription('count', parallelism => 5)",
            &[],
        )
        .unwrap();
    wait_lanes(&mut pair, 5, &[]);
    let lanes: i32 = pair
        .consumer
        .query_one(
            "SELECT lanes FROM amqp.subscription_status WHERE subscription = 'count'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(lanes, 5, "subscription_status.lanes");
    publish_keyed(
        &mut pair.producer,
        pair.producer_broker,
        &route.exchange,
        &route.routing_key,
        (0, 100),
        4,
        "'{}'::jsonb",
    )
    .unwrap();
    let c = &mut pair.consumer;
    eventually(BULK, "100 effects", || {
        let n = scalar_i64(c, "SELECT count(*) FROM public.keyed")?;
        if n == 100 {
            Ok(())
        } else {
            Err(format!("{n}"))
        }
    });
    pair.consumer
        .execute(
            "SELECT amqp.alter_subscription('count', parallelism => 1)",
            &[],
        )
        .unwrap();
    wait_lanes(&mut pair, 0, &[]);
    // Handled by the subscription worker itself again.
    publish_keyed(
        &mut pair.producer,
        pair.producer_broker,
        &route.exchange,
        &route.routing_key,
        (100, 150),
        4,
        "'{}'::jsonb",
    )
    .unwrap();
    let c = &mut pair.consumer;
    eventually(BULK, "150 effects", || {
        let n = scalar_i64(c, "SELECT count(*) FROM public.keyed")?;
        if n == 150 {
            Ok(())
        } else {
            Err(format!("{n}"))
        }
    });
    let sub_worker = pair.wait_sub_worker(None);
    let last: i32 = pair
        .consumer
        .query_one(
            "SELECT count(*)::int FROM public.keyed WHERE n >= 100 AND pid <> $1",
            &[&sub_worker],
        )
        .unwrap()
        .get(0);
    assert_eq!(last, 0, "messages after parallelism 1 handled by a lane");
}

/// Inside a lane too, a handler that catches the cancel of `amqp_outbox.handler_timeout` is
/// ended (the lane exits, another takes its place) and its message recorded as failed; and
/// hostile ordering headers (a NUL, bytes that are not UTF-8, 60 KB) are ordered by their digest
/// and handled beside good traffic. Nothing else waits for them.
#[test]
fn a_trapped_handler_and_hostile_keys_in_a_lane_hold_back_nothing_else() {
    use amqp_outbox_testkit::amqp_admin::AmqpAdmin;
    use lapin::types::{AMQPValue, FieldTable, LongString};
    use lapin::BasicProperties;

    let rabbit = Rabbit::shared();
    let q = rabbit.declare_queue("lanes-hostile");
    let mut pair = Pair::new(
        rabbit.endpoint(),
        &[
            ("amqp_outbox.handler_timeout", "500".into()),
            (WORKER_SLOTS.0, WORKER_SLOTS.1.into()),
        ],
    );
    let c = &mut pair.consumer;
    c.batch_execute(
        "CREATE TABLE public.handled (seq bigint GENERATED ALWAYS AS IDENTITY, body text,
                                      key_digest text, pid int DEFAULT pg_backend_pid());
         CREATE FUNCTION public.trap_or_apply(d amqp.delivery) RETURNS void LANGUAGE plpgsql AS $fn$
         BEGIN
             IF amqp.body_text(d) LIKE 'stubborn%' THEN
                 LOOP
                     BEGIN
                         PERFORM pg_sleep(0.05);
                     EXCEPTION WHEN query_canceled THEN NULL;
                     END;
                 END LOOP;
             END IF;
             INSERT INTO public.handled (body, key_digest)
             VALUES (amqp.body_text(d), md5(coalesce(d.headers->>'k', '')));
         END
         $fn$;",
    )
    .expect("handler");
    c.execute(
        "SELECT amqp.subscribe('hostile', $1, $2, 'public.trap_or_apply(amqp.delivery)', \
                               max_attempts => 1, parallelism => 2, ordering => 'header:k')",
        &[&pair.consumer_broker, &q.queue],
    )
    .expect("subscribe");
    wait_state(&mut pair, "hostile", "consuming");
    let before = wait_lanes(&mut pair, 2, &[]);

    let admin = AmqpAdmin::connect(&rabbit.endpoint().uri()).expect("AMQP client");
    let send = |body: &str, key: AMQPValue| {
        let mut headers = FieldTable::default();
        headers.insert("k".into(), key);
        let props = BasicProperties::default()
            .with_message_id(body.to_string().into())
            .with_delivery_mode(2)
            .with_headers(headers);
        admin
            .publish("", &q.queue, body.as_bytes(), props)
            .unwrap_or_else(|e| panic!("publishing {body}: {e}"));
    };
    let text = |s: &str| AMQPValue::LongString(s.into());
    send("good-1", text("a"));
    send("stubborn-1", text("a"));
    send("good-2", text("a"));
    send("nul-1", text("x\0y"));
    send(
        "bytes-1",
        AMQPValue::LongString(LongString::from(vec![0xff, 0xfe, 0x00, 0x80])),
    );
    send("huge-1", text(&"h".repeat(60_000)));
    for i in 3..=12 {
        send(&format!("good-{i}"), text(["b", "c", "d"][i % 3]));
    }
    send("nul-2", text("x\0y"));

    let c = &mut pair.consumer;
    let dead = eventually(
        BULK,
        "stubborn-1 dead with the timeout as its error",
        || {
            c.query_opt(
                "SELECT last_error FROM amqp.inbox_failed \
              WHERE subscription = 'hostile' AND convert_from(body, 'UTF8') = 'stubborn-1' \
                AND dead_lettered_at IS NOT NULL",
                &[],
            )
            .map_err(|e| e.to_string())?
            .map(|r| r.get::<_, String>(0))
            .ok_or_else(|| "not dead yet".to_string())
        },
    );
    assert!(dead.contains("handler_timeout"), "{dead}");
    eventually(BULK, "every other message handled", || {
        let n = scalar_i64(c, "SELECT count(*) FROM public.handled")?;
        if n == 16 {
            return Ok(());
        }
        let mut rows = |sql: &str| -> Result<Vec<String>, String> {
            Ok(c.query(sql, &[])
                .map_err(|e| e.to_string())?
                .iter()
                .map(|r| r.get::<_, String>(0))
                .collect())
        };
        Err(format!(
            "{n} of 16 handled: {:?}; waiting {:?}; failed {:?}",
            rows("SELECT body FROM public.handled ORDER BY seq")?,
            rows("SELECT convert_from(body, 'UTF8') || ' ' || left(coalesce(ordering_key, '-'), 20) \
                    || ' ' || coalesce(ended::text, '-') FROM amqp.inbox_waiting")?,
            rows("SELECT convert_from(body, 'UTF8') || ' ' || left(coalesce(last_error, ''), 80) \
                    || ' ' || (dead_lettered_at IS NOT NULL) FROM amqp.inbox_failed")?,
        ))
    });
    let order: Vec<String> = c
        .query(
            "SELECT body FROM public.handled WHERE body IN ('good-1', 'good-2', 'nul-1', 'nul-2') \
              ORDER BY seq",
            &[],
        )
        .expect("handled order")
        .iter()
        .map(|r| r.get(0))
        .collect();
    let pos = |b: &str| order.iter().position(|x| x == b).expect(b);
    assert!(
        pos("good-1") < pos("good-2"),
        "key a out of order: {order:?}"
    );
    assert!(
        pos("nul-1") < pos("nul-2"),
        "the NUL key out of order: {order:?}"
    );
    // The lane whose handler trapped the cancel was ended, and another took its place.
    let old: Vec<i32> = before.iter().map(|(_, p)| *p).collect();
    let after = wait_lanes(&mut pair, 2, &[]);
    assert!(
        after.iter().any(|(_, p)| !old.contains(p)),
        "no lane was replaced: {before:?} then {after:?}"
    );
    let waiting = scalar_i64(
        &mut pair.consumer,
        "SELECT count(*) FROM amqp.inbox_waiting",
    )
    .expect("waiting");
    assert_eq!(waiting, 0);
}
