//! The one AMQP admin client of the test crates and the benchmark: declares, binds, purges and
//! deletes queues and exchanges, counts messages, publishes and takes messages, over lapin on a
//! tokio runtime shared by the whole process. The calls are synchronous, so tests stay plain
//! `#[test]` functions.
//!
//! Every operation runs on a channel of its own: a refusal (404, 406) closes only that channel,
//! so a test can probe for a missing queue or provoke an inequivalent declare and go on using
//! the same client.

use std::future::Future;
use std::sync::OnceLock;
use std::time::Duration;

use futures_lite::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions, QueuePurgeOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, Consumer, ExchangeKind};

/// How long a connection attempt may take before it counts as failed.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The process-wide runtime the AMQP clients run on. Multi-threaded, so connections keep their
/// heartbeats and spawned consumers keep running between the synchronous calls.
pub fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("testkit-amqp")
            .enable_all()
            .build()
            .expect("cannot build the tokio runtime for the AMQP clients")
    })
}

/// `host:port` of an AMQP URI, for messages (never the credentials).
fn server_of(uri: &str) -> &str {
    let rest = uri.split_once("://").map_or(uri, |(_, r)| r);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    rest.split(['/', '?']).next().unwrap_or(rest)
}

/// Connects to `uri`, giving up after `timeout`.
pub async fn connect(uri: &str, timeout: Duration) -> Result<Connection, String> {
    let server = server_of(uri);
    match tokio::time::timeout(
        timeout,
        Connection::connect(uri, ConnectionProperties::default()),
    )
    .await
    {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(format!("cannot connect to {server}: {e}")),
        Err(_) => Err(format!("connecting to {server} timed out")),
    }
}

async fn channel(conn: &Connection) -> Result<Channel, String> {
    conn.create_channel()
        .await
        .map_err(|e| format!("cannot open a channel: {e}"))
}

/// A new channel in publisher-confirm mode.
pub async fn confirm_channel(conn: &Connection) -> Result<Channel, String> {
    let ch = channel(conn).await?;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| format!("confirm.select: {e}"))?;
    Ok(ch)
}

/// A consumer of `queue` on a new channel: with `prefetch` unacknowledged deliveries at most
/// (none: unlimited), acknowledging by itself when `no_ack`.
pub async fn start_consumer(
    conn: &Connection,
    queue: &str,
    prefetch: Option<u16>,
    no_ack: bool,
) -> Result<Consumer, String> {
    let ch = channel(conn).await?;
    if let Some(n) = prefetch {
        ch.basic_qos(n, BasicQosOptions::default())
            .await
            .map_err(|e| format!("basic.qos: {e}"))?;
    }
    ch.basic_consume(
        queue.into(),
        "".into(),
        BasicConsumeOptions {
            no_ack,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .map_err(|e| format!("basic.consume {queue}: {e}"))
}

/// What a passive `queue.declare` tells about a queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueCounts {
    /// Messages ready for delivery (not those delivered and not yet acknowledged).
    pub messages: u32,
    pub consumers: u32,
}

/// A connection to a broker for declaring, inspecting and deleting test objects.
pub struct AmqpAdmin {
    connection: Connection,
}

impl AmqpAdmin {
    /// Connects to `uri` (within [`CONNECT_TIMEOUT`]).
    pub fn connect(uri: &str) -> Result<AmqpAdmin, String> {
        Self::connect_within(uri, CONNECT_TIMEOUT)
    }

    pub fn connect_within(uri: &str, timeout: Duration) -> Result<AmqpAdmin, String> {
        let connection = runtime().block_on(connect(uri, timeout))?;
        Ok(AmqpAdmin { connection })
    }

    pub fn connection(&self) -> &Connection {
        &self.connection
    }

    /// Runs `op` on a new channel and closes the channel when `op` succeeded (a refused one is
    /// closed by the broker already).
    fn on_channel<T, F, Fut>(&self, op: F) -> Result<T, String>
    where
        F: FnOnce(Channel) -> Fut,
        Fut: Future<Output = Result<T, String>>,
    {
        runtime().block_on(async {
            let ch = channel(&self.connection).await?;
            let v = op(ch.clone()).await?;
            let _ = ch.close(200, "done".into()).await;
            Ok(v)
        })
    }

    /// [`on_channel`](Self::on_channel) for one AMQP method whose reply is not needed; the
    /// broker's error is prefixed with `what`.
    fn method<T, F, Fut>(&self, what: &str, op: F) -> Result<(), String>
    where
        F: FnOnce(Channel) -> Fut,
        Fut: Future<Output = lapin::Result<T>>,
    {
        self.on_channel(
            |ch| async move { op(ch).await.map(drop).map_err(|e| format!("{what}: {e}")) },
        )
    }

    pub fn declare_exchange(
        &self,
        name: &str,
        kind: ExchangeKind,
        durable: bool,
    ) -> Result<(), String> {
        self.method(&format!("exchange.declare {name}"), |ch| async move {
            ch.exchange_declare(
                name.into(),
                kind,
                ExchangeDeclareOptions {
                    durable,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
        })
    }

    pub fn delete_exchange(&self, name: &str) -> Result<(), String> {
        self.method(&format!("exchange.delete {name}"), |ch| async move {
            ch.exchange_delete(name.into(), ExchangeDeleteOptions::default())
                .await
        })
    }

    /// Declares `name` with `arguments`; the broker's error text when it refuses (e.g. 406
    /// for arguments inequivalent to an existing queue's).
    pub fn declare_queue(
        &self,
        name: &str,
        durable: bool,
        arguments: FieldTable,
    ) -> Result<(), String> {
        self.method(&format!("queue.declare {name}"), |ch| async move {
            ch.queue_declare(
                name.into(),
                QueueDeclareOptions {
                    durable,
                    ..Default::default()
                },
                arguments,
            )
            .await
        })
    }

    /// Binds an existing queue to an existing exchange.
    pub fn bind_queue(
        &self,
        queue: &str,
        exchange: &str,
        binding_key: &str,
        arguments: FieldTable,
    ) -> Result<(), String> {
        self.method(
            &format!("queue.bind {queue} to {exchange} ({binding_key})"),
            |ch| async move {
                ch.queue_bind(
                    queue.into(),
                    exchange.into(),
                    binding_key.into(),
                    QueueBindOptions::default(),
                    arguments,
                )
                .await
            },
        )
    }

    /// Deletes a queue (no error when it does not exist).
    pub fn delete_queue(&self, name: &str) -> Result<(), String> {
        self.method(&format!("queue.delete {name}"), |ch| async move {
            ch.queue_delete(name.into(), QueueDeleteOptions::default())
                .await
        })
    }

    pub fn purge_queue(&self, name: &str) -> Result<(), String> {
        self.method(&format!("queue.purge {name}"), |ch| async move {
            ch.queue_purge(name.into(), QueuePurgeOptions::default())
                .await
        })
    }

    /// A passive `queue.declare`: `Some(counts)` when the queue exists, `None` when the broker
    /// answers 404.
    pub fn queue_counts(&self, name: &str) -> Result<Option<QueueCounts>, String> {
        runtime().block_on(async {
            let ch = channel(&self.connection).await?;
            let r = ch
                .queue_declare(
                    name.into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await;
            match r {
                Ok(q) => {
                    let _ = ch.close(200, "done".into()).await;
                    Ok(Some(QueueCounts {
                        messages: q.message_count(),
                        consumers: q.consumer_count(),
                    }))
                }
                Err(e) if e.to_string().contains("NOT_FOUND") || e.to_string().contains("404") => {
                    Ok(None)
                }
                Err(e) => Err(format!("passive queue.declare {name}: {e}")),
            }
        })
    }

    /// Ready messages in `queue`; an error when it does not exist.
    pub fn queue_len(&self, name: &str) -> Result<u32, String> {
        self.queue_counts(name)?
            .map(|c| c.messages)
            .ok_or_else(|| format!("queue {name} does not exist"))
    }

    /// Publishes one message and waits for the broker's confirm.
    pub fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), String> {
        runtime().block_on(async {
            let ch = confirm_channel(&self.connection).await?;
            let confirm = ch
                .basic_publish(
                    exchange.into(),
                    routing_key.into(),
                    BasicPublishOptions::default(),
                    body,
                    properties,
                )
                .await
                .map_err(|e| format!("basic.publish: {e}"))?
                .await
                .map_err(|e| format!("publish confirm: {e}"))?;
            let _ = ch.close(200, "done".into()).await;
            if confirm.is_ack() {
                Ok(())
            } else {
                Err(format!("not confirmed: {confirm:?}"))
            }
        })
    }

    /// Takes `n` messages from `queue` (acknowledged on delivery); an error when fewer arrive
    /// within `timeout`.
    pub fn consume(
        &self,
        queue: &str,
        n: usize,
        timeout: Duration,
    ) -> Result<Vec<Delivery>, String> {
        runtime().block_on(async {
            let mut consumer = start_consumer(&self.connection, queue, None, true).await?;
            let mut out = Vec::with_capacity(n);
            let deadline = tokio::time::Instant::now() + timeout;
            while out.len() < n {
                match tokio::time::timeout_at(deadline, consumer.next()).await {
                    Ok(Some(Ok(d))) => out.push(d),
                    other => return Err(format!("consumed {} of {n}: {other:?}", out.len())),
                }
            }
            Ok(out)
        })
    }

    /// Deletes `queues` and `exchanges`, ignoring errors, within `timeout` in all.
    pub fn delete_all(&self, queues: &[String], exchanges: &[String], timeout: Duration) {
        runtime().block_on(async {
            let _ = tokio::time::timeout(timeout, async {
                let ch = channel(&self.connection).await?;
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
                let _ = ch.close(200, "done".into()).await;
                Ok::<(), String>(())
            })
            .await;
        });
    }
}

impl Drop for AmqpAdmin {
    fn drop(&mut self) {
        let conn = &self.connection;
        runtime().block_on(async {
            let _ =
                tokio::time::timeout(Duration::from_secs(3), conn.close(200, "bye".into())).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::server_of;

    #[test]
    fn server_of_hides_credentials_and_options() {
        assert_eq!(
            server_of("amqp://guest:guest@127.0.0.1:5672/%2f?heartbeat=5"),
            "127.0.0.1:5672"
        );
        assert_eq!(server_of("amqp://127.0.0.1:5672"), "127.0.0.1:5672");
    }
}
