//! One end-to-end test's world: a private cluster with the extension and one broker row, a
//! route on the broker, and a consumer on the route's queue.

use std::time::{Duration, Instant};

use postgres::Client;

use crate::outbox::{add_broker_with_proof, create_extension};
use crate::{
    eventually, unique_name, AmqpEndpoint, Collector, Outbox, PgCluster, PgConfig, ProducerConfig,
    Rabbit, Received, Route, WorkerStatus,
};

const WORKER_UP: Duration = Duration::from_secs(30);
const ARRIVAL: Duration = Duration::from_secs(30);
const BULK_ARRIVAL: Duration = Duration::from_secs(150);

/// Deletes this database's acknowledgement queue from the broker when dropped (each test
/// cluster has its own system identifier, so each creates a new durable queue).
struct AckQueueCleanup {
    endpoint: AmqpEndpoint,
    name: String,
}

impl Drop for AckQueueCleanup {
    fn drop(&mut self) {
        if let Ok(r) = Rabbit::connect(self.endpoint.clone()) {
            let _ = r.delete_queue(&self.name);
        }
    }
}

/// One test's world: a cluster with the extension and one broker row (with the given proof
/// mode), a route on the broker and a consumer on its queue. Fields drop in order: consumer,
/// route, client, cluster (stopped), then the acknowledgement queue is deleted.
pub struct World {
    pub collector: Collector,
    pub route: Route,
    pub client: Client,
    pub outbox: Outbox,
    pub ack_queue: String,
    pub cluster: PgCluster,
    _ack_cleanup: AckQueueCleanup,
}

impl World {
    /// A broker row with the default proof mode (ack_queue).
    pub fn new(name: &str, config: PgConfig, rabbit: &Rabbit) -> World {
        Self::with_proof(name, config, rabbit, "ack_queue")
    }

    /// A broker row with this `proof` ('ack_queue' or 'confirm').
    pub fn with_proof(name: &str, config: PgConfig, rabbit: &Rabbit, proof: &str) -> World {
        let cluster = PgCluster::new(config);
        let mut client = cluster.client();
        create_extension(&mut client);
        let broker_id = add_broker_with_proof(&mut client, rabbit.endpoint(), proof);
        let ack_queue = Outbox::ack_queue_name(&mut client);
        let cleanup = AckQueueCleanup {
            endpoint: rabbit.endpoint().clone(),
            name: ack_queue.clone(),
        };
        let route = rabbit.declare_route(name);
        let collector = rabbit.consume_connected(&route);
        cluster.wait_for_worker(&mut client, WORKER_UP);
        World {
            collector,
            route,
            client,
            outbox: Outbox { broker_id },
            ack_queue,
            cluster,
            _ack_cleanup: cleanup,
        }
    }

    /// One message delivered and its row deleted: the worker is connected and idle, and what the
    /// test measures next starts from there.
    pub fn warm_up(&mut self) {
        self.publish("warm-up");
        self.collector.wait_for_body("warm-up", ARRIVAL);
        Outbox::wait_drained(&mut self.client, ARRIVAL);
    }

    pub fn publish(&mut self, body: &str) {
        let (ex, rk) = (self.route.exchange.clone(), self.route.routing_key.clone());
        self.outbox.publish(&mut self.client, &ex, &rk, body);
    }

    /// [`ProducerConfig::new`]'s defaults for a producer `name` publishing to the route.
    pub fn producer_config(&self, name: &str) -> ProducerConfig {
        ProducerConfig::new(
            name,
            self.outbox.broker_id,
            &self.route.exchange,
            &self.route.routing_key,
        )
    }

    /// `amqp.publish_message` to the route; returns the row id.
    pub fn publish_id(&mut self, body: &str) -> i64 {
        self.client
            .query_one(
                "SELECT amqp.publish_message($1, $2, $3, $4)",
                &[
                    &self.outbox.broker_id,
                    &self.route.exchange,
                    &self.route.routing_key,
                    &body,
                ],
            )
            .unwrap_or_else(|e| panic!("amqp.publish_message({body}): {e}"))
            .get(0)
    }

    pub fn status(&mut self) -> WorkerStatus {
        Outbox::worker_status(&mut self.client).unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn rows(&mut self) -> i64 {
        Outbox::rows(&mut self.client).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Waits until nothing unparked is left in the outbox *and* a marker published after that
    /// moment has arrived: every copy of every earlier message was in the queue before the
    /// marker (one channel, one queue: RabbitMQ keeps the order), so the consumer has seen them
    /// all.
    ///
    /// Robust to `test_lose_one_in`: a new marker goes out every second until one arrives, and
    /// each later marker's record reports the earlier lost ones (gap rule), so nothing has to
    /// wait for `resend_after`.
    pub fn settle(&mut self) {
        let mut empty_since: Option<Instant> = None;
        // (marker, published at)
        let mut markers: Vec<(String, Instant)> = Vec::new();
        eventually(
            BULK_ARRIVAL,
            "the outbox to drain and a later marker to arrive",
            || {
                let pending = Outbox::pending(&mut self.client)?;
                if pending == 0 && empty_since.is_none() {
                    empty_since = Some(Instant::now());
                }
                if let Some(t) = empty_since {
                    if markers
                        .iter()
                        .any(|(m, at)| *at > t && self.collector.has_body(m))
                    {
                        return Ok(());
                    }
                }
                let due = markers
                    .last()
                    .is_none_or(|(_, at)| at.elapsed() >= Duration::from_secs(1));
                if due {
                    let marker = unique_name("marker");
                    let (ex, rk) = (self.route.exchange.clone(), self.route.routing_key.clone());
                    self.outbox.publish(&mut self.client, &ex, &rk, &marker);
                    markers.push((marker, Instant::now()));
                }
                Err(format!(
                    "{pending} rows pending; empty since {empty_since:?}; {} markers sent",
                    markers.len()
                ))
            },
        );
        // Markers published before the last one and lost are resent by the gap rule. Parked
        // rows stay (a test that parks one looks at it afterwards).
        Outbox::wait_drained(&mut self.client, ARRIVAL);
    }

    /// Deliveries whose body is not a settle() marker.
    pub fn deliveries(&self) -> Vec<Received> {
        self.collector
            .deliveries()
            .into_iter()
            .filter(|d| !d.text().starts_with("e2e.marker."))
            .collect()
    }

    /// [`settle`](Self::settle) when another broker keeps rows in the outbox: waits until no
    /// row of `broker_id` is left, then for a marker published after that.
    pub fn settle_only_broker(&mut self, broker_id: i32) {
        let count = |c: &mut Client| -> Result<i64, String> {
            c.query_one(
                "SELECT count(*) FROM amqp.message WHERE broker_id = $1",
                &[&broker_id],
            )
            .map(|r| r.get(0))
            .map_err(|e| e.to_string())
        };
        eventually(
            BULK_ARRIVAL,
            "the broker's rows to drain",
            || match count(&mut self.client)? {
                0 => Ok(()),
                n => Err(format!("{n} rows of broker {broker_id}")),
            },
        );
        let marker = unique_name("marker");
        self.publish(&marker);
        self.collector.wait_for_body(&marker, ARRIVAL);
        eventually(ARRIVAL, "the marker's row to be deleted", || {
            match count(&mut self.client)? {
                0 => Ok(()),
                n => Err(format!("{n} rows of broker {broker_id}")),
            }
        });
    }
}
