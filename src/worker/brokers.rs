//! The brokers the AMQP thread works with: the engine's [`Brokers`] (read from the tables, sent
//! when they changed, orphans parked); here only what every broker of this database shares.

pub use amqp_outbox_engine::brokers::Brokers;

use crate::gucs::WorkerSettings;
use amqp_outbox_broker::BrokerConfig;

/// What every broker shares: the settings, and this database's acknowledgement queue.
pub(crate) fn template(s: &WorkerSettings) -> BrokerConfig {
    amqp_outbox_engine::brokers::template(s, crate::ack_queue::name())
}
