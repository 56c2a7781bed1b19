//! What a DBA does to a database that holds undelivered messages: `pg_dump`/`pg_restore` it
//! (custom and plain formats), recover a base backup to an earlier point, update the extension.
//! Nothing committed may be lost, and every message keeps the `message_id` it was given.
//!
//! Each test runs its own PostgreSQL clusters and publishes to the shared RabbitMQ.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use amqp_outbox_e2e::outbox::{add_broker, create_extension};
use amqp_outbox_e2e::pg::wait_for_lock_wait;
use amqp_outbox_e2e::{
    eventually, eventually_count, unique_name, AmqpEndpoint, PgCluster, PgConfig, Rabbit, Route,
    StopMode,
};
use postgres::{Client, GenericClient};

const WORKER_UP: Duration = Duration::from_secs(30);
const BULK_ARRIVAL: Duration = Duration::from_secs(150);

/// The version before this one: `sql/amqp_outbox--<PREVIOUS>.sql` is shipped so that the update
/// path can be tested (and taken by users who have it installed).
const PREVIOUS: &str = "0.1.0";

fn disabled() -> PgConfig {
    PgConfig::default().setting("amqp_outbox.enabled", "off")
}

/// One message as the producer's database recorded it (`message_id` empty before 0.2.0 stored it).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Row {
    id: i64,
    message_id: String,
    body: Vec<u8>,
    headers: Option<String>,
    attempts: i32,
    last_error: Option<String>,
    parked: bool,
}

fn rows(client: &mut Client, table: &str) -> Vec<Row> {
    let sql = format!(
        "SELECT id, coalesce(to_jsonb(m) ->> 'message_id', ''), body, headers::text, attempts, \
                last_error, parked_at IS NOT NULL \
           FROM amqp.{table} m ORDER BY id"
    );
    client
        .query(&sql, &[])
        .unwrap_or_else(|e| panic!("reading amqp.{table}: {e}"))
        .iter()
        .map(|r| Row {
            id: r.get(0),
            message_id: r.get(1),
            body: r.get(2),
            headers: r.get(3),
            attempts: r.get(4),
            last_error: r.get(5),
            parked: r.get(6),
        })
        .collect()
}

fn scalar<T: for<'a> postgres::types::FromSql<'a>>(client: &mut Client, sql: &str) -> T {
    client
        .query_one(sql, &[])
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .get(0)
}

/// Fills the outbox of a database whose worker is disabled with `n` messages to `exchange`/`key`:
/// text bodies through `publish()`, JSON headers through `publish_message()`, binary bodies
/// through `publish_bytes()`; every 100th is parked, every 50th is waiting for a retry, and one
/// parked message is discarded (by `amqp.discard()`, or with `by_hand` by the statements the
/// previous version's `amqp.discard()` ran, since the new library's needs the new table).
fn fill(client: &mut Client, broker_id: i32, exchange: &str, key: &str, n: i32, by_hand: bool) {
    client
        .execute(
            "SELECT CASE g % 3
                      WHEN 0 THEN amqp.publish($1, $2, $3, 'text-' || g)::int::bigint
                      WHEN 1 THEN amqp.publish_message($1, $2, $3, 'json-' || g,
                                      jsonb_build_object('n', g, 'tag', 'ü-' || g))
                      ELSE amqp.publish_bytes($1, $2, $3,
                                      '\\x00ff'::bytea || convert_to('bin-' || g, 'UTF8'),
                                      '{\"kind\": \"bytes\"}')
                    END
               FROM generate_series(1, $4::int) g",
            &[&broker_id, &exchange, &key, &n],
        )
        .unwrap_or_else(|e| panic!("publishing {n} messages: {e}"));
    client
        .batch_execute(
            "UPDATE amqp.message SET attempts = 10, last_error = 'refused (test)', parked_at = now()
              WHERE id % 100 = 7;
             UPDATE amqp.message SET attempts = 2, last_error = 'nacked (test)',
                                     next_attempt_at = now() - interval '1 second'
              WHERE id % 50 = 3;",
        )
        .unwrap_or_else(|e| panic!("parking and retrying test rows: {e}"));
    let parked: i64 = scalar(
        client,
        "SELECT min(id) FROM amqp.message WHERE parked_at IS NOT NULL",
    );
    let discard = if by_hand {
        "WITH gone AS (DELETE FROM amqp.message WHERE id = $1 RETURNING *)
         INSERT INTO amqp.discarded SELECT gone.*, now(), current_user, 'discarded by the test'
           FROM gone"
    } else {
        "SELECT amqp.discard($1, 'discarded by the test')"
    };
    client
        .execute(discard, &[&parked])
        .unwrap_or_else(|e| panic!("discarding {parked}: {e}"));
}

/// A second host row for broker `broker_id` (failover), TLS settings filled but off, a declared
/// exchange, queue and binding: configuration the restored database must keep.
fn configure(client: &mut Client, broker_id: i32, endpoint: &AmqpEndpoint, names: &str) {
    client
        .execute(
            "INSERT INTO amqp.broker (broker_id, host, port, vhost, username, password,
                                      tls_server_name)
             VALUES ($1, 'localhost', $2, $3, $4, $5, 'rabbit.example')",
            &[
                &broker_id,
                &i32::from(endpoint.port),
                &endpoint.vhost,
                &endpoint.username,
                &endpoint.password,
            ],
        )
        .unwrap_or_else(|e| panic!("second host row: {e}"));
    client
        .execute(
            "SELECT amqp.exchange_declare($1, $2 || '.x', 'topic', false, true, false),
                    amqp.queue_declare($1, $2 || '.q', true, false),
                    amqp.queue_bind($1, $2 || '.q', $2 || '.x', '#')",
            &[&broker_id, &names],
        )
        .unwrap_or_else(|e| panic!("declarations: {e:?}"));
}

/// What a DBA would compare: the user's configuration and the outbox, as text.
fn configuration(client: &mut Client) -> Vec<String> {
    configuration_with(client, &Counts::All)
}

/// What [`configuration_with`] leaves out of what a running worker changes while the test reads.
#[derive(Clone, PartialEq, Eq)]
enum Counts {
    All,
    /// The day's `delivered` count, and the production log's records of deliveries at or after
    /// this instant (a `timestamptz` literal).
    ButDeliveredFrom(String),
}

fn configuration_with(client: &mut Client, counts: &Counts) -> Vec<String> {
    let (daily, delivered_before) = match counts {
        Counts::All => (
            "SELECT format('%s', d) FROM amqp.daily_stats d ORDER BY 1",
            "infinity".to_string(),
        ),
        Counts::ButDeliveredFrom(from) => (
            "SELECT format('%s %s %s %s %s %s %s %s %s %s', day, business_type, produced, consumed,
                    late, lost, resent, compensated, parked, failed)
               FROM amqp.daily_stats ORDER BY 1",
            from.clone(),
        ),
    };
    let mut out = Vec::new();
    for sql in [
        "SELECT format('%s', b) FROM amqp.broker b ORDER BY broker_id, host, port",
        "SELECT format('%s %s %s %s %s', broker_id, exchange, exchange_type, durable, auto_delete)
           FROM amqp.exchange ORDER BY 1",
        "SELECT format('%s %s %s %s', broker_id, queue, durable, arguments) FROM amqp.queue ORDER BY 1",
        "SELECT format('%s %s %s %s', broker_id, queue, exchange, routing_key) FROM amqp.binding ORDER BY 1",
        "SELECT format('%s %s %s %s', id, message_id, discarded_by, reason) FROM amqp.discarded ORDER BY 1",
        // The consuming side: subscriptions, failed messages, consumption records (hot and
        // archived): a restored consumer must still recognise what it handled.
        "SELECT format('%s', s) FROM amqp.subscription s ORDER BY 1",
        "SELECT format('%s %s %s %s %s', id, subscription, message_id, attempts, last_error)
           FROM amqp.inbox_failed ORDER BY 1",
        "SELECT format('%s %s %s %s', consumer, message_id, business_key, storage)
           FROM amqp.consumption ORDER BY 1",
        // Reconciliation: rules, handlers, the production log (a day partition and the
        // default one), receipts, compensations, statistics.
        "SELECT format('%s', r) FROM amqp.monitor_rule r ORDER BY 1",
        "SELECT format('%s %s', business_type, handler) FROM amqp.compensation_handler ORDER BY 1",
        "SELECT format('%s %s %s %s %s', message_id, business_type, resends, expected, tableoid::regclass)
           FROM amqp.produced WHERE delivered_at < $1::text::timestamptz ORDER BY 1",
        "SELECT format('%s %s %s %s', message_id, consumer, status, tableoid::regclass)
           FROM amqp.receipt ORDER BY 1",
        "SELECT format('%s %s %s %s', message_id, consumer, state, attempts) FROM amqp.compensation ORDER BY 1",
        daily,
    ] {
        let rows = if sql.contains("$1") {
            client.query(sql, &[&delivered_before])
        } else {
            client.query(sql, &[])
        };
        for r in rows.unwrap_or_else(|e| panic!("{sql}: {e}")) {
            out.push(r.get(0));
        }
    }
    out
}

/// A consumer's state: a subscription (paused) with its handler, failed messages, consumption
/// records in both hot tables and one moved to the archive.
fn consumer_state(client: &mut Client, broker_id: i32) {
    client
        .batch_execute(&format!(
            "CREATE TABLE effect (message_id text);
             CREATE FUNCTION handle(d amqp.delivery) RETURNS void LANGUAGE sql
                 AS $$ INSERT INTO effect VALUES (d.message_id) $$;
             SELECT amqp.subscribe('dumped', {broker_id}, 'dumped.q', 'handle(amqp.delivery)', 5, 3);
             SELECT amqp.pause_subscription('dumped');
             INSERT INTO amqp.inbox_failed (subscription, message_id, exchange, routing_key, body, last_error)
             VALUES ('dumped', 'failed-1', 'x', 'k', 'body', 'boom');
             SELECT amqp.consume_once('dumped', 'old-' || g) FROM generate_series(1, 3) g;
             UPDATE amqp._consumed_since SET since = now() - interval '40 days' WHERE hot = 'a';
             UPDATE amqp._consumed_since SET since = now() - interval '20 days' WHERE hot = 'b';
             TRUNCATE amqp._consumed_b;
             SELECT amqp.rotate_consumption();
             SELECT amqp.consume_once('dumped', 'new-' || g, 'key-' || g) FROM generate_series(1, 3) g;"
        ))
        .unwrap_or_else(|e| panic!("consumer state: {e}"));
    let archived: i64 = scalar(client, "SELECT count(*) FROM amqp.consumption_archive");
    assert_eq!(archived, 3, "the old records were archived");
}

/// A producer's reconciliation state: a rule, a compensation handler, production records and
/// receipts of two days (each day its own partition), pending compensations, statistics.
fn reconciliation_state(client: &mut Client) {
    client
        .batch_execute(
            "CREATE FUNCTION undo(original amqp.produced, failure amqp.receipt) RETURNS void
                 LANGUAGE sql AS $$ SELECT $$;
             INSERT INTO amqp.monitor_rule (business_type, consumers, action)
             VALUES ('signup', '{mail,coupon}', 'report');
             -- For another type: the monitor (it runs) must leave this state as it is.
             SELECT amqp.on_failure('refund', 'undo(amqp.produced, amqp.receipt)');
             CREATE TEMP TABLE ids AS
                 SELECT amqp._new_message_id() AS message_id, NULL::timestamptz AS at
                 UNION ALL SELECT 'custom-id-2', now() - interval '3 days';
             UPDATE ids SET at = amqp._uuid7_time(message_id) WHERE at IS NULL;
             INSERT INTO amqp.produced (message_id, message_at, seq, broker_id, exchange, routing_key,
                                        system_id, host_id, business_type, producer_pid,
                                        producer_started_at, created_at, expected, body)
             SELECT message_id, at, 1, 1, 'x', 'signup', 'shop', 'db', 'signup', 1, now(), at,
                    '{mail,coupon}', 'b'
               FROM ids;
             INSERT INTO amqp.receipt (message_id, message_at, consumer, status, error)
             SELECT message_id, at, 'coupon', 'failed', 'down' FROM ids;
             INSERT INTO amqp.compensation (message_id, consumer, message_at, business_type)
             SELECT message_id, 'coupon', at, 'signup' FROM ids;
             SELECT amqp._count(amqp._day(now()), 'signup', 'failed', 2);",
        )
        .unwrap_or_else(|e| panic!("reconciliation state: {e:?}"));
    // The subscription worker makes the records' days and moves them there.
    eventually(
        Duration::from_secs(60),
        "the records in their day partitions",
        || {
            let n: i64 = client
                .query_one(
                    "SELECT (SELECT count(*) FROM amqp.produced_default)
                      + (SELECT count(*) FROM amqp.receipt_default)",
                    &[],
                )
                .map_err(|e| e.to_string())?
                .get(0);
            if n == 0 {
                Ok(())
            } else {
                Err(format!("{n} left in the default partitions"))
            }
        },
    );
    let days: i64 = scalar(
        client,
        "SELECT count(*) FROM pg_inherits WHERE inhparent IN ('amqp.produced'::regclass, 'amqp.receipt'::regclass)",
    );
    assert_eq!(days, 6, "two days and the default partition, of each table");
    // The monitor counts the two failed receipts in the statistics (beside the 2 counted
    // above): before the dump, or the source would count them after it and differ.
    eventually_count(
        client,
        Duration::from_secs(60),
        "the monitor's count of the failed receipts",
        "SELECT coalesce(sum(failed), 0)::bigint FROM amqp.daily_stats WHERE business_type = 'signup'",
        4,
    );
}

/// Publishes with `publish_sql` and reads the new row's stored message_id in the same
/// transaction: once it commits, the worker may deliver and delete the row at once.
fn publish_and_read_id(client: &mut Client, publish_sql: &str) -> (i64, String) {
    let mut tx = client
        .transaction()
        .unwrap_or_else(|e| panic!("BEGIN: {e}"));
    let id: i64 = tx
        .query_one(publish_sql, &[])
        .map(|r| r.get(0))
        .unwrap_or_else(|e| panic!("{publish_sql}: {e}"));
    let message_id: String = tx
        .query_one("SELECT message_id FROM amqp.message WHERE id = $1", &[&id])
        .map(|r| r.get(0))
        .unwrap_or_else(|e| panic!("reading message {id}: {e}"));
    tx.commit().unwrap_or_else(|e| panic!("COMMIT: {e}"));
    (id, message_id)
}

fn dump(source: &PgCluster, format: &str, file: &str) -> String {
    let path = source.dir().join(file).display().to_string();
    let db = source.config().database.clone();
    source
        .run_client("pg_dump", &[format, "-f", &path, &db])
        .unwrap_or_else(|e| panic!("{e}"));
    path
}

#[test]
fn dump_and_restore_keep_every_message_its_id_and_the_configuration() {
    let rabbit = Rabbit::shared();
    let route = rabbit.declare_route("dump");
    let names = unique_name("dump.decl");
    // The restored databases' workers declare these in the shared broker: deleted at the end.
    let _declared = Route {
        endpoint: rabbit.endpoint().clone(),
        exchange: format!("{names}.x"),
        queue: format!("{names}.q"),
        routing_key: "#".to_string(),
        delete_on_drop: true,
    };

    // The producer's database: worker off, so everything stays in the outbox.
    let source = PgCluster::new(disabled());
    let mut src = source.client();
    create_extension(&mut src);
    let broker_id = add_broker(&mut src, rabbit.endpoint());
    configure(&mut src, broker_id, rabbit.endpoint(), &names);
    consumer_state(&mut src, broker_id);
    reconciliation_state(&mut src);
    fill(
        &mut src,
        broker_id,
        &route.exchange,
        &route.routing_key,
        1000,
        false,
    );
    let before = rows(&mut src, "message");
    let before_config = configuration(&mut src);
    // The restored worker delivers while the test reads: what it logs from now on is left out.
    let restore_starts = Counts::ButDeliveredFrom(scalar(&mut src, "SELECT now()::text"));
    let before_but_delivered = configuration_with(&mut src, &restore_starts);
    assert_eq!(before.len(), 999, "1,000 published, one discarded");
    let parked_before: BTreeSet<i64> = before.iter().filter(|r| r.parked).map(|r| r.id).collect();
    assert_eq!(parked_before.len(), 9);
    let max_broker_id: i32 = scalar(&mut src, "SELECT max(broker_id) FROM amqp.broker");
    let max_id: i64 = scalar(&mut src, "SELECT max(id) FROM amqp.message");

    // Plain format, restored with psql into another database of the same cluster.
    let plain = dump(&source, "-Fp", "outbox.sql");
    src.batch_execute("CREATE DATABASE plain_copy")
        .unwrap_or_else(|e| panic!("CREATE DATABASE plain_copy: {e}"));
    source
        .run_client(
            "psql",
            &[
                "-X",
                "-q",
                "-v",
                "ON_ERROR_STOP=1",
                "-f",
                &plain,
                "plain_copy",
            ],
        )
        .unwrap_or_else(|e| panic!("{e}"));
    let mut copy = source.client_db("plain_copy");
    assert_eq!(
        rows(&mut copy, "message"),
        before,
        "plain dump: outbox differs"
    );
    assert_eq!(
        configuration(&mut copy),
        before_config,
        "plain dump: configuration differs"
    );

    // Custom format, restored into another cluster whose worker is on: it delivers the
    // restored messages with no step after pg_restore.
    let custom = dump(&source, "-Fc", "outbox.dump");
    drop(copy);
    drop(src);
    let collector = rabbit.consume_connected(&route);
    let target = PgCluster::new(PgConfig::default());
    let mut dst = target.client();
    // pg_restore reads the file as the postgres user; it lies in the source's directory.
    target
        .run_client("pg_restore", &["--exit-on-error", "-d", "e2e", &custom])
        .unwrap_or_else(|e| panic!("{e}"));
    // The restore's CREATE EXTENSION has the launcher start the database's workers.
    target.wait_for_worker(&mut dst, WORKER_UP);
    // The restored worker is already delivering: its delivered count moves meanwhile.
    assert_eq!(
        configuration_with(&mut dst, &restore_starts),
        before_but_delivered,
        "custom dump: configuration differs"
    );
    // The restored consumer still recognises what it consumed (by id and by business key).
    let again: Vec<bool> = dst
        .query(
            "SELECT amqp.consume_once('dumped', 'new-1'), amqp.consume_once('dumped', 'other', 'key-2'),
                    amqp.consume_once('dumped', 'never-seen')",
            &[],
        )
        .map(|r| vec![r[0].get(0), r[0].get(1), r[0].get(2)])
        .unwrap_or_else(|e| panic!("consume_once after restore: {e}"));
    assert_eq!(again, vec![false, false, true]);

    let expected: BTreeMap<String, Vec<u8>> = before
        .iter()
        .filter(|r| !r.parked)
        .map(|r| (r.message_id.clone(), r.body.clone()))
        .collect();
    assert_eq!(expected.len(), 990);
    let arrived = collector.wait_for_count(expected.len(), BULK_ARRIVAL);
    let mut seen: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    for d in &arrived {
        let id = d.message_id.clone().unwrap_or_default();
        seen.insert(id, d.body.clone());
    }
    assert_eq!(
        seen, expected,
        "each restored message arrives with the message_id and body it had before the dump"
    );
    eventually(
        Duration::from_secs(60),
        "the restored outbox to drain",
        || {
            let left: i64 = scalar(
                &mut dst,
                "SELECT count(*) FROM amqp.message WHERE parked_at IS NULL",
            );
            if left == 0 {
                Ok(())
            } else {
                Err(format!("{left} unparked rows left"))
            }
        },
    );
    let parked_after: Vec<Row> = rows(&mut dst, "message");
    let parked_expected: Vec<Row> = before.iter().filter(|r| r.parked).cloned().collect();
    assert_eq!(
        parked_after, parked_expected,
        "parked messages stay parked, as they were"
    );

    // Nothing generated after the restore collides with a restored row.
    let new_broker: i32 = scalar(
        &mut dst,
        "INSERT INTO amqp.broker (host) VALUES ('127.0.0.1') RETURNING broker_id",
    );
    assert!(
        new_broker > max_broker_id,
        "broker_id {new_broker} reuses a restored one"
    );
    let (new_id, new_message_id) = publish_and_read_id(
        &mut dst,
        &format!(
            "SELECT amqp.publish_message({broker_id}, '{}', '{}', 'after-restore')",
            route.exchange, route.routing_key
        ),
    );
    assert!(
        new_id > max_id,
        "message id {new_id} reuses a restored one (max {max_id})"
    );
    assert!(!before.iter().any(|r| r.message_id == new_message_id));
    let d = collector.wait_for_body("after-restore", Duration::from_secs(30));
    assert_eq!(d.message_id.as_deref(), Some(new_message_id.as_str()));

    // The worker of the restored database declared the restored topology.
    let queue = format!("{names}.q");
    eventually(
        Duration::from_secs(30),
        "the restored queue declaration",
        || match rabbit.queue_counts(&queue)? {
            Some(_) => Ok(()),
            None => Err(format!("queue {queue} not declared")),
        },
    );
    let _ = rabbit.delete_queue(&queue);
    let exchange_count: i64 = scalar(&mut dst, "SELECT count(*) FROM amqp.exchange");
    assert_eq!(exchange_count, 1);
}

#[test]
fn a_copy_recovered_to_an_earlier_point_never_repeats_a_message_id() {
    let rabbit = Rabbit::shared();
    let route = rabbit.declare_route("pitr");
    let collector = rabbit.consume_connected(&route);
    const N: usize = 200;

    let mut original = PgCluster::new(PgConfig::default());
    let mut client = original.client();
    create_extension(&mut client);
    let broker_id = add_broker(&mut client, rabbit.endpoint());
    original.wait_for_worker(&mut client, WORKER_UP);
    // The restore point: a base backup taken before the first set is published.
    let mut copy = PgCluster::from_base_backup(&original, PgConfig::default());

    let publish = |client: &mut Client, prefix: &str| -> Vec<i64> {
        client
            .query(
                "SELECT amqp.publish_message($1, $2, $3, $4::text || g) \
                   FROM generate_series(1, $5::int) g",
                &[
                    &broker_id,
                    &route.exchange,
                    &route.routing_key,
                    &prefix,
                    &(N as i32),
                ],
            )
            .unwrap_or_else(|e| panic!("publishing: {e}"))
            .iter()
            .map(|r| r.get(0))
            .collect()
    };
    let first_ids = publish(&mut client, "first-");
    let first = collector.wait_for_count(N, BULK_ARRIVAL);
    drop(client);
    // The original is gone (the disaster); the copy takes over its broker and queue names.
    original.stop(StopMode::Fast);

    copy.start();
    let mut client = copy.client();
    copy.wait_for_worker(&mut client, WORKER_UP);
    let second_ids = publish(&mut client, "second-");
    assert_eq!(
        first_ids, second_ids,
        "the recovered copy hands out the same row ids again (the premise of this test)"
    );
    let all = collector.wait_for_count(2 * N, BULK_ARRIVAL);
    let ids = |prefix: &str| -> BTreeSet<String> {
        all.iter()
            .filter(|d| d.text().starts_with(prefix))
            .map(|d| d.message_id.clone().unwrap_or_default())
            .collect()
    };
    let (a, b) = (ids("first-"), ids("second-"));
    assert_eq!(a.len(), N, "first set: {} distinct message_ids", a.len());
    assert_eq!(b.len(), N, "second set: {} distinct message_ids", b.len());
    let shared: Vec<&String> = a.intersection(&b).collect();
    assert!(
        shared.is_empty(),
        "message_ids repeated after recovery: {shared:?}"
    );
    assert!(first.iter().all(|d| d.text().starts_with("first-")));
}

/// The message_id the previous version's worker derived for row `id`: the cluster's system
/// identifier, the database's and the outbox table's oids, in hex, and the row id.
fn previous_message_ids(client: &mut Client, table: &str) -> BTreeMap<i64, String> {
    let r = client
        .query_one(
            "SELECT s.system_identifier, d.oid::bigint, 'amqp.message'::regclass::oid::bigint
               FROM pg_control_system() s, pg_database d WHERE d.datname = current_database()",
            &[],
        )
        .unwrap_or_else(|e| panic!("reading the identifiers: {e}"));
    let (sysid, dboid, reloid): (i64, i64, i64) = (r.get(0), r.get(1), r.get(2));
    let ids: Vec<i64> = client
        .query(&format!("SELECT id FROM amqp.{table} ORDER BY id"), &[])
        .unwrap_or_else(|e| panic!("reading amqp.{table}: {e}"))
        .iter()
        .map(|r| r.get(0))
        .collect();
    ids.into_iter()
        .map(|id| (id, format!("{:x}-{dboid:x}-{reloid:x}-{id}", sysid as u64)))
        .collect()
}

fn stored_message_ids(client: &mut impl GenericClient, table: &str) -> BTreeMap<i64, String> {
    client
        .query(
            &format!("SELECT id, message_id FROM amqp.{table} ORDER BY id"),
            &[],
        )
        .unwrap_or_else(|e| panic!("reading amqp.{table}: {e}"))
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// Every object of the extension, described: members, columns (in order, with types, NOT NULL
/// and defaults), constraints, indexes, triggers, views, functions, privileges, comments,
/// storage options and what pg_dump keeps. Two databases with equal descriptions have the
/// same schema.
const DESCRIBE_SQL: &str = "
WITH ext AS (SELECT oid, extconfig FROM pg_extension WHERE extname = 'amqp_outbox'),
     -- Day partitions are made by the worker, at its own time: not part of the schema.
     day AS (SELECT '^(produced|receipt|consumption_archive)_[0-9]{8}'::text AS re),
     rel AS (SELECT c.* FROM pg_class c, day
              WHERE c.relnamespace = 'amqp'::regnamespace AND c.relname !~ day.re)
SELECT 'member ' || pg_describe_object(classid, objid, objsubid)
  FROM pg_depend WHERE refclassid = 'pg_extension'::regclass
   AND refobjid = (SELECT oid FROM ext) AND deptype = 'e'
UNION ALL
SELECT format('column %s.%s %s %s notnull=%s default=%s comment=%s', c.relname, a.attnum,
              a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
              pg_get_expr(d.adbin, d.adrelid), col_description(c.oid, a.attnum))
  FROM rel c JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
  LEFT JOIN pg_attrdef d ON d.adrelid = c.oid AND d.adnum = a.attnum
 WHERE c.relkind IN ('r', 'v', 'S')
UNION ALL
SELECT format('relation %s %s acl=%s options=%s comment=%s', relname, relkind, relacl, reloptions,
              obj_description(oid, 'pg_class'))
  FROM rel
UNION ALL
SELECT format('constraint %s %s %s', conrelid::regclass, conname, pg_get_constraintdef(oid))
  FROM pg_constraint, day WHERE connamespace = 'amqp'::regnamespace
   AND coalesce(conrelid::regclass::text, '') !~ ('^amqp[.]' || substr(day.re, 2))
UNION ALL
SELECT 'index ' || indexdef FROM pg_indexes, day WHERE schemaname = 'amqp' AND tablename !~ day.re
UNION ALL
SELECT format('trigger %s', pg_get_triggerdef(t.oid))
  FROM pg_trigger t JOIN rel c ON c.oid = t.tgrelid WHERE NOT t.tgisinternal
UNION ALL
SELECT format('view %s %s', relname, pg_get_viewdef(oid)) FROM rel WHERE relkind = 'v'
UNION ALL
SELECT format('function %s (%s) returns %s vol=%s par=%s strict=%s secdef=%s src=%s acl=%s config=%s',
              p.oid::regprocedure, pg_get_function_arguments(p.oid), pg_get_function_result(p.oid),
              p.provolatile, p.proparallel, p.proisstrict, p.prosecdef, p.prosrc, p.proacl,
              p.proconfig)
  FROM pg_proc p WHERE p.pronamespace = 'amqp'::regnamespace
UNION ALL
SELECT format('type %s', t.oid::regtype) FROM pg_type t
 WHERE t.typnamespace = 'amqp'::regnamespace AND t.typrelid = 0 AND t.typelem = 0
UNION ALL
SELECT 'dumped ' || x::regclass::text FROM ext, unnest(ext.extconfig) x
UNION ALL
SELECT format('schema acl=%s', nspacl) FROM pg_namespace WHERE nspname = 'amqp'
ORDER BY 1";

fn describe(client: &mut Client) -> Vec<String> {
    client
        .query(DESCRIBE_SQL, &[])
        .unwrap_or_else(|e| panic!("describing the extension: {e}"))
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[test]
fn update_from_the_previous_version_keeps_every_message_and_its_id() {
    let rabbit = Rabbit::shared();
    let route = rabbit.declare_route("update");
    let collector = rabbit.consume_connected(&route);

    let mut cluster = PgCluster::new(disabled());
    let mut client = cluster.client();
    client
        .batch_execute(&format!(
            "CREATE EXTENSION amqp_outbox VERSION '{PREVIOUS}'"
        ))
        .unwrap_or_else(|e| panic!("CREATE EXTENSION amqp_outbox VERSION '{PREVIOUS}': {e}"));
    let broker_id = add_broker(&mut client, rabbit.endpoint());
    // Published through the previous version's SQL functions (the library is already new).
    fill(
        &mut client,
        broker_id,
        &route.exchange,
        &route.routing_key,
        300,
        true,
    );
    let expected = previous_message_ids(&mut client, "message");
    let expected_discarded = previous_message_ids(&mut client, "discarded");
    let before = rows(&mut client, "message");
    assert_eq!(expected_discarded.len(), 1);

    // The new library with the old SQL: the worker waits and says why, nothing is lost.
    cluster.set_setting("amqp_outbox.enabled", "on");
    cluster.reload();
    eventually(
        Duration::from_secs(30),
        "the worker's version warning",
        || {
            let log = cluster.log();
            if log.contains(&format!("is version {PREVIOUS} but the library is")) {
                Ok(())
            } else {
                Err(cluster.log_tail(5))
            }
        },
    );
    assert_eq!(
        rows(&mut client, "message"),
        before,
        "nothing moves before the update"
    );

    // The ids are read in the update's own transaction: once it commits, the worker may
    // deliver (and delete) the rows at any moment.
    let mut tx = client
        .transaction()
        .unwrap_or_else(|e| panic!("BEGIN: {e}"));
    tx.batch_execute("ALTER EXTENSION amqp_outbox UPDATE")
        .unwrap_or_else(|e| panic!("ALTER EXTENSION amqp_outbox UPDATE: {e}"));
    let stored = stored_message_ids(&mut tx, "message");
    let stored_discarded = stored_message_ids(&mut tx, "discarded");
    tx.commit().unwrap_or_else(|e| panic!("COMMIT: {e}"));
    let version: String = scalar(
        &mut client,
        "SELECT extversion FROM pg_extension WHERE extname = 'amqp_outbox'",
    );
    let default_version: String = scalar(
        &mut client,
        "SELECT default_version FROM pg_available_extensions WHERE name = 'amqp_outbox'",
    );
    assert_eq!(version, default_version);
    assert_ne!(version, PREVIOUS);
    assert_eq!(
        stored, expected,
        "the update keeps the message_id each row had"
    );
    assert_eq!(stored_discarded, expected_discarded);

    // The worker now delivers the pending rows, each with its message_id.
    let pending: BTreeMap<String, Vec<u8>> = before
        .iter()
        .filter(|r| !r.parked)
        .map(|r| (expected[&r.id].clone(), r.body.clone()))
        .collect();
    let arrived = collector.wait_for_count(pending.len(), BULK_ARRIVAL);
    let seen: BTreeMap<String, Vec<u8>> = arrived
        .iter()
        .map(|d| (d.message_id.clone().unwrap_or_default(), d.body.clone()))
        .collect();
    assert_eq!(seen, pending);

    // A parked row stays parked through the update; retried, it goes out with its old id.
    let parked = before.iter().find(|r| r.parked).expect("a parked row");
    let still_parked: bool = scalar(
        &mut client,
        &format!(
            "SELECT parked_at IS NOT NULL FROM amqp.message WHERE id = {}",
            parked.id
        ),
    );
    assert!(still_parked);
    client
        .execute("SELECT amqp.retry($1)", &[&parked.id])
        .unwrap_or_else(|e| panic!("amqp.retry: {e}"));
    let want = expected[&parked.id].clone();
    let d = eventually(
        Duration::from_secs(30),
        "the retried parked message",
        || {
            collector
                .find_from(0, |d| d.message_id.as_deref() == Some(want.as_str()))
                .ok_or_else(|| format!("no delivery with message_id {want}"))
        },
    );
    assert_eq!(d.body, parked.body);

    // New messages get new, stored ids.
    let (_, message_id) = publish_and_read_id(
        &mut client,
        &format!(
            "SELECT amqp.publish_message({broker_id}, '{}', '{}', 'after-update')",
            route.exchange, route.routing_key
        ),
    );
    assert_eq!(message_id.len(), 36, "a UUID: {message_id}");
    let d = collector.wait_for_body("after-update", Duration::from_secs(30));
    assert_eq!(d.message_id.as_deref(), Some(message_id.as_str()));
    // The updated database publishes for later and with keys (0.8.0).
    let keyed = "SELECT amqp.publish_message($1, $2, $3, $4, deliver_after => '1 second', \
                 idempotency_key => 'after-update')";
    let first: i64 = client
        .query_one(
            keyed,
            &[
                &broker_id,
                &route.exchange,
                &route.routing_key,
                &"later-after-update",
            ],
        )
        .map(|r| r.get(0))
        .unwrap_or_else(|e| panic!("delayed publish after the update: {e}"));
    let again: i64 = client
        .query_one(
            keyed,
            &[&broker_id, &route.exchange, &route.routing_key, &"repeated"],
        )
        .map(|r| r.get(0))
        .unwrap_or_else(|e| panic!("repeated publish after the update: {e}"));
    assert_eq!(first, again);
    collector.wait_for_body("later-after-update", Duration::from_secs(30));

    // An updated database has exactly the schema of one created at the new version.
    client
        .batch_execute("CREATE DATABASE fresh")
        .unwrap_or_else(|e| panic!("CREATE DATABASE fresh: {e}"));
    let mut fresh = cluster.client_db("fresh");
    create_extension(&mut fresh);
    let (updated, created) = (describe(&mut client), describe(&mut fresh));
    let only_updated: Vec<&String> = updated.iter().filter(|l| !created.contains(l)).collect();
    let only_created: Vec<&String> = created.iter().filter(|l| !updated.contains(l)).collect();
    assert!(
        only_updated.is_empty() && only_created.is_empty(),
        "updated and fresh schemas differ\nonly after the update: {only_updated:#?}\nonly when created: {only_created:#?}"
    );
}

/// The granted locks `pid` holds on relations of the schema `amqp`, as "relation mode".
fn amqp_locks_held(client: &mut Client, pid: i32) -> Vec<String> {
    client
        .query(
            "SELECT c.relname || ' ' || l.mode FROM pg_locks l \
               JOIN pg_class c ON c.oid = l.relation \
              WHERE l.pid = $1 AND l.granted AND c.relnamespace = 'amqp'::regnamespace \
              ORDER BY 1",
            &[&pid],
        )
        .unwrap_or_else(|e| panic!("reading pg_locks: {e}"))
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// `DROP EXTENSION` against a worker transaction, forced into the order that once deadlocked
/// (40P01): the worker's transaction has locked `amqp.message` (every one of its transactions
/// does that first) and the DROP starts; then the worker's transaction goes on to the tables
/// behind `amqp.message` (its DELETE writes `amqp.produced`). The DROP must queue on
/// `amqp.message` before it locks anything else, so the worker's transaction finishes and the
/// DROP follows it. A session stands in for the worker so that the order is not left to timing.
#[test]
fn drop_extension_queues_behind_the_worker_instead_of_deadlocking() {
    let cluster = PgCluster::new(disabled());
    let mut worker = cluster.client();
    create_extension(&mut worker);
    let mut dropper = cluster.client();
    let dropper_pid: i32 = scalar(&mut dropper, "SELECT pg_backend_pid()");
    let mut observer = cluster.client();

    worker
        .batch_execute("BEGIN; LOCK TABLE amqp.message IN ROW EXCLUSIVE MODE")
        .unwrap_or_else(|e| panic!("locking amqp.message: {e}"));
    let drop = std::thread::spawn(move || {
        dropper
            .batch_execute("SET lock_timeout = '60s'; DROP EXTENSION amqp_outbox")
            .map_err(|e| format!("{e} ({:?})", e.code().map(|c| c.code().to_string())))
    });
    wait_for_lock_wait(
        &mut observer,
        dropper_pid,
        "amqp.message",
        Duration::from_secs(30),
    );
    assert_eq!(
        amqp_locks_held(&mut observer, dropper_pid),
        Vec::<String>::new(),
        "the waiting DROP already holds locks on the extension's relations"
    );
    // Well above deadlock_timeout (1 s): a deadlock would be reported before this runs out.
    worker
        .batch_execute(
            "SET LOCAL lock_timeout = '20s'; \
             LOCK TABLE amqp.produced IN ROW EXCLUSIVE MODE; \
             LOCK TABLE amqp.broker IN ROW SHARE MODE; \
             COMMIT",
        )
        .unwrap_or_else(|e| panic!("the worker's transaction after the DROP started: {e}"));
    match drop.join() {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("DROP EXTENSION after the worker's transaction: {e}"),
        Err(_) => panic!("the DROP's thread panicked"),
    }
    let left: i64 = scalar(
        &mut observer,
        "SELECT count(*) FROM pg_extension WHERE extname = 'amqp_outbox'",
    );
    assert_eq!(left, 0, "the extension is still installed");
}

/// The update to 0.8.0 turns the handler columns of `amqp.subscription` and
/// `amqp.compensation_handler` from regprocedure (which pg_upgrade refuses: the function OIDs it
/// holds do not survive an upgrade) into each function's schema-qualified name. Every handler
/// still names the function it named, one whose function was dropped gets a name no function
/// has (never a bare OID, which another function could have after pg_upgrade), and both
/// columns are text.
#[test]
fn update_to_0_8_0_keeps_each_handler_by_name() {
    let cluster = PgCluster::new(disabled());
    let mut client = cluster.client();
    client
        .batch_execute(
            "CREATE EXTENSION amqp_outbox VERSION '0.1.0'; \
             ALTER EXTENSION amqp_outbox UPDATE TO '0.7.0'",
        )
        .unwrap_or_else(|e| panic!("installing 0.7.0: {e}"));
    let broker_id = add_broker(&mut client, &AmqpEndpoint::shared());
    // Subscribed with the names as a session with `handlers` on its search_path wrote them.
    client
        .batch_execute(&format!(
            "CREATE SCHEMA handlers;
             CREATE FUNCTION public.on_order(d amqp.delivery) RETURNS void LANGUAGE sql AS 'SELECT';
             CREATE FUNCTION handlers.on_invoice(d amqp.delivery) RETURNS void LANGUAGE sql AS 'SELECT';
             CREATE FUNCTION public.gone(d amqp.delivery) RETURNS void LANGUAGE sql AS 'SELECT';
             CREATE FUNCTION handlers.undo(o amqp.produced, f amqp.receipt) RETURNS void
                 LANGUAGE sql AS 'SELECT';
             SET search_path = handlers, public;
             SELECT amqp.subscribe('orders', {broker_id}, 'orders.q', 'on_order(amqp.delivery)');
             SELECT amqp.subscribe('invoices', {broker_id}, 'invoices.q', 'on_invoice(amqp.delivery)');
             SELECT amqp.subscribe('gone', {broker_id}, 'gone.q', 'gone(amqp.delivery)');
             SELECT amqp.on_failure('order', 'undo(amqp.produced, amqp.receipt)');
             RESET search_path;"
        ))
        .unwrap_or_else(|e| panic!("subscribing at 0.7.0: {e}"));
    let handler_oids = |client: &mut Client, sql: &str| -> BTreeMap<String, Option<u32>> {
        client
            .query(sql, &[])
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect()
    };
    let before = handler_oids(
        &mut client,
        "SELECT subscription, handler::oid FROM amqp.subscription \
         UNION ALL SELECT business_type, handler::oid FROM amqp.compensation_handler",
    );
    assert_eq!(before.len(), 4, "{before:?}");
    let gone: u32 = before["gone"].unwrap_or_else(|| panic!("no oid for 'gone': {before:?}"));
    client
        .batch_execute("DROP FUNCTION public.gone(amqp.delivery)")
        .unwrap_or_else(|e| panic!("DROP FUNCTION: {e}"));

    client
        .batch_execute("ALTER EXTENSION amqp_outbox UPDATE TO '0.8.0'")
        .unwrap_or_else(|e| panic!("ALTER EXTENSION amqp_outbox UPDATE TO '0.8.0': {e}"));

    let types: Vec<String> = client
        .query(
            "SELECT format_type(atttypid, atttypmod) FROM pg_attribute \
              WHERE attname = 'handler' \
                AND attrelid IN ('amqp.subscription'::regclass, 'amqp.compensation_handler'::regclass)",
            &[],
        )
        .unwrap_or_else(|e| panic!("reading the column types: {e}"))
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(types, ["text", "text"]);
    // Resolved with an empty search_path: only a schema-qualified name resolves.
    let resolve = "SELECT subscription, to_regprocedure(handler)::oid FROM amqp.subscription \
                   UNION ALL SELECT business_type, to_regprocedure(handler)::oid \
                     FROM amqp.compensation_handler";
    client
        .batch_execute("SET search_path = ''")
        .unwrap_or_else(|e| panic!("SET search_path: {e}"));
    let after = handler_oids(&mut client, resolve);
    let mut expected = before.clone();
    expected.insert("gone".to_string(), None);
    assert_eq!(after, expected, "each handler names the function it named");
    let gone_name: String = scalar(
        &mut client,
        "SELECT handler FROM amqp.subscription WHERE subscription = 'gone'",
    );
    assert_eq!(gone_name, format!("\"dropped function {gone}\"()"));
    let shown: i64 = scalar(
        &mut client,
        "SELECT count(*) FROM amqp.subscription_status s JOIN amqp.subscription USING (subscription) \
          WHERE s.handler = subscription.handler",
    );
    assert_eq!(shown, 3, "amqp.subscription_status shows each handler");
}
