//! Helpers for the integration tests: a bridge that collects events the way the worker does
//! (waiting on the wake fd), and an admin connection that declares and deletes test objects.
//! They run against the shared RabbitMQ at 127.0.0.1:5672 and never reconfigure it.

#![allow(dead_code)]

pub mod node;

use amqp_outbox_broker::{
    AckQueueConfig, BrokerConfig, BrokerHandle, Command, Endpoint, Event, ExchangeDecl,
    OutboundMessage, ProofMode, RecordWait,
};
use amqp_outbox_testkit::amqp_admin::{AmqpAdmin, QueueCounts};
use lapin::message::Delivery;
use lapin::types::FieldTable;
use lapin::ExchangeKind;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// A name no other test (or run) uses.
pub fn unique(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!(
        "ao_test_{prefix}_{}_{}_{nanos}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

pub fn local_endpoint() -> Endpoint {
    Endpoint {
        host: "127.0.0.1".into(),
        port: 5672,
        vhost: "/".into(),
        username: "guest".into(),
        password: "guest".into(),
        tls: None,
    }
}

/// `Confirm` mode: the publisher confirm is the proof; no acknowledgement queue.
pub fn config(broker_id: i32, hosts: Vec<Endpoint>, exchanges: Vec<ExchangeDecl>) -> BrokerConfig {
    BrokerConfig {
        broker_id,
        hosts,
        randomize_hosts: false,
        exchanges,
        queues: vec![],
        bindings: vec![],
        proof: ProofMode::Confirm,
        ack_queue: AckQueueConfig {
            name: unique("unused_acks"),
            quorum: false,
            record_wait: RecordWait::default(),
        },
        connect_timeout: Duration::from_secs(5),
        heartbeat_secs: 10,
        confirm_timeout: Duration::from_secs(30),
        reconnect_min: Duration::from_millis(100),
        reconnect_max: Duration::from_secs(1),
    }
}

/// The worker's declaration of a transient exchange (neither durable nor auto-deleted), the
/// kind the tests declare; `passive` only checks that it exists.
pub fn exchange_decl(name: &str, kind: &str, passive: bool) -> ExchangeDecl {
    ExchangeDecl {
        name: name.to_string(),
        kind: kind.into(),
        passive,
        durable: false,
        auto_delete: false,
    }
}

pub fn message(id: i64, exchange: &str, routing_key: &str) -> OutboundMessage {
    let mut headers = serde_json::Map::new();
    headers.insert("x-producer-pid".into(), serde_json::json!(4242));
    headers.insert("x-seq".into(), serde_json::json!(id));
    headers.insert("tag".into(), serde_json::json!(format!("t{id}")));
    headers.insert(
        "nested".into(),
        serde_json::json!({ "ok": true, "ratio": 0.5, "list": [1, "two", null] }),
    );
    OutboundMessage {
        id,
        exchange: exchange.into(),
        routing_key: routing_key.into(),
        body: format!("body-{id}").into_bytes(),
        delivery_mode: 2,
        content_type: Some("text/plain".into()),
        reply_to: Some("replies".into()),
        correlation_id: Some(format!("corr-{id}")),
        message_id: format!("sysid-{id}"),
        timestamp: 1_700_000_000 + id as u64,
        headers,
        lose_in_transit: false,
    }
}

/// `AckQueue` mode with the acknowledgement queue `ack_queue` (declared by the broker side).
pub fn ack_config(
    broker_id: i32,
    hosts: Vec<Endpoint>,
    exchanges: Vec<ExchangeDecl>,
    ack_queue: &str,
    quorum: bool,
) -> BrokerConfig {
    let mut c = config(broker_id, hosts, exchanges);
    c.proof = ProofMode::AckQueue;
    c.ack_queue = AckQueueConfig {
        name: ack_queue.into(),
        quorum,
        record_wait: RecordWait::default(),
    };
    c
}

/// The worker's side: sends commands, waits on the wake fd, keeps every event seen.
pub struct Bridge {
    handle: Option<BrokerHandle>,
    pub seen: Vec<Event>,
}

impl Bridge {
    /// A bridge configured with `cfg` alone, once its publishing channel is up; with the
    /// channel's epoch.
    pub fn connected(cfg: BrokerConfig) -> (Bridge, u64) {
        let mut bridge = Bridge::new();
        let broker_id = cfg.broker_id;
        bridge.send(Command::Configure(vec![cfg]));
        let epoch = bridge.wait_connected(broker_id, 0);
        (bridge, epoch)
    }

    pub fn new() -> Self {
        Bridge {
            handle: Some(amqp_outbox_broker::spawn().expect("spawn")),
            seen: Vec::new(),
        }
    }

    pub fn send(&self, c: Command) {
        assert!(self.handle.as_ref().unwrap().send(c), "AMQP thread gone");
    }

    pub fn publish(&self, broker_id: i32, messages: Vec<OutboundMessage>, solo: bool) {
        self.send(Command::Publish {
            broker_id,
            messages,
            solo,
        });
    }

    /// Waits (on the wake fd, at most `max`) for events and returns the new ones.
    pub fn poll(&mut self, max: Duration) -> Vec<Event> {
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
            if let Event::Fatal(f) = e {
                panic!("fatal event: {f}");
            }
        }
        new
    }

    /// Feeds every new event to `f` until it returns Some, or panics after `timeout`.
    pub fn wait_for<T>(&mut self, timeout: Duration, mut f: impl FnMut(&Event) -> Option<T>) -> T {
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
                self.seen.push(e);
            }
            if let Some(v) = found {
                return v;
            }
        }
    }

    /// Waits for a Connected event of `broker_id` with an epoch above `after`; returns the epoch.
    pub fn wait_connected(&mut self, broker_id: i32, after: u64) -> u64 {
        self.wait_for(Duration::from_secs(20), |e| match e {
            Event::Connected {
                broker_id: b,
                epoch,
                ..
            } if *b == broker_id && *epoch > after => Some(*epoch),
            _ => None,
        })
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            h.shutdown(Duration::from_secs(5));
        }
    }
}

/// The testkit's admin client on the shared broker, with these tests' conventions: non-durable
/// objects, deleted when the Admin is dropped, and a panic where a test cannot go on.
pub struct Admin {
    amqp: AmqpAdmin,
    exchanges: Vec<String>,
    queues: Vec<String>,
}

impl Admin {
    pub fn new() -> Self {
        Admin {
            amqp: AmqpAdmin::connect(AMQP_URL).expect("admin connection"),
            exchanges: vec![],
            queues: vec![],
        }
    }

    pub fn exchange(&mut self, name: &str, kind: ExchangeKind) {
        self.amqp.declare_exchange(name, kind, false).unwrap();
        self.exchanges.push(name.to_string());
    }

    /// Deletes an exchange now.
    pub fn delete_exchange(&mut self, name: &str) {
        self.amqp.delete_exchange(name).unwrap();
        self.exchanges.retain(|e| e != name);
    }

    /// A uniquely named direct exchange `<prefix>_x…` and queue `<prefix>_q…`, bound with `rk`:
    /// (exchange, queue).
    pub fn direct_route(&mut self, prefix: &str) -> (String, String) {
        let exchange = unique(&format!("{prefix}_x"));
        let queue = unique(&format!("{prefix}_q"));
        self.exchange(&exchange, ExchangeKind::Direct);
        self.queue(&queue, &exchange, "rk");
        (exchange, queue)
    }

    /// A queue bound to `exchange` with `key`.
    pub fn queue(&mut self, name: &str, exchange: &str, key: &str) {
        self.queue_with_binding_args(name, exchange, key, FieldTable::default());
    }

    /// Deletes `queue` (made by someone else) when this Admin is dropped.
    pub fn cleanup_queue(&mut self, queue: &str) {
        self.queues.push(queue.to_string());
    }

    /// Deletes `exchange` (made by someone else) when this Admin is dropped.
    pub fn cleanup_exchange(&mut self, exchange: &str) {
        self.exchanges.push(exchange.to_string());
    }

    /// A queue bound to `exchange` with `key` and binding `arguments`.
    pub fn queue_with_binding_args(
        &mut self,
        name: &str,
        exchange: &str,
        key: &str,
        arguments: FieldTable,
    ) {
        self.amqp
            .declare_queue(name, false, FieldTable::default())
            .unwrap();
        self.amqp
            .bind_queue(name, exchange, key, arguments)
            .unwrap();
        self.queues.push(name.to_string());
    }

    /// Publishes a raw message (no properties) to `queue` through the default exchange.
    pub fn publish_raw(&self, queue: &str, body: &[u8]) {
        self.amqp
            .publish("", queue, body, lapin::BasicProperties::default())
            .unwrap();
    }

    /// A queue with no binding (reachable through the default exchange), deleted on drop.
    pub fn plain_queue(&mut self, name: &str) {
        self.amqp
            .declare_queue(name, false, FieldTable::default())
            .unwrap();
        self.queues.push(name.to_string());
    }

    /// Publishes one message with `properties`, confirmed.
    pub fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: lapin::BasicProperties,
    ) {
        self.amqp
            .publish(exchange, routing_key, body, properties)
            .unwrap();
    }

    /// Ready messages and consumers of `queue` (which must exist).
    pub fn queue_counts(&self, queue: &str) -> QueueCounts {
        self.amqp
            .queue_counts(queue)
            .unwrap()
            .unwrap_or_else(|| panic!("queue {queue} does not exist"))
    }

    /// Deletes `queue` now (it is still deleted again on drop, harmlessly).
    pub fn delete_queue(&self, queue: &str) {
        self.amqp.delete_queue(queue).unwrap();
    }

    pub fn queue_exists(&self, queue: &str) -> bool {
        self.amqp.queue_counts(queue).unwrap().is_some()
    }

    /// Declares `queue` durable with `arguments`; the broker's error text when it refuses
    /// (e.g. 406 for inequivalent arguments).
    pub fn try_declare_durable(&self, queue: &str, arguments: FieldTable) -> Result<(), String> {
        self.amqp.declare_queue(queue, true, arguments)
    }

    /// Consumes `n` messages from `queue` (fails after `timeout`).
    pub fn consume(&self, queue: &str, n: usize, timeout: Duration) -> Vec<Delivery> {
        self.amqp
            .consume(queue, n, timeout)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn queue_len(&self, queue: &str) -> u32 {
        self.amqp.queue_len(queue).unwrap()
    }
}

impl Drop for Admin {
    fn drop(&mut self) {
        self.amqp
            .delete_all(&self.queues, &self.exchanges, Duration::from_secs(10));
    }
}
