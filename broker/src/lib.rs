//! The AMQP side of amqp_outbox's worker. This crate does not depend on `pgrx`: it runs
//! on its own thread (tokio + lapin), and PostgreSQL's C API is single-threaded.
//!
//! The worker's main thread talks to it through [`BrokerHandle`]: it sends [`Command`]s and
//! receives [`Event`]s. Each batch of events is announced by a byte on a socket that the main
//! thread waits on (`WaitLatchOrSocket`), so a confirm wakes it at once without polling.

mod ack;
mod amqp_values;
pub mod backoff;
mod exchange_probe;
mod failover;
mod listener;
mod publisher;
mod supervisor;
mod thread;
mod tls;
mod wake;

pub use amqp_values::header_table_size;
pub use thread::spawn;

use std::fmt;
use std::time::Duration;

/// One host of a broker. Several hosts of one `broker_id` are alternatives (failover).
#[derive(Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
    pub vhost: String,
    pub username: String,
    pub password: String,
    /// `Some`: connect with TLS (`amqps`), verifying the server's certificate and host name.
    /// Never falls back to plaintext.
    pub tls: Option<TlsOptions>,
}

/// TLS settings of one host (columns `tls_*` of `amqp.broker`). Files are PEM, read by the
/// worker when it connects.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct TlsOptions {
    /// CA certificates to trust; `None`: the system's trust store.
    pub ca_file: Option<String>,
    /// Client certificate chain and its private key, for brokers that require one.
    pub cert_file: Option<String>,
    pub key_file: Option<String>,
    /// The name the certificate must carry, when it differs from `host`.
    pub server_name: Option<String>,
}

/// Never prints the password.
impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.display_name())
    }
}

impl Endpoint {
    /// `user@host:port/vhost`, safe to log.
    pub fn display_name(&self) -> String {
        format!(
            "{}@{}:{}{}{}",
            self.username,
            self.host,
            self.port,
            if self.vhost.starts_with('/') { "" } else { "/" },
            self.vhost
        )
    }
}

/// An exchange the worker declares on every (re)connection, before publishing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExchangeDecl {
    pub name: String,
    pub kind: String,
    pub passive: bool,
    pub durable: bool,
    pub auto_delete: bool,
}

/// A queue the worker declares on every (re)connection (`amqp.queue_declare()`).
#[derive(Clone, Debug, PartialEq)]
pub struct QueueDecl {
    pub name: String,
    pub durable: bool,
    pub auto_delete: bool,
    /// Queue arguments, e.g. `{"x-queue-type": "quorum"}` or a dead-letter exchange.
    pub arguments: serde_json::Map<String, serde_json::Value>,
}

/// A binding the worker declares on every (re)connection (`amqp.queue_bind()`), after the
/// exchanges and queues.
#[derive(Clone, Debug, PartialEq)]
pub struct BindingDecl {
    pub queue: String,
    pub exchange: String,
    pub routing_key: String,
    pub arguments: serde_json::Map<String, serde_json::Value>,
}

/// What the worker takes as proof that a message was delivered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProofMode {
    /// A positive publisher confirm without a return.
    Confirm,
    /// The confirm, and the acknowledgement record of the message seen on the acknowledgement
    /// queue by the listener (see [`Event::Acked`] and [`Event::Lost`]).
    AckQueue,
}

/// The broker-side acknowledgement queue of one database (`AckQueue` mode).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AckQueueConfig {
    /// Unique per database and cluster, so two databases can share a broker.
    pub name: String,
    /// Declare it with `x-queue-type = quorum` instead of a classic durable queue.
    pub quorum: bool,
}

/// Everything one broker connection needs. Sent again whenever anything changes; the
/// supervisor reconnects only when `hosts`, `heartbeat_secs`, or the acknowledgement setup
/// (`proof`, `ack_queue`) changed, or on [`Command::Reconnect`]. New exchanges, queues and
/// bindings are declared on the live connection.
#[derive(Clone, Debug, PartialEq)]
pub struct BrokerConfig {
    pub broker_id: i32,
    pub hosts: Vec<Endpoint>,
    /// Try the hosts in a random order on each round (spreads brokers' clients over a cluster),
    /// instead of in the listed order.
    pub randomize_hosts: bool,
    pub exchanges: Vec<ExchangeDecl>,
    pub queues: Vec<QueueDecl>,
    pub bindings: Vec<BindingDecl>,
    pub proof: ProofMode,
    /// Used when `proof` is `AckQueue`.
    pub ack_queue: AckQueueConfig,
    pub connect_timeout: Duration,
    /// AMQP heartbeat in seconds (0 disables it).
    pub heartbeat_secs: u16,
    /// A message not confirmed within this time means the connection is hung: it is closed.
    pub confirm_timeout: Duration,
    pub reconnect_min: Duration,
    pub reconnect_max: Duration,
}

/// One row of `amqp.message`, as the worker publishes it.
#[derive(Clone, Debug, PartialEq)]
pub struct OutboundMessage {
    pub id: i64,
    pub exchange: String,
    pub routing_key: String,
    pub body: Vec<u8>,
    /// 1 = transient, 2 = persistent.
    pub delivery_mode: u8,
    pub content_type: Option<String>,
    pub reply_to: Option<String>,
    pub correlation_id: Option<String>,
    /// Stable across every resend of this row.
    pub message_id: String,
    /// Seconds since the Unix epoch (AMQP `timestamp` property).
    pub timestamp: u64,
    /// Headers to send: the caller's (a JSON object) merged with the producer headers.
    pub headers: serde_json::Map<String, serde_json::Value>,
    /// Fault injection for tests: behave as if this message and its acknowledgement record were
    /// lost in transit (nothing is sent, no confirm is awaited; it is registered as published
    /// on the current channel, so a later acknowledgement record reports it [`Event::Lost`]).
    /// In `Confirm` mode nothing ever reports it: only the worker's own timeout does.
    pub lose_in_transit: bool,
}

#[derive(Debug)]
pub enum Command {
    /// The full set of brokers. Brokers no longer listed are disconnected.
    Configure(Vec<BrokerConfig>),
    /// Publish these, in this order, on the broker's current channel. With `solo`, each message
    /// is published only after the previous one is settled, so an error is attributable to it.
    ///
    /// Every message gets exactly one answer: its id in one [`Event::Confirmed`], or one
    /// [`Event::Failed`] (at once with [`Failure::Transient`] when the broker is not connected
    /// or not configured), unless the thread reports [`Event::Fatal`].
    ///
    /// Exception: a message with `lose_in_transit` that reaches a live publishing channel gets
    /// neither; in `AckQueue` mode it is reported [`Event::Lost`] once a later record of that
    /// channel arrives, otherwise the worker's own timeout handles it. (If the channel is down
    /// or dies before its turn, it fails `Transient` like any other.)
    ///
    /// In `AckQueue` mode the messages of each command (each message, with `solo`) are followed
    /// on the same channel by one acknowledgement record to `ack_queue` (default exchange,
    /// mandatory, persistent, `application/json`):
    /// `{"v":1,"session":"<hex u64 per AMQP thread>","epoch":E,"seq":N,"ids":[…]}`, `seq`
    /// numbering the records of channel `E` from 1. The record's own confirm is not reported.
    Publish {
        broker_id: i32,
        messages: Vec<OutboundMessage>,
        solo: bool,
    },
    /// Close and reopen this broker's connection (for `amqp.disconnect()`).
    Reconnect {
        broker_id: i32,
    },
    Shutdown,
}

/// How a publish failed, which decides what the worker does with the row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// Not the message's fault (connection lost, not connected, timeout): publish it again,
    /// without counting an attempt.
    Transient,
    /// The channel was closed by an error while this message was unconfirmed; the culprit may be
    /// another message. Publish it again alone (`solo`) to find out.
    Ambiguous,
    /// The broker nacked it: it could not take responsibility for it (an internal error, a
    /// queue refusing publishes while full or electing a leader). Not the message's fault:
    /// publish it again after a delay, without counting an attempt. After several nacks in a
    /// row the connection is replaced, since a channel can stay in that state.
    Nacked,
    /// This message was refused (returned as unroutable, channel error while it was the only
    /// one in flight): count an attempt, back off, park after the limit.
    Rejected,
    /// This message can never be published as it is (its properties do not fit in one frame
    /// of this connection, a property AMQP cannot carry): park it at once.
    Unsendable,
}

#[derive(Debug)]
pub enum Event {
    /// A connection and a confirm-mode channel are up. `epoch` grows with every new channel.
    Connected {
        broker_id: i32,
        host: String,
        epoch: u64,
    },
    /// The connection is down (or never came up); `error` never contains a password.
    Disconnected { broker_id: i32, error: String },
    /// Positively confirmed with no return: these rows are on the broker.
    Confirmed {
        broker_id: i32,
        epoch: u64,
        ids: Vec<i64>,
    },
    /// `AckQueue` mode: the listener saw the acknowledgement records of these messages, published
    /// on channel `epoch` of this process. (Records of another process are ignored.)
    Acked {
        broker_id: i32,
        epoch: u64,
        ids: Vec<i64>,
    },
    /// `AckQueue` mode, the gap rule: these messages were published on channel `epoch` before a
    /// message whose acknowledgement record has arrived, and their own record did not arrive
    /// first. Records of one channel reach the queue in order, so they were lost in transit
    /// (unless confirmed, which proves the message itself arrived).
    Lost {
        broker_id: i32,
        epoch: u64,
        ids: Vec<i64>,
    },
    /// Not delivered.
    Failed {
        broker_id: i32,
        id: i64,
        failure: Failure,
        error: String,
    },
    /// Something worth a log line that is not a state change of a connection.
    Log { level: LogLevel, message: String },
    /// The AMQP thread cannot go on (its runtime failed); the worker should exit and restart.
    Fatal(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogLevel {
    Debug,
    Info,
    Warning,
}

/// The worker's end of the bridge.
pub struct BrokerHandle {
    commands: tokio::sync::mpsc::UnboundedSender<Command>,
    events: std::sync::mpsc::Receiver<Event>,
    wake: wake::WakeReceiver,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl BrokerHandle {
    /// Returns false when the AMQP thread is gone.
    pub fn send(&self, command: Command) -> bool {
        self.commands.send(command).is_ok()
    }

    /// The file descriptor to wait on for readability; it becomes readable when events arrive.
    pub fn wake_fd(&self) -> std::os::fd::RawFd {
        self.wake.fd()
    }

    /// Takes every pending event (and consumes the wake-ups that announced them).
    pub fn drain_events(&self) -> Vec<Event> {
        self.wake.clear();
        self.events.try_iter().collect()
    }

    /// Asks the AMQP thread to stop and waits for it, at most `timeout`.
    pub fn shutdown(mut self, timeout: Duration) {
        let _ = self.commands.send(Command::Shutdown);
        if let Some(t) = self.thread.take() {
            let deadline = std::time::Instant::now() + timeout;
            while !t.is_finished() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}
