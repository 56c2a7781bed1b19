//! Tests of the harness itself: they need PostgreSQL and RabbitMQ, but not the extension.

use std::time::Duration;

use amqp_outbox_e2e::ledger::{Ledger, MessageKey};
use amqp_outbox_e2e::{eventually, PgCluster, PgConfig, PrivateRabbit, Rabbit, StopMode};

#[test]
fn private_cluster_starts_stops_and_restarts_without_preload() {
    let mut cluster = PgCluster::new(
        PgConfig::new()
            .without_preload()
            .setting("work_mem", "'7MB'"),
    );
    let port = cluster.port();
    assert!(port > 55000, "port {port} should be above 55000");
    let mut client = cluster.client();
    let row = client
        .query_one(
            "SELECT current_database()::text, current_setting('work_mem'), \
             current_setting('listen_addresses'), current_setting('server_version_num')::int",
            &[],
        )
        .expect("query the private cluster");
    assert_eq!(row.get::<_, String>(0), "e2e");
    assert_eq!(row.get::<_, String>(1), "7MB");
    assert_eq!(row.get::<_, String>(2), "127.0.0.1");
    // The PostgreSQL that PG_CONFIG names (15 unless it names another).
    let version: i32 = row.get(3);
    let major = amqp_outbox_e2e::PgInstall::find()
        .unwrap_or_else(|e| panic!("{e}"))
        .major;
    assert_eq!(
        i64::from(version) / 10000,
        i64::from(major),
        "PostgreSQL {major} expected, got {version}"
    );
    drop(client);

    cluster.stop(StopMode::Fast);
    assert!(cluster.try_client().is_err(), "server should be down");
    cluster.start();
    cluster
        .client()
        .batch_execute("SELECT 1")
        .expect("query after start");

    cluster.set_setting("work_mem", "'9MB'");
    cluster.restart();
    let wm: String = cluster
        .client()
        .query_one("SELECT current_setting('work_mem')", &[])
        .expect("query after restart")
        .get(0);
    assert_eq!(wm, "9MB");

    cluster
        .client()
        .batch_execute("DO $$ BEGIN RAISE LOG 'e2e-log-marker-%', 42; END $$")
        .expect("RAISE LOG");
    eventually(
        Duration::from_secs(10),
        "the marker in the server log",
        || {
            if cluster.log().contains("e2e-log-marker-42") {
                Ok(())
            } else {
                Err(cluster.log_tail(5))
            }
        },
    );
    cluster.stop(StopMode::Immediate);
    cluster.start();
    let dir = cluster.dir().to_path_buf();
    drop(cluster);
    assert!(!dir.exists(), "{} should be removed on drop", dir.display());
}

#[test]
fn shared_rabbit_route_collects_deliveries_with_properties() {
    let rabbit = Rabbit::shared();
    let route = rabbit.declare_route("harness");
    let collector = rabbit.consume_connected(&route);
    for i in 0..5 {
        rabbit
            .publish(
                &route.exchange,
                &route.routing_key,
                format!("h:{i}").as_bytes(),
            )
            .expect("publish");
    }
    let got = collector.wait_for_count(5, Duration::from_secs(10));
    let bodies: Vec<String> = got.iter().map(|d| d.text()).collect();
    assert_eq!(bodies, ["h:0", "h:1", "h:2", "h:3", "h:4"]);
    assert_eq!(got[0].message_id.as_deref(), Some("direct-h:0"));
    assert_eq!(got[0].delivery_mode, Some(2));
    assert_eq!(got[0].exchange, route.exchange);

    let ledger = Ledger::new();
    let keys: Vec<MessageKey> = (0..5).map(|i| MessageKey::new("h", i)).collect();
    ledger.committed(&keys);
    ledger.aborted(&[MessageKey::new("h", 99)]);
    ledger.check(&got).assert_exactly_once_in_order();
}

#[test]
fn private_rabbit_survives_stop_app_close_connections_and_full_restart() {
    let mut node = PrivateRabbit::start();
    assert_ne!(node.port(), 5672);
    let rabbit = node.rabbit();
    let mut route = rabbit.declare_route("private");
    route.delete_on_drop = false;
    let collector = rabbit.consume(&route);
    drop(rabbit);
    collector.wait_connected(Duration::from_secs(10));

    let publish = |node: &PrivateRabbit, body: &str| {
        let r = node.rabbit();
        r.publish(&route.exchange, &route.routing_key, body.as_bytes())
            .expect("publish to the private node");
    };
    publish(&node, "p:0");
    collector.wait_for_body("p:0", Duration::from_secs(10));

    node.close_all_connections("e2e harness test");
    eventually(Duration::from_secs(10), "the consumer to reconnect", || {
        if collector.connections() >= 2 {
            Ok(())
        } else {
            Err(format!("{} connections", collector.connections()))
        }
    });
    publish(&node, "p:1");
    collector.wait_for_body("p:1", Duration::from_secs(10));

    node.stop_app();
    assert!(
        !node.accepts_connections(),
        "AMQP port should be closed after stop_app"
    );
    node.start_app();
    publish(&node, "p:2");
    collector.wait_for_body("p:2", Duration::from_secs(20));

    // A full stop and boot keeps the durable route and the ports.
    node.stop();
    assert!(!node.accepts_connections(), "node should be down");
    node.boot();
    publish(&node, "p:3");
    collector.wait_for_body("p:3", Duration::from_secs(30));

    let ledger = Ledger::new();
    ledger.committed(&(0..4).map(|i| MessageKey::new("p", i)).collect::<Vec<_>>());
    let report = ledger.check(&collector.deliveries());
    report.assert_at_least_once(0);
    assert!(report.order_violations.is_empty(), "{report}");

    let dir = node.dir().to_path_buf();
    drop(collector);
    drop(node);
    assert!(!dir.exists(), "{} should be removed on drop", dir.display());
}

#[test]
fn two_private_rabbits_run_side_by_side() {
    let a = PrivateRabbit::start();
    let b = PrivateRabbit::start();
    assert_ne!(a.port(), b.port());
    let ra = a.rabbit();
    let rb = b.rabbit();
    let route = ra.declare_route("side");
    let collector = ra.consume(&route);
    ra.publish(&route.exchange, &route.routing_key, b"a:0")
        .expect("publish on a");
    collector.wait_for_body("a:0", Duration::from_secs(10));
    // The route exists only on node a.
    assert!(rb
        .publish(&route.exchange, &route.routing_key, b"b:0")
        .is_err());
}

#[test]
fn checker_reports_lost_phantom_duplicates_and_order() {
    use amqp_outbox_e2e::Received;
    use std::time::Instant;
    let d = |body: &str, id: &str| Received {
        body: body.as_bytes().to_vec(),
        exchange: String::new(),
        routing_key: String::new(),
        redelivered: false,
        message_id: Some(id.to_string()),
        delivery_mode: Some(2),
        content_type: None,
        reply_to: None,
        correlation_id: None,
        timestamp: None,
        user_id: None,
        headers: Default::default(),
        connection_no: 0,
        received_at: Instant::now(),
    };
    let ledger = Ledger::new();
    ledger.committed(&(0..4).map(|i| MessageKey::new("a", i)).collect::<Vec<_>>());
    ledger.aborted(&[MessageKey::new("a", 4)]);
    ledger.unknown(&[MessageKey::new("a", 5)], None, None);
    let deliveries = vec![
        d("a:0", "m0"),
        d("a:2", "m2"),
        d("a:1", "m1"),
        d("a:2", "m2-other"),
        d("a:4", "m4"),
        d("zzz", "mz"),
    ];
    let r = ledger.check(&deliveries);
    assert_eq!(r.lost, vec![MessageKey::new("a", 3)], "{r}");
    assert_eq!(r.phantom, vec![MessageKey::new("a", 4)], "{r}");
    assert_eq!(r.duplicates.len(), 1, "{r}");
    assert_eq!(r.duplicates_with_differing_ids().len(), 1, "{r}");
    assert_eq!(r.order_violations.len(), 1, "{r}");
    assert_eq!(r.order_violations[0].seq, 1, "{r}");
    assert_eq!(r.unexpected, vec!["zzz".to_string()], "{r}");
    let text = r.to_string();
    assert!(text.contains("a:3") && text.contains("a:4") && text.contains("m2-other"));
}

/// A COMMIT without an answer is resolved by the token its transaction inserted, not by its xid:
/// after a crash, the xid of a transaction that never reached the disk can belong to a later
/// transaction, and `pg_xact_status` then reports that one. A transaction still running stays
/// unknown.
#[test]
fn unknown_commits_are_resolved_by_their_token_not_by_their_xid() {
    use amqp_outbox_e2e::ledger::{Outcome, CREATE_COMMIT_TOKENS, INSERT_COMMIT_TOKEN};
    let cluster = PgCluster::new(PgConfig::new().without_preload());
    let mut client = cluster.client();
    client.batch_execute(CREATE_COMMIT_TOKENS).unwrap();
    let xid_of = |c: &mut postgres::Client| -> String {
        c.query_one("SELECT pg_catalog.pg_current_xact_id()::text", &[])
            .unwrap()
            .get(0)
    };
    let key = |p: &str, n: u64| MessageKey::new(p, n);

    // Committed, with its token.
    client.batch_execute("BEGIN").unwrap();
    let committed_xid = xid_of(&mut client);
    client.execute(INSERT_COMMIT_TOKEN, &[&"a:0"]).unwrap();
    client.batch_execute("COMMIT").unwrap();
    // Still running on another connection.
    let mut other = cluster.client();
    other.batch_execute("BEGIN").unwrap();
    let running_xid = xid_of(&mut other);
    other.execute(INSERT_COMMIT_TOKEN, &[&"c:0"]).unwrap();

    let ledger = Ledger::new();
    ledger.unknown(
        &[key("a", 0), key("a", 1)],
        Some(committed_xid.clone()),
        Some("a:0".into()),
    );
    // Lost in a crash; its xid now names the committed transaction above.
    ledger.unknown(&[key("b", 0)], Some(committed_xid), Some("b:0".into()));
    ledger.unknown(&[key("c", 0)], Some(running_xid), Some("c:0".into()));
    ledger.unknown(&[key("d", 0)], None, None);
    ledger.resolve_unknown(&mut client).unwrap();

    assert_eq!(ledger.outcome(&key("a", 0)), Some(Outcome::Committed));
    assert_eq!(ledger.outcome(&key("a", 1)), Some(Outcome::Committed));
    assert_eq!(ledger.outcome(&key("b", 0)), Some(Outcome::Aborted));
    assert!(matches!(
        ledger.outcome(&key("c", 0)),
        Some(Outcome::Unknown { .. })
    ));
    assert!(matches!(
        ledger.outcome(&key("d", 0)),
        Some(Outcome::Unknown { .. })
    ));
    other.batch_execute("ROLLBACK").unwrap();
}
