//! Integration tests against the RabbitMQ at 127.0.0.1:5672 (guest/guest).

mod common;

use amqp_outbox_broker::{Command, Endpoint, Event, Failure};
use common::*;
use lapin::types::AMQPValue;
use lapin::ExchangeKind;
use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

const B: i32 = 1;

fn header<'a>(d: &'a lapin::message::Delivery, key: &str) -> &'a AMQPValue {
    d.properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(key))
        .unwrap_or_else(|| panic!("header {key} missing"))
}

/// Waits until `confirms` messages are confirmed and message `culprit` failed as `failure`, all
/// on the channel of `epoch` (a new channel fails the test); returns the confirmed ids and the
/// culprit's error.
fn confirmed_beside_one_failure(
    bridge: &mut Bridge,
    epoch: u64,
    culprit: i64,
    failure: Failure,
    confirms: usize,
) -> (BTreeSet<i64>, String) {
    let mut confirmed = BTreeSet::new();
    let mut culprit_error = None;
    bridge.wait_for(Duration::from_secs(30), |e| {
        match e {
            Event::Confirmed { ids, .. } => confirmed.extend(ids.iter().copied()),
            Event::Failed {
                id,
                failure: f,
                error,
                ..
            } => {
                assert_eq!(*id, culprit, "another message failed: {f:?}: {error}");
                assert_eq!(*f, failure, "{error}");
                culprit_error = Some(error.clone());
            }
            Event::Connected { epoch: e, .. } => panic!("new channel (epoch {e} after {epoch})"),
            _ => {}
        }
        (confirmed.len() == confirms && culprit_error.is_some()).then_some(())
    });
    (confirmed, culprit_error.unwrap_or_default())
}

/// Exactly one Disconnected event so far: the bridge reports losing a connection once, not
/// on every failed round or new connection after it.
fn assert_one_disconnected(bridge: &Bridge) {
    let disconnected = bridge
        .seen
        .iter()
        .filter(|e| matches!(e, Event::Disconnected { .. }))
        .count();
    assert_eq!(disconnected, 1, "{:#?}", bridge.seen);
}

#[test]
fn batch_of_1000_is_confirmed_and_consumed_with_properties() {
    let mut admin = Admin::new();
    let (exchange, queue) = admin.direct_route("batch");

    let mut bridge = Bridge::new();
    // The worker's declaration of an existing exchange (passive) must not disturb anything.
    let decl = exchange_decl(&exchange, "direct", true);
    bridge.send(Command::Configure(vec![config(
        B,
        vec![local_endpoint()],
        vec![decl],
    )]));
    let epoch = bridge.wait_connected(B, 0);

    let ids: Vec<i64> = (1..=1000).collect();
    for chunk in ids.chunks(250) {
        let msgs = chunk.iter().map(|&i| message(i, &exchange, "rk")).collect();
        bridge.publish(B, msgs, false);
    }

    let mut confirmed = BTreeSet::new();
    let mut confirm_events = 0;
    bridge.wait_for(Duration::from_secs(60), |e| {
        match e {
            Event::Confirmed {
                broker_id,
                epoch: ep,
                ids,
            } if *broker_id == B => {
                assert_eq!(*ep, epoch);
                confirm_events += 1;
                for id in ids {
                    assert!(confirmed.insert(*id), "id {id} confirmed twice");
                }
            }
            Event::Failed { id, error, .. } => panic!("message {id} failed: {error}"),
            _ => {}
        }
        (confirmed.len() == 1000).then_some(())
    });
    assert_eq!(confirmed, ids.iter().copied().collect());
    // Confirms that complete together are coalesced.
    assert!(
        confirm_events < 1000,
        "{confirm_events} Confirmed events for 1000 messages"
    );

    let got = admin.consume(&queue, 1000, Duration::from_secs(30));
    for (i, d) in got.iter().enumerate() {
        let id = i as i64 + 1; // one channel, one queue: order kept
        let p = &d.properties;
        assert_eq!(d.data, format!("body-{id}").into_bytes());
        assert_eq!(
            p.message_id().as_ref().map(|s| s.to_string()),
            Some(format!("sysid-{id}"))
        );
        assert_eq!(*p.delivery_mode(), Some(2));
        assert_eq!(
            p.content_type().as_ref().map(|s| s.to_string()),
            Some("text/plain".into())
        );
        assert_eq!(
            p.reply_to().as_ref().map(|s| s.to_string()),
            Some("replies".into())
        );
        assert_eq!(
            p.correlation_id().as_ref().map(|s| s.to_string()),
            Some(format!("corr-{id}"))
        );
        assert_eq!(*p.timestamp(), Some(1_700_000_000 + id as u64));
        assert_eq!(*header(d, "x-seq"), AMQPValue::LongLongInt(id));
        assert_eq!(*header(d, "x-producer-pid"), AMQPValue::LongLongInt(4242));
        assert_eq!(
            *header(d, "tag"),
            AMQPValue::LongString(format!("t{id}").into())
        );
        match header(d, "nested") {
            AMQPValue::FieldTable(t) => {
                assert_eq!(t.inner()["ok"], AMQPValue::Boolean(true));
                assert_eq!(t.inner()["ratio"], AMQPValue::Double(0.5));
                match &t.inner()["list"] {
                    AMQPValue::FieldArray(a) => assert_eq!(a.as_slice().len(), 3),
                    other => panic!("list: {other:?}"),
                }
            }
            other => panic!("nested: {other:?}"),
        }
    }
}

#[test]
fn unroutable_message_is_rejected_while_its_neighbours_are_confirmed() {
    let mut admin = Admin::new();
    let (exchange, queue) = admin.direct_route("unroutable");

    let (mut bridge, _) = Bridge::connected(config(B, vec![local_endpoint()], vec![]));

    // Every 10th message has no route; pipelined, so acks come back in groups.
    let msgs: Vec<_> = (1..=100)
        .map(|i| {
            let rk = if i % 10 == 5 { "nowhere" } else { "rk" };
            message(i, &exchange, rk)
        })
        .collect();
    bridge.publish(B, msgs, false);

    let mut confirmed = BTreeSet::new();
    let mut rejected = BTreeSet::new();
    bridge.wait_for(Duration::from_secs(30), |e| {
        match e {
            Event::Confirmed { ids, .. } => confirmed.extend(ids.iter().copied()),
            Event::Failed {
                id, failure, error, ..
            } => {
                assert_eq!(*failure, Failure::Rejected, "{id}: {error}");
                assert!(error.contains("312"), "{error}");
                assert!(error.contains("NO_ROUTE"), "{error}");
                rejected.insert(*id);
            }
            _ => {}
        }
        (confirmed.len() + rejected.len() == 100).then_some(())
    });
    let expected_rejected: BTreeSet<i64> = (1..=100).filter(|i| i % 10 == 5).collect();
    assert_eq!(rejected, expected_rejected);
    assert_eq!(confirmed.len(), 90);
    assert_eq!(admin.queue_len(&queue), 90);
}

/// A missing exchange is found before the first publish to it (a passive declare on a channel
/// of its own): the culprit is rejected with the broker's 404 at its first attempt, and the
/// good messages around it are confirmed once, on the same channel.
#[test]
fn missing_exchange_is_rejected_before_publishing_and_its_neighbours_go_out_once() {
    let mut admin = Admin::new();
    let (exchange, queue) = admin.direct_route("probe_good");
    let missing = unique("probe_missing_x");

    let (mut bridge, epoch) = Bridge::connected(config(B, vec![local_endpoint()], vec![]));
    let bad = 50;
    let msgs: Vec<_> = (1..=100)
        .map(|i| message(i, if i == bad { &missing } else { &exchange }, "rk"))
        .collect();
    bridge.publish(B, msgs, false);
    let (_, rejection) =
        confirmed_beside_one_failure(&mut bridge, epoch, bad, Failure::Rejected, 99);
    assert!(
        rejection.contains("404") && rejection.contains("no exchange"),
        "{rejection}"
    );
    assert_eq!(
        admin.queue_len(&queue),
        99,
        "each good message exactly once"
    );
}

/// An exchange deleted after its first publish on this connection is only found by the
/// channel error: every message is blamed only when it is its own fault.
#[test]
fn missing_exchange_blames_only_the_culprit_and_solo_resend_is_rejected_with_404() {
    let mut admin = Admin::new();
    let (exchange, queue) = admin.direct_route("good");
    let missing = unique("missing_x");
    admin.exchange(&missing, ExchangeKind::Direct);

    let (mut bridge, first_epoch) = Bridge::connected(config(B, vec![local_endpoint()], vec![]));
    // Published once while it exists (unroutable: no queue), so the connection knows it.
    bridge.publish(B, vec![message(1000, &missing, "rk")], false);
    bridge.wait_for(Duration::from_secs(10), |e| match e {
        Event::Failed { id: 1000, .. } => Some(()),
        _ => None,
    });
    admin.delete_exchange(&missing);

    let bad = 50;
    let msgs: Vec<_> = (1..=100)
        .map(|i| {
            if i == bad {
                message(i, &missing, "rk")
            } else {
                message(i, &exchange, "rk")
            }
        })
        .collect();
    let by_id: HashMap<i64, _> = msgs.iter().map(|m| (m.id, m.clone())).collect();
    bridge.publish(B, msgs, false);

    // Play the worker: resend what failed (the culprit alone), until every good message is
    // confirmed and the culprit is rejected on its own.
    let mut confirmed = BTreeSet::new();
    let mut bad_failures = Vec::new();
    let mut last_epoch = first_epoch;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut bad_rejection: Option<String> = None;
    while confirmed.len() < 99 || bad_rejection.is_none() {
        assert!(
            Instant::now() < deadline,
            "confirmed {} of 99, bad failures {bad_failures:?}",
            confirmed.len()
        );
        for e in bridge.poll(Duration::from_millis(200)) {
            match &e {
                Event::Connected { epoch, .. } => {
                    assert!(*epoch > last_epoch);
                    last_epoch = *epoch;
                }
                Event::Confirmed { ids, .. } => {
                    assert!(!ids.contains(&bad), "the culprit was confirmed");
                    confirmed.extend(ids.iter().copied());
                }
                Event::Failed {
                    id, failure, error, ..
                } => {
                    if *id == bad {
                        bad_failures.push((*failure, error.clone()));
                        match failure {
                            Failure::Rejected => {
                                assert!(error.contains("404"), "{error}");
                                bad_rejection = Some(error.clone());
                            }
                            Failure::Ambiguous | Failure::Transient | Failure::Nacked => {
                                bridge.publish(B, vec![by_id[id].clone()], true)
                            }
                            Failure::Unsendable => panic!("a missing exchange is not unsendable"),
                        }
                    } else {
                        assert_ne!(*failure, Failure::Rejected, "{id}: {error}");
                        bridge.publish(B, vec![by_id[id].clone()], false);
                    }
                }
                _ => {}
            }
            bridge.seen.push(e);
        }
    }
    // The channel error cost a channel, not the connection: a new epoch came up.
    assert!(last_epoch > first_epoch);
    assert!(bad_rejection.unwrap().contains("no exchange"));
    // At least once: a good message unconfirmed when the channel died may have been routed
    // before it, and its resend is then a duplicate (same message_id).
    let n = admin.queue_len(&queue) as usize;
    assert!(n >= 99, "{n} messages in the queue");
    let got: BTreeSet<String> = admin
        .consume(&queue, n, Duration::from_secs(10))
        .iter()
        .map(|d| d.properties.message_id().as_ref().unwrap().to_string())
        .collect();
    let want: BTreeSet<String> = (1..=100)
        .filter(|i| *i != bad)
        .map(|i| format!("sysid-{i}"))
        .collect();
    assert_eq!(got, want);
}

#[test]
fn unreachable_broker_reports_disconnected_without_password_and_fails_publishes_transient() {
    let password = "pw-S3cr3t-%/@-xyz";
    let mut bridge = Bridge::new();
    let ep = Endpoint {
        host: "127.0.0.1".into(),
        port: 1,
        vhost: "/".into(),
        username: "someone".into(),
        password: password.into(),
        tls: None,
    };
    bridge.send(Command::Configure(vec![config(B, vec![ep], vec![])]));
    let error = bridge.wait_for(Duration::from_secs(20), |e| match e {
        Event::Disconnected { broker_id, error } if *broker_id == B => Some(error.clone()),
        _ => None,
    });
    assert!(!error.contains(password), "{error}");
    assert!(!error.contains("S3cr3t"), "{error}");
    assert!(error.contains("127.0.0.1:1"), "{error}");

    bridge.publish(B, vec![message(7, "x", "rk"), message(8, "x", "rk")], false);
    let mut failed = BTreeSet::new();
    bridge.wait_for(Duration::from_secs(10), |e| {
        if let Event::Failed {
            id, failure, error, ..
        } = e
        {
            assert_eq!(*failure, Failure::Transient);
            assert!(!error.contains("S3cr3t"));
            failed.insert(*id);
        }
        (failed.len() == 2).then_some(())
    });

    // Further failed rounds do not repeat the Disconnected event (no log storm), and nothing
    // the thread said contains the password.
    let _ = bridge.poll(Duration::from_millis(500));
    assert_one_disconnected(&bridge);
    for e in &bridge.seen {
        assert!(!format!("{e:?}").contains("S3cr3t"), "{e:?}");
    }
}

#[test]
fn wrong_password_reports_disconnected_without_password() {
    let password = "not-the-Guest-Password-91";
    let mut bridge = Bridge::new();
    let mut ep = local_endpoint();
    ep.password = password.into();
    bridge.send(Command::Configure(vec![config(B, vec![ep], vec![])]));
    let error = bridge.wait_for(Duration::from_secs(20), |e| match e {
        Event::Disconnected { error, .. } => Some(error.clone()),
        Event::Connected { .. } => panic!("connected with a wrong password"),
        _ => None,
    });
    assert!(!error.contains("Guest-Password"), "{error}");
}

#[test]
fn failover_uses_the_next_host() {
    let mut bridge = Bridge::new();
    let mut dead = local_endpoint();
    dead.port = 1;
    bridge.send(Command::Configure(vec![config(
        B,
        vec![dead, local_endpoint()],
        vec![],
    )]));
    let host = bridge.wait_for(Duration::from_secs(20), |e| match e {
        Event::Connected { host, .. } => Some(host.clone()),
        _ => None,
    });
    assert!(host.contains(":5672"), "{host}");
}

#[test]
fn reconnect_command_gives_a_new_connected_with_a_larger_epoch() {
    let (mut bridge, first) = Bridge::connected(config(B, vec![local_endpoint()], vec![]));
    bridge.send(Command::Reconnect { broker_id: B });
    let second = bridge.wait_connected(B, first);
    assert!(second > first);
    assert_one_disconnected(&bridge);
}

#[test]
fn removed_broker_fails_publishes_transient() {
    let (mut bridge, _) = Bridge::connected(config(B, vec![local_endpoint()], vec![]));
    bridge.send(Command::Configure(vec![]));
    bridge.publish(B, vec![message(1, "x", "rk")], false);
    let failure = bridge.wait_for(Duration::from_secs(10), |e| match e {
        Event::Failed { id: 1, failure, .. } => Some(*failure),
        _ => None,
    });
    assert_eq!(failure, Failure::Transient);
}

#[test]
fn declaration_failure_is_a_warning_and_other_exchanges_are_declared() {
    let mut admin = Admin::new();
    let missing = unique("passive_missing_x");
    let created = unique("declared_x");
    let mut bridge = Bridge::new();
    let decls = vec![
        exchange_decl(&missing, "direct", true),
        exchange_decl(&created, "fanout", false),
    ];
    bridge.send(Command::Configure(vec![config(
        B,
        vec![local_endpoint()],
        decls,
    )]));
    bridge.wait_connected(B, 0);
    assert!(bridge.seen.iter().any(|e| matches!(
        e,
        Event::Log { message, .. } if message.contains(&missing) && message.contains("404")
    )));
    // Declared, so deletable; register it for cleanup by redeclaring it.
    admin.exchange(&created, ExchangeKind::Fanout);
    // And publishing to it works on the publishing channel (unroutable: no queue bound).
    bridge.publish(B, vec![message(1, &created, "")], false);
    let failure = bridge.wait_for(Duration::from_secs(10), |e| match e {
        Event::Failed {
            id: 1,
            failure,
            error,
            ..
        } => Some((*failure, error.clone())),
        Event::Confirmed { ids, .. } if ids.contains(&1) => panic!("unroutable confirmed"),
        _ => None,
    });
    assert_eq!(failure.0, Failure::Rejected, "{}", failure.1);
}

/// Closes this process's connection of `broker_id` with rabbitmqctl (only ours: matched by the
/// connection name). None when rabbitmqctl cannot be used here.
fn force_close_our_connection(broker_id: i32) -> Option<()> {
    let marker = format!(
        "amqp_outbox broker {broker_id} (pid {})",
        std::process::id()
    );
    let out = std::process::Command::new("rabbitmqctl")
        .args(["-q", "list_connections", "pid", "client_properties"])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || !text.contains(&marker) {
        eprintln!(
            "rabbitmqctl list_connections: {}\n{text}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        return None;
    }
    let pid = text
        .lines()
        .find(|l| l.contains(&marker))?
        .split('\t')
        .next()?
        .to_string();
    let status = std::process::Command::new("rabbitmqctl")
        .args(["-q", "close_connection", &pid, "test closes it"])
        .status()
        .ok()?;
    status.success().then_some(())
}

fn rabbitmqctl_usable() -> bool {
    std::process::Command::new("rabbitmqctl")
        .args(["-q", "status"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

#[test]
fn connection_loss_fails_in_flight_transient_and_reconnects_with_a_new_epoch() {
    if !rabbitmqctl_usable() {
        eprintln!("rabbitmqctl is not usable here: skipped");
        return;
    }
    let broker_id = 1_000_000 + (std::process::id() % 100_000) as i32;
    let mut admin = Admin::new();
    let (exchange, _queue) = admin.direct_route("loss");

    let mut bridge = Bridge::new();
    bridge.send(Command::Configure(vec![config(
        broker_id,
        vec![local_endpoint()],
        vec![],
    )]));
    let first = bridge.wait_connected(broker_id, 0);

    let closer = std::thread::spawn(move || force_close_our_connection(broker_id));
    // Keep publishing until the connection is closed under us, so some are in flight (or sent
    // after the close, before the broker task noticed): rabbitmqctl takes from one to several
    // seconds, more than a fixed number of messages lasts on a quick machine. A batch of 50 at a
    // time, waiting for events between, left nothing in flight at the close in one CI run
    // (14,100 confirmed, 0 failures): the publisher is kept IN_FLIGHT ahead of the confirms.
    const IN_FLIGHT: usize = 1_000;
    let mut next_id = 1;
    let mut confirmed = BTreeSet::new();
    let mut to_resend = Vec::new();
    let mut connected = true;
    let mut disconnected_error = None;
    let mut epoch = first;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut closer = Some(closer);
    loop {
        assert!(Instant::now() < deadline, "{:#?}", bridge.seen);
        if closer.as_ref().is_some_and(|c| c.is_finished()) {
            let closed = closer.take().unwrap().join().unwrap();
            assert_eq!(closed, Some(()), "could not close the connection");
        }
        while disconnected_error.is_none()
            && next_id < 200_000
            && (next_id - 1) as usize - confirmed.len() < IN_FLIGHT
        {
            let msgs = (next_id..next_id + 50)
                .map(|i| message(i, &exchange, "rk"))
                .collect();
            bridge.publish(broker_id, msgs, false);
            next_id += 50;
        }
        if connected && !to_resend.is_empty() {
            let msgs = to_resend
                .drain(..)
                .map(|i| message(i, &exchange, "rk"))
                .collect();
            bridge.publish(broker_id, msgs, false);
        }
        for e in bridge.poll(Duration::from_millis(20)) {
            match &e {
                Event::Disconnected { error, .. } => {
                    connected = false;
                    disconnected_error = Some(error.clone());
                }
                Event::Connected { epoch: ep, .. } => {
                    assert!(*ep > epoch);
                    epoch = *ep;
                    connected = true;
                }
                Event::Confirmed { ids, .. } => confirmed.extend(ids.iter().copied()),
                Event::Failed {
                    id, failure, error, ..
                } => {
                    assert_eq!(*failure, Failure::Transient, "{id}: {error}");
                    to_resend.push(*id);
                }
                _ => {}
            }
            bridge.seen.push(e);
        }
        if disconnected_error.is_some()
            && epoch > first
            && connected
            && to_resend.is_empty()
            && confirmed.len() as i64 == next_id - 1
        {
            break;
        }
    }
    let error = disconnected_error.unwrap();
    eprintln!(
        "disconnected: {error}; {} confirmed, {} failures on the way",
        confirmed.len(),
        bridge
            .seen
            .iter()
            .filter(|e| matches!(e, Event::Failed { .. }))
            .count()
    );
    assert!(
        error.contains("320") || error.contains("CONNECTION_FORCED"),
        "{error}"
    );
    assert!(
        bridge
            .seen
            .iter()
            .any(|e| matches!(e, Event::Failed { .. })),
        "nothing was in flight when the connection closed; the test proved little"
    );
}

/// A message whose properties cannot fit in one frame (a 200 KB header) would make RabbitMQ
/// close the whole connection (501 FRAME_ERROR) on every try, holding back everything behind
/// it. It is refused before it is written, as unsendable, and its neighbours go out on the
/// same connection.
#[test]
fn a_message_too_large_for_a_frame_is_unsendable_and_the_connection_stays() {
    let mut admin = Admin::new();
    let (exchange, _queue) = admin.direct_route("frame");

    let (mut bridge, epoch) = Bridge::connected(config(B, vec![local_endpoint()], vec![]));
    let mut msgs: Vec<_> = (1..=5).map(|i| message(i, &exchange, "rk")).collect();
    msgs[2]
        .headers
        .insert("big".into(), serde_json::Value::String("x".repeat(200_000)));
    bridge.publish(B, msgs, false);

    let (confirmed, error) =
        confirmed_beside_one_failure(&mut bridge, epoch, 3, Failure::Unsendable, 4);
    assert!(error.contains("frame size"), "{error}");
    assert_eq!(confirmed, [1, 2, 4, 5].into());
}
