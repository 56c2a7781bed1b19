//! The active subscriptions, read from `amqp.subscription` with the hosts of their brokers
//! (the engine's [`Subscriptions`] decides what the AMQP thread is told).

use super::queries;
use crate::gucs::WorkerSettings;
use crate::worker::brokers::template;
use crate::worker::queries::load_brokers;
use amqp_outbox_broker::inbox::SubscriptionConfig;
pub use amqp_outbox_engine::consume::subscriptions::Subscriptions;
use pgrx::spi::{SpiClient, SpiResult};

/// Reads the tables; returns the configuration to send when it changed.
pub fn reload(
    subs: &mut Subscriptions,
    client: &SpiClient<'_>,
    settings: &WorkerSettings,
) -> SpiResult<Option<Vec<SubscriptionConfig>>> {
    let brokers = load_brokers(client, &template(settings))?;
    Ok(subs.update(queries::load_subscriptions(client)?, &brokers))
}
