//! `pg_upgrade` of a database with the extension installed and messages waiting, from the
//! PostgreSQL that `PG_CONFIG` names to the later one that `AMQP_OUTBOX_E2E_UPGRADE_TO` names
//! (its `pg_config`), each with this version of the extension installed. `make test-pg-upgrade`
//! runs it from PostgreSQL 15 to 18: the 15.19 of the same wheels as 18 by default, since no
//! PostgreSQL 16-18 available here can restore what Debian's 15.20 stores in every column (its
//! `pg_attver` attribute option); `UPGRADE_FROM=15` takes the system's.
//!
//! Messages are committed while the broker row points at a port where nothing listens, so they
//! are all still in the outbox when the cluster stops; after `pg_upgrade` the new server starts,
//! its workers run, and once the broker row points at the real broker every message arrives
//! once, with the `message_id` it was given before the upgrade, and the subscription handles
//! what comes in.
//!
//! A plain `cargo test` skips it (`#[ignore]`: it needs the second PostgreSQL); `make
//! test-pg-upgrade` runs it. Run without `AMQP_OUTBOX_E2E_UPGRADE_TO`, or without the extension
//! installed in either PostgreSQL, it fails and says what is missing.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use amqp_outbox_e2e::outbox::{add_broker, create_extension};
use amqp_outbox_e2e::{
    eventually, AmqpEndpoint, Outbox, PgCluster, PgConfig, PgInstall, Rabbit, Received,
};
use postgres::Client;

const WORKERS_UP: Duration = Duration::from_secs(60);
const ARRIVAL: Duration = Duration::from_secs(30);
const BULK_ARRIVAL: Duration = Duration::from_secs(150);
/// Messages committed before the upgrade: six transactions of 100.
const TRANSACTIONS: i32 = 6;
const PER_TRANSACTION: i32 = 100;

/// The PostgreSQL to upgrade to, from `AMQP_OUTBOX_E2E_UPGRADE_TO`.
fn upgrade_target() -> PgInstall {
    let Some(pg_config) = std::env::var_os("AMQP_OUTBOX_E2E_UPGRADE_TO") else {
        panic!(
            "AMQP_OUTBOX_E2E_UPGRADE_TO is not set: it names the pg_config of the PostgreSQL to \
             upgrade to, with the extension installed (`make test-pg-upgrade` sets it to \
             PostgreSQL 18's, after `make install-test PG=18`)"
        );
    };
    let install = PgInstall::from_pg_config(&PathBuf::from(pg_config))
        .unwrap_or_else(|e| panic!("AMQP_OUTBOX_E2E_UPGRADE_TO: {e}"));
    install
        .check_extension_installed()
        .unwrap_or_else(|e| panic!("the PostgreSQL to upgrade to: {e}"));
    install
}

/// The backend types of the extension's processes now running, each with how many.
fn workers(client: &mut Client) -> Result<BTreeMap<String, i64>, String> {
    client
        .batch_execute("SELECT pg_catalog.pg_stat_clear_snapshot()")
        .map_err(|e| e.to_string())?;
    let rows = client
        .query(
            "SELECT backend_type, count(*) FROM pg_stat_activity \
              WHERE backend_type LIKE 'amqp_outbox%' GROUP BY 1",
            &[],
        )
        .map_err(|e| format!("reading pg_stat_activity: {e}"))?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// Waits until the launcher and the database's three workers run, one of each.
fn wait_for_workers(cluster: &PgCluster, client: &mut Client) {
    let expected: BTreeMap<String, i64> = [
        "amqp_outbox",
        "amqp_outbox launcher",
        "amqp_outbox monitor",
        "amqp_outbox subscriptions",
    ]
    .iter()
    .map(|t| (t.to_string(), 1))
    .collect();
    eventually(WORKERS_UP, "the launcher and the three workers", || {
        let now = workers(client)?;
        if now == expected {
            Ok(())
        } else {
            Err(format!("{now:?}; log:\n{}", cluster.log_tail(10)))
        }
    });
}

/// Every row of the outbox: id -> (message_id, body, parked).
fn outbox(client: &mut Client) -> BTreeMap<i64, (String, Vec<u8>, bool)> {
    client
        .query(
            "SELECT id, message_id, body, parked_at IS NOT NULL FROM amqp.message ORDER BY id",
            &[],
        )
        .unwrap_or_else(|e| panic!("reading amqp.message: {e}"))
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2), r.get(3))))
        .collect()
}

/// A port on 127.0.0.1 where nothing listens (bound, then closed again).
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap_or_else(|e| panic!("binding a port to close: {e}"));
    listener
        .local_addr()
        .unwrap_or_else(|e| panic!("the bound port: {e}"))
        .port()
}

fn by_message_id(deliveries: &[Received]) -> BTreeMap<String, Vec<Vec<u8>>> {
    let mut seen: BTreeMap<String, Vec<Vec<u8>>> = BTreeMap::new();
    for d in deliveries {
        seen.entry(d.message_id.clone().unwrap_or_default())
            .or_default()
            .push(d.body.clone());
    }
    seen
}

#[test]
#[ignore = "needs a later PostgreSQL with the extension installed: make test-pg-upgrade"]
fn pg_upgrade_keeps_every_pending_message_and_its_id_and_the_workers_run() {
    let new_install = upgrade_target();
    let old_install = PgInstall::find().unwrap_or_else(|e| panic!("PG_CONFIG: {e}"));
    old_install
        .check_extension_installed()
        .unwrap_or_else(|e| panic!("the PostgreSQL to upgrade from: {e}"));
    assert!(
        new_install.major > old_install.major,
        "pg_upgrade goes to a later major: from PostgreSQL {} (PG_CONFIG) to {} \
         (AMQP_OUTBOX_E2E_UPGRADE_TO)",
        old_install.major,
        new_install.major
    );
    // pg_upgrade carries the catalog over, not the scripts: both sides need the same version.
    let version = old_install
        .extension_version()
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        new_install.extension_version().as_deref(),
        Ok(version.as_str()),
        "the same extension version must be installed in both PostgreSQL"
    );
    eprintln!(
        "pg_upgrade from PostgreSQL {} ({}) to {} ({}), amqp_outbox {version}",
        old_install.major,
        old_install.bindir.display(),
        new_install.major,
        new_install.bindir.display()
    );

    let rabbit = Rabbit::shared();
    let route = rabbit.declare_route("upgrade");
    let collector = rabbit.consume_connected(&route);
    let inbox = rabbit.declare_queue("upgrade.inbox");

    // The old cluster: the broker row points where nothing listens.
    let mut old = PgCluster::new(PgConfig::default().install(old_install.clone()));
    let mut client = old.client();
    create_extension(&mut client);
    let broker_id = add_broker(&mut client, &AmqpEndpoint::local(closed_port()));
    client
        .batch_execute(&format!(
            "CREATE TABLE handled (message_id text PRIMARY KEY, body text NOT NULL);
             CREATE FUNCTION public.on_message(d amqp.delivery) RETURNS void LANGUAGE sql
                 AS $$ INSERT INTO handled VALUES (d.message_id, amqp.body_text(d)) $$;
             CREATE FUNCTION public.undo(o amqp.produced, f amqp.receipt) RETURNS void
                 LANGUAGE sql AS 'SELECT';
             SELECT amqp.subscribe('upgrade', {broker_id}, '{}', 'public.on_message(amqp.delivery)');
             SELECT amqp.on_failure('upgrade', 'public.undo(amqp.produced, amqp.receipt)');",
            inbox.queue
        ))
        .unwrap_or_else(|e| panic!("subscribing: {e}"));
    wait_for_workers(&old, &mut client);

    // Committed while they cannot be delivered, in several transactions; one rolled back.
    for t in 0..TRANSACTIONS {
        let mut tx = client
            .transaction()
            .unwrap_or_else(|e| panic!("BEGIN: {e}"));
        tx.execute(
            "SELECT amqp.publish_message($1, $2, $3, 'm-' || g, jsonb_build_object('n', g)) \
               FROM generate_series($4::int, $5::int) g",
            &[
                &broker_id,
                &route.exchange,
                &route.routing_key,
                &(t * PER_TRANSACTION + 1),
                &((t + 1) * PER_TRANSACTION),
            ],
        )
        .unwrap_or_else(|e| panic!("publishing: {e}"));
        tx.commit().unwrap_or_else(|e| panic!("COMMIT: {e}"));
    }
    let mut tx = client
        .transaction()
        .unwrap_or_else(|e| panic!("BEGIN: {e}"));
    tx.execute(
        "SELECT amqp.publish($1, $2, $3, 'rolled-back')",
        &[&broker_id, &route.exchange, &route.routing_key],
    )
    .unwrap_or_else(|e| panic!("publishing: {e}"));
    tx.rollback().unwrap_or_else(|e| panic!("ROLLBACK: {e}"));

    // The worker tried the broker, could not reach it, and keeps every message pending.
    eventually(
        ARRIVAL,
        "the worker to report the unreachable broker",
        || {
            let row = client
                .query_one(
                    "SELECT connected, last_error FROM amqp.broker_status WHERE broker_id = $1",
                    &[&broker_id],
                )
                .map_err(|e| e.to_string())?;
            let (connected, error): (bool, Option<String>) = (row.get(0), row.get(1));
            match (connected, error) {
                (false, Some(e)) => Ok(e),
                other => Err(format!("{other:?}")),
            }
        },
    );
    let before = outbox(&mut client);
    let total = usize::try_from(TRANSACTIONS * PER_TRANSACTION).unwrap_or(0);
    assert_eq!(
        before.len(),
        total,
        "every committed message is in the outbox"
    );
    assert!(
        before.values().all(|(_, _, parked)| !parked),
        "none is parked"
    );
    let handlers_before: Vec<(String, String)> = client
        .query(
            "SELECT 'subscription', handler FROM amqp.subscription \
             UNION ALL SELECT 'compensation', handler FROM amqp.compensation_handler ORDER BY 1",
            &[],
        )
        .unwrap_or_else(|e| panic!("reading the handlers: {e}"))
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert!(collector.deliveries().is_empty(), "nothing was delivered");
    drop(client);

    // pg_upgrade: stops the old server, makes the new cluster, copies, starts it.
    let (new, printed) = old
        .upgrade(PgConfig::default().install(new_install.clone()))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        printed.contains("Upgrade Complete"),
        "pg_upgrade printed:\n{printed}"
    );
    let mut client = new.client();
    let major: i32 = client
        .query_one(
            "SELECT current_setting('server_version_num')::int / 10000",
            &[],
        )
        .map(|r| r.get(0))
        .unwrap_or_else(|e| panic!("server_version_num: {e}"));
    assert_eq!(i64::from(major), i64::from(new_install.major));
    let extversion: String = client
        .query_one(
            "SELECT extversion FROM pg_extension WHERE extname = 'amqp_outbox'",
            &[],
        )
        .map(|r| r.get(0))
        .unwrap_or_else(|e| panic!("extversion: {e}"));
    assert_eq!(extversion, version);
    assert_eq!(
        outbox(&mut client),
        before,
        "the outbox after the upgrade: same ids, message_ids and bodies"
    );
    let handlers_after: Vec<(String, String, bool)> = client
        .query(
            "SELECT 'subscription', handler, to_regprocedure(handler) IS NOT NULL \
               FROM amqp.subscription \
             UNION ALL SELECT 'compensation', handler, to_regprocedure(handler) IS NOT NULL \
               FROM amqp.compensation_handler ORDER BY 1",
            &[],
        )
        .unwrap_or_else(|e| panic!("reading the handlers: {e}"))
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let expected_handlers: Vec<(String, String, bool)> = handlers_before
        .into_iter()
        .map(|(what, h)| (what, h, true))
        .collect();
    assert_eq!(
        handlers_after, expected_handlers,
        "each handler, by name, names an existing function"
    );
    // The workers run on the new server (none ran during pg_upgrade itself).
    wait_for_workers(&new, &mut client);
    assert!(
        new.log().contains("launcher started"),
        "{}",
        new.log_tail(20)
    );

    // The broker reachable: every pending message arrives, with its message_id and body.
    client
        .execute(
            "UPDATE amqp.broker SET port = $1 WHERE broker_id = $2",
            &[&i32::from(rabbit.endpoint().port), &broker_id],
        )
        .unwrap_or_else(|e| panic!("pointing the broker row at the broker: {e}"));
    collector.wait_for_count(total, BULK_ARRIVAL);
    Outbox::wait_drained(&mut client, BULK_ARRIVAL);
    // One more, published after the upgrade: a new message_id. Once it has arrived, so has
    // every copy of the earlier ones (one channel, one queue: RabbitMQ keeps the order).
    let mut tx = client
        .transaction()
        .unwrap_or_else(|e| panic!("BEGIN: {e}"));
    let new_id: i64 = tx
        .query_one(
            "SELECT amqp.publish_message($1, $2, $3, 'after-upgrade')",
            &[&broker_id, &route.exchange, &route.routing_key],
        )
        .map(|r| r.get(0))
        .unwrap_or_else(|e| panic!("publishing after the upgrade: {e}"));
    let new_message_id: String = tx
        .query_one(
            "SELECT message_id FROM amqp.message WHERE id = $1",
            &[&new_id],
        )
        .map(|r| r.get(0))
        .unwrap_or_else(|e| panic!("reading its message_id: {e}"));
    tx.commit().unwrap_or_else(|e| panic!("COMMIT: {e}"));
    let last = collector.wait_for_body("after-upgrade", ARRIVAL);
    assert_eq!(last.message_id.as_deref(), Some(new_message_id.as_str()));
    assert!(
        before.keys().all(|id| *id < new_id),
        "id {new_id} reuses an id of before the upgrade"
    );

    let seen = by_message_id(&collector.deliveries());
    let mut expected: BTreeMap<String, Vec<Vec<u8>>> = before
        .values()
        .map(|(message_id, body, _)| (message_id.clone(), vec![body.clone()]))
        .collect();
    assert!(
        !expected.contains_key(&new_message_id),
        "the new message_id {new_message_id} repeats one of before the upgrade"
    );
    expected.insert(new_message_id, vec![b"after-upgrade".to_vec()]);
    let lost: Vec<&String> = expected.keys().filter(|k| !seen.contains_key(*k)).collect();
    let unexpected: Vec<&String> = seen.keys().filter(|k| !expected.contains_key(*k)).collect();
    let twice: BTreeSet<&String> = seen
        .iter()
        .filter(|(_, bodies)| bodies.len() > 1)
        .map(|(k, _)| k)
        .collect();
    assert!(
        lost.is_empty() && unexpected.is_empty() && twice.is_empty(),
        "{} lost {lost:?}, {} unexpected {unexpected:?}, {} twice {twice:?}",
        lost.len(),
        unexpected.len(),
        twice.len()
    );
    assert_eq!(seen, expected, "each message with the body it had");

    // The subscription, made before the upgrade, handles what comes in after it (sent through
    // the outbox to its queue, by the default exchange).
    client
        .execute(
            "SELECT amqp.publish($1, '', $2, 'to-the-subscription')",
            &[&broker_id, &inbox.queue],
        )
        .unwrap_or_else(|e| panic!("publishing to the subscription's queue: {e}"));
    eventually(ARRIVAL, "the subscription to handle the message", || {
        let bodies: Vec<String> = client
            .query("SELECT body FROM handled", &[])
            .map_err(|e| e.to_string())?
            .iter()
            .map(|r| r.get(0))
            .collect();
        if bodies == ["to-the-subscription"] {
            Ok(())
        } else {
            Err(format!("handled: {bodies:?}; log:\n{}", new.log_tail(10)))
        }
    });
}
