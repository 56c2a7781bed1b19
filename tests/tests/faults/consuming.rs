//! Case 25: locks and poison on the consuming side, under load. The outbox's messages reach a
//! second queue, bound to the same route, that a subscription of the same database consumes,
//! while a session holds the older consumption table with retention due, one message in fifty
//! breaks a deferred foreign key, and messages whose dead letter the outbox refuses arrive.
//! The subscription worker must never restart, every other message must be handled exactly
//! once, and each poison message must be recorded as failed with its reason.

use std::time::{Duration, Instant};

use amqp_outbox_e2e::eventually;
use amqp_outbox_testkit::amqp_admin::AmqpAdmin;
use lapin::BasicProperties;
use postgres::Client;

use super::harness::*;

/// The handler's schema: every handled message is a row of `public.child` under parent 1, but
/// one in fifty names parent 999, which the deferred foreign key refuses; a body over 2,000
/// bytes (injected) fails the handler at once.
const SCHEMA: &str = "
    CREATE TABLE public.parent (id integer PRIMARY KEY);
    INSERT INTO public.parent VALUES (1);
    CREATE TABLE public.child (
        body text PRIMARY KEY,
        parent integer NOT NULL REFERENCES public.parent DEFERRABLE INITIALLY DEFERRED,
        calls integer NOT NULL DEFAULT 1);
    CREATE FUNCTION public.handle(d amqp.delivery) RETURNS void LANGUAGE plpgsql AS $fn$
    DECLARE
        b text := amqp.body_text(d);
    BEGIN
        IF octet_length(b) > 2000 THEN
            RAISE EXCEPTION 'too big to handle';
        END IF;
        INSERT INTO public.child (body, parent)
        VALUES (b, CASE WHEN split_part(b, ':', 2) !~ '^[0-9]+$' THEN 1
                        WHEN split_part(b, ':', 2)::bigint % 50 = 7 THEN 999 ELSE 1 END)
        ON CONFLICT (body) DO UPDATE SET calls = child.calls + 1;
    END
    $fn$;";

fn sub_worker(client: &mut Client) -> Option<i32> {
    client
        .batch_execute("SELECT pg_stat_clear_snapshot()")
        .ok()?;
    client
        .query_opt(
            "SELECT pid FROM pg_stat_activity WHERE backend_type = 'amqp_outbox subscriptions'",
            &[],
        )
        .ok()
        .flatten()
        .map(|r| r.get(0))
}

#[test]
fn case25_locks_and_poison_never_stop_the_subscription() {
    let config = base_config().setting("amqp_outbox.max_message_size", 3000);
    let mut rig = Rig::new("25 consuming: locks and poison", config);
    let rabbit = rig.node.rabbit();
    let sub_queue = rabbit.declare_queue("chaos-25-sub");
    rabbit.bind_queue(
        &sub_queue.queue,
        &rig.route.exchange,
        &rig.route.routing_key,
    );
    let dlx = rabbit.declare_route("chaos-25-dlx");
    rig.client.batch_execute(SCHEMA).unwrap();
    rig.client
        .execute(
            "SELECT amqp.subscribe('chaos', $1, $2, 'public.handle(amqp.delivery)', \
                                   max_attempts => 1, dead_letter_exchange => $3)",
            &[&rig.outbox.broker_id, &sub_queue.queue, &dlx.exchange],
        )
        .unwrap();
    // Retention due, and a session that keeps the older consumption table: the subscription
    // worker, started again, runs the retention at once.
    rig.client
        .batch_execute("UPDATE amqp._consumed_since SET since = since - interval '40 days'")
        .unwrap();
    let mut holder = rig.cluster.client();
    holder
        .batch_execute("BEGIN; SELECT amqp.consume_once('holder', 'hold-1')")
        .unwrap();
    let client = &mut rig.client;
    let first = eventually(WORKER_UP, "the subscription worker", || {
        sub_worker(client).ok_or_else(|| "none".to_string())
    });
    client
        .execute("SELECT pg_terminate_backend($1)", &[&first])
        .unwrap();
    let worker = eventually(
        WORKER_UP,
        "the subscription worker back",
        || match sub_worker(client) {
            Some(p) if p != first => Ok(p),
            other => Err(format!("{other:?}")),
        },
    );

    let producers = rig.producers("cs", 3, u64::MAX, 10, 0.05);
    let admin = AmqpAdmin::connect(&rig.node.endpoint().uri()).expect("AMQP client");
    let big = "x".repeat(5000);
    for i in 0..5 {
        let since = rig.collector.len();
        rig.wait_more_deliveries(since, 200, &format!("deliveries before poison {i}"));
        admin
            .publish(
                "",
                &sub_queue.queue,
                format!("big:{i}:{big}").as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .unwrap();
    }
    let heal_at = Instant::now();
    rig.wait_more_deliveries(rig.collector.len(), 200, "deliveries after the poison");
    join_all(producers);
    let report = rig.finish(
        Some(heal_at),
        MAX_IN_FLIGHT,
        &[],
        "subscription beside the route",
    );

    // The consuming side: every committed message handled once, but the one in fifty the
    // deferred key refuses, which is dead in inbox_failed with 23503 like the big ones with
    // their refused dead letter; the worker never restarted.
    let committed: Vec<String> = rig
        .ledger
        .committed_keys()
        .iter()
        .map(|k| k.body())
        .collect();
    let good = committed
        .iter()
        .filter(|b| {
            b.split(':')
                .nth(1)
                .and_then(|s| s.parse::<u64>().ok())
                .is_some_and(|n| n % 50 != 7)
        })
        .count() as i64;
    let refused = committed.len() as i64 - good;
    let client = &mut rig.client;
    let (handled, most) = eventually(drain_timeout(), "every good message handled", || {
        let r = client
            .query_one(
                "SELECT count(*), coalesce(max(calls), 0) FROM public.child \
                  WHERE body NOT LIKE 'e2e.marker.%'",
                &[],
            )
            .map_err(|e| e.to_string())?;
        let (n, calls): (i64, i32) = (r.get(0), r.get(1));
        if n >= good {
            Ok((n, calls))
        } else {
            Err(format!("{n} of {good} handled"))
        }
    });
    assert_eq!(most, 1, "a message was handled twice");
    assert_eq!(handled, good, "{report}");
    let failed = |client: &mut Client, sql: &str| -> i64 {
        client.query_one(sql, &[]).map(|r| r.get(0)).unwrap_or(-1)
    };
    eventually(Duration::from_secs(60), "the poison recorded", || {
        let fk = failed(
            client,
            "SELECT count(*) FROM amqp.inbox_failed \
              WHERE last_sqlstate = '23503' AND dead_lettered_at IS NOT NULL",
        );
        let big = failed(
            client,
            "SELECT count(*) FROM amqp.inbox_failed \
              WHERE last_error LIKE '%not dead-lettered%' AND dead_lettered_at IS NOT NULL",
        );
        if fk >= refused && big == 5 {
            Ok(())
        } else {
            Err(format!(
                "{fk} of {refused} refused by the key, {big} of 5 big ones"
            ))
        }
    });
    assert_eq!(
        sub_worker(client),
        Some(worker),
        "the subscription worker restarted"
    );
    holder.batch_execute("COMMIT").unwrap();
}
