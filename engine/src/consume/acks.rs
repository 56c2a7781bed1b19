//! Which deliveries may be acknowledged once the transaction commits: those handled (or kept
//! as failed, or duplicates) in it, and those put into `amqp.inbox_waiting` whose row is gone
//! (handled by a lane). Tags are kept per subscription and channel epoch: the broker takes
//! them per channel, and a tag of an earlier channel is dropped by the AMQP thread.

use super::message::Message;
use amqp_outbox_broker::inbox::InboxCommand;
use std::collections::BTreeMap;

/// Deliveries to acknowledge after the commit.
#[derive(Default)]
pub struct Acks(BTreeMap<(String, u64), Vec<u64>>);

impl Acks {
    /// `m`, if it came from the broker.
    pub fn add(&mut self, m: &Message) {
        if let Some((epoch, tag)) = m.delivery {
            self.push(m.subscription.clone(), epoch, tag);
        }
    }

    fn push(&mut self, subscription: String, epoch: u64, tag: u64) {
        self.0.entry((subscription, epoch)).or_default().push(tag);
    }

    /// The AMQP thread's commands, one per subscription and channel.
    pub fn commands(self) -> Vec<InboxCommand> {
        self.0
            .into_iter()
            .map(|((subscription, epoch), delivery_tags)| InboxCommand::Ack {
                subscription,
                epoch,
                delivery_tags,
            })
            .collect()
    }
}

/// Deliveries put into `amqp.inbox_waiting`, by row id: acknowledged once their row is gone.
#[derive(Default)]
pub struct Staged(BTreeMap<i64, Vec<(String, u64, u64)>>);

impl Staged {
    /// `m` was put into `amqp.inbox_waiting` as row `row` (the row it already had when it was
    /// delivered again while it waits); `None`: that row went meanwhile, its handling
    /// committed, and this copy is acknowledged with the transaction.
    pub fn note(&mut self, m: &Message, row: Option<i64>, acks: &mut Acks) {
        let Some((epoch, tag)) = m.delivery else {
            return;
        };
        match row {
            Some(id) => self
                .0
                .entry(id)
                .or_default()
                .push((m.subscription.clone(), epoch, tag)),
            None => acks.push(m.subscription.clone(), epoch, tag),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The rows to look for.
    pub fn rows(&self) -> Vec<i64> {
        self.0.keys().copied().collect()
    }

    /// These rows are gone: their deliveries are acknowledged with the transaction.
    pub fn gone(&mut self, rows: Vec<i64>, acks: &mut Acks) {
        for id in rows {
            for (subscription, epoch, tag) in self.0.remove(&id).unwrap_or_default() {
                acks.push(subscription, epoch, tag);
            }
        }
    }

    /// Whether a delivery of this subscription still waits for a lane.
    pub fn holds(&self, subscription: &str) -> bool {
        self.0.values().flatten().any(|(s, _, _)| s == subscription)
    }
}
