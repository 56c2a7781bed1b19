//! The worker's memory of what it has handed to the AMQP thread: per broker, the connection
//! state, the ids awaiting an outcome, and the suspects that must be published alone.
//! Plain Rust, no PostgreSQL calls. Bounded by `max_in_flight` per broker.

use std::collections::{BTreeSet, HashMap, HashSet};

#[derive(Default)]
pub struct BrokerFlight {
    pub connected: bool,
    pub host: Option<String>,
    pub epoch: u64,
    /// Why the connection is down, if it is.
    pub error: Option<String>,
    pub in_flight: HashSet<i64>,
    /// Ids whose last publish ended in an ambiguous channel error, or that failed before: they
    /// are published one at a time, with nothing else in flight, so an error names its cause.
    pub suspects: BTreeSet<i64>,
}

impl BrokerFlight {
    pub fn isolating(&self) -> bool {
        !self.suspects.is_empty()
    }
}

#[derive(Default)]
pub struct Flight {
    brokers: HashMap<i32, BrokerFlight>,
    /// id → broker, for every id in flight anywhere.
    owner: HashMap<i64, i32>,
}

impl Flight {
    pub fn broker(&mut self, broker_id: i32) -> &mut BrokerFlight {
        self.brokers.entry(broker_id).or_default()
    }

    /// Keeps only these brokers (the others were removed from amqp.broker).
    pub fn retain_brokers(&mut self, ids: &[i32]) {
        self.brokers.retain(|id, _| ids.contains(id));
        let brokers = &self.brokers;
        self.owner.retain(|_, b| brokers.contains_key(b));
    }

    pub fn brokers(&self) -> impl Iterator<Item = (&i32, &BrokerFlight)> {
        self.brokers.iter()
    }

    pub fn is_in_flight(&self, id: i64) -> bool {
        self.owner.contains_key(&id)
    }

    pub fn mark_sent(&mut self, broker_id: i32, id: i64) {
        self.owner.insert(id, broker_id);
        self.broker(broker_id).in_flight.insert(id);
    }

    /// The outcome of `id` is known (or will never come): it is no longer in flight.
    pub fn settle(&mut self, id: i64) {
        if let Some(b) = self.owner.remove(&id) {
            if let Some(bf) = self.brokers.get_mut(&b) {
                bf.in_flight.remove(&id);
            }
        }
    }

    /// A connection went down or a new channel came up: whatever was in flight on the old one
    /// will be published again (the AMQP thread also fails each of them).
    pub fn forget_in_flight(&mut self, broker_id: i32) {
        if let Some(bf) = self.brokers.get_mut(&broker_id) {
            for id in bf.in_flight.drain() {
                self.owner.remove(&id);
            }
        }
    }

    /// Brokers that may take new (non-suspect) messages now, with how many each may take.
    pub fn open_brokers(&self, max_in_flight: usize) -> Vec<(i32, usize)> {
        let mut open: Vec<(i32, usize)> = self
            .brokers
            .iter()
            .filter(|(_, b)| b.connected && !b.isolating() && b.in_flight.len() < max_in_flight)
            .map(|(id, b)| (*id, max_in_flight - b.in_flight.len()))
            .collect();
        open.sort_unstable();
        open
    }

    /// Brokers whose suspects can be published now: connected, nothing else in flight.
    pub fn isolation_ready(&self) -> Vec<(i32, Vec<i64>)> {
        self.brokers
            .iter()
            .filter(|(_, b)| b.connected && b.isolating() && b.in_flight.is_empty())
            .map(|(id, b)| (*id, b.suspects.iter().copied().collect()))
            .collect()
    }
}
