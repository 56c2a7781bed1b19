//! RabbitMQ helpers: uniquely named exchanges and queues, and a consumer that records every
//! delivery.
//!
//! The AMQP client (lapin) runs on one tokio runtime shared by the whole test process; the
//! helpers here are synchronous, so tests stay plain `#[test]` functions.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use amqp_outbox_testkit::amqp_admin::{self, runtime, AmqpAdmin};
use futures_lite::StreamExt;
use lapin::options::BasicAckOptions;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, ExchangeKind};

use crate::{eventually, unique_name};

pub use amqp_outbox_testkit::amqp_admin::QueueCounts;

/// Where a broker listens and how to log in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AmqpEndpoint {
    pub host: String,
    pub port: u16,
    pub vhost: String,
    pub username: String,
    pub password: String,
}

impl AmqpEndpoint {
    /// The shared broker: 127.0.0.1:5672 guest/guest, or `AMQP_OUTBOX_E2E_AMQP_PORT`.
    /// Tests never restart or reconfigure it.
    pub fn shared() -> AmqpEndpoint {
        let port = std::env::var("AMQP_OUTBOX_E2E_AMQP_PORT")
            .ok()
            .and_then(|p| p.parse().ok())
            .unwrap_or(5672);
        AmqpEndpoint::local(port)
    }

    /// 127.0.0.1:`port`, vhost `/`, guest/guest.
    pub fn local(port: u16) -> AmqpEndpoint {
        AmqpEndpoint {
            host: "127.0.0.1".to_string(),
            port,
            vhost: "/".to_string(),
            username: "guest".to_string(),
            password: "guest".to_string(),
        }
    }

    pub fn uri(&self) -> String {
        let vhost = if self.vhost == "/" {
            "%2f".to_string()
        } else {
            self.vhost.clone()
        };
        format!(
            "amqp://{}:{}@{}:{}/{vhost}?heartbeat=5&connection_timeout=5000",
            self.username, self.password, self.host, self.port
        )
    }
}

/// The testkit's admin client on one broker, with the e2e tests' conventions: uniquely named
/// durable objects that go away with their [`Route`], and panics where a test cannot go on.
pub struct Rabbit {
    endpoint: AmqpEndpoint,
    admin: AmqpAdmin,
}

impl Rabbit {
    /// The shared broker (127.0.0.1:5672).
    pub fn shared() -> Rabbit {
        Rabbit::connect(AmqpEndpoint::shared()).unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn connect(endpoint: AmqpEndpoint) -> Result<Rabbit, String> {
        let admin = AmqpAdmin::connect(&endpoint.uri())?;
        Ok(Rabbit { endpoint, admin })
    }

    pub fn endpoint(&self) -> &AmqpEndpoint {
        &self.endpoint
    }

    /// A durable direct exchange and a durable queue bound to it with the routing key `rk`,
    /// both uniquely named after `prefix`. Deleted when the [`Route`] is dropped.
    pub fn declare_route(&self, prefix: &str) -> Route {
        self.declare_route_kind(prefix, ExchangeKind::Direct, "rk")
    }

    pub fn declare_route_kind(&self, prefix: &str, kind: ExchangeKind, binding_key: &str) -> Route {
        let base = unique_name(prefix);
        let route = Route {
            endpoint: self.endpoint.clone(),
            exchange: format!("{base}.x"),
            queue: format!("{base}.q"),
            routing_key: binding_key.to_string(),
            delete_on_drop: true,
        };
        let r = self
            .admin
            .declare_exchange(&route.exchange, kind, true)
            .and_then(|()| {
                self.admin
                    .declare_queue(&route.queue, true, FieldTable::default())
            })
            .and_then(|()| {
                self.admin.bind_queue(
                    &route.queue,
                    &route.exchange,
                    binding_key,
                    FieldTable::default(),
                )
            });
        if let Err(e) = r {
            panic!("cannot declare the test route on {:?}: {e}", self.endpoint);
        }
        route
    }

    /// Publishes one message directly (not through the outbox), waiting for the broker's
    /// confirm. For testing the harness and for foreign messages in a queue.
    pub fn publish(&self, exchange: &str, routing_key: &str, body: &[u8]) -> Result<(), String> {
        let properties = BasicProperties::default()
            .with_message_id(format!("direct-{}", String::from_utf8_lossy(body)).into())
            .with_delivery_mode(2);
        self.admin.publish(exchange, routing_key, body, properties)
    }

    /// A consumer on `route`'s queue that records every delivery (see [`Collector`]).
    pub fn consume(&self, route: &Route) -> Collector {
        Collector::start(self.endpoint.clone(), route.queue.clone())
    }

    /// [`Rabbit::consume`], once the consumer is connected (within 10 s): a message published
    /// after this returns is not missed.
    pub fn consume_connected(&self, route: &Route) -> Collector {
        let collector = self.consume(route);
        collector.wait_connected(Duration::from_secs(10));
        collector
    }

    /// A uniquely named durable queue and no exchange (the [`Route`] names the default
    /// exchange `""` and routes by the queue's name). Deleted when the route is dropped.
    pub fn declare_queue(&self, prefix: &str) -> Route {
        let queue = format!("{}.q", unique_name(prefix));
        if let Err(e) = self
            .admin
            .declare_queue(&queue, true, FieldTable::default())
        {
            panic!("cannot declare a test queue on {:?}: {e}", self.endpoint);
        }
        Route {
            endpoint: self.endpoint.clone(),
            exchange: String::new(),
            routing_key: queue.clone(),
            queue,
            delete_on_drop: true,
        }
    }

    /// `Some(counts)` when the queue exists, `None` when the broker answers 404. `messages`
    /// counts ready messages only (not those delivered to a consumer and not yet acknowledged).
    pub fn queue_counts(&self, queue: &str) -> Result<Option<QueueCounts>, String> {
        self.admin.queue_counts(queue)
    }

    /// Binds an existing queue to an existing exchange with `binding_key`.
    pub fn bind_queue(&self, queue: &str, exchange: &str, binding_key: &str) {
        if let Err(e) = self.try_bind_queue(queue, exchange, binding_key) {
            panic!("{e}");
        }
    }

    /// As [`Rabbit::bind_queue`], for a broker that may not be ready for it yet.
    pub fn try_bind_queue(
        &self,
        queue: &str,
        exchange: &str,
        binding_key: &str,
    ) -> Result<(), String> {
        self.admin
            .bind_queue(queue, exchange, binding_key, FieldTable::default())
    }

    /// Deletes a queue (if it exists).
    pub fn delete_queue(&self, queue: &str) -> Result<(), String> {
        self.admin.delete_queue(queue)
    }
}

/// A uniquely named durable exchange and queue, bound with `routing_key`. Both are deleted
/// (best effort) on drop. An empty `exchange` is the default exchange (never deleted).
#[derive(Debug)]
pub struct Route {
    pub endpoint: AmqpEndpoint,
    pub exchange: String,
    pub queue: String,
    pub routing_key: String,
    /// Off for a broker that is about to be thrown away anyway.
    pub delete_on_drop: bool,
}

impl Drop for Route {
    fn drop(&mut self) {
        if !self.delete_on_drop {
            return;
        }
        // A connection of its own: the Rabbit that declared the route may be gone. The default
        // exchange (a queue-only route) cannot be deleted.
        let timeout = Duration::from_secs(5);
        if let Ok(admin) = AmqpAdmin::connect_within(&self.endpoint.uri(), timeout) {
            let exchanges: Vec<String> = Some(self.exchange.clone())
                .filter(|e| !e.is_empty())
                .into_iter()
                .collect();
            admin.delete_all(std::slice::from_ref(&self.queue), &exchanges, timeout);
        }
    }
}

/// One delivery as the consumer saw it.
#[derive(Clone, Debug)]
pub struct Received {
    pub body: Vec<u8>,
    pub exchange: String,
    pub routing_key: String,
    pub redelivered: bool,
    pub message_id: Option<String>,
    pub delivery_mode: Option<u8>,
    pub content_type: Option<String>,
    pub reply_to: Option<String>,
    pub correlation_id: Option<String>,
    pub timestamp: Option<u64>,
    /// The AMQP user_id property (RabbitMQ checks it against the publisher's user).
    pub user_id: Option<String>,
    /// The AMQP headers, converted to JSON (strings, numbers, booleans, arrays, objects).
    pub headers: serde_json::Map<String, serde_json::Value>,
    /// Which consumer connection of the collector received it (0, 1, … after reconnects).
    pub connection_no: u64,
    pub received_at: Instant,
}

impl Received {
    /// The body as UTF-8 (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn header(&self, name: &str) -> Option<&serde_json::Value> {
        self.headers.get(name)
    }
}

/// Converts an AMQP field value to JSON, for easy assertions.
pub fn amqp_to_json(value: &AMQPValue) -> serde_json::Value {
    use serde_json::Value;
    match value {
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::ShortShortInt(v) => Value::from(*v),
        AMQPValue::ShortShortUInt(v) => Value::from(*v),
        AMQPValue::ShortInt(v) => Value::from(*v),
        AMQPValue::ShortUInt(v) => Value::from(*v),
        AMQPValue::LongInt(v) => Value::from(*v),
        AMQPValue::LongUInt(v) => Value::from(*v),
        AMQPValue::LongLongInt(v) => Value::from(*v),
        AMQPValue::Float(v) => Value::from(*v),
        AMQPValue::Double(v) => Value::from(*v),
        AMQPValue::DecimalValue(d) => {
            Value::from(f64::from(d.value) / 10f64.powi(i32::from(d.scale)))
        }
        AMQPValue::ShortString(s) => Value::String(s.as_str().to_string()),
        AMQPValue::LongString(s) => Value::String(String::from_utf8_lossy(s.as_bytes()).into()),
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(amqp_to_json).collect()),
        AMQPValue::Timestamp(t) => Value::from(*t),
        AMQPValue::FieldTable(t) => Value::Object(table_to_json(t)),
        AMQPValue::ByteArray(b) => Value::String(String::from_utf8_lossy(b.as_slice()).into()),
        AMQPValue::Void => Value::Null,
    }
}

pub fn table_to_json(table: &FieldTable) -> serde_json::Map<String, serde_json::Value> {
    table
        .inner()
        .iter()
        .map(|(k, v)| (k.as_str().to_string(), amqp_to_json(v)))
        .collect()
}

#[derive(Default)]
struct CollectorState {
    deliveries: Vec<Received>,
    connections: u64,
    /// The AMQP port of the broker it consumes from now.
    connected_to: Option<u16>,
    last_error: Option<String>,
}

/// A consumer on one queue, on its own connection, recording every delivery in arrival order
/// (recorded first, then acknowledged). When its connection drops (a broker stopped or
/// restarted), it reconnects every 200 ms until dropped, to the next of its brokers (the nodes
/// of a cluster, like a real client of one); an unacknowledged delivery then comes again with
/// `redelivered` set, so it is recorded twice.
pub struct Collector {
    queue: String,
    state: Arc<Mutex<CollectorState>>,
    stop: Option<tokio::sync::watch::Sender<bool>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Collector {
    pub fn start(endpoint: AmqpEndpoint, queue: String) -> Collector {
        Self::start_failover(vec![endpoint], queue)
    }

    /// Consumes through the first of `endpoints` that answers, and the next one (round robin)
    /// whenever the connection is lost.
    pub fn start_failover(endpoints: Vec<AmqpEndpoint>, queue: String) -> Collector {
        assert!(!endpoints.is_empty(), "a collector needs a broker");
        let state = Arc::new(Mutex::new(CollectorState::default()));
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let task = runtime().spawn(collect(endpoints, queue.clone(), state.clone(), stop_rx));
        Collector {
            queue,
            state,
            stop: Some(stop_tx),
            task: Some(task),
        }
    }

    pub fn queue(&self) -> &str {
        &self.queue
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CollectorState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every delivery so far, in arrival order.
    pub fn deliveries(&self) -> Vec<Received> {
        self.lock().deliveries.clone()
    }

    pub fn len(&self) -> usize {
        self.lock().deliveries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bodies (UTF-8, lossy) in arrival order.
    pub fn bodies(&self) -> Vec<String> {
        self.lock().deliveries.iter().map(Received::text).collect()
    }

    /// How many times the consumer has connected (1 once it is up).
    pub fn connections(&self) -> u64 {
        self.lock().connections
    }

    pub fn last_error(&self) -> Option<String> {
        self.lock().last_error.clone()
    }

    /// The AMQP port of the broker it consumes from now (None while reconnecting).
    pub fn connected_to(&self) -> Option<u16> {
        self.lock().connected_to
    }

    /// The first delivery from index `from` on that satisfies `pred` (cheap polling of a
    /// growing log).
    pub fn find_from(&self, from: usize, pred: impl Fn(&Received) -> bool) -> Option<Received> {
        let st = self.lock();
        st.deliveries.iter().skip(from).find(|d| pred(d)).cloned()
    }

    /// Waits until the consumer is connected and consuming.
    pub fn wait_connected(&self, timeout: Duration) {
        eventually(timeout, "the test consumer to connect", || {
            if self.connections() > 0 {
                Ok(())
            } else {
                Err(self
                    .last_error()
                    .unwrap_or_else(|| "not connected yet".into()))
            }
        });
    }

    /// Waits until a delivery with this body arrived, and returns it.
    pub fn wait_for_body(&self, body: &str, timeout: Duration) -> Received {
        eventually(timeout, &format!("a delivery with body {body:?}"), || {
            let st = self.lock();
            st.deliveries
                .iter()
                .find(|d| d.body == body.as_bytes())
                .cloned()
                .ok_or_else(|| {
                    format!(
                        "{} deliveries so far, none with that body; consumer error: {:?}",
                        st.deliveries.len(),
                        st.last_error
                    )
                })
        })
    }

    /// True when a delivery with this body has arrived.
    pub fn has_body(&self, body: &str) -> bool {
        self.lock()
            .deliveries
            .iter()
            .any(|d| d.body == body.as_bytes())
    }

    /// Waits until at least `n` deliveries arrived.
    pub fn wait_for_count(&self, n: usize, timeout: Duration) -> Vec<Received> {
        eventually(
            timeout,
            &format!("{n} deliveries on {}", self.queue),
            || {
                let st = self.lock();
                if st.deliveries.len() >= n {
                    Ok(st.deliveries.clone())
                } else {
                    Err(format!(
                        "{} deliveries so far; consumer error: {:?}",
                        st.deliveries.len(),
                        st.last_error
                    ))
                }
            },
        )
    }

    /// Deliveries counted by body: body → how many times it arrived.
    pub fn body_counts(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for d in self.lock().deliveries.iter() {
            *m.entry(d.text()).or_insert(0) += 1;
        }
        m
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(true);
        }
        if let Some(task) = self.task.take() {
            // Give it a moment to close its connection politely, then abort.
            let _ = runtime()
                .block_on(async { tokio::time::timeout(Duration::from_secs(2), task).await });
        }
    }
}

async fn collect(
    endpoints: Vec<AmqpEndpoint>,
    queue: String,
    state: Arc<Mutex<CollectorState>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    for endpoint in endpoints.iter().cycle() {
        if *stop.borrow() {
            return;
        }
        match consume_once(endpoint, &queue, &state, &mut stop).await {
            Ok(()) => return,
            Err(e) => {
                let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
                st.connected_to = None;
                st.last_error = Some(e);
            }
        }
        tokio::select! {
            _ = stop.changed() => return,
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
    }
}

/// How long the test consumer waits for one basic.ack to go out (a hung broker keeps the
/// connection open).
const ACK_WAIT: Duration = Duration::from_secs(5);

/// Consumes `queue` on one connection to `endpoint`, recording each delivery in `state` (before
/// its ack). Every wait on the broker is bounded, so the collector always gets back to
/// reconnecting. `Ok` only when `stop` fires.
async fn consume_once(
    endpoint: &AmqpEndpoint,
    queue: &str,
    state: &Arc<Mutex<CollectorState>>,
    stop: &mut tokio::sync::watch::Receiver<bool>,
) -> Result<(), String> {
    let lock = || state.lock().unwrap_or_else(|e| e.into_inner());
    let conn = amqp_admin::connect(&endpoint.uri(), amqp_admin::CONNECT_TIMEOUT).await?;
    let consume = async {
        // A node still booting can accept the connection and never answer: bound the setup,
        // so the consumer tries again instead of waiting forever.
        let setup = amqp_admin::start_consumer(&conn, queue, Some(500), false);
        let mut consumer = tokio::time::timeout(Duration::from_secs(10), setup)
            .await
            .map_err(|_| format!("consumer setup on {queue} timed out"))?
            .map_err(|e| format!("{e} (port {})", endpoint.port))?;
        let connection_no = {
            let mut st = lock();
            st.connections += 1;
            st.connected_to = Some(endpoint.port);
            st.connections - 1
        };
        loop {
            tokio::select! {
                _ = stop.changed() => return Ok(()),
                next = consumer.next() => match next {
                    Some(Ok(d)) => {
                        let p = &d.properties;
                        let received = Received {
                            body: d.data.clone(),
                            exchange: d.exchange.as_str().to_string(),
                            routing_key: d.routing_key.as_str().to_string(),
                            redelivered: d.redelivered,
                            message_id: p.message_id().as_ref().map(|s| s.as_str().to_string()),
                            delivery_mode: *p.delivery_mode(),
                            content_type: p.content_type().as_ref().map(|s| s.as_str().to_string()),
                            reply_to: p.reply_to().as_ref().map(|s| s.as_str().to_string()),
                            correlation_id: p
                                .correlation_id()
                                .as_ref()
                                .map(|s| s.as_str().to_string()),
                            timestamp: *p.timestamp(),
                            user_id: p.user_id().as_ref().map(|s| s.as_str().to_string()),
                            headers: p.headers().as_ref().map(table_to_json).unwrap_or_default(),
                            connection_no,
                            received_at: Instant::now(),
                        };
                        lock().deliveries.push(received);
                        tokio::time::timeout(ACK_WAIT, d.acker.ack(BasicAckOptions::default()))
                            .await
                            .map_err(|_| format!("basic.ack on {queue} timed out"))?
                            .map_err(|e| format!("basic.ack: {e}"))?;
                    }
                    Some(Err(e)) => return Err(format!("consumer on {queue}: {e}")),
                    None => return Err(format!("consumer on {queue} was cancelled")),
                },
            }
        }
    };
    // A connection the broker closed (stop_app, a stopped node) does not always end the
    // consumer's stream, nor an ack under way on it: watch the connection itself beside every
    // wait above, and reconnect.
    let watch = async {
        let mut check = tokio::time::interval(Duration::from_millis(500));
        loop {
            check.tick().await;
            if !conn.status().connected() {
                return Err(format!("consumer on {queue}: connection closed"));
            }
        }
    };
    let result = tokio::select! {
        r = consume => r,
        r = watch => r,
    };
    let _ = tokio::time::timeout(Duration::from_secs(2), conn.close(200, "bye".into())).await;
    result
}
