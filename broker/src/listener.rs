//! The acknowledgement listener of one broker (`AckQueue` mode): its own connection (a
//! publishing connection blocked by a resource alarm must not stop it, and RabbitMQ does not
//! block a connection that only consumes), to the broker's hosts with the same failover and
//! backoff as the publisher but reconnecting independently. It consumes the acknowledgement
//! queue and turns each record of this session into `Acked` / `Lost` events via the tracker.
//!
//! Auto-ack (`no_ack`) consumption, on purpose: the listener then never has to write anything
//! to keep receiving (lapin holds back *every* frame, acks included, on a connection the broker
//! has blocked, and manual acks would stall at the prefetch limit), and a record lost with the
//! connection or a crash only costs a resend — the gap rule or the worker's timeout covers it.

use crate::ack::{self, SharedTracker};
use crate::amqp_values::to_field_table;
use crate::bridge::{Event, LogLevel};
use crate::config::{AckQueueConfig, BrokerConfig, Endpoint};
use crate::connection::{close_connection, describe_error, open_connection, Redactor};
use crate::events::{spawn_guarded, EventSink};
use crate::reconnect::{self, Client, End, Interrupt};
use futures_util::future::{BoxFuture, FutureExt};
use futures_util::stream::StreamExt;
use lapin::options::{BasicConsumeOptions, QueueDeclareOptions};
use lapin::types::ShortString;
use lapin::{Connection, Consumer};
use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

/// Deliveries handled (and their events coalesced) per wake-up at most.
const BATCH: usize = 1000;
/// How often the listener checks that its connection is still open.
const CONNECTION_CHECK: Duration = Duration::from_secs(1);

/// The broker task's end of a listener.
pub(crate) struct ListenerHandle {
    cfg: watch::Sender<BrokerConfig>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Option<()>>,
}

impl ListenerHandle {
    pub(crate) fn update(&self, cfg: &BrokerConfig) {
        self.cfg.send_if_modified(|cur| {
            let changed = cur != cfg;
            if changed {
                *cur = cfg.clone();
            }
            changed
        });
    }

    /// Tells the listener to close its connection and end; it does so on its own.
    pub(crate) fn signal_stop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }

    /// Stops it and waits (bounded) for its connection to close.
    pub(crate) async fn stop(mut self, wait: Duration) {
        self.signal_stop();
        if tokio::time::timeout(wait, &mut self.task).await.is_err() {
            self.task.abort();
        }
    }
}

pub(crate) fn start(
    cfg: BrokerConfig,
    session: String,
    tracker: SharedTracker,
    sink: EventSink,
) -> ListenerHandle {
    let (cfg_tx, cfg_rx) = watch::channel(cfg.clone());
    let (stop_tx, stop_rx) = oneshot::channel();
    let broker_id = cfg.broker_id;
    let listener = Listener {
        redactor: Redactor::new(&cfg.hosts),
        cfg,
        cfg_rx,
        stop: stop_rx,
        session,
        tracker,
        sink: sink.clone(),
        reported_down: false,
    };
    let task = spawn_guarded(
        sink,
        format!("broker {broker_id}: acknowledgement listener"),
        listener.run(),
    );
    ListenerHandle {
        cfg: cfg_tx,
        stop: Some(stop_tx),
        task,
    }
}

struct Listener {
    cfg: BrokerConfig,
    cfg_rx: watch::Receiver<BrokerConfig>,
    stop: oneshot::Receiver<()>,
    session: String,
    tracker: SharedTracker,
    sink: EventSink,
    redactor: Redactor,
    /// A loss (or failure to connect) was logged as a warning and no connect since.
    reported_down: bool,
}

/// What a connection needs; a change of any of these means a new connection.
fn connection_key(c: &BrokerConfig) -> (&[Endpoint], u16, &AckQueueConfig) {
    (&c.hosts, c.heartbeat_secs, &c.ack_queue)
}

impl Client for Listener {
    type Conn = (Connection, Consumer);

    fn config(&self) -> &BrokerConfig {
        &self.cfg
    }

    fn connect(&self, ep: Endpoint) -> BoxFuture<'static, Result<Self::Conn, String>> {
        connect(ep, self.cfg.clone(), self.sink.clone()).boxed()
    }

    /// Awaits `fut` while watching for a stop or a configuration change that needs a new
    /// connection.
    async fn wait_for<F: Future + Send>(&mut self, fut: F) -> Result<F::Output, Interrupt> {
        let mut fut = std::pin::pin!(fut);
        loop {
            tokio::select! {
                _ = &mut self.stop => return Err(Interrupt::Stop),
                out = &mut fut => return Ok(out),
                changed = self.cfg_rx.changed() => {
                    if changed.is_err() {
                        // The broker task is gone.
                        return Err(Interrupt::Stop);
                    }
                    if self.take_config() {
                        self.reported_down = false;
                        return Err(Interrupt::Restart);
                    }
                }
            }
        }
    }

    async fn serve(&mut self, ep: Endpoint, (conn, consumer): Self::Conn) -> End {
        self.reported_down = false;
        self.log(
            LogLevel::Info,
            format!(
                "acknowledgement listener connected to {}, consuming \"{}\"",
                ep.display_name(),
                self.cfg.ack_queue.name
            ),
        );
        let end = self.consume(&conn, consumer, &ep).await;
        close_connection(&conn).await;
        match end {
            Some(Interrupt::Stop) => End::Stop,
            Some(Interrupt::Restart) => End::Restart,
            None => End::Lost,
        }
    }

    fn unreachable(&mut self, errors: Vec<String>) {
        self.down(format!(
            "acknowledgement listener cannot connect: {}",
            errors.join("; ")
        ));
    }
}

/// What the records of one channel in one burst of deliveries said.
#[derive(Default)]
struct EpochSeen {
    lost: Vec<i64>,
    acked: Vec<i64>,
    records: usize,
}

impl Listener {
    fn id(&self) -> i32 {
        self.cfg.broker_id
    }

    async fn run(mut self) {
        reconnect::drive(&mut self).await;
    }

    /// Takes the latest configuration; true when it needs a new connection.
    fn take_config(&mut self) -> bool {
        let cfg = self.cfg_rx.borrow_and_update().clone();
        let restart = connection_key(&cfg) != connection_key(&self.cfg);
        self.redactor = Redactor::new(&cfg.hosts);
        self.cfg = cfg;
        restart
    }

    /// Consumes until the connection is lost (None) or interrupted.
    async fn consume(
        &mut self,
        conn: &Connection,
        mut consumer: Consumer,
        ep: &Endpoint,
    ) -> Option<Interrupt> {
        loop {
            // Bounded, so a quiet queue still notices a connection that died without telling
            // its consumer.
            let next = tokio::time::timeout(CONNECTION_CHECK, consumer.next());
            let outcome = match self.wait_for(next).await {
                Err(interrupt) => return Some(interrupt),
                Ok(Err(_quiet)) => {
                    if conn.status().connected() {
                        continue;
                    }
                    None
                }
                Ok(Ok(outcome)) => outcome,
            };
            let mut batch = Vec::new();
            let mut lost: Option<String> = None;
            match outcome {
                Some(Ok(d)) => batch.push(d.data),
                Some(Err(e)) => lost = Some(describe_error(&e)),
                None if conn.status().connected() => {
                    lost = Some("the consumer was cancelled".into())
                }
                None => lost = Some("connection is no longer open".into()),
            }
            // Take what is already there too, so their events are coalesced.
            while lost.is_none() && batch.len() < BATCH {
                match consumer.next().now_or_never() {
                    Some(Some(Ok(d))) => batch.push(d.data),
                    Some(Some(Err(e))) => lost = Some(describe_error(&e)),
                    Some(None) => lost = Some("the consumer was cancelled".into()),
                    None => break,
                }
            }
            self.handle(&batch);
            if lost.is_some() || !conn.status().connected() {
                let why = lost.unwrap_or_else(|| "connection is no longer open".into());
                self.down(format!(
                    "acknowledgement listener lost its connection to {}: {why}",
                    ep.display_name()
                ));
                return None;
            }
        }
    }

    /// Turns a batch of record bodies into events: per epoch one Lost (first: those records
    /// were published before the acknowledged ones) and one Acked.
    fn handle(&self, bodies: &[Vec<u8>]) {
        let mut per_epoch: BTreeMap<(i32, u64), EpochSeen> = BTreeMap::new();
        let mut foreign = 0usize;
        let mut unknown = 0usize;
        let mut malformed: Vec<String> = Vec::new();
        {
            let mut tracker = ack::lock(&self.tracker);
            for body in bodies {
                let record = match ack::parse_record(body) {
                    Ok(r) => r,
                    Err(e) => {
                        malformed.push(e);
                        continue;
                    }
                };
                if record.session != self.session {
                    foreign += 1;
                    continue;
                }
                let Some(seen) = tracker.seen(&record) else {
                    unknown += 1;
                    continue;
                };
                let entry = per_epoch.entry((seen.broker_id, record.epoch)).or_default();
                entry.lost.extend(seen.lost);
                entry.acked.extend(seen.acked);
                entry.records += 1;
            }
        }
        for ((broker_id, epoch), seen) in per_epoch {
            if !seen.lost.is_empty() {
                self.sink.send(Event::Lost {
                    broker_id,
                    epoch,
                    ids: seen.lost,
                });
            }
            if !seen.acked.is_empty() {
                self.sink.send(Event::Acked {
                    broker_id,
                    epoch,
                    ids: seen.acked,
                    records: seen.records,
                });
            }
        }
        if foreign > 0 {
            self.log(
                LogLevel::Debug,
                format!("ignored {foreign} acknowledgement record(s) of another worker session"),
            );
        }
        if unknown > 0 {
            self.log(
                LogLevel::Debug,
                format!("ignored {unknown} acknowledgement record(s) of a forgotten channel"),
            );
        }
        if let Some(first) = malformed.first() {
            self.log(
                LogLevel::Warning,
                format!(
                    "ignored {} malformed message(s) on the acknowledgement queue \"{}\" ({first})",
                    malformed.len(),
                    self.cfg.ack_queue.name
                ),
            );
        }
    }

    /// A loss or a failed round: a warning the first time, then Debug until connected again.
    fn down(&mut self, error: String) {
        if self.reported_down {
            self.log(LogLevel::Debug, error);
        } else {
            self.reported_down = true;
            self.log(LogLevel::Warning, error);
        }
    }

    fn log(&self, level: LogLevel, message: String) {
        self.sink.send(Event::Log {
            level,
            message: format!("broker {}: {}", self.id(), self.redactor.clean(&message)),
        });
    }
}

/// Connects to one host, declares the acknowledgement queue (same arguments as the publishing
/// side) and starts consuming it. Bounded by the connect timeout.
async fn connect(
    ep: Endpoint,
    cfg: BrokerConfig,
    sink: EventSink,
) -> Result<(Connection, Consumer), String> {
    let redactor = Redactor::new(std::slice::from_ref(&ep));
    let limit = cfg.connect_timeout;
    let conn = open_connection(&ep, &cfg, "ack listener", false).await?;
    match tokio::time::timeout(limit, declare_and_consume(&conn, &cfg, &sink, &redactor)).await {
        Ok(Ok(consumer)) => Ok((conn, consumer)),
        Ok(Err(e)) => {
            close_connection(&conn).await;
            Err(e)
        }
        Err(_) => {
            close_connection(&conn).await;
            Err(format!(
                "declaring and consuming the acknowledgement queue timed out after {limit:?}"
            ))
        }
    }
}

async fn declare_and_consume(
    conn: &Connection,
    cfg: &BrokerConfig,
    sink: &EventSink,
    redactor: &Redactor,
) -> Result<Consumer, String> {
    let name = ShortString::try_new(cfg.ack_queue.name.as_str())
        .map_err(|_| "acknowledgement queue name longer than 255 bytes".to_string())?;
    let args = to_field_table(&ack::ack_queue_arguments(&cfg.ack_queue))?;
    let channel = conn
        .create_channel()
        .await
        .map_err(|e| redactor.clean_secrets(&describe_error(&e)))?;
    let declared = channel
        .queue_declare(
            name.clone(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            args,
        )
        .await;
    // A refused declaration (it exists with other arguments, say) closes the channel; the queue
    // may still be consumable, so warn and try on a new channel.
    let channel = match declared {
        Ok(_) => channel,
        Err(e) => {
            sink.send(Event::Log {
                level: LogLevel::Warning,
                message: format!(
                    "broker {}: cannot declare the acknowledgement queue \"{}\": {}",
                    cfg.broker_id,
                    cfg.ack_queue.name,
                    redactor.clean_secrets(&describe_error(&e))
                ),
            });
            conn.create_channel()
                .await
                .map_err(|e| redactor.clean_secrets(&describe_error(&e)))?
        }
    };
    channel
        .basic_consume(
            name,
            ShortString::from(""),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .map_err(|e| {
            format!(
                "cannot consume the acknowledgement queue \"{}\": {}",
                cfg.ack_queue.name,
                redactor.clean_secrets(&describe_error(&e))
            )
        })
}
