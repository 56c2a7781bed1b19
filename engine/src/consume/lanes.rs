//! Lanes: the handlers of subscriptions with a parallelism or an ordering, several at once.
//! Their messages wait in `amqp.inbox_waiting` (unacknowledged until their row is gone); each
//! lane claims some (`FOR UPDATE SKIP LOCKED`, a key's next message only once no earlier one
//! waits, runs or has failed) and handles them in its own transaction. Lane n serves the
//! subscriptions whose parallelism is above n, so a subscription has at most `parallelism`
//! messages in progress; lane 0 also empties what waits for a subscription that has no lanes
//! any more.

use super::message::{Ordering, Sub};
use std::collections::BTreeMap;

/// The most lanes a database has (a subscription's parallelism is at most this).
pub const MAX_LANES: usize = 16;

/// Messages one transaction of a lane takes at most.
pub const LANE_BATCH: usize = 8;

/// What lane `n` serves.
#[derive(Debug, PartialEq)]
pub struct Serving {
    /// The subscriptions it takes messages of.
    pub names: Vec<String>,
    /// Messages per transaction at most: few enough that the other lanes of a subscription
    /// find some too.
    pub limit: usize,
    /// The largest parallelism among those with an ordering, if any.
    pub ordered: Option<usize>,
}

/// What lane `n` serves of `subs` (those whose handler can run).
pub fn serving(subs: &BTreeMap<String, Sub>, n: usize) -> Serving {
    let mut names = Vec::new();
    let mut limit = LANE_BATCH;
    let mut ordered = None;
    for s in subs.values().filter(|s| s.handler.is_some()) {
        if s.parallelism > n || (n == 0 && !s.has_lanes()) {
            names.push(s.name.clone());
            limit = limit.min((usize::from(s.prefetch) / (2 * s.parallelism)).max(1));
            if s.ordering != Ordering::None {
                ordered = ordered.max(Some(s.parallelism));
            }
        }
    }
    Serving {
        names,
        limit,
        ordered,
    }
}

/// A lane holds the key of each message it took until it commits: with an ordering, its share
/// of the keys that can go now (`heads`), so that the other lanes find some too.
pub fn ordered_limit(limit: usize, heads: usize, parallelism: usize) -> usize {
    limit.min(heads.div_ceil(parallelism.max(1)).max(1))
}

/// How many lanes the subscriptions want: the largest parallelism of those with lanes.
pub fn wanted(subs: &BTreeMap<String, Sub>) -> usize {
    subs.values()
        .filter(|s| s.handler.is_some() && s.has_lanes())
        .map(|s| s.parallelism.min(MAX_LANES))
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sub(name: &str, parallelism: usize, ordering: &str, prefetch: u16) -> Sub {
        Sub {
            name: name.into(),
            broker_id: 1,
            queue: "q".into(),
            prefetch,
            max_attempts: 3,
            dead_letter_exchange: None,
            owner: 10,
            handler: Some(("public.h".into(), 20)),
            problem: None,
            parallelism,
            ordering: Ordering::parse(ordering),
        }
    }

    #[test]
    fn lane_n_serves_the_subscriptions_whose_parallelism_is_above_n() {
        let subs: BTreeMap<String, Sub> = [
            sub("plain", 1, "none", 100),
            sub("wide", 4, "none", 100),
            sub("keyed", 2, "business_key", 8),
        ]
        .into_iter()
        .map(|s| (s.name.clone(), s))
        .collect();
        let zero = serving(&subs, 0);
        assert_eq!(zero.names, ["keyed", "plain", "wide"]);
        // keyed: 8 / (2 × 2) = 2 a transaction at most.
        assert_eq!(zero.limit, 2);
        assert_eq!(zero.ordered, Some(2));
        assert_eq!(serving(&subs, 1).names, ["keyed", "wide"]);
        assert_eq!(serving(&subs, 2).names, ["wide"]);
        assert_eq!(serving(&subs, 2).ordered, None);
        assert!(serving(&subs, 4).names.is_empty());
        assert_eq!(wanted(&subs), 4);
        assert_eq!(ordered_limit(8, 5, 2), 3);
        assert_eq!(ordered_limit(8, 0, 2), 1);
    }
}
