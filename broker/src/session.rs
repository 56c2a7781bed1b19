//! One broker's publishing connection: the broker's task, a [`Client`] of the reconnect
//! driver. Connected, it runs one publishing channel at a time (a new one, with a new epoch,
//! after a channel error), answers the supervisor's commands, watches the connection (lost,
//! blocked by a resource alarm) and keeps the acknowledgement listener in step with the
//! configuration.

use crate::ack::{self, SharedTracker};
use crate::batch::Batch;
use crate::bridge::{Event, LogLevel};
use crate::config::{BrokerConfig, Endpoint, ProofMode};
use crate::connection::{
    close_connection, describe_error, frame_limit, open_connection, Redactor, CLOSE_WAIT,
};
use crate::declare::{self, declare, Decls};
use crate::events::{spawn_guarded, EventSink};
use crate::listener::{self, ListenerHandle};
use crate::publisher::{self, AckCtx, ChannelCtx, ChannelEnd, Job};
use crate::reconnect::{self, Client, End, Interrupt};
use futures_util::future::{BoxFuture, FutureExt};
use futures_util::stream::{Stream, StreamExt};
use lapin::options::ConfirmSelectOptions;
use lapin::types::ShortString;
use lapin::{Channel, Connection};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

/// Channel epochs grow across every broker and every AMQP thread of the process.
static EPOCH: AtomicU64 = AtomicU64::new(0);

/// A publishing task stops within this once told to (it selects on its stop signal everywhere).
const STOP_WAIT: Duration = Duration::from_secs(5);
/// How often a connected broker task checks that its connection is still up, in case the
/// connection died without an event.
const CONNECTION_CHECK: Duration = Duration::from_secs(1);
/// A declaration the broker refused (a binding to a queue not declared yet) is tried again
/// after this, on the live connection.
const DECLARE_RETRY: Duration = Duration::from_secs(10);

/// What the supervisor asks of a broker's task.
pub(crate) enum BrokerCmd {
    Configure(BrokerConfig),
    Publish(Batch),
    Reconnect,
    Shutdown,
}

/// What every broker task of the thread shares: one session and one record tracker per AMQP
/// thread (see `ack`).
#[derive(Clone)]
pub(crate) struct Shared {
    session: String,
    tracker: SharedTracker,
}

impl Shared {
    pub(crate) fn new() -> Self {
        Shared {
            session: ack::new_session(),
            tracker: SharedTracker::default(),
        }
    }
}

/// Starts the task of one broker; it runs until told to shut down.
pub(crate) fn start(
    config: BrokerConfig,
    sink: EventSink,
    shared: Shared,
) -> (mpsc::UnboundedSender<BrokerCmd>, JoinHandle<Option<()>>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let broker_id = config.broker_id;
    let task = BrokerTask {
        redactor: Redactor::new(&config.hosts),
        cfg: config,
        rx,
        sink: sink.clone(),
        reported_down: false,
        shared,
        listener: None,
        ack_invalid_warned: false,
        unrecorded: Vec::new(),
        changes: declare::Changes::default(),
    };
    let handle = spawn_guarded(sink, format!("broker {broker_id}: task"), task.run());
    (tx, handle)
}

/// A connection made by `connect`, with what was declared on it.
pub(crate) struct Session {
    conn: Arc<Connection>,
    /// The declarations already made on this connection.
    declared: Decls,
}

struct BrokerTask {
    cfg: BrokerConfig,
    rx: mpsc::UnboundedReceiver<BrokerCmd>,
    sink: EventSink,
    redactor: Redactor,
    /// A Disconnected event went out and no Connected since: do not repeat it every round.
    reported_down: bool,
    shared: Shared,
    /// The acknowledgement listener, in `AckQueue` mode.
    listener: Option<ListenerHandle>,
    /// The invalid acknowledgement queue name of the current configuration was logged.
    ack_invalid_warned: bool,
    /// Confirmed ids whose acknowledgement record the last publishing channel could not
    /// deliver: the next channel (on this connection or the next) records them first.
    unrecorded: Vec<i64>,
    /// Declarations on the live connection: in order, and what was refused.
    changes: declare::Changes,
}

impl Client for BrokerTask {
    type Conn = Session;

    fn config(&self) -> &BrokerConfig {
        &self.cfg
    }

    fn connect(&self, ep: Endpoint) -> BoxFuture<'static, Result<Session, String>> {
        connect(ep, self.cfg.clone(), self.sink.clone()).boxed()
    }

    /// Awaits `fut` while answering commands: not being connected, publishes fail at once.
    async fn wait_for<F: Future + Send>(&mut self, fut: F) -> Result<F::Output, Interrupt> {
        let mut fut = std::pin::pin!(fut);
        loop {
            tokio::select! {
                out = &mut fut => return Ok(out),
                cmd = self.rx.recv() => match cmd {
                    None | Some(BrokerCmd::Shutdown) => return Err(Interrupt::Stop),
                    Some(BrokerCmd::Reconnect) => return Err(Interrupt::Restart),
                    Some(BrokerCmd::Publish(mut batch)) => {
                        batch.unsent_because(format!("broker {} is not connected", self.id()));
                    }
                    Some(BrokerCmd::Configure(cfg)) => {
                        if self.apply_config(cfg) {
                            // New hosts: a fresh state, worth a fresh Disconnected if it fails.
                            self.reported_down = false;
                            return Err(Interrupt::Restart);
                        }
                    }
                },
            }
        }
    }

    fn serve(&mut self, ep: Endpoint, session: Session) -> impl Future<Output = End> + Send {
        // RabbitMQ checks a user_id property against the connection's user: receipts carry it,
        // so that a producer can tell who sent them (see outbound::build).
        let user = ShortString::try_new(ep.username.as_str()).ok();
        self.publish_on(ep.display_name(), user, session)
    }

    fn unreachable(&mut self, errors: Vec<String>) {
        let error = format!("cannot connect: {}", errors.join("; "));
        if self.reported_down {
            self.log(LogLevel::Debug, error);
        } else {
            self.report_down(error);
        }
    }

    fn no_hosts(&mut self) {
        self.report_down("no host is configured".to_string());
    }
}

impl BrokerTask {
    fn id(&self) -> i32 {
        self.cfg.broker_id
    }

    async fn run(mut self) {
        self.sync_listener();
        reconnect::drive(&mut self).await;
        if let Some(l) = self.listener.take() {
            l.stop(CLOSE_WAIT).await;
        }
    }

    /// Starts, updates or stops the listener to match the configuration.
    fn sync_listener(&mut self) {
        let wanted = ack::queue_in_use(&self.cfg).is_some();
        if self.cfg.proof == ProofMode::AckQueue && !wanted {
            if !self.ack_invalid_warned {
                self.ack_invalid_warned = true;
                self.log(
                    LogLevel::Warning,
                    format!(
                        "the acknowledgement queue name \"{}\" is empty or longer than 255 bytes: \
                         no acknowledgement records are published",
                        crate::amqp_values::truncate(&self.cfg.ack_queue.name, 40)
                    ),
                );
            }
        } else {
            self.ack_invalid_warned = false;
        }
        match (&mut self.listener, wanted) {
            (Some(l), true) => l.update(&self.cfg),
            (None, true) => {
                self.listener = Some(listener::start(
                    self.cfg.clone(),
                    self.shared.session.clone(),
                    self.shared.tracker.clone(),
                    self.sink.clone(),
                ));
            }
            (Some(_), false) => {
                // Detached: it closes its connection and ends on its own.
                if let Some(mut l) = self.listener.take() {
                    l.signal_stop();
                }
            }
            (None, false) => {}
        }
    }

    /// Stores a new configuration; true when the connection must be remade for it. A change of
    /// proof mode or acknowledgement queue reconnects too: records must never be published
    /// before their queue is declared, and a new channel starts a clean record sequence.
    fn apply_config(&mut self, cfg: BrokerConfig) -> bool {
        let reconnect = cfg.hosts != self.cfg.hosts
            || cfg.heartbeat_secs != self.cfg.heartbeat_secs
            || ack::queue_in_use(&cfg) != ack::queue_in_use(&self.cfg);
        self.redactor = Redactor::new(&cfg.hosts);
        self.cfg = cfg;
        self.sync_listener();
        reconnect
    }

    /// Connected: run publishing channels (a new one, with a new epoch, after a channel error)
    /// until the connection goes away or a command ends it.
    async fn publish_on(
        &mut self,
        host: String,
        user: Option<ShortString>,
        session: Session,
    ) -> End {
        let Session { conn, mut declared } = session;
        let mut conn_events: Pin<Box<dyn Stream<Item = lapin::Event> + Send>> =
            Box::pin(conn.events_listener());
        // The broker's resource alarm: while set, missing confirms are not a hang.
        let (blocked_tx, blocked_rx) = watch::channel(conn.status().blocked());
        if conn.status().blocked() {
            self.log(
                LogLevel::Info,
                format!("{host}: publishing paused: broker resource alarm"),
            );
        }
        let mut check = tokio::time::interval(CONNECTION_CHECK);
        // When declarations the broker refused are tried again.
        let mut declare_retry: Option<Instant> = None;
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

        loop {
            // A (new) publishing channel. Meanwhile publishes fail as Transient, as when
            // disconnected. Bounded: a channel closed by a connection that is dying (its status
            // not updated yet) is reopened on that connection, and the answer may never come.
            let limit = self.cfg.connect_timeout;
            let opening = tokio::time::timeout(limit, open_publishing_channel(&conn));
            let channel = match self.wait_for(opening).await {
                Ok(Ok(Ok(ch))) => ch,
                Ok(Ok(Err(e))) => {
                    let error = format!(
                        "{host}: cannot open a publishing channel: {}",
                        self.redactor.clean_secrets(&describe_error(&e))
                    );
                    self.report_down(error);
                    close_connection(&conn).await;
                    return End::Lost;
                }
                Ok(Err(_)) => {
                    self.report_down(format!(
                        "{host}: opening a publishing channel timed out after {limit:?}"
                    ));
                    close_connection(&conn).await;
                    return End::Lost;
                }
                Err(interrupt) => {
                    return self.end_session(&conn, &host, interrupt).await;
                }
            };
            // Declarations added while the channel was being (re)opened.
            self.declare_changes(&conn, &mut declared);
            let epoch = EPOCH.fetch_add(1, Ordering::SeqCst) + 1;
            let (job_tx, job_rx) = mpsc::unbounded_channel();
            let (stop_tx, stop_rx) = oneshot::channel();
            let ctx = ChannelCtx {
                broker_id: self.id(),
                epoch,
                channel: channel.clone(),
                conn: conn.clone(),
                sink: self.sink.clone(),
                redactor: self.redactor.clone(),
                confirm_timeout: self.cfg.confirm_timeout,
                frame_max: frame_limit(conn.configuration().frame_max()),
                user: user.clone(),
                blocked: blocked_rx.clone(),
                ack: self.ack_ctx(),
            };
            let mut pub_task = spawn_guarded(
                self.sink.clone(),
                format!("broker {}: publishing channel {epoch}", self.id()),
                publisher::run(ctx, job_rx, stop_rx, std::mem::take(&mut self.unrecorded)),
            );
            let mut running = Running {
                sink: self.sink.clone(),
                job_tx,
                stop_tx: Some(stop_tx),
                channel,
            };
            self.reported_down = false;
            self.sink.send(Event::Connected {
                broker_id: self.id(),
                host: host.clone(),
                epoch,
            });
            if *blocked_rx.borrow() {
                self.report_blocked(true);
            }

            // What ends this channel: Some(end of session), or None to open a new channel.
            let outcome: Option<End> = loop {
                tokio::select! {
                    end = &mut pub_task => {
                        let end = match end {
                            Ok(Some((end, unrecorded))) => {
                                self.unrecorded = unrecorded;
                                end
                            }
                            // Reported as a fatal event by spawn_guarded.
                            Ok(None) => ChannelEnd::Closed("publishing task panicked".into()),
                            Err(e) => {
                                self.sink.send(Event::Fatal(format!(
                                    "broker {}: publishing task failed: {e}", self.id()
                                )));
                                ChannelEnd::Closed("publishing task failed".into())
                            }
                        };
                        match end {
                            ChannelEnd::Hung(text) => {
                                self.report_down(format!("{host}: {text}"));
                                close_connection(&conn).await;
                                break Some(End::Lost);
                            }
                            ChannelEnd::Closed(text) => {
                                if conn.status().connected() {
                                    self.log(
                                        LogLevel::Warning,
                                        format!("{host}: publishing channel closed, reopening it: {text}"),
                                    );
                                    break None;
                                }
                                self.report_down(format!("{host}: connection lost: {text}"));
                                break Some(End::Lost);
                            }
                            ChannelEnd::Stopped => {
                                // Only we stop it, and we do not come back here after that.
                                break Some(End::Lost);
                            }
                            ChannelEnd::Refusing(text) => {
                                self.report_down(format!("{host}: {text}"));
                                close_connection(&conn).await;
                                break Some(End::Refused);
                            }
                        }
                    }
                    cmd = self.rx.recv() => match cmd {
                        Some(BrokerCmd::Publish(batch)) => {
                            // Refused only once the channel's task ended: dropped, the batch
                            // fails its messages itself.
                            let _ = running.job_tx.send(Job::Publish(batch));
                        }
                        Some(BrokerCmd::Configure(cfg)) => {
                            let old_timeout = self.cfg.confirm_timeout;
                            if self.apply_config(cfg) {
                                self.unrecorded = running.stop(&mut pub_task, "broker configuration changed").await;
                                self.report_down(format!("{host}: reconnecting: configuration changed"));
                                close_connection(&conn).await;
                                self.reported_down = false;
                                break Some(End::Restart);
                            }
                            if self.cfg.confirm_timeout != old_timeout {
                                let _ = running.job_tx.send(Job::SetConfirmTimeout(self.cfg.confirm_timeout));
                            }
                            self.declare_changes(&conn, &mut declared);
                        }
                        Some(BrokerCmd::Reconnect) => {
                            self.unrecorded = running.stop(&mut pub_task, "reconnect requested").await;
                            self.report_down(format!("{host}: reconnect requested"));
                            close_connection(&conn).await;
                            break Some(End::Restart);
                        }
                        None | Some(BrokerCmd::Shutdown) => {
                            self.unrecorded = running.stop(&mut pub_task, "shutting down").await;
                            let _ = tokio::time::timeout(
                                CLOSE_WAIT,
                                running.channel.close(200, "shutting down".into()),
                            )
                            .await;
                            close_connection(&conn).await;
                            break Some(End::Stop);
                        }
                    },
                    ev = conn_events.next() => {
                        let lost = match ev {
                            Some(lapin::Event::Error(e)) => (!conn.status().connected())
                                .then(|| self.redactor.clean_secrets(&describe_error(&e))),
                            Some(lapin::Event::ConnectionBlocked(reason)) => {
                                blocked_tx.send_replace(true);
                                self.report_blocked(true);
                                self.log(LogLevel::Info, format!(
                                    "{host}: publishing paused: broker resource alarm ({reason})"
                                ));
                                None
                            }
                            Some(lapin::Event::ConnectionUnblocked) => {
                                blocked_tx.send_replace(false);
                                self.report_blocked(false);
                                self.log(LogLevel::Info, format!("{host}: publishing resumed"));
                                None
                            }
                            Some(_) => None,
                            None => Some("connection closed".to_string()),
                        };
                        if let Some(text) = lost {
                            let why = format!("connection lost: {text}");
                            self.unrecorded = running.stop(&mut pub_task, &why).await;
                            self.report_down(format!("{host}: {why}"));
                            break Some(End::Lost);
                        }
                    }
                    _ = check.tick() => {
                        let refused = self.changes.take_failed();
                        if !refused.is_empty() {
                            declared = declared.minus(&refused);
                            declare_retry.get_or_insert(Instant::now() + DECLARE_RETRY);
                        }
                        if declare_retry.is_some_and(|at| at <= Instant::now()) {
                            declare_retry = None;
                            self.declare_changes(&conn, &mut declared);
                        }
                        if !conn.status().connected() {
                            let why = "connection lost: connection is no longer open".to_string();
                            self.unrecorded = running.stop(&mut pub_task, &why).await;
                            self.report_down(format!("{host}: {why}"));
                            break Some(End::Lost);
                        }
                    }
                }
            };
            if let Some(end) = outcome {
                return end;
            }
        }
    }

    /// The record settings of a new publishing channel.
    fn ack_ctx(&self) -> Option<AckCtx> {
        let q = ack::queue_in_use(&self.cfg)?;
        Some(AckCtx {
            queue: ShortString::try_new(q.name.as_str()).ok()?,
            session: self.shared.session.clone(),
            tracker: self.shared.tracker.clone(),
            wait: q.record_wait,
        })
    }

    /// Declares on the live connection what was configured since its declarations.
    fn declare_changes(&self, conn: &Arc<Connection>, declared: &mut Decls) {
        declare::declare_changes(
            conn,
            &self.cfg,
            declared,
            &self.sink,
            &self.redactor,
            &self.changes,
        );
    }

    /// Ends a session interrupted while it had no publishing channel.
    async fn end_session(&mut self, conn: &Connection, host: &str, interrupt: Interrupt) -> End {
        close_connection(conn).await;
        match interrupt {
            Interrupt::Stop => End::Stop,
            Interrupt::Restart => {
                self.report_down(format!("{host}: reconnecting"));
                self.reported_down = false;
                End::Restart
            }
        }
    }

    fn report_down(&mut self, error: String) {
        if self.reported_down {
            return;
        }
        self.reported_down = true;
        self.sink.send(Event::Disconnected {
            broker_id: self.id(),
            error: self.redactor.clean(&error),
        });
    }

    fn report_blocked(&self, blocked: bool) {
        self.sink.send(Event::Blocked {
            broker_id: self.id(),
            blocked,
        });
    }

    fn log(&self, level: LogLevel, message: String) {
        self.sink.send(Event::Log {
            level,
            message: format!("broker {}: {}", self.id(), self.redactor.clean(&message)),
        });
    }
}

/// The broker task's end of a publishing task.
struct Running {
    sink: EventSink,
    job_tx: mpsc::UnboundedSender<Job>,
    stop_tx: Option<oneshot::Sender<String>>,
    channel: Channel,
}

impl Running {
    /// Tells the publishing task to fail what it holds (Transient) and waits for it to finish;
    /// returns the confirmed ids it could not record.
    async fn stop(
        &mut self,
        task: &mut JoinHandle<Option<(ChannelEnd, Vec<i64>)>>,
        why: &str,
    ) -> Vec<i64> {
        if let Some(tx) = self.stop_tx.take() {
            let _ = tx.send(why.to_string());
        }
        match tokio::time::timeout(STOP_WAIT, &mut *task).await {
            Ok(Ok(Some((_, unrecorded)))) => unrecorded,
            Ok(_) => Vec::new(),
            Err(_) => {
                // Cannot happen (the task selects on its stop signal at every await), but if it
                // did, its messages would go unanswered: say so, the worker restarts.
                task.abort();
                self.sink.send(Event::Fatal(
                    "a publishing task did not stop; unconfirmed messages are unaccounted for"
                        .into(),
                ));
                Vec::new()
            }
        }
    }
}

/// Connects to one host, declares the exchanges, queues, bindings and acknowledgement queue,
/// and returns the connection. Bounded by the connect timeout (built here, inside the runtime).
async fn connect(ep: Endpoint, cfg: BrokerConfig, sink: EventSink) -> Result<Session, String> {
    let redactor = Redactor::new(std::slice::from_ref(&ep));
    let limit = cfg.connect_timeout;
    let conn = Arc::new(open_connection(&ep, &cfg, "broker", false).await?);
    let decls = Decls::of(&cfg);
    let declared = tokio::time::timeout(
        limit,
        declare(&conn, &decls, cfg.broker_id, &sink, &redactor),
    )
    .await;
    let Ok(failed) = declared else {
        close_connection(&conn).await;
        return Err(format!(
            "declaring exchanges and queues timed out after {limit:?}"
        ));
    };
    // What the broker refused is not declared: the session tries it again.
    Ok(Session {
        conn,
        declared: decls.minus(&failed),
    })
}

async fn open_publishing_channel(conn: &Connection) -> lapin::Result<Channel> {
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}
