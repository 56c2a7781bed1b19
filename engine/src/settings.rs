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

impl WorkerSettings {
    /// The product's one retry backoff, from `retry_backoff_min` and `retry_backoff_max`.
    pub fn retry_backoff(&self) -> Backoff {
        Backoff::new(self.retry_backoff_min, self.retry_backoff_max)
    }
}
