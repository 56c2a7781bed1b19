//! What the worker tells the AMQP side about each broker: hosts, declarations, proof mode
//! and timeouts. Plain data.

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
    /// How long the ids of small commands wait to share one record.
    pub record_wait: RecordWait,
}

/// A command that leaves fewer than 64 ids unrecorded does not get a record of its own: the
/// record waits for the next commands' ids until they pause for `quiet`, at most `most` after
/// its first id. At moderate rates a command holds a message or two, and a record for each
/// would double what the broker stores, routes and delivers; a drain's large commands still get
/// theirs at once. The defaults suit every deployment; tests lengthen them to hold a record
/// back on purpose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordWait {
    /// A record goes once no command has come for this long. A deadline counted from the first
    /// id alone lands wherever the next message happens to be: at a steady 200 messages/s (one
    /// every 5 ms) each record went out with the next message and shared its way through the
    /// publishing task, the I/O loop and the broker. After a pause, the record follows its
    /// message while the way is clear; commands closer together than this share one record.
    pub quiet: Duration,
    /// How long published ids may wait for their record. Far below the worker's batching of the
    /// DELETE (20 ms), so rows are deleted no later; a loss is revealed this much later at most.
    pub most: Duration,
}

impl Default for RecordWait {
    fn default() -> Self {
        RecordWait {
            quiet: Duration::from_millis(1),
            most: Duration::from_millis(5),
        }
    }
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

/// Configurations for unit tests.
#[cfg(test)]
pub(crate) mod fixtures {
    use super::*;

    pub(crate) fn endpoint(host: &str, password: &str) -> Endpoint {
        Endpoint {
            host: host.into(),
            port: 5672,
            vhost: "/".into(),
            username: "u".into(),
            password: password.into(),
            tls: None,
        }
    }

    /// Confirm mode, short timeouts, no declarations.
    pub(crate) fn broker_config(hosts: Vec<Endpoint>) -> BrokerConfig {
        BrokerConfig {
            broker_id: 1,
            hosts,
            randomize_hosts: false,
            exchanges: vec![],
            queues: vec![],
            bindings: vec![],
            proof: ProofMode::Confirm,
            ack_queue: AckQueueConfig {
                name: "acks".into(),
                quorum: false,
                record_wait: RecordWait::default(),
            },
            connect_timeout: Duration::from_secs(3),
            heartbeat_secs: 7,
            confirm_timeout: Duration::from_secs(3),
            reconnect_min: Duration::from_millis(1),
            reconnect_max: Duration::from_millis(2),
        }
    }
}
