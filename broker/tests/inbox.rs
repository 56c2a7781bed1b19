//! The inbox (subscriptions) against the shared RabbitMQ at 127.0.0.1:5672: consuming with
//! manual acknowledgements, epochs and redelivery, a missing queue, removal, prefetch and the
//! queue depth. Every queue is uniquely named and deleted afterwards.

mod common;

use amqp_outbox_broker::inbox::{
    self, Delivery, InboxCommand, InboxEvent, InboxHandle, SubscriptionConfig,
};
use common::*;
use lapin::types::{AMQPValue, ByteArray, DecimalValue, FieldArray, FieldTable, LongString};
use lapin::BasicProperties;
use serde_json::json;
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(20);

/// The subscription worker's side: sends commands, waits on the wake fd, keeps every event.
struct Inbox {
    handle: Option<InboxHandle>,
    seen: Vec<InboxEvent>,
    /// Deliveries seen and not yet taken by [`Inbox::deliveries`].
    pending: Vec<Delivery>,
}

impl Inbox {
    fn new() -> Self {
        Inbox {
            handle: Some(inbox::spawn().expect("spawn the inbox thread")),
            seen: Vec::new(),
            pending: Vec::new(),
        }
    }

    fn send(&self, c: InboxCommand) {
        assert!(self.handle.as_ref().unwrap().send(c), "inbox thread gone");
    }

    fn configure(&self, subs: Vec<SubscriptionConfig>) {
        self.send(InboxCommand::Configure(subs));
    }

    fn ack(&self, sub: &str, epoch: u64, tags: Vec<u64>) {
        self.send(InboxCommand::Ack {
            subscription: sub.into(),
            epoch,
            delivery_tags: tags,
        });
    }

    /// Keeps an event, and its deliveries for [`Inbox::deliveries`].
    fn record(&mut self, e: InboxEvent) {
        if let InboxEvent::Deliveries(ds) = &e {
            self.pending.extend(ds.iter().cloned());
        }
        self.seen.push(e);
    }

    /// Waits (on the wake fd, at most `max`) and returns the new events.
    fn poll(&mut self, max: Duration) -> Vec<InboxEvent> {
        let handle = self.handle.as_ref().unwrap();
        let mut p = libc::pollfd {
            fd: handle.wake_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = max.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: `p` is one valid pollfd, and the count passed is 1.
        unsafe { libc::poll(&mut p, 1, ms) };
        let new = handle.drain_events();
        for e in &new {
            if let InboxEvent::Fatal(f) = e {
                panic!("fatal event: {f}");
            }
        }
        new
    }

    /// Feeds every new event to `f` until it returns Some, or panics after `timeout`.
    fn wait_for<T>(&mut self, timeout: Duration, mut f: impl FnMut(&InboxEvent) -> Option<T>) -> T {
        let deadline = Instant::now() + timeout;
        loop {
            let now = Instant::now();
            if now >= deadline {
                panic!("timed out; events so far: {:#?}", self.seen);
            }
            let new = self.poll((deadline - now).min(Duration::from_millis(200)));
            let mut found = None;
            for e in new {
                if found.is_none() {
                    found = f(&e);
                }
                self.record(e);
            }
            if let Some(v) = found {
                return v;
            }
        }
    }

    /// The epoch of the next Connected event of `sub` above `after`.
    fn connected(&mut self, sub: &str, after: u64) -> u64 {
        self.wait_for(WAIT, |e| match e {
            InboxEvent::Connected {
                subscription,
                epoch,
                ..
            } if subscription == sub && *epoch > after => Some(*epoch),
            _ => None,
        })
    }

    /// The error of the next Disconnected event of `sub`.
    fn disconnected(&mut self, sub: &str) -> String {
        self.wait_for(WAIT, |e| match e {
            InboxEvent::Disconnected {
                subscription,
                error,
            } if subscription == sub => Some(error.clone()),
            _ => None,
        })
    }

    /// Takes the pending deliveries of `sub`.
    fn take(&mut self, sub: &str) -> Vec<Delivery> {
        let (mine, others) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|d| d.subscription == sub);
        self.pending = others;
        mine
    }

    /// Collects deliveries of `sub` until there are `n`; panics on more.
    fn deliveries(&mut self, sub: &str, n: usize) -> Vec<Delivery> {
        let mut got = self.take(sub);
        let deadline = Instant::now() + WAIT;
        while got.len() < n {
            assert!(
                Instant::now() < deadline,
                "got {} of {n}: {got:#?}",
                got.len()
            );
            for e in self.poll(Duration::from_millis(200)) {
                self.record(e);
            }
            got.extend(self.take(sub));
        }
        assert_eq!(got.len(), n, "more deliveries than expected: {got:#?}");
        got
    }

    /// No delivery of `sub` during `d`.
    fn no_deliveries(&mut self, sub: &str, d: Duration) {
        let deadline = Instant::now() + d;
        loop {
            let got = self.take(sub);
            assert!(got.is_empty(), "unexpected: {got:#?}");
            if Instant::now() >= deadline {
                return;
            }
            for e in self.poll(Duration::from_millis(100)) {
                self.record(e);
            }
        }
    }

    fn disconnections(&self, sub: &str) -> Vec<&str> {
        self.seen
            .iter()
            .filter_map(|e| match e {
                InboxEvent::Disconnected {
                    subscription,
                    error,
                } if subscription == sub => Some(error.as_str()),
                _ => None,
            })
            .collect()
    }
}

impl Drop for Inbox {
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            h.shutdown(Duration::from_secs(5));
        }
    }
}

fn sub(name: &str, queue: &str, prefetch: u16) -> SubscriptionConfig {
    SubscriptionConfig {
        subscription: name.into(),
        broker: config(1, vec![local_endpoint()], vec![]),
        queue: queue.into(),
        prefetch,
    }
}

fn tags(ds: &[Delivery]) -> Vec<u64> {
    ds.iter().map(|d| d.delivery_tag).collect()
}

/// Waits until `queue` has no consumer and `ready` messages ready (unacknowledged ones return
/// asynchronously once their channel is gone).
fn wait_ready(admin: &Admin, queue: &str, ready: u32) {
    let deadline = Instant::now() + WAIT;
    loop {
        let c = admin.queue_counts(queue);
        if c.consumers == 0 && c.messages == ready {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{queue}: {c:?}, expected {ready} ready"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Shuts the inbox down (its connections closed) and returns the ready count of `queue` once
/// unacknowledged messages would have returned.
fn ready_after_shutdown(inbox: Inbox, admin: &Admin, queue: &str) -> u32 {
    drop(inbox);
    std::thread::sleep(Duration::from_millis(300));
    let c = admin.queue_counts(queue);
    assert_eq!(c.consumers, 0, "{queue}: {c:?}");
    c.messages
}

fn publish_n(admin: &Admin, queue: &str, n: usize) {
    for i in 0..n {
        let props = BasicProperties::default().with_message_id(format!("m{i}").into());
        admin.publish("", queue, format!("b{i}").as_bytes(), props);
    }
}

#[test]
fn deliveries_carry_every_field_and_acks_empty_the_queue() {
    let mut admin = Admin::new();
    let (exchange, queue) = admin.direct_route("inbox_fields");
    let n = 5;
    for i in 0..n {
        let mut headers = FieldTable::default();
        headers.insert("s".into(), AMQPValue::LongString(LongString::from("text")));
        headers.insert("i".into(), AMQPValue::LongInt(-7));
        headers.insert("seq".into(), AMQPValue::LongLongInt(i as i64));
        headers.insert("f".into(), AMQPValue::Double(0.5));
        headers.insert("b".into(), AMQPValue::Boolean(true));
        headers.insert("v".into(), AMQPValue::Void);
        headers.insert("ts".into(), AMQPValue::Timestamp(1_700_000_000));
        headers.insert(
            "d".into(),
            AMQPValue::DecimalValue(DecimalValue {
                scale: 2,
                value: 314,
            }),
        );
        headers.insert(
            "raw".into(),
            AMQPValue::ByteArray(ByteArray::from(vec![0u8, 255])),
        );
        let mut nested = FieldTable::default();
        nested.insert("ok".into(), AMQPValue::Boolean(false));
        headers.insert(
            "list".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![
                AMQPValue::ShortInt(1),
                AMQPValue::FieldTable(nested),
            ])),
        );
        let props = BasicProperties::default()
            .with_message_id(format!("m{i}").into())
            .with_content_type("application/json".into())
            .with_correlation_id(format!("c{i}").into())
            .with_reply_to("replies".into())
            .with_timestamp(1_700_000_000 + i as u64)
            .with_headers(headers);
        admin.publish(&exchange, "rk", format!("{{\"n\":{i}}}").as_bytes(), props);
    }

    let mut inbox = Inbox::new();
    inbox.configure(vec![sub("fields", &queue, 100)]);
    let epoch = inbox.connected("fields", 0);
    assert_eq!(epoch, 1, "a subscription's epochs start at 1");
    let got = inbox.deliveries("fields", n);
    for (i, d) in got.iter().enumerate() {
        assert_eq!(d.subscription, "fields");
        assert_eq!(d.epoch, epoch);
        assert_eq!(d.delivery_tag, i as u64 + 1);
        assert_eq!(d.exchange, exchange);
        assert_eq!(d.routing_key, "rk");
        assert!(!d.redelivered);
        assert_eq!(d.body, format!("{{\"n\":{i}}}").into_bytes());
        assert_eq!(d.message_id.as_deref(), Some(format!("m{i}").as_str()));
        assert_eq!(d.content_type.as_deref(), Some("application/json"));
        assert_eq!(d.correlation_id.as_deref(), Some(format!("c{i}").as_str()));
        assert_eq!(d.reply_to.as_deref(), Some("replies"));
        assert_eq!(d.timestamp, Some(1_700_000_000 + i as u64));
        assert_eq!(
            serde_json::Value::Object(d.headers.clone()),
            json!({
                "s": "text", "i": -7, "seq": i, "f": 0.5, "b": true, "v": null,
                "ts": 1_700_000_000u64, "d": "3.14", "raw": {"$bytes": "AP8="},
                "list": [1, {"ok": false}],
            })
        );
    }
    inbox.ack("fields", epoch, tags(&got));
    inbox.no_deliveries("fields", Duration::from_millis(300));
    assert!(
        inbox.disconnections("fields").is_empty(),
        "{:#?}",
        inbox.seen
    );
    // Closed, the connection would return what was not acknowledged.
    assert_eq!(ready_after_shutdown(inbox, &admin, &queue), 0);
}

#[test]
fn unacked_deliveries_come_back_after_reconnect_and_old_epochs_are_ignored() {
    let mut admin = Admin::new();
    let queue = unique("inbox_redeliver");
    admin.plain_queue(&queue);
    publish_n(&admin, &queue, 3);

    let mut inbox = Inbox::new();
    inbox.configure(vec![sub("redo", &queue, 10)]);
    let e1 = inbox.connected("redo", 0);
    let first = inbox.deliveries("redo", 3);
    assert!(first.iter().all(|d| !d.redelivered && d.epoch == e1));

    inbox.send(InboxCommand::Reconnect {
        subscription: "redo".into(),
    });
    let why = inbox.disconnected("redo");
    assert!(why.contains("reconnect requested"), "{why}");
    let e2 = inbox.connected("redo", e1);
    assert_eq!(e2, e1 + 1);
    let again = inbox.deliveries("redo", 3);
    assert!(
        again.iter().all(|d| d.redelivered && d.epoch == e2),
        "{again:#?}"
    );
    let ids = |ds: &[Delivery]| {
        let mut v: Vec<_> = ds.iter().map(|d| d.message_id.clone()).collect();
        v.sort();
        v
    };
    assert_eq!(ids(&first), ids(&again));

    // The old epoch's tags (the same numbers as the new ones) are dropped, not sent: the
    // channel stays up and the messages stay unacknowledged.
    inbox.ack("redo", e1, tags(&first));
    publish_n(&admin, &queue, 1);
    let more = inbox.deliveries("redo", 1);
    assert_eq!(more[0].epoch, e2);
    assert_eq!(inbox.disconnections("redo").len(), 1, "{:#?}", inbox.seen);

    // Acknowledged on the current epoch (a repeated tag is ignored), they are gone.
    let mut all = tags(&again);
    all.extend(tags(&more));
    all.push(all[0]);
    inbox.ack("redo", e2, all);
    inbox.no_deliveries("redo", Duration::from_millis(300));
    assert_eq!(inbox.disconnections("redo").len(), 1, "{:#?}", inbox.seen);
    assert_eq!(ready_after_shutdown(inbox, &admin, &queue), 0);
}

#[test]
fn a_missing_queue_is_reported_and_consumed_once_it_exists() {
    let mut admin = Admin::new();
    let queue = unique("inbox_missing");
    admin.cleanup_queue(&queue);

    let mut inbox = Inbox::new();
    inbox.configure(vec![sub("late", &queue, 10)]);
    let error = inbox.disconnected("late");
    assert!(
        error.contains("NOT_FOUND") && error.contains(&queue),
        "{error}"
    );
    assert!(!error.contains("guest:guest"), "{error}");

    admin.plain_queue(&queue);
    publish_n(&admin, &queue, 2);
    let epoch = inbox.connected("late", 0);
    let got = inbox.deliveries("late", 2);
    inbox.ack("late", epoch, tags(&got));
    // The same error was reported once, however many rounds failed.
    assert_eq!(inbox.disconnections("late").len(), 1, "{:#?}", inbox.seen);
}

#[test]
fn a_deleted_queue_disconnects_and_a_new_one_is_consumed() {
    let mut admin = Admin::new();
    let queue = unique("inbox_deleted");
    admin.plain_queue(&queue);
    let mut inbox = Inbox::new();
    inbox.configure(vec![sub("gone", &queue, 10)]);
    let e1 = inbox.connected("gone", 0);

    admin.delete_queue(&queue);
    let why = inbox.disconnected("gone");
    assert!(why.contains("cancelled"), "{why}");
    let why = inbox.disconnected("gone");
    assert!(why.contains("NOT_FOUND"), "{why}");

    admin.plain_queue(&queue);
    publish_n(&admin, &queue, 1);
    let e2 = inbox.connected("gone", e1);
    let got = inbox.deliveries("gone", 1);
    assert_eq!(got[0].epoch, e2);
    inbox.ack("gone", e2, tags(&got));
}

#[test]
fn a_removed_subscription_stops_and_returns_its_unacked_messages() {
    let mut admin = Admin::new();
    let keep_q = unique("inbox_keep");
    let drop_q = unique("inbox_drop");
    admin.plain_queue(&keep_q);
    admin.plain_queue(&drop_q);
    publish_n(&admin, &drop_q, 5);

    let mut inbox = Inbox::new();
    inbox.configure(vec![sub("keep", &keep_q, 10), sub("drop", &drop_q, 10)]);
    let got = inbox.deliveries("drop", 5);
    let drop_epoch = got[0].epoch;
    inbox.configure(vec![sub("keep", &keep_q, 10)]);
    wait_ready(&admin, &drop_q, 5);
    // Nothing more of it arrives, and acknowledgements of it are dropped.
    publish_n(&admin, &drop_q, 1);
    inbox.ack("drop", drop_epoch, tags(&got));
    inbox.no_deliveries("drop", Duration::from_millis(500));
    assert_eq!(admin.queue_counts(&drop_q).messages, 6);

    // The other subscription was not disturbed.
    publish_n(&admin, &keep_q, 1);
    let kept = inbox.deliveries("keep", 1);
    assert!(inbox.disconnections("keep").is_empty(), "{:#?}", inbox.seen);
    inbox.ack("keep", kept[0].epoch, tags(&kept));

    // Configured again, it goes on counting epochs (an acknowledgement meant for its old
    // channel can never hit the new one) and gets the returned messages again.
    inbox.configure(vec![sub("keep", &keep_q, 10), sub("drop", &drop_q, 10)]);
    let e2 = inbox.connected("drop", drop_epoch);
    assert_eq!(e2, drop_epoch + 1);
    let again = inbox.deliveries("drop", 6);
    assert_eq!(again.iter().filter(|d| d.redelivered).count(), 5);
    inbox.ack("drop", e2, tags(&again));
    assert_eq!(ready_after_shutdown(inbox, &admin, &drop_q), 0);
}

#[test]
fn prefetch_bounds_the_unacked_deliveries() {
    let mut admin = Admin::new();
    let queue = unique("inbox_prefetch");
    admin.plain_queue(&queue);
    publish_n(&admin, &queue, 10);

    let mut inbox = Inbox::new();
    inbox.configure(vec![sub("pf", &queue, 3)]);
    let epoch = inbox.connected("pf", 0);
    let first = inbox.deliveries("pf", 3);
    inbox.no_deliveries("pf", Duration::from_millis(700));
    // Two acknowledged (one multiple ack), two more come.
    inbox.ack(
        "pf",
        epoch,
        vec![first[0].delivery_tag, first[1].delivery_tag],
    );
    let next = inbox.deliveries("pf", 2);
    inbox.no_deliveries("pf", Duration::from_millis(500));
    // The oldest (first[2]) is still out: the acks of the newer ones are single acks.
    inbox.ack("pf", epoch, tags(&next));
    let last = inbox.deliveries("pf", 2);
    let mut rest = vec![first[2].delivery_tag];
    rest.extend(tags(&last));
    inbox.ack("pf", epoch, rest);
    let tail = inbox.deliveries("pf", 3);
    inbox.ack("pf", epoch, tags(&tail));
    inbox.no_deliveries("pf", Duration::from_millis(300));
    assert!(inbox.disconnections("pf").is_empty(), "{:#?}", inbox.seen);
    assert_eq!(ready_after_shutdown(inbox, &admin, &queue), 0);
}

#[test]
fn queue_depth_reports_the_ready_messages() {
    let mut admin = Admin::new();
    let queue = unique("inbox_depth");
    admin.plain_queue(&queue);
    publish_n(&admin, &queue, 5);

    let mut inbox = Inbox::new();
    inbox.configure(vec![sub("depth", &queue, 1)]);
    inbox.deliveries("depth", 1);
    // One delivered and unacknowledged, four ready, one consumer (ours).
    inbox.wait_for(WAIT, |e| match e {
        InboxEvent::QueueDepth {
            subscription,
            ready: 4,
            consumers: 1,
        } if subscription == "depth" => Some(()),
        _ => None,
    });
}

#[test]
fn a_changed_prefetch_reconnects() {
    let mut admin = Admin::new();
    let queue = unique("inbox_change");
    admin.plain_queue(&queue);
    publish_n(&admin, &queue, 4);

    let mut inbox = Inbox::new();
    inbox.configure(vec![sub("chg", &queue, 1)]);
    let e1 = inbox.connected("chg", 0);
    inbox.deliveries("chg", 1);
    inbox.configure(vec![sub("chg", &queue, 4)]);
    let e2 = inbox.connected("chg", e1);
    let got = inbox.deliveries("chg", 4);
    assert!(got.iter().all(|d| d.epoch == e2));
    inbox.ack("chg", e2, tags(&got));
}
