//! End-to-end tests of where the worker's claim reads from (the scan floor) and of the outbox
//! giving a drained backlog's space back: a private PostgreSQL 15 cluster with the extension
//! preloaded (one per test) publishing to the shared RabbitMQ.

use std::time::Duration;

use amqp_outbox_e2e::{eventually, Outbox, PgConfig, Rabbit, World};
use postgres::Client;

const ARRIVAL: Duration = Duration::from_secs(30);
const BULK_ARRIVAL: Duration = Duration::from_secs(150);

/// Waits until `amqp.message` has no row this session can see.
fn wait_empty(c: &mut Client, what: &str) {
    eventually(ARRIVAL, what, || match Outbox::rows(c)? {
        0 => Ok(()),
        n => Err(format!("{n} rows left")),
    });
}

fn position(bodies: &[String], body: &str) -> usize {
    bodies
        .iter()
        .position(|b| b == body)
        .unwrap_or_else(|| panic!("{body} not delivered: {bodies:?}"))
}

/// Bytes `amqp.message` (heap, TOAST, indexes) holds above its empty size (one page per index).
fn excess_bytes(c: &mut Client) -> i64 {
    c.query_one(
        "SELECT pg_total_relation_size(c.oid) \
                - current_setting('block_size')::int8 * (SELECT count(*) FROM pg_index i \
                                                          WHERE i.indrelid IN (c.oid, c.reltoastrelid)) \
           FROM pg_class c WHERE c.oid = 'amqp.message'::regclass",
        &[],
    )
    .expect("size of amqp.message")
    .get(0)
}

/// A transaction that drew a small id stays open while a later stream is delivered: the floor
/// must not pass its row, so when it commits its two messages go out in their order. (Reading
/// from a plain high-water mark would publish the second first and find the first only later.)
#[test]
fn an_open_transactions_first_message_is_not_passed_over() {
    let rabbit = Rabbit::shared();
    let mut f = World::new("floor-open", PgConfig::default(), &rabbit);
    let mut long = f.cluster.client();
    long.batch_execute("BEGIN").expect("BEGIN");
    f.outbox.publish(
        &mut long,
        &f.route.exchange,
        &f.route.routing_key,
        "long:first",
    );

    for i in 0..300 {
        f.publish(&format!("stream:{i}"));
    }
    f.collector.wait_for_body("stream:299", ARRIVAL);
    // Delivered and deleted: the floor could have moved past "long:first" by now if it
    // ignored the open transaction.
    // (The open transaction's row is not visible here.)
    wait_empty(&mut f.client, "the stream's rows to be deleted");
    f.outbox.publish(
        &mut long,
        &f.route.exchange,
        &f.route.routing_key,
        "long:second",
    );
    long.batch_execute("COMMIT").expect("COMMIT");
    f.collector.wait_for_body("long:second", ARRIVAL);
    f.collector.wait_for_body("long:first", ARRIVAL);

    let bodies = f.collector.bodies();
    assert!(
        position(&bodies, "long:first") < position(&bodies, "long:second"),
        "the session's messages out of order: {:?}",
        &bodies[bodies.len().saturating_sub(5)..]
    );
    for i in 1..300 {
        assert!(
            position(&bodies, &format!("stream:{}", i - 1))
                < position(&bodies, &format!("stream:{i}")),
            "stream:{i} overtook stream:{}",
            i - 1
        );
    }
    // Nothing was found late by the once-a-second read from the lowest id.
    assert!(
        !f.cluster.log().contains("at or below its last scan floor"),
        "the floor passed over a row:\n{}",
        f.cluster.log_tail(20)
    );
}

/// A row inserted straight into `amqp.message` with an id below the floor (not through
/// `amqp.publish()`) is still found: the claim reads from the lowest id once a second.
#[test]
fn a_row_inserted_below_the_floor_is_still_delivered() {
    let rabbit = Rabbit::shared();
    let mut f = World::new("floor-below", PgConfig::default(), &rabbit);
    for i in 0..200 {
        f.publish(&format!("before:{i}"));
    }
    f.collector.wait_for_body("before:199", ARRIVAL);
    let lowest: i64 = f
        .client
        .query_one("SELECT last_value FROM amqp.message_id_seq", &[])
        .expect("sequence")
        .get(0);
    assert!(lowest > 100, "ids were drawn: {lowest}");
    // Id 1 was used and deleted long ago: far below where the claim now reads from.
    f.client
        .execute(
            "INSERT INTO amqp.message (id, producer_started_at, broker_id, exchange, routing_key, body) \
             VALUES (1, now(), $1, $2, $3, convert_to('below:1', 'UTF8'))",
            &[&f.outbox.broker_id, &f.route.exchange, &f.route.routing_key],
        )
        .expect("direct INSERT with a small id");
    f.collector.wait_for_body("below:1", ARRIVAL);
    assert!(
        f.cluster.log().contains("at or below its last scan floor"),
        "found by the read from the lowest id, and said so"
    );
    f.publish("after");
    f.collector.wait_for_body("after", ARRIVAL);
}

/// A drained backlog's space is given back without VACUUM FULL or REINDEX, but never while
/// another session uses the table: the worker only takes the table's lock if it is free.
#[test]
fn a_drained_backlog_gives_its_space_back_once_nobody_uses_the_table() {
    let rabbit = Rabbit::shared();
    let mut f = World::new("shrink", PgConfig::default(), &rabbit);
    let empty = excess_bytes(&mut f.client);
    assert!(empty <= 64 * 1024, "a new table: {empty} bytes over empty");

    // A session that keeps reading the table (ACCESS SHARE lock, as pg_dump would).
    let mut reader = f.cluster.client();
    reader
        .batch_execute("BEGIN; SELECT count(*) FROM amqp.message")
        .expect("reader");

    f.client
        .execute(
            "SELECT amqp.publish($1, $2, $3, repeat('x', 400) || i) \
               FROM generate_series(1, 20000) AS i",
            &[&f.outbox.broker_id, &f.route.exchange, &f.route.routing_key],
        )
        .expect("a backlog of 20,000");
    let peak = excess_bytes(&mut f.client);
    assert!(peak > 4 * 1024 * 1024, "the backlog takes space: {peak}");
    f.collector.wait_for_count(20_000, BULK_ARRIVAL);
    wait_empty(&mut f.client, "amqp.message to be empty");
    // The worker looks every 10 s: over that, with the reader holding its lock, nothing shrinks.
    std::thread::sleep(Duration::from_secs(12));
    let while_held = excess_bytes(&mut f.client);
    assert!(
        while_held > 4 * 1024 * 1024,
        "truncated while another session held a lock: {while_held} bytes left of {peak}"
    );
    reader.batch_execute("COMMIT").expect("reader COMMIT");

    eventually(ARRIVAL, "amqp.message to shrink to its empty size", || {
        let now = excess_bytes(&mut f.client);
        if now <= 64 * 1024 {
            Ok(())
        } else {
            Err(format!("{now} bytes over empty (peak {peak})"))
        }
    });
    // The worker logs after its TRUNCATE has committed, so the smaller size can be seen a
    // moment before the line is written.
    f.cluster.wait_for_log(
        "amqp.message was empty; truncated it",
        Duration::from_secs(5),
    );
    // Still publishing after the TRUNCATE (the worker's kept plans follow the new files).
    f.publish("after-shrink");
    f.collector.wait_for_body("after-shrink", ARRIVAL);
}

/// A TRUNCATE trigger that raises (an object the table's owner added) only keeps the table
/// large: the worker logs it and goes on delivering.
#[test]
fn a_failing_truncate_leaves_the_table_and_delivery_alone() {
    let rabbit = Rabbit::shared();
    let mut f = World::new("shrink-refused", PgConfig::default(), &rabbit);
    f.client
        .batch_execute(
            "CREATE FUNCTION public.no_truncate() RETURNS trigger LANGUAGE plpgsql AS \
               $$BEGIN RAISE EXCEPTION 'e2e: no TRUNCATE of the outbox'; END$$; \
             CREATE TRIGGER no_truncate BEFORE TRUNCATE ON amqp.message \
               FOR EACH STATEMENT EXECUTE FUNCTION public.no_truncate()",
        )
        .expect("trigger");
    let worker_pid = |c: &mut Client| -> Option<i32> {
        c.query_opt(
            "SELECT pid FROM pg_stat_activity WHERE backend_type = 'amqp_outbox' \
              AND datname = current_database()",
            &[],
        )
        .ok()
        .flatten()
        .map(|r| r.get(0))
    };
    let pid = worker_pid(&mut f.client);
    assert!(pid.is_some(), "the worker runs");
    f.client
        .execute(
            "SELECT amqp.publish($1, $2, $3, repeat('y', 400) || i) \
               FROM generate_series(1, 5000) AS i",
            &[&f.outbox.broker_id, &f.route.exchange, &f.route.routing_key],
        )
        .expect("a backlog of 5,000");
    f.collector.wait_for_count(5_000, BULK_ARRIVAL);
    f.cluster
        .wait_for_log("e2e: no TRUNCATE of the outbox", ARRIVAL);
    assert!(excess_bytes(&mut f.client) > 64 * 1024, "not truncated");
    f.publish("after-refusal");
    f.collector.wait_for_body("after-refusal", ARRIVAL);
    assert_eq!(worker_pid(&mut f.client), pid, "the worker did not restart");
}
