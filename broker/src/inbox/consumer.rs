//! One subscription's consumer: a [`Client`] of the reconnect driver on a connection of its
//! own (a slow or broken subscription never affects another). Connected, it consumes the queue
//! with manual acknowledgements on one channel (one epoch), forwards deliveries in batches,
//! sends the worker's acknowledgements of that channel, and reports the queue's depth.
//! Anything that ends the channel ends the connection: the driver connects again.

use super::acks::Outstanding;
use super::bridge::{Delivery, InboxEvent, InboxSink, SubscriptionConfig};
use super::depth;
use super::headers::{table_to_json, without_nul};
use crate::amqp_values::truncate;
use crate::bridge::LogLevel;
use crate::config::{BrokerConfig, Endpoint};
use crate::connection::{close_connection, describe_error, open_connection, Redactor, CLOSE_WAIT};
use crate::events::spawn_guarded;
use crate::reconnect::{self, Client, End, Interrupt};
use futures_util::future::{BoxFuture, FutureExt};
use futures_util::stream::StreamExt;
use lapin::options::{BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::protocol::AMQPErrorKind;
use lapin::types::{FieldTable, ShortString};
use lapin::{Channel, Connection, Consumer, ErrorKind};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Deliveries per event at most.
const BATCH: usize = 1000;
/// How often a connected consumer checks that its connection is still open, in case it died
/// without its consumer hearing of it.
const CONNECTION_CHECK: Duration = Duration::from_secs(1);
/// An acknowledgement not handed to the connection within this means the connection is hung.
const ACK_WAIT: Duration = Duration::from_secs(5);

/// What the router asks of a subscription's task.
#[derive(Debug)]
pub(crate) enum SubCmd {
    // Boxed: a configuration is far larger than the other commands.
    Configure(Box<SubscriptionConfig>),
    Ack { epoch: u64, tags: Vec<u64> },
    Reconnect,
    Stop,
}

/// Starts the task of one subscription; it runs until told to stop. `epochs` is the
/// subscription's channel counter, kept by the router across restarts of the subscription so
/// that an old epoch is never current again.
pub(crate) fn start(
    cfg: SubscriptionConfig,
    epochs: Arc<AtomicU64>,
    sink: InboxSink,
) -> (mpsc::UnboundedSender<SubCmd>, JoinHandle<Option<()>>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let what = format!("subscription \"{}\": consumer", cfg.subscription);
    let consumer = SubConsumer {
        redactor: Redactor::new(&cfg.broker.hosts),
        cfg,
        rx,
        sink: sink.clone(),
        epochs,
        last_down: None,
    };
    let task = spawn_guarded(sink, what, consumer.run());
    (tx, task)
}

/// A connection consuming the queue.
pub(crate) struct Consuming {
    conn: Arc<Connection>,
    channel: Channel,
    consumer: Consumer,
}

struct SubConsumer {
    cfg: SubscriptionConfig,
    rx: mpsc::UnboundedReceiver<SubCmd>,
    sink: InboxSink,
    redactor: Redactor,
    epochs: Arc<AtomicU64>,
    /// The error of the last Disconnected event, while not connected since: the same error
    /// is not reported again every round.
    last_down: Option<String>,
}

/// What a connection needs; a change of any of these means a new connection.
fn connection_key(c: &SubscriptionConfig) -> (&str, u16, &[Endpoint], u16) {
    (
        &c.queue,
        c.prefetch,
        &c.broker.hosts,
        c.broker.heartbeat_secs,
    )
}

/// How a connected consumer's use of its connection ends.
enum Outcome {
    /// The channel or the connection went away (`why`); the driver reconnects as `end` says.
    Lost(String, End),
    /// Reconnect now (`why`).
    Restart(String),
    Stop,
}

impl Client for SubConsumer {
    type Conn = Consuming;

    fn config(&self) -> &BrokerConfig {
        &self.cfg.broker
    }

    fn connect(&self, ep: Endpoint) -> BoxFuture<'static, Result<Consuming, String>> {
        connect(ep, self.cfg.clone()).boxed()
    }

    /// Awaits `fut` while answering commands; acknowledgements have no channel to go to.
    async fn wait_for<F: Future + Send>(&mut self, fut: F) -> Result<F::Output, Interrupt> {
        let mut fut = std::pin::pin!(fut);
        loop {
            tokio::select! {
                out = &mut fut => return Ok(out),
                cmd = self.rx.recv() => match cmd {
                    None | Some(SubCmd::Stop) => return Err(Interrupt::Stop),
                    Some(SubCmd::Reconnect) => {
                        self.last_down = None;
                        return Err(Interrupt::Restart);
                    }
                    Some(SubCmd::Ack { .. }) => {}
                    Some(SubCmd::Configure(cfg)) => {
                        if self.apply_config(*cfg) {
                            self.last_down = None;
                            return Err(Interrupt::Restart);
                        }
                    }
                },
            }
        }
    }

    async fn serve(&mut self, ep: Endpoint, consuming: Consuming) -> End {
        let host = ep.display_name();
        let conn = consuming.conn.clone();
        let channel = consuming.channel.clone();
        let outcome = self.consume(&host, consuming).await;
        match outcome {
            Outcome::Lost(why, end) => {
                self.down(format!("{host}: {why}"));
                close_connection(&conn).await;
                end
            }
            Outcome::Restart(why) => {
                self.cancel(&channel).await;
                close_connection(&conn).await;
                self.down(format!("{host}: {why}"));
                // A fresh start: its first failure is worth reporting.
                self.last_down = None;
                End::Restart
            }
            Outcome::Stop => {
                self.cancel(&channel).await;
                close_connection(&conn).await;
                End::Stop
            }
        }
    }

    fn unreachable(&mut self, errors: Vec<String>) {
        self.down(errors.join("; "));
    }

    fn no_hosts(&mut self) {
        self.down("no host is configured".to_string());
    }
}

impl SubConsumer {
    fn name(&self) -> &str {
        &self.cfg.subscription
    }

    async fn run(mut self) {
        reconnect::drive(&mut self).await;
    }

    /// Stores a new configuration; true when it needs a new connection.
    fn apply_config(&mut self, cfg: SubscriptionConfig) -> bool {
        let restart = connection_key(&cfg) != connection_key(&self.cfg);
        self.redactor = Redactor::new(&cfg.broker.hosts);
        self.cfg = cfg;
        restart
    }

    /// Consumes on a new epoch until the channel ends or a command ends it.
    async fn consume(&mut self, host: &str, consuming: Consuming) -> Outcome {
        let Consuming {
            conn,
            channel,
            mut consumer,
        } = consuming;
        let epoch = self.epochs.fetch_add(1, Ordering::SeqCst) + 1;
        self.last_down = None;
        self.sink.send(InboxEvent::Connected {
            subscription: self.name().to_string(),
            host: host.to_string(),
            epoch,
        });
        self.log(
            LogLevel::Info,
            format!(
                "connected to {host}, consuming \"{}\" (prefetch {}, epoch {epoch})",
                self.cfg.queue, self.cfg.prefetch
            ),
        );
        let depth = match ShortString::try_new(self.cfg.queue.as_str()) {
            Ok(queue) => Some(spawn_guarded(
                self.sink.clone(),
                format!("subscription \"{}\": queue depth", self.name()),
                depth::watch(
                    conn.clone(),
                    queue,
                    self.name().to_string(),
                    self.sink.clone(),
                ),
            )),
            // Cannot happen: consuming it needed a valid name.
            Err(_) => None,
        };
        let mut outstanding = Outstanding::default();
        let mut check = tokio::time::interval(CONNECTION_CHECK);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

        let outcome = loop {
            tokio::select! {
                first = consumer.next() => {
                    if let Some(lost) = self.forward(&conn, &mut consumer, first, epoch, &mut outstanding) {
                        break lost;
                    }
                }
                cmd = self.rx.recv() => match cmd {
                    None | Some(SubCmd::Stop) => break Outcome::Stop,
                    Some(SubCmd::Reconnect) => break Outcome::Restart("reconnect requested".into()),
                    Some(SubCmd::Configure(cfg)) => {
                        if self.apply_config(*cfg) {
                            break Outcome::Restart("reconnecting: configuration changed".into());
                        }
                    }
                    Some(SubCmd::Ack { epoch: e, tags }) => {
                        // Tags of an older channel: the broker requeued them when it closed.
                        if e == epoch {
                            if let Some(lost) = self.ack(&channel, &mut outstanding, &tags).await {
                                break lost;
                            }
                        }
                    }
                },
                _ = check.tick() => {
                    if !conn.status().connected() {
                        break Outcome::Lost("connection lost: connection is no longer open".into(), End::Lost);
                    }
                }
            }
        };
        if let Some(d) = depth {
            d.abort();
        }
        outcome
    }

    /// Forwards `first` and whatever else has already arrived (up to [`BATCH`]) as one event;
    /// Some when the channel is gone.
    fn forward(
        &self,
        conn: &Connection,
        consumer: &mut Consumer,
        first: Option<lapin::Result<lapin::message::Delivery>>,
        epoch: u64,
        outstanding: &mut Outstanding,
    ) -> Option<Outcome> {
        let mut batch = Vec::new();
        let mut next = Some(first);
        let mut lost = None;
        while let Some(item) = next.take() {
            match item {
                Some(Ok(d)) => {
                    outstanding.delivered(d.delivery_tag);
                    batch.push(self.delivery(epoch, d));
                }
                Some(Err(e)) => lost = Some(self.channel_error(conn, &e)),
                None if conn.status().connected() => {
                    lost = Some(Outcome::Lost(
                        "the broker cancelled the consumer (queue deleted?)".into(),
                        End::Lost,
                    ))
                }
                None => {
                    lost = Some(Outcome::Lost(
                        "connection lost: connection is no longer open".into(),
                        End::Lost,
                    ))
                }
            }
            if lost.is_none() && batch.len() < BATCH {
                next = consumer.next().now_or_never();
            }
        }
        if !batch.is_empty() {
            self.sink.send(InboxEvent::Deliveries(batch));
        }
        lost
    }

    /// A channel closed by the broker over something it refuses (403, 404, 406…) reconnects
    /// after a delay that grows while it repeats; anything else is a loss.
    fn channel_error(&self, conn: &Connection, e: &lapin::Error) -> Outcome {
        let text = self.redactor.clean_secrets(&describe_error(e));
        if matches!(e.kind(), ErrorKind::ParsingError(_)) {
            // A frame the client library cannot parse ends the connection, and the same
            // message comes first again on the next one: no quick reconnects. (Short-string
            // properties that are not UTF-8 do that; RabbitMQ passes them on.)
            return Outcome::Lost(
                format!(
                    "a delivery cannot be parsed ({text}): a property that is not valid UTF-8? \
                     Remove that message from the queue; reconnecting with a growing delay"
                ),
                End::Refused,
            );
        }
        let refused = matches!(e.kind(), ErrorKind::ProtocolError(a) if matches!(a.kind(), AMQPErrorKind::Soft(_)));
        if refused && conn.status().connected() {
            Outcome::Lost(format!("consumer channel closed: {text}"), End::Refused)
        } else {
            Outcome::Lost(format!("connection lost: {text}"), End::Lost)
        }
    }

    /// Sends the acknowledgements of `tags` on the current channel. A failure means the channel
    /// is gone (its deliveries will come again): Some when it is hung.
    async fn ack(
        &self,
        channel: &Channel,
        outstanding: &mut Outstanding,
        tags: &[u64],
    ) -> Option<Outcome> {
        for frame in outstanding.acknowledge(tags) {
            let sent = tokio::time::timeout(
                ACK_WAIT,
                channel.basic_ack(
                    frame.tag,
                    BasicAckOptions {
                        multiple: frame.multiple,
                    },
                ),
            )
            .await;
            match sent {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    self.log(
                        LogLevel::Debug,
                        format!(
                            "acknowledgement not sent, the channel is gone: {}",
                            describe_error(&e)
                        ),
                    );
                    return None;
                }
                Err(_) => {
                    return Some(Outcome::Lost(
                        format!("an acknowledgement was not sent within {ACK_WAIT:?}"),
                        End::Lost,
                    ))
                }
            }
        }
        None
    }

    /// Cancels the consumer (bounded) before its connection is closed: nothing more is
    /// delivered meanwhile. What was not acknowledged goes back to the queue with the
    /// connection.
    async fn cancel(&self, channel: &Channel) {
        if channel.status().connected() {
            let _ = tokio::time::timeout(
                CLOSE_WAIT,
                channel.basic_cancel(consumer_tag(self.name()), BasicCancelOptions::default()),
            )
            .await;
        }
    }

    fn delivery(&self, epoch: u64, d: lapin::message::Delivery) -> Delivery {
        let p = &d.properties;
        let text = |s: &Option<ShortString>| s.as_ref().map(|s| without_nul(s.as_str()));
        Delivery {
            subscription: self.name().to_string(),
            epoch,
            delivery_tag: d.delivery_tag,
            exchange: without_nul(d.exchange.as_str()),
            routing_key: without_nul(d.routing_key.as_str()),
            redelivered: d.redelivered,
            message_id: text(p.message_id()),
            content_type: text(p.content_type()),
            correlation_id: text(p.correlation_id()),
            reply_to: text(p.reply_to()),
            user_id: text(p.user_id()),
            timestamp: *p.timestamp(),
            headers: p.headers().as_ref().map(table_to_json).unwrap_or_default(),
            body: d.data,
        }
    }

    /// Reports a new error as Disconnected (the same one again only as a debug line).
    fn down(&mut self, error: String) {
        let error = self.redactor.clean(&error);
        if self.last_down.as_deref() == Some(error.as_str()) {
            self.log(LogLevel::Debug, error);
            return;
        }
        self.last_down = Some(error.clone());
        self.sink.send(InboxEvent::Disconnected {
            subscription: self.name().to_string(),
            error,
        });
    }

    fn log(&self, level: LogLevel, message: String) {
        self.sink.send(InboxEvent::Log {
            level,
            message: format!(
                "subscription \"{}\": {}",
                self.name(),
                self.redactor.clean(&message)
            ),
        });
    }
}

/// `amqp_outbox.<subscription>`, cut to the 255 bytes a consumer tag may have.
fn consumer_tag(subscription: &str) -> ShortString {
    let tag = format!("amqp_outbox.{subscription}");
    ShortString::try_new(truncate(&tag, 255)).unwrap_or_else(|_| ShortString::from(""))
}

/// Connects to one host and starts consuming, bounded by the connect timeout.
async fn connect(ep: Endpoint, cfg: SubscriptionConfig) -> Result<Consuming, String> {
    let redactor = Redactor::new(std::slice::from_ref(&ep));
    let limit = cfg.broker.connect_timeout;
    let role = format!("subscription \"{}\" broker", cfg.subscription);
    let conn = Arc::new(open_connection(&ep, &cfg.broker, &role, true).await?);
    match tokio::time::timeout(limit, start_consuming(&conn, &cfg, &redactor)).await {
        Ok(Ok((channel, consumer))) => Ok(Consuming {
            conn,
            channel,
            consumer,
        }),
        Ok(Err(e)) => {
            close_connection(&conn).await;
            Err(e)
        }
        Err(_) => {
            close_connection(&conn).await;
            Err(format!(
                "starting to consume \"{}\" timed out after {limit:?}",
                cfg.queue
            ))
        }
    }
}

/// A channel with the prefetch limit, consuming the queue with manual acknowledgements. The
/// queue is not declared: it belongs to the user.
async fn start_consuming(
    conn: &Connection,
    cfg: &SubscriptionConfig,
    redactor: &Redactor,
) -> Result<(Channel, Consumer), String> {
    let queue = ShortString::try_new(cfg.queue.as_str()).map_err(|_| {
        format!(
            "queue name longer than 255 bytes: {}...",
            truncate(&cfg.queue, 40)
        )
    })?;
    let channel = conn
        .create_channel()
        .await
        .map_err(|e| redactor.clean_secrets(&describe_error(&e)))?;
    channel
        .basic_qos(cfg.prefetch, BasicQosOptions::default())
        .await
        .map_err(|e| format!("basic.qos refused: {}", redactor.clean(&describe_error(&e))))?;
    let consumer = channel
        .basic_consume(
            queue,
            consumer_tag(&cfg.subscription),
            BasicConsumeOptions {
                no_ack: false,
                exclusive: false,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await
        // The broker's text names the queue, which a user wrote: masked by position only.
        .map_err(|e| {
            format!(
                "cannot consume queue \"{}\": {}",
                cfg.queue,
                redactor.clean(&describe_error(&e))
            )
        })?;
    Ok((channel, consumer))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consumer_tags_fit_in_a_short_string() {
        assert_eq!(consumer_tag("orders").as_str(), "amqp_outbox.orders");
        assert_eq!(consumer_tag(&"é".repeat(200)).as_str().len(), 254);
    }
}
