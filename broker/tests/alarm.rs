//! A resource alarm on a private RabbitMQ node of this test (the shared node's limits are never
//! touched): publishing pauses without being taken for a hang, the acknowledgement listener's
//! connection is not blocked, and everything drains once the alarm clears.

mod common;

use amqp_outbox_broker::{Event, LogLevel};
use common::node::{rabbitmq_installed, Node};
use common::*;
use std::time::{Duration, Instant};

fn connection_states(node: &Node) -> Vec<(String, String)> {
    node.ctl_output(&["list_connections", "client_properties", "state"])
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let name = if l.contains("ack listener") {
                "listener"
            } else if l.contains("amqp_outbox broker") {
                "publisher"
            } else {
                return None;
            };
            let state = l.rsplit('\t').next()?.trim().to_string();
            Some((name.to_string(), state))
        })
        .collect()
}

#[test]
fn resource_alarm_pauses_publishing_without_a_hang_and_everything_drains_after() {
    if !rabbitmq_installed() {
        eprintln!("rabbitmq-server is not installed here: skipped");
        return;
    }
    let Some(node) = Node::start() else {
        panic!("cannot start a private RabbitMQ node");
    };
    let ack_q = unique("alarm_acks");
    let target = unique("alarm_target");
    let mut cfg = ack_config(1, vec![node.endpoint()], vec![], &ack_q, false);
    // Short, so the alarm below lasts several confirm timeouts.
    cfg.confirm_timeout = Duration::from_secs(2);
    cfg.queues = vec![amqp_outbox_broker::QueueDecl {
        name: target.clone(),
        durable: false,
        auto_delete: false,
        arguments: serde_json::Map::new(),
    }];
    let (mut bridge, _) = Bridge::connected(cfg);

    let (mut confirmed, mut acked) = (0usize, 0usize);

    bridge.publish(
        1,
        (1..=10).map(|i| message(i, "", &target)).collect(),
        false,
    );
    bridge.wait_for(Duration::from_secs(20), |e| {
        tally(e, &mut confirmed, &mut acked);
        (confirmed == 10 && acked == 10).then_some(())
    });

    assert!(
        node.ctl(&["set_disk_free_limit", "100000GB"]),
        "cannot set the alarm"
    );
    let restore = scopeguard(&node);
    bridge.publish(
        1,
        (11..=30).map(|i| message(i, "", &target)).collect(),
        false,
    );
    bridge.wait_for(Duration::from_secs(20), |e| {
        tally(e, &mut confirmed, &mut acked);
        matches!(
            e,
            Event::Blocked {
                broker_id: 1,
                blocked: true
            }
        )
        .then_some(())
    });
    // Several confirm timeouts pass: no hang is declared, nothing fails or disconnects.
    let until = Instant::now() + Duration::from_secs(7);
    while Instant::now() < until {
        for e in bridge.poll(Duration::from_millis(200)) {
            tally(&e, &mut confirmed, &mut acked);
            bridge.seen.push(e);
        }
    }
    assert!(confirmed < 30, "confirms came through a resource alarm");
    // The worker is told (so its timeout sweep waits), and so is the log.
    assert!(bridge.seen.iter().any(
        |e| matches!(e, Event::Log { level: LogLevel::Info, message }
            if message.contains("publishing paused: broker resource alarm"))
    ));
    // The listener only consumes: the broker does not block it ("blocking" means it would be
    // blocked if it published; deliveries keep flowing).
    let states = connection_states(&node);
    assert!(
        states
            .iter()
            .any(|(n, s)| n == "listener" && (s == "running" || s == "blocking")),
        "{states:?}"
    );
    assert!(
        states
            .iter()
            .any(|(n, s)| n == "publisher" && s.starts_with("block")),
        "{states:?}"
    );
    drop(restore);
    bridge.wait_for(Duration::from_secs(30), |e| {
        tally(e, &mut confirmed, &mut acked);
        (confirmed == 30 && acked == 30).then_some(())
    });
    assert!(bridge
        .seen
        .iter()
        .any(|e| matches!(e, Event::Log { message, .. }
        if message.contains("publishing resumed"))));
    assert!(bridge.seen.iter().any(|e| matches!(
        e,
        Event::Blocked {
            broker_id: 1,
            blocked: false
        }
    )));
    drop(bridge);
    drop(node);
}

fn tally(e: &Event, confirmed: &mut usize, acked: &mut usize) {
    match e {
        Event::Confirmed { ids, .. } => *confirmed += ids.len(),
        Event::Acked { ids, .. } => *acked += ids.len(),
        Event::Failed { id, error, .. } => panic!("{id} failed: {error}"),
        Event::Disconnected { error, .. } => panic!("disconnected: {error}"),
        Event::Lost { ids, .. } => panic!("lost: {ids:?}"),
        _ => {}
    }
}

/// Restores the disk limit when dropped (also when the test panics).
struct Restore<'a>(&'a Node);

fn scopeguard(node: &Node) -> Restore<'_> {
    Restore(node)
}

impl Drop for Restore<'_> {
    fn drop(&mut self) {
        let _ = self.0.ctl(&["set_disk_free_limit", "50MB"]);
    }
}
