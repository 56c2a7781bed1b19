//! The settings the delivery reads, as plain values. The host fills them from its own
//! configuration (the extension from its `amqp_outbox.*` settings, src/gucs.rs) and copies them
//! once per reload, so that a step never sees a setting change mid-way.

use amqp_outbox_broker::backoff::Backoff;
use std::time::Duration;

/// The settings the worker uses (and a relay would), copied once per reload.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerSettings {
    pub enabled: bool,
    pub max_message_size: usize,
    pub max_attempts: i32,
    pub naptime: Duration,
    pub batch_interval: Duration,
    pub batch_size: usize,
    pub max_in_flight: usize,
    pub max_in_flight_bytes: usize,
    pub connect_timeout: Duration,
    pub heartbeat_secs: u16,
    pub confirm_timeout: Duration,
    pub retry_backoff_min: Duration,
    pub retry_backoff_max: Duration,
    pub resend_after: Duration,
    pub ack_queue_quorum: bool,
    #[cfg(feature = "fault-injection")]
    pub lose_one_in: u32,
    #[cfg(feature = "fault-injection")]
    pub delete_after: Option<Duration>,
    pub max_pending: i32,
    pub randomize_hosts: bool,
    pub standby_names: String,
}

/// The defaults of the settings, one constant each: the extension declares its
/// `amqp_outbox.*` settings with them (src/gucs.rs), a relay starts from [`DEFAULTS`].
pub mod defaults {
    use std::time::Duration;

    pub const ENABLED: bool = true;
    pub const MAX_MESSAGE_SIZE: usize = 8 * 1024 * 1024;
    pub const MAX_ATTEMPTS: i32 = 10;
    pub const NAPTIME: Duration = Duration::from_millis(1000);
    pub const BATCH_INTERVAL: Duration = Duration::from_millis(2);
    pub const BATCH_SIZE: usize = 500;
    pub const MAX_IN_FLIGHT: usize = 2000;
    pub const MAX_IN_FLIGHT_BYTES: usize = 32 * 1024 * 1024;
    pub const CONNECT_TIMEOUT: Duration = Duration::from_millis(5000);
    pub const HEARTBEAT_SECS: u16 = 10;
    pub const CONFIRM_TIMEOUT: Duration = Duration::from_millis(15_000);
    pub const RETRY_BACKOFF_MIN: Duration = Duration::from_millis(200);
    pub const RETRY_BACKOFF_MAX: Duration = Duration::from_millis(60_000);
    pub const RESEND_AFTER: Duration = Duration::from_millis(30_000);
    pub const ACK_QUEUE_QUORUM: bool = false;
    pub const MAX_PENDING: i32 = 0;
    pub const RANDOMIZE_HOSTS: bool = false;

    /// Milliseconds of a default, as a setting in milliseconds declares it.
    pub const fn millis(d: Duration) -> i32 {
        d.as_millis() as i32
    }
}

/// Every default ([`defaults`]) as the settings a relay starts from.
pub const DEFAULTS: WorkerSettings = WorkerSettings {
    enabled: defaults::ENABLED,
    max_message_size: defaults::MAX_MESSAGE_SIZE,
    max_attempts: defaults::MAX_ATTEMPTS,
    naptime: defaults::NAPTIME,
    batch_interval: defaults::BATCH_INTERVAL,
    batch_size: defaults::BATCH_SIZE,
    max_in_flight: defaults::MAX_IN_FLIGHT,
    max_in_flight_bytes: defaults::MAX_IN_FLIGHT_BYTES,
    connect_timeout: defaults::CONNECT_TIMEOUT,
    heartbeat_secs: defaults::HEARTBEAT_SECS,
    confirm_timeout: defaults::CONFIRM_TIMEOUT,
    retry_backoff_min: defaults::RETRY_BACKOFF_MIN,
    retry_backoff_max: defaults::RETRY_BACKOFF_MAX,
    resend_after: defaults::RESEND_AFTER,
    ack_queue_quorum: defaults::ACK_QUEUE_QUORUM,
    #[cfg(feature = "fault-injection")]
    lose_one_in: 0,
    #[cfg(feature = "fault-injection")]
    delete_after: None,
    max_pending: defaults::MAX_PENDING,
    randomize_hosts: defaults::RANDOMIZE_HOSTS,
    standby_names: String::new(),
};

impl WorkerSettings {
    /// The product's one retry backoff, from `retry_backoff_min` and `retry_backoff_max`.
    pub fn retry_backoff(&self) -> Backoff {
        Backoff::new(self.retry_backoff_min, self.retry_backoff_max)
    }
}
