//! Case 12: lifecycle and configuration changes.

use std::time::{Duration, Instant};

use amqp_outbox_e2e::chaos::{count_log_lines, holds_for, ProxyMode, TcpProxy};
use amqp_outbox_e2e::outbox::create_extension;
use amqp_outbox_e2e::{eventually, unique_name, MessageKey, Outbox};

use super::harness::*;

// ------------------------------------------------------------------------------------------
// 12. lifecycle and config
// ------------------------------------------------------------------------------------------

#[test]
fn case12_lifecycle_and_config() {
    let mut rig = Rig::new(
        "12 lifecycle and config",
        base_config()
            .setting("amqp_outbox.retry_backoff_min", 200)
            .setting("amqp_outbox.retry_backoff_max", 2000),
    );
    let mut seq = 0u64;
    let mut next = || {
        seq += 1;
        MessageKey::new("l", seq)
    };
    let mut notes = Vec::new();

    // (a) Broker down at server start: backoff, no hot loop, delivered once it is up.
    rig.node.stop();
    let from = rig.cluster.log().len();
    rig.cluster.restart();
    rig.reconnect();
    let k = next();
    rig.publish_key(&k);
    let cluster = &rig.cluster;
    eventually(
        ARRIVAL,
        "the worker to report the broker unavailable",
        || {
            if count_log_lines(&cluster.log(), from, &["broker", "unavailable"]) > 0 {
                Ok(())
            } else {
                Err(cluster.log_tail(5))
            }
        },
    );
    let window_from = rig.cluster.log().len();
    let t = Instant::now();
    let window = Duration::from_secs(6);
    // Observation window (counting log lines over a few seconds is the measurement).
    std::thread::sleep(window);
    let lines = count_log_lines(&rig.cluster.log(), window_from, &["amqp_outbox"]);
    notes.push(format!(
        "broker down at start: {lines} log lines in {:.0}s",
        t.elapsed().as_secs_f64()
    ));
    assert!(
        lines <= 10,
        "hot loop while the broker is down: {lines} log lines in {:?}:\n{}",
        t.elapsed(),
        rig.cluster.log_tail(20)
    );
    rig.node.boot();
    rig.collector.wait_for_body(&k.body(), ARRIVAL);

    // (b) Wrong password: one clear line, no password, no hot loop; fixed by UPDATE.
    let secret = unique_name("Pw").replace('.', "-");
    let from = rig.cluster.log().len();
    rig.client
        .execute(
            "UPDATE amqp.broker SET password = $2 WHERE broker_id = $1",
            &[&rig.outbox.broker_id, &secret],
        )
        .unwrap();
    let k = next();
    rig.publish_key(&k);
    let cluster = &rig.cluster;
    eventually(ARRIVAL, "the failed login in the log", || {
        if count_log_lines(&cluster.log(), from, &["broker", "unavailable"]) > 0 {
            Ok(())
        } else {
            Err(cluster.log_tail(5))
        }
    });
    let window_from = rig.cluster.log().len();
    std::thread::sleep(window);
    let log = rig.cluster.log();
    let lines = count_log_lines(&log, window_from, &["amqp_outbox"]);
    let first_line = log[from..]
        .lines()
        .find(|l| l.contains("unavailable"))
        .unwrap_or("")
        .to_string();
    notes.push(format!("wrong password: {lines} log lines in 6s"));
    eprintln!("wrong password reported as: {first_line}");
    assert!(lines <= 10, "hot loop on a wrong password: {lines} lines");
    assert!(!log.contains(&secret), "the password is in the server log");
    let status: Option<String> = rig
        .client
        .query_one(
            "SELECT string_agg(coalesce(last_error, ''), ' ') FROM amqp.broker_status",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(
        !status.unwrap_or_default().contains(&secret),
        "amqp.broker_status shows the password"
    );
    rig.client
        .execute(
            "UPDATE amqp.broker SET password = 'guest' WHERE broker_id = $1",
            &[&rig.outbox.broker_id],
        )
        .unwrap();
    rig.collector.wait_for_body(&k.body(), ARRIVAL);

    // (c) A new host: through a proxy, then directly; the old one is cut.
    let proxy = TcpProxy::start(format!("127.0.0.1:{}", rig.node.port()).parse().unwrap());
    rig.client
        .execute(
            "UPDATE amqp.broker SET port = $2 WHERE broker_id = $1",
            &[&rig.outbox.broker_id, &i32::from(proxy.port())],
        )
        .unwrap();
    let k = next();
    rig.publish_key(&k);
    rig.collector.wait_for_body(&k.body(), ARRIVAL);
    assert!(
        proxy.accepted() > 0,
        "the new host (the proxy) was not used"
    );
    rig.client
        .execute(
            "UPDATE amqp.broker SET port = $2 WHERE broker_id = $1",
            &[&rig.outbox.broker_id, &i32::from(rig.node.port())],
        )
        .unwrap();
    let client = &mut rig.client;
    let node_port = rig.node.port();
    eventually(ARRIVAL, "broker_status on the direct host", || {
        let host: Option<String> = client
            .query_one(
                "SELECT max(host) FROM amqp.broker_status WHERE connected",
                &[],
            )
            .map_err(|e| e.to_string())?
            .get(0);
        match host {
            Some(h) if h.contains(&format!(":{node_port}")) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    proxy.set_mode(ProxyMode::Refuse);
    proxy.cut();
    let k = next();
    rig.publish_key(&k);
    rig.collector.wait_for_body(&k.body(), ARRIVAL);
    drop(proxy);

    // (d) A setting reload: amqp_outbox.enabled off holds messages, on releases them.
    rig.cluster.set_setting("amqp_outbox.enabled", "off");
    rig.cluster.reload();
    let client = &mut rig.client;
    eventually(ARRIVAL, "enabled = off to be visible", || {
        let v: String = client
            .query_one("SHOW amqp_outbox.enabled", &[])
            .map_err(|e| e.to_string())?
            .get(0);
        if v == "off" {
            Ok(())
        } else {
            Err(v)
        }
    });
    let k = next();
    rig.publish_key(&k);
    let collector = &rig.collector;
    let held = holds_for(Duration::from_secs(3), "held while disabled", || {
        if collector.has_body(&k.body()) {
            Err("published while amqp_outbox.enabled = off".into())
        } else {
            Ok(())
        }
    });
    rig.cluster.set_setting("amqp_outbox.enabled", "on");
    rig.cluster.reload();
    rig.collector.wait_for_body(&k.body(), ARRIVAL);
    notes.push(format!(
        "enabled=off reload: {}",
        if held.is_ok() { "held" } else { "NOT held" }
    ));

    // (e) DROP EXTENSION while the worker publishes: refused while messages wait; after they
    // are deleted, no crash; CREATE EXTENSION again works.
    let b = rig.outbox.broker_id;
    rig.client
        .execute(
            "SELECT count(amqp.publish($1, $2, $3, 'drop:' || g)) FROM generate_series(1, 2000) g",
            &[&b, &rig.route.exchange, &rig.route.routing_key],
        )
        .unwrap();
    let worker_before = rig.worker_pid();
    let from = rig.cluster.log().len();
    // Refused while messages wait (they would be lost); dropped once they are deleted on
    // purpose, in the same transaction.
    // (The refused attempt sees a message of its own transaction: the worker may already have
    // delivered the 2,000.)
    let refused = {
        let mut tx = rig.client.transaction().unwrap();
        tx.execute(
            "SELECT amqp.publish($1, $2, $3, 'drop:held')",
            &[&b, &rig.route.exchange, &rig.route.routing_key],
        )
        .unwrap();
        tx.batch_execute("DROP EXTENSION amqp_outbox")
            .expect_err("DROP EXTENSION with messages in the outbox must be refused")
    };
    assert_eq!(
        refused.as_db_error().map(|e| e.code().code().to_string()),
        Some("2BP01".to_string()),
        "{refused}"
    );
    rig.client
        .batch_execute("BEGIN; DELETE FROM amqp.message; DROP EXTENSION amqp_outbox; COMMIT")
        .unwrap();
    let cluster = &rig.cluster;
    eventually(
        ARRIVAL,
        "the worker to notice the dropped extension",
        || {
            let log = cluster.log();
            // The worker exits (the launcher starts it again after CREATE EXTENSION).
            if count_log_lines(&log, from, &["extension no longer installed"]) > 0 {
                Ok(())
            } else {
                Err(cluster.log_tail(5))
            }
        },
    );
    let log = rig.cluster.log();
    assert!(
        !log.contains("terminated by signal") && !log.contains("PANIC"),
        "the cluster crashed:\n{}",
        rig.cluster.log_tail(40)
    );
    let log = rig.cluster.log();
    let worker_exits = count_log_lines(&log, from, &["amqp_outbox", "exited with exit code"]);
    let worker_error = log[from..]
        .lines()
        .find(|l| l.contains("amqp_outbox ERROR"))
        .map(|l| l.chars().take(160).collect::<String>());
    create_extension(&mut rig.client);
    let b: i32 = amqp_outbox_e2e::outbox::add_broker(&mut rig.client, &rig.node.endpoint());
    rig.outbox = Outbox { broker_id: b };
    let worker_after = rig.worker_pid();
    let k = next();
    rig.publish_key(&k);
    rig.collector.wait_for_body(&k.body(), ARRIVAL);
    notes.push(format!(
        "DROP EXTENSION mid-publish: no cluster crash, worker {worker_before:?} -> {worker_after:?} ({worker_exits} worker exit(s), error {worker_error:?}), works after CREATE EXTENSION"
    ));
    let log = rig.cluster.log();
    assert!(!log.contains(&secret));
    assert!(
        !log.contains("terminated by signal"),
        "a process died by a signal:\n{}",
        rig.cluster.log_tail(40)
    );
    rig.finish(None, MAX_IN_FLIGHT, &["drop:"], &notes.join("; "));
}
