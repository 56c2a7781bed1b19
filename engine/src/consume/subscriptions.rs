//! The active subscriptions (paused ones are left out: their consumers are closed) with the
//! hosts of their brokers, and what is sent to the AMQP thread.

use super::message::Sub;
use amqp_outbox_broker::inbox::SubscriptionConfig;
use amqp_outbox_broker::BrokerConfig;
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
    /// Takes the subscriptions as read, with the brokers as configured; returns the
    /// configuration to send to the AMQP thread when it changed.
    pub fn update(
        &mut self,
        subs: Vec<Sub>,
        brokers: &[BrokerConfig],
    ) -> Option<Vec<SubscriptionConfig>> {
        let mut active = BTreeMap::new();
        let mut configs = Vec::new();
        let mut problems = Vec::new();
        for sub in subs {
            let broker = brokers.iter().find(|b| b.broker_id == sub.broker_id);
            match (broker, &sub.handler) {
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
            return None;
        }
        self.sent = Some(configs.clone());
        Some(configs)
    }

    /// Forget what was sent: the next update sends again (after the extension reappeared).
    pub fn forget(&mut self) {
        self.sent = None;
        self.active.clear();
        self.problems.clear();
    }

    /// At most half of the smallest prefetch per transaction: while one half is handled, the
    /// broker refills the half acknowledged before, instead of waiting for a whole batch.
    pub fn batch_limit(&self, batch_size: usize) -> usize {
        self.active
            .values()
            .map(|s| usize::from(s.prefetch / 2).max(1))
            .min()
            .unwrap_or(batch_size)
            .min(batch_size)
    }
}
