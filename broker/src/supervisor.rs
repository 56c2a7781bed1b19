//! The supervisor: one task per `broker_id`, each keeping one publishing connection to one of
//! its hosts at a time (failover in order, capped exponential backoff with jitter between full
//! rounds), and reporting one event per state change.

use crate::ack::{self, SharedTracker};
use crate::amqp_values::to_field_table;
use crate::failover::{self, Round};
use crate::listener::{self, ListenerHandle};
use crate::publisher::{self, describe_error, AckCtx, ChannelCtx, ChannelEnd, Job};
use crate::thread::{spawn_guarded, EventSink};
use crate::{
    AckQueueConfig, BindingDecl, BrokerConfig, Command, Endpoint, Event, ExchangeDecl, Failure,
    LogLevel, OutboundMessage, ProofMode, QueueDecl,
};
use futures_util::stream::{Stream, StreamExt};
use lapin::options::{
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{FieldTable, ShortString};
use lapin::uri::{AMQPAuthority, AMQPQueryString, AMQPUri, AMQPUserInfo};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

/// Channel epochs grow across every broker and every AMQP thread of the process.
static EPOCH: AtomicU64 = AtomicU64::new(0);

/// Bound on a clean close (channel.close / connection.close) before the socket is just dropped.
const CLOSE_WAIT: Duration = Duration::from_secs(2);
/// Bound on the whole shutdown of every broker task.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(5);
/// A publishing task stops within this once told to (it selects on its stop signal everywhere).
const STOP_WAIT: Duration = Duration::from_secs(5);
/// How often a connected broker task checks that its connection is still up, in case the
/// connection died without an event.
const CONNECTION_CHECK: Duration = Duration::from_secs(1);

/// Replaces a broker's passwords in any text that may reach a log: error strings come from
/// lapin and the OS, and we never want to rely on them leaving the URI out.
#[derive(Clone, Debug, Default)]
pub(crate) struct Redactor(Arc<Vec<String>>);

impl Redactor {
    pub(crate) fn new(hosts: &[Endpoint]) -> Self {
        let mut secrets: Vec<String> = Vec::new();
        for h in hosts {
            if h.password.is_empty() {
                continue;
            }
            secrets.push(h.password.clone());
            let encoded = percent_encode(&h.password);
            if encoded != h.password {
                secrets.push(encoded);
            }
        }
        // Longest first, so a password containing another is replaced whole.
        secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
        secrets.dedup();
        Redactor(Arc::new(secrets))
    }

    /// Masks what stands in a URI's password field (`scheme://user:PASSWORD@host`), by position.
    /// Safe on any text, also text a user wrote (an exchange name in a broker's error): it never
    /// looks for the password itself, so such text cannot be used to test a guess.
    pub(crate) fn clean(&self, text: &str) -> String {
        mask_uri_passwords(text)
    }

    /// For the error texts of the connection step (opening a connection or a channel, the
    /// connection's own errors), which no user writes: also every known password, and its
    /// percent-encoded form, wherever it stands. Apply it to the error alone, before the
    /// `user@host` it is reported with is put in front (a password may equal the user name).
    pub(crate) fn clean_secrets(&self, text: &str) -> String {
        let mut out = mask_uri_passwords(text);
        for s in self.0.iter() {
            if out.contains(s.as_str()) {
                out = out.replace(s.as_str(), "********");
            }
        }
        out
    }
}

/// `scheme://user:secret@host…` becomes `scheme://user:********@host…`, for every URI in `text`.
fn mask_uri_passwords(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("://") {
        let (head, tail) = rest.split_at(i + 3);
        out.push_str(head);
        let end = tail
            .find(|c: char| matches!(c, '/' | '?' | '#') || c.is_whitespace())
            .unwrap_or(tail.len());
        let authority = &tail[..end];
        match authority
            .rfind('@')
            .and_then(|at| authority[..at].find(':').map(|colon| (colon, at)))
        {
            Some((colon, at)) => {
                out.push_str(&authority[..=colon]);
                out.push_str("********");
                out.push_str(&authority[at..]);
            }
            None => out.push_str(authority),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Until the reconnect driver owns it.
pub(crate) fn backoff(min: Duration, max: Duration, n: u32) -> Duration {
    crate::backoff::Backoff::new(min, max).delay(n)
}

enum BrokerCmd {
    Configure(BrokerConfig),
    Publish {
        messages: Vec<OutboundMessage>,
        solo: bool,
    },
    Reconnect,
    Shutdown,
}

struct Slot {
    config: BrokerConfig,
    tx: mpsc::UnboundedSender<BrokerCmd>,
    task: JoinHandle<()>,
}

/// Runs until `Command::Shutdown` (or until the worker drops its handle).
pub(crate) async fn run(mut commands: mpsc::UnboundedReceiver<Command>, sink: EventSink) {
    // One session and one record tracker per AMQP thread (see `ack`).
    let shared = Shared {
        session: ack::new_session(),
        tracker: SharedTracker::default(),
    };
    let mut brokers: HashMap<i32, Slot> = HashMap::new();
    // Removed brokers still closing; awaited (bounded) at shutdown.
    let mut retiring: Vec<JoinHandle<()>> = Vec::new();

    while let Some(cmd) = commands.recv().await {
        match cmd {
            Command::Configure(configs) => {
                let mut wanted: HashMap<i32, BrokerConfig> = HashMap::new();
                for c in configs {
                    if wanted.contains_key(&c.broker_id) {
                        sink.send(Event::Log {
                            level: LogLevel::Warning,
                            message: format!(
                                "broker {} is configured twice; using the last entry",
                                c.broker_id
                            ),
                        });
                    }
                    wanted.insert(c.broker_id, c);
                }
                let removed: Vec<i32> = brokers
                    .keys()
                    .filter(|id| !wanted.contains_key(id))
                    .copied()
                    .collect();
                for id in removed {
                    if let Some(slot) = brokers.remove(&id) {
                        let _ = slot.tx.send(BrokerCmd::Shutdown);
                        retiring.push(slot.task);
                    }
                }
                for (id, config) in wanted {
                    match brokers.get_mut(&id) {
                        Some(slot) if !slot.task.is_finished() => {
                            if slot.config != config {
                                slot.config = config.clone();
                                let _ = slot.tx.send(BrokerCmd::Configure(config));
                            }
                        }
                        _ => {
                            brokers.insert(id, start_broker(config, sink.clone(), shared.clone()));
                        }
                    }
                }
                retiring.retain(|t| !t.is_finished());
            }
            Command::Publish {
                broker_id,
                messages,
                solo,
            } => {
                let undelivered = match brokers.get(&broker_id) {
                    Some(slot) => match slot.tx.send(BrokerCmd::Publish { messages, solo }) {
                        Ok(()) => None,
                        Err(mpsc::error::SendError(BrokerCmd::Publish { messages, .. })) => {
                            Some((messages, "the broker's task has stopped"))
                        }
                        Err(_) => None,
                    },
                    None => Some((messages, "broker is not configured")),
                };
                if let Some((messages, why)) = undelivered {
                    for m in messages {
                        sink.send(Event::Failed {
                            broker_id,
                            id: m.id,
                            failure: Failure::Transient,
                            error: format!("broker {broker_id}: {why}"),
                        });
                    }
                }
            }
            Command::Reconnect { broker_id } => {
                if let Some(slot) = brokers.get(&broker_id) {
                    let _ = slot.tx.send(BrokerCmd::Reconnect);
                }
            }
            Command::Shutdown => break,
        }
    }

    for slot in brokers.values() {
        let _ = slot.tx.send(BrokerCmd::Shutdown);
    }
    retiring.extend(brokers.into_values().map(|s| s.task));
    let all = futures_util::future::join_all(retiring);
    let _ = tokio::time::timeout(SHUTDOWN_WAIT, all).await;
}

/// What every broker task of the thread shares.
#[derive(Clone)]
struct Shared {
    session: String,
    tracker: SharedTracker,
}

fn start_broker(config: BrokerConfig, sink: EventSink, shared: Shared) -> Slot {
    let (tx, rx) = mpsc::unbounded_channel();
    let task = BrokerTask {
        redactor: Redactor::new(&config.hosts),
        cfg: config.clone(),
        rx,
        sink: sink.clone(),
        reported_down: false,
        failures: 0,
        refused_in_a_row: 0,
        shared,
        listener: None,
        ack_invalid_warned: false,
    };
    let broker_id = config.broker_id;
    let handle = spawn_guarded(sink, format!("broker {broker_id}: task"), task.run());
    Slot {
        config,
        tx,
        task: handle,
    }
}

/// Why waiting (connecting, backing off) was cut short.
enum Interrupt {
    Shutdown,
    /// Start over now: Reconnect, or a configuration change that needs a new connection.
    Restart,
}

/// How a connected session ended.
enum SessionEnd {
    Shutdown,
    /// Reconnect at once (requested, or new configuration).
    Restart,
    /// The connection was lost; reconnect after the minimum delay.
    Lost,
    /// The broker kept nacking: reconnect after a delay that grows while this repeats.
    Refused,
}

struct Session {
    conn: Arc<Connection>,
    host: String,
    /// The declarations already made on this connection.
    declared: Decls,
}

/// Everything declared on (re)connection, in this order: exchanges, queues, bindings, then the
/// acknowledgement queue (`AckQueue` mode).
#[derive(Clone, Debug, Default, PartialEq)]
struct Decls {
    exchanges: Vec<ExchangeDecl>,
    queues: Vec<QueueDecl>,
    bindings: Vec<BindingDecl>,
    ack_queue: Option<AckQueueConfig>,
}

impl Decls {
    fn of(cfg: &BrokerConfig) -> Self {
        Decls {
            exchanges: cfg.exchanges.clone(),
            queues: cfg.queues.clone(),
            bindings: cfg.bindings.clone(),
            ack_queue: ack_queue_of(cfg).cloned(),
        }
    }

    /// What `self` has that `done` has not.
    fn minus(&self, done: &Decls) -> Decls {
        fn new<T: Clone + PartialEq>(all: &[T], done: &[T]) -> Vec<T> {
            all.iter().filter(|d| !done.contains(d)).cloned().collect()
        }
        Decls {
            exchanges: new(&self.exchanges, &done.exchanges),
            queues: new(&self.queues, &done.queues),
            bindings: new(&self.bindings, &done.bindings),
            ack_queue: self
                .ack_queue
                .clone()
                .filter(|q| done.ack_queue.as_ref() != Some(q)),
        }
    }

    fn is_empty(&self) -> bool {
        self.exchanges.is_empty()
            && self.queues.is_empty()
            && self.bindings.is_empty()
            && self.ack_queue.is_none()
    }
}

/// The acknowledgement queue, when records are to be published (`AckQueue` mode with a usable
/// queue name).
fn ack_queue_of(cfg: &BrokerConfig) -> Option<&AckQueueConfig> {
    (cfg.proof == ProofMode::AckQueue && ack::valid_queue_name(&cfg.ack_queue.name))
        .then_some(&cfg.ack_queue)
}

struct BrokerTask {
    cfg: BrokerConfig,
    rx: mpsc::UnboundedReceiver<BrokerCmd>,
    sink: EventSink,
    redactor: Redactor,
    /// A Disconnected event went out and no Connected since: do not repeat it every round.
    reported_down: bool,
    /// Sessions in a row given up because the broker kept nacking.
    refused_in_a_row: u32,
    /// Consecutive failed rounds over all hosts.
    failures: u32,
    shared: Shared,
    /// The acknowledgement listener, in `AckQueue` mode.
    listener: Option<ListenerHandle>,
    /// The invalid acknowledgement queue name of the current configuration was logged.
    ack_invalid_warned: bool,
}

impl failover::Interruptible for BrokerTask {
    type Interrupt = Interrupt;
    fn wait_for<F: Future + Send>(
        &mut self,
        fut: F,
    ) -> impl Future<Output = Result<F::Output, Interrupt>> + Send {
        self.waiting(fut)
    }
}

impl BrokerTask {
    fn id(&self) -> i32 {
        self.cfg.broker_id
    }

    async fn run(mut self) {
        self.sync_listener();
        self.run_connections().await;
        if let Some(l) = self.listener.take() {
            l.stop(CLOSE_WAIT).await;
        }
    }

    /// Starts, updates or stops the listener to match the configuration.
    fn sync_listener(&mut self) {
        let wanted = ack_queue_of(&self.cfg).is_some();
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

    async fn run_connections(&mut self) {
        let mut delay: Option<Duration> = None;
        loop {
            if let Some(d) = delay.take() {
                match self.waiting(tokio::time::sleep(d)).await {
                    Ok(()) | Err(Interrupt::Restart) => {}
                    Err(Interrupt::Shutdown) => return,
                }
            }
            if self.cfg.hosts.is_empty() {
                self.report_down("no host is configured".to_string());
                match self.waiting(std::future::pending::<()>()).await {
                    Err(Interrupt::Shutdown) => return,
                    _ => continue,
                }
            }
            let cfg = self.cfg.clone();
            let sink = self.sink.clone();
            let round =
                failover::round(self, &cfg, |ep| connect(ep, cfg.clone(), sink.clone())).await;
            let session = match round {
                Round::Connected(_, session) => session,
                Round::Interrupted(Interrupt::Shutdown) => return,
                Round::Interrupted(Interrupt::Restart) => continue,
                Round::Failed(errors) => {
                    self.failures = self.failures.saturating_add(1);
                    let error = format!("cannot connect: {}", errors.join("; "));
                    if self.reported_down {
                        self.log(LogLevel::Debug, error);
                    } else {
                        self.report_down(error);
                    }
                    delay = Some(backoff(
                        self.cfg.reconnect_min,
                        self.cfg.reconnect_max,
                        self.failures - 1,
                    ));
                    continue;
                }
            };
            self.failures = 0;
            match self.serve(session).await {
                SessionEnd::Shutdown => return,
                SessionEnd::Restart => {}
                SessionEnd::Lost => {
                    self.refused_in_a_row = 0;
                    delay = Some(backoff(self.cfg.reconnect_min, self.cfg.reconnect_max, 0))
                }
                SessionEnd::Refused => {
                    delay = Some(backoff(
                        self.cfg.reconnect_min,
                        self.cfg.reconnect_max,
                        self.refused_in_a_row,
                    ));
                    self.refused_in_a_row = self.refused_in_a_row.saturating_add(1);
                }
            }
        }
    }

    /// Awaits `fut` while answering commands: not being connected, publishes fail at once.
    async fn waiting<F: Future>(&mut self, fut: F) -> Result<F::Output, Interrupt> {
        let mut fut = std::pin::pin!(fut);
        loop {
            tokio::select! {
                out = &mut fut => return Ok(out),
                cmd = self.rx.recv() => match cmd {
                    None | Some(BrokerCmd::Shutdown) => return Err(Interrupt::Shutdown),
                    Some(BrokerCmd::Reconnect) => return Err(Interrupt::Restart),
                    Some(BrokerCmd::Publish { messages, .. }) => {
                        let why = format!("broker {} is not connected", self.id());
                        self.fail_all(messages, &why);
                    }
                    Some(BrokerCmd::Configure(cfg)) => {
                        if self.apply_config(cfg) {
                            // New hosts: a fresh state, worth a fresh Disconnected if it fails.
                            self.reported_down = false;
                            self.failures = 0;
                            return Err(Interrupt::Restart);
                        }
                    }
                },
            }
        }
    }

    /// Stores a new configuration; true when the connection must be remade for it. A change of
    /// proof mode or acknowledgement queue reconnects too: records must never be published
    /// before their queue is declared, and a new channel starts a clean record sequence.
    fn apply_config(&mut self, cfg: BrokerConfig) -> bool {
        let reconnect = cfg.hosts != self.cfg.hosts
            || cfg.heartbeat_secs != self.cfg.heartbeat_secs
            || ack_queue_of(&cfg) != ack_queue_of(&self.cfg);
        self.redactor = Redactor::new(&cfg.hosts);
        self.cfg = cfg;
        self.sync_listener();
        reconnect
    }

    /// Connected: run publishing channels (a new one, with a new epoch, after a channel error)
    /// until the connection goes away or a command ends it.
    async fn serve(&mut self, session: Session) -> SessionEnd {
        let Session {
            conn,
            host,
            mut declared,
        } = session;
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
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

        loop {
            // A (new) publishing channel. Meanwhile publishes fail as Transient, as when
            // disconnected. Bounded: a channel closed by a connection that is dying (its status
            // not updated yet) is reopened on that connection, and the answer may never come.
            let limit = self.cfg.connect_timeout;
            let opening = tokio::time::timeout(limit, open_publishing_channel(&conn));
            let channel = match self.waiting(opening).await {
                Ok(Ok(Ok(ch))) => ch,
                Ok(Ok(Err(e))) => {
                    let error = format!(
                        "{host}: cannot open a publishing channel: {}",
                        self.redactor.clean_secrets(&describe_error(&e))
                    );
                    self.report_down(error);
                    close_connection(&conn).await;
                    return SessionEnd::Lost;
                }
                Ok(Err(_)) => {
                    self.report_down(format!(
                        "{host}: opening a publishing channel timed out after {limit:?}"
                    ));
                    close_connection(&conn).await;
                    return SessionEnd::Lost;
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
                blocked: blocked_rx.clone(),
                ack: self.ack_ctx(),
            };
            let mut pub_task = tokio::spawn(publisher::run(ctx, job_rx, stop_rx));
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

            // What ends this channel: Some(end of session), or None to open a new channel.
            let outcome: Option<SessionEnd> = loop {
                tokio::select! {
                    end = &mut pub_task => {
                        let end = match end {
                            Ok(end) => end,
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
                                break Some(SessionEnd::Lost);
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
                                break Some(SessionEnd::Lost);
                            }
                            ChannelEnd::Stopped => {
                                // Only we stop it, and we do not come back here after that.
                                break Some(SessionEnd::Lost);
                            }
                            ChannelEnd::Refusing(text) => {
                                self.report_down(format!("{host}: {text}"));
                                close_connection(&conn).await;
                                break Some(SessionEnd::Refused);
                            }
                        }
                    }
                    cmd = self.rx.recv() => match cmd {
                        Some(BrokerCmd::Publish { messages, solo }) => {
                            if let Err(mpsc::error::SendError(Job::Publish { messages, .. })) =
                                running.job_tx.send(Job::Publish { messages, solo })
                            {
                                self.fail_all(messages, "publishing channel closed");
                            }
                        }
                        Some(BrokerCmd::Configure(cfg)) => {
                            let old_timeout = self.cfg.confirm_timeout;
                            if self.apply_config(cfg) {
                                running.stop(&mut pub_task, "broker configuration changed").await;
                                self.report_down(format!("{host}: reconnecting: configuration changed"));
                                close_connection(&conn).await;
                                self.reported_down = false;
                                break Some(SessionEnd::Restart);
                            }
                            if self.cfg.confirm_timeout != old_timeout {
                                let _ = running.job_tx.send(Job::SetConfirmTimeout(self.cfg.confirm_timeout));
                            }
                            self.declare_changes(&conn, &mut declared);
                        }
                        Some(BrokerCmd::Reconnect) => {
                            running.stop(&mut pub_task, "reconnect requested").await;
                            self.report_down(format!("{host}: reconnect requested"));
                            close_connection(&conn).await;
                            break Some(SessionEnd::Restart);
                        }
                        None | Some(BrokerCmd::Shutdown) => {
                            running.stop(&mut pub_task, "shutting down").await;
                            let _ = tokio::time::timeout(
                                CLOSE_WAIT,
                                running.channel.close(200, "shutting down".into()),
                            )
                            .await;
                            close_connection(&conn).await;
                            break Some(SessionEnd::Shutdown);
                        }
                    },
                    ev = conn_events.next() => {
                        let lost = match ev {
                            Some(lapin::Event::Error(e)) => (!conn.status().connected())
                                .then(|| self.redactor.clean_secrets(&describe_error(&e))),
                            Some(lapin::Event::ConnectionBlocked(reason)) => {
                                blocked_tx.send_replace(true);
                                self.log(LogLevel::Info, format!(
                                    "{host}: publishing paused: broker resource alarm ({reason})"
                                ));
                                None
                            }
                            Some(lapin::Event::ConnectionUnblocked) => {
                                blocked_tx.send_replace(false);
                                self.log(LogLevel::Info, format!("{host}: publishing resumed"));
                                None
                            }
                            Some(_) => None,
                            None => Some("connection closed".to_string()),
                        };
                        if let Some(text) = lost {
                            let why = format!("connection lost: {text}");
                            running.stop(&mut pub_task, &why).await;
                            self.report_down(format!("{host}: {why}"));
                            break Some(SessionEnd::Lost);
                        }
                    }
                    _ = check.tick() => {
                        if !conn.status().connected() {
                            let why = "connection lost: connection is no longer open".to_string();
                            running.stop(&mut pub_task, &why).await;
                            self.report_down(format!("{host}: {why}"));
                            break Some(SessionEnd::Lost);
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
        let q = ack_queue_of(&self.cfg)?;
        Some(AckCtx {
            queue: ShortString::try_new(q.name.as_str()).ok()?,
            session: self.shared.session.clone(),
            tracker: self.shared.tracker.clone(),
        })
    }

    /// Declares (in the background, on its own channel) what was configured since the
    /// connection's declarations: a new configuration does not need a new connection for that.
    fn declare_changes(&self, conn: &Arc<Connection>, declared: &mut Decls) {
        let all = Decls::of(&self.cfg);
        let new = all.minus(declared);
        *declared = all;
        if new.is_empty() {
            return;
        }
        let conn = conn.clone();
        let (id, sink, redactor, limit) = (
            self.id(),
            self.sink.clone(),
            self.redactor.clone(),
            self.cfg.connect_timeout,
        );
        tokio::spawn(async move {
            let work = declare(&conn, &new, id, &sink, &redactor);
            if tokio::time::timeout(limit, work).await.is_err() {
                sink.send(Event::Log {
                    level: LogLevel::Warning,
                    message: format!("broker {id}: declaring exchanges and queues timed out"),
                });
            }
        });
    }

    /// Ends a session interrupted while it had no publishing channel.
    async fn end_session(
        &mut self,
        conn: &Connection,
        host: &str,
        interrupt: Interrupt,
    ) -> SessionEnd {
        close_connection(conn).await;
        match interrupt {
            Interrupt::Shutdown => SessionEnd::Shutdown,
            Interrupt::Restart => {
                self.report_down(format!("{host}: reconnecting"));
                self.reported_down = false;
                SessionEnd::Restart
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

    fn log(&self, level: LogLevel, message: String) {
        self.sink.send(Event::Log {
            level,
            message: format!("broker {}: {}", self.id(), self.redactor.clean(&message)),
        });
    }

    fn fail_all(&self, messages: Vec<OutboundMessage>, why: &str) {
        let error = self.redactor.clean(why);
        for m in messages {
            self.sink.send(Event::Failed {
                broker_id: self.id(),
                id: m.id,
                failure: Failure::Transient,
                error: error.clone(),
            });
        }
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
    /// Tells the publishing task to fail what it holds (Transient) and waits for it to finish.
    async fn stop(&mut self, task: &mut JoinHandle<ChannelEnd>, why: &str) {
        if let Some(tx) = self.stop_tx.take() {
            let _ = tx.send(why.to_string());
        }
        if task.is_finished() {
            let _ = task.await;
            return;
        }
        if tokio::time::timeout(STOP_WAIT, &mut *task).await.is_err() {
            // Cannot happen (the task selects on its stop signal at every await), but if it
            // did, its messages would go unanswered: say so, the worker restarts.
            task.abort();
            self.sink.send(Event::Fatal(
                "a publishing task did not stop; unconfirmed messages are unaccounted for".into(),
            ));
        }
    }
}

pub(crate) fn uri_for(ep: &Endpoint, cfg: &BrokerConfig) -> AMQPUri {
    // Built field by field: no URI string holding the password is ever formatted.
    AMQPUri {
        scheme: crate::tls::scheme_of(ep),
        authority: AMQPAuthority {
            userinfo: AMQPUserInfo {
                username: ep.username.clone(),
                password: ep.password.clone(),
            },
            host: ep.host.clone(),
            port: ep.port,
        },
        vhost: ep.vhost.clone(),
        query: AMQPQueryString {
            heartbeat: Some(cfg.heartbeat_secs),
            connection_timeout: u64::try_from(cfg.connect_timeout.as_millis())
                .ok()
                .filter(|ms| *ms > 0),
            ..AMQPQueryString::default()
        },
    }
}

/// Opens a connection to one host (TLS when configured), named for RabbitMQ's connection list,
/// within the connect timeout (built here, inside the runtime). Errors carry no password.
pub(crate) async fn open_connection(
    ep: &Endpoint,
    cfg: &BrokerConfig,
    role: &str,
) -> Result<Connection, String> {
    let props = ConnectionProperties::default().with_connection_name(
        format!(
            "amqp_outbox {role} {} (pid {})",
            cfg.broker_id,
            std::process::id()
        )
        .into(),
    );
    let limit = cfg.connect_timeout;
    match tokio::time::timeout(limit, crate::tls::connect(ep, cfg, props)).await {
        Err(_) => Err(format!("connection timed out after {limit:?}")),
        Ok(Err(e)) => Err(Redactor::new(std::slice::from_ref(ep)).clean_secrets(&e)),
        Ok(Ok(c)) => Ok(c),
    }
}

/// Connects to one host, declares the exchanges, queues, bindings and acknowledgement queue,
/// and returns the connection. Bounded by the connect timeout (built here, inside the runtime).
async fn connect(ep: Endpoint, cfg: BrokerConfig, sink: EventSink) -> Result<Session, String> {
    let redactor = Redactor::new(std::slice::from_ref(&ep));
    let limit = cfg.connect_timeout;
    let conn = Arc::new(open_connection(&ep, &cfg, "broker").await?);
    let decls = Decls::of(&cfg);
    let declared = tokio::time::timeout(
        limit,
        declare(&conn, &decls, cfg.broker_id, &sink, &redactor),
    )
    .await;
    if declared.is_err() {
        close_connection(&conn).await;
        return Err(format!(
            "declaring exchanges and queues timed out after {limit:?}"
        ));
    }
    Ok(Session {
        conn,
        host: ep.display_name(),
        declared: decls,
    })
}

async fn open_publishing_channel(conn: &Connection) -> lapin::Result<Channel> {
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}

/// Declares on a channel of their own, so a failed declaration (which closes its channel) never
/// touches the publishing channel. A failure is a warning; the others are still declared.
async fn declare(
    conn: &Connection,
    decls: &Decls,
    broker_id: i32,
    sink: &EventSink,
    redactor: &Redactor,
) {
    let warn = |message: String| {
        sink.send(Event::Log {
            level: LogLevel::Warning,
            message: format!("broker {broker_id}: {}", redactor.clean(&message)),
        })
    };
    let mut channel: Option<Channel> = None;
    for d in &decls.exchanges {
        let Some(name) = short_name(&d.name, "exchange", &warn) else {
            continue;
        };
        let Some(ch) = usable_channel(conn, &mut channel, &warn).await else {
            return;
        };
        let options = ExchangeDeclareOptions {
            passive: d.passive,
            durable: d.durable,
            auto_delete: d.auto_delete,
            internal: false,
            nowait: false,
        };
        match ch
            .exchange_declare(name, exchange_kind(&d.kind), options, FieldTable::default())
            .await
        {
            Ok(()) => channel = Some(ch),
            // The broker closed that channel; the next declaration opens another.
            Err(e) => warn(format!(
                "cannot declare exchange \"{}\" ({}): {}",
                d.name,
                d.kind,
                describe_error(&e)
            )),
        }
    }
    let ack_queue = decls.ack_queue.as_ref().map(|q| QueueDecl {
        name: q.name.clone(),
        durable: true,
        auto_delete: false,
        arguments: ack::ack_queue_arguments(q),
    });
    for (d, what) in decls
        .queues
        .iter()
        .map(|d| (d, "queue"))
        .chain(ack_queue.iter().map(|d| (d, "acknowledgement queue")))
    {
        let Some(name) = short_name(&d.name, what, &warn) else {
            continue;
        };
        let args = match to_field_table(&d.arguments) {
            Ok(a) => a,
            Err(e) => {
                warn(format!(
                    "{what} \"{}\" not declared: arguments: {e}",
                    d.name
                ));
                continue;
            }
        };
        let Some(ch) = usable_channel(conn, &mut channel, &warn).await else {
            return;
        };
        let options = QueueDeclareOptions {
            passive: false,
            durable: d.durable,
            exclusive: false,
            auto_delete: d.auto_delete,
            nowait: false,
        };
        match ch.queue_declare(name, options, args).await {
            Ok(_) => channel = Some(ch),
            Err(e) => warn(format!(
                "cannot declare {what} \"{}\": {}",
                d.name,
                describe_error(&e)
            )),
        }
    }
    for b in &decls.bindings {
        let (Some(queue), Some(exchange), Some(key)) = (
            short_name(&b.queue, "binding queue", &warn),
            short_name(&b.exchange, "binding exchange", &warn),
            short_name(&b.routing_key, "binding routing key", &warn),
        ) else {
            continue;
        };
        let args = match to_field_table(&b.arguments) {
            Ok(a) => a,
            Err(e) => {
                warn(format!(
                    "binding of queue \"{}\" to exchange \"{}\" not declared: arguments: {e}",
                    b.queue, b.exchange
                ));
                continue;
            }
        };
        let Some(ch) = usable_channel(conn, &mut channel, &warn).await else {
            return;
        };
        match ch
            .queue_bind(queue, exchange, key, QueueBindOptions::default(), args)
            .await
        {
            Ok(()) => channel = Some(ch),
            Err(e) => warn(format!(
                "cannot bind queue \"{}\" to exchange \"{}\" with key \"{}\": {}",
                b.queue,
                b.exchange,
                b.routing_key,
                describe_error(&e)
            )),
        }
    }
    if let Some(ch) = channel {
        let _ = ch.close(200, "declared".into()).await;
    }
}

/// The name as a ShortString, or a warning when it is longer than 255 bytes.
fn short_name(name: &str, what: &str, warn: &impl Fn(String)) -> Option<ShortString> {
    match ShortString::try_new(name) {
        Ok(s) => Some(s),
        Err(_) => {
            warn(format!(
                "{what} name longer than 255 bytes, not declared: {}...",
                crate::amqp_values::truncate(name, 40)
            ));
            None
        }
    }
}

/// The declaration channel: the open one, or a new one after a failed declaration closed it.
/// None (after a warning) when no channel can be opened.
async fn usable_channel(
    conn: &Connection,
    channel: &mut Option<Channel>,
    warn: &impl Fn(String),
) -> Option<Channel> {
    match channel.take() {
        Some(ch) if ch.status().connected() => Some(ch),
        _ => match conn.create_channel().await {
            Ok(ch) => Some(ch),
            Err(e) => {
                warn(format!(
                    "cannot open a channel to declare exchanges and queues: {}",
                    describe_error(&e)
                ));
                None
            }
        },
    }
}

fn exchange_kind(kind: &str) -> ExchangeKind {
    match kind {
        "direct" => ExchangeKind::Direct,
        "fanout" => ExchangeKind::Fanout,
        "topic" => ExchangeKind::Topic,
        "headers" => ExchangeKind::Headers,
        other => ExchangeKind::Custom(other.to_string()),
    }
}

/// A clean close when the broker answers, bounded when it does not.
pub(crate) async fn close_connection(conn: &Connection) {
    if conn.status().connected() {
        let _ = tokio::time::timeout(CLOSE_WAIT, conn.close(200, "OK".into())).await;
    }
}

/// The frame size to fit content headers into: the negotiated one (0 would mean "no limit",
/// which RabbitMQ never negotiates; taken as the protocol's largest frame).
fn frame_limit(negotiated: u32) -> usize {
    if negotiated == 0 {
        u32::MAX as usize
    } else {
        negotiated as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(password: &str) -> Endpoint {
        Endpoint {
            host: "h".into(),
            port: 5672,
            vhost: "/".into(),
            username: "u".into(),
            password: password.into(),
            tls: None,
        }
    }

    #[test]
    fn connection_errors_lose_passwords_and_their_encoding() {
        let r = Redactor::new(&[ep("s3cr/t p@ss"), ep(""), ep("other")]);
        let text = "auth failed for amqp://u:s3cr%2Ft%20p%40ss@h and s3cr/t p@ss, other";
        let clean = r.clean_secrets(text);
        assert!(!clean.contains("s3cr"), "{clean}");
        assert!(!clean.contains("other"), "{clean}");
        assert!(clean.contains("amqp://u:********@h"), "{clean}");
        // An empty password redacts nothing.
        assert_eq!(Redactor::new(&[ep("")]).clean_secrets("abc"), "abc");
    }

    #[test]
    fn other_text_is_masked_by_position_only() {
        // A password cannot be confirmed by naming an exchange after a guess...
        let r = Redactor::new(&[ep("guest")]);
        let text = "404 NOT_FOUND - no exchange 'guest' in vhost '/'";
        assert_eq!(r.clean(text), text);
        // ...and a user name equal to the password stays readable...
        assert_eq!(r.clean("guest@127.0.0.1:5672/"), "guest@127.0.0.1:5672/");
        // ...while a URI's password field is always masked.
        assert_eq!(
            r.clean("see amqps://app:hunter2@rabbit:5671/%2F and amqp://h/x"),
            "see amqps://app:********@rabbit:5671/%2F and amqp://h/x"
        );
    }

    #[test]
    fn endpoint_debug_has_no_password() {
        let e = ep("hunter2");
        assert!(!format!("{e:?}").contains("hunter2"));
        let uri = uri_for(
            &e,
            &BrokerConfig {
                broker_id: 1,
                hosts: vec![e.clone()],
                randomize_hosts: false,
                exchanges: vec![],
                queues: vec![],
                bindings: vec![],
                proof: crate::ProofMode::Confirm,
                ack_queue: crate::AckQueueConfig {
                    name: "acks".into(),
                    quorum: false,
                },
                connect_timeout: Duration::from_secs(3),
                heartbeat_secs: 7,
                confirm_timeout: Duration::from_secs(3),
                reconnect_min: Duration::from_secs(1),
                reconnect_max: Duration::from_secs(2),
            },
        );
        assert_eq!(uri.scheme, lapin::uri::AMQPScheme::AMQP);
        assert_eq!(uri.query.heartbeat, Some(7));
        assert_eq!(uri.query.connection_timeout, Some(3000));
        assert_eq!(uri.vhost, "/");
    }
}
