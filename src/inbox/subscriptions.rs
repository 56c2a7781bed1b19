//! The active subscriptions, read from `amqp.subscription` (paused ones are left out: their
//! consumers are closed) with the hosts of their brokers, and what is sent to the AMQP thread.

use super::queries;
use super::types::Sub;
use crate::gucs::WorkerSettings;
use crate::worker::brokers::template;
use crate::worker::queries::load_brokers;
use amqp_outbox_broker::inbox::SubscriptionConfig;
use pgrx::spi::{SpiClient, SpiResult};
use std::collections::BTreeMap;

#[derive(Default)]
pub struct Subscriptions {
    pub active: BTreeMap<String, Sub>,
    /// Active subscriptions that cannot consume, and why (for their status rows).
    pub problems: Vec<(String, String)>,
    /// What the AMQP thread was last told.
    sent: Option<Vec<SubscriptionConfig>>,
}

impl Subscriptions {
    /// Reads the tables; returns the configuration to send when it changed.
    pub fn reload(
        &mut self,
        client: &SpiClient<'_>,
        settings: &WorkerSettings,
    ) -> SpiResult<Option<Vec<SubscriptionConfig>>> {
        let brokers = load_brokers(client, &template(settings))?;
        let mut active = BTreeMap::new();
        let mut configs = Vec::new();
        let mut problems = Vec::new();
        for sub in queries::load_subscriptions(client)? {
            let broker = brokers.iter().find(|b| b.broker_id == sub.broker_id);
            match (broker, &sub.call) {
                (_, None) => problems.push((
                    sub.name.clone(),
                    sub.problem
                        .clone()
                        .unwrap_or_else(|| "the handler cannot run".to_string()),
                )),
                (None, _) => problems.push((
                    sub.name.clone(),
                    format!("broker {} does not exist in amqp.broker", sub.broker_id),
                )),
                (Some(broker), Some(_)) => configs.push(SubscriptionConfig {
                    subscription: sub.name.clone(),
                    broker: broker.clone(),
                    queue: sub.queue.clone(),
                    prefetch: sub.prefetch,
                }),
            }
            active.insert(sub.name.clone(), sub);
        }
        self.active = active;
        self.problems = problems;
        if self.sent.as_ref() == Some(&configs) {
            return Ok(None);
        }
        self.sent = Some(configs.clone());
        Ok(Some(configs))
    }

    /// Forget what was sent: the next reload sends again (after the extension reappeared).
    pub fn forget(&mut self) {
        self.sent = None;
        self.active.clear();
        self.problems.clear();
    }
}
