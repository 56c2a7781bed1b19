//! Helpers for the integration tests: a bridge that collects events the way the worker does
//! (waiting on the wake fd), and an admin connection that declares and deletes test objects.
//! They run against the shared RabbitMQ at 127.0.0.1:5672 and never reconfigure it.

#![allow(dead_code)]

pub mod node;

use amqp_outbox_broker::{
    AckQueueConfig, BrokerConfig, BrokerHandle, Command, Endpoint, Event, ExchangeDecl,
    OutboundMessage, ProofMode,
};
use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
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
        },
        connect_timeout: Duration::from_secs(5),
        heartbeat_secs: 10,
        confirm_timeout: Duration::from_secs(30),
        reconnect_min: Duration::from_millis(100),
        reconnect_max: Duration::from_secs(1),
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

/// An independent lapin connection for setting up and checking; deletes what it declared.
pub struct Admin {
    pub rt: tokio::runtime::Runtime,
    conn: Connection,
    pub ch: Channel,
    exchanges: Vec<String>,
    queues: Vec<String>,
}

impl Admin {
    pub fn new() -> Self {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let (conn, ch) = rt.block_on(async {
            let conn = Connection::connect(AMQP_URL, ConnectionProperties::default())
                .await
                .expect("admin connection");
            let ch = conn.create_channel().await.unwrap();
            (conn, ch)
        });
        Admin {
            rt,
            conn,
            ch,
            exchanges: vec![],
            queues: vec![],
        }
    }

    pub fn exchange(&mut self, name: &str, kind: ExchangeKind) {
        self.rt
            .block_on(self.ch.exchange_declare(
                name.into(),
                kind,
                ExchangeDeclareOptions::default(),
                FieldTable::default(),
            ))
            .unwrap();
        self.exchanges.push(name.to_string());
    }

    /// Deletes an exchange now.
    pub fn delete_exchange(&mut self, name: &str) {
        self.rt
            .block_on(
                self.ch
                    .exchange_delete(name.into(), ExchangeDeleteOptions::default()),
            )
            .unwrap();
        self.exchanges.retain(|e| e != name);
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
        self.rt.block_on(async {
            self.ch
                .queue_declare(
                    name.into(),
                    QueueDeclareOptions::default(),
                    FieldTable::default(),
                )
                .await
                .unwrap();
            self.ch
                .queue_bind(
                    name.into(),
                    exchange.into(),
                    key.into(),
                    QueueBindOptions::default(),
                    arguments,
                )
                .await
                .unwrap();
        });
        self.queues.push(name.to_string());
    }

    /// Publishes a raw message to `queue` through the default exchange (with confirms off).
    pub fn publish_raw(&self, queue: &str, body: &[u8]) {
        self.rt
            .block_on(self.ch.basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                body,
                lapin::BasicProperties::default(),
            ))
            .unwrap();
    }

    /// Whether `queue` exists (a passive declare on a throwaway channel: a 404 closes it).
    pub fn queue_exists(&self, queue: &str) -> bool {
        self.rt.block_on(async {
            let ch = self.conn.create_channel().await.unwrap();
            let ok = ch
                .queue_declare(
                    queue.into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .is_ok();
            if ok {
                let _ = ch.close(200, "ok".into()).await;
            }
            ok
        })
    }

    /// Declares `queue` durable with `arguments` on a throwaway channel; the broker's error text
    /// when it refuses (e.g. 406 for inequivalent arguments).
    pub fn try_declare_durable(&self, queue: &str, arguments: FieldTable) -> Result<(), String> {
        self.rt.block_on(async {
            let ch = self.conn.create_channel().await.unwrap();
            let res = ch
                .queue_declare(
                    queue.into(),
                    QueueDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    arguments,
                )
                .await;
            match res {
                Ok(_) => {
                    let _ = ch.close(200, "ok".into()).await;
                    Ok(())
                }
                Err(e) => Err(e.to_string()),
            }
        })
    }

    /// Consumes `n` messages from `queue` (fails after `timeout`).
    pub fn consume(&self, queue: &str, n: usize, timeout: Duration) -> Vec<Delivery> {
        self.rt.block_on(async {
            let mut consumer = self
                .ch
                .basic_consume(
                    queue.into(),
                    "".into(),
                    BasicConsumeOptions {
                        no_ack: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .unwrap();
            let mut out = Vec::with_capacity(n);
            let deadline = tokio::time::Instant::now() + timeout;
            while out.len() < n {
                match tokio::time::timeout_at(deadline, consumer.next()).await {
                    Ok(Some(Ok(d))) => out.push(d),
                    other => panic!("consumed {} of {n}: {other:?}", out.len()),
                }
            }
            out
        })
    }

    pub fn queue_len(&self, queue: &str) -> u32 {
        self.rt
            .block_on(self.ch.queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            ))
            .unwrap()
            .message_count()
    }
}

impl Drop for Admin {
    fn drop(&mut self) {
        let queues = std::mem::take(&mut self.queues);
        let exchanges = std::mem::take(&mut self.exchanges);
        let _ = self.rt.block_on(async {
            // A fresh channel: the test may have broken the admin one.
            let ch = self.conn.create_channel().await?;
            for q in queues {
                let _ = ch
                    .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                    .await;
            }
            for e in exchanges {
                let _ = ch
                    .exchange_delete(e.as_str().into(), ExchangeDeleteOptions::default())
                    .await;
            }
            self.conn.close(200, "bye".into()).await
        });
    }
}
