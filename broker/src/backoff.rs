//! The product's one retry policy: reconnects, nacked messages and refused publishes all wait
//! `min·2^n`, capped at `max`, jittered down by up to half (never below `min`), so many
//! workers or messages that failed together do not retry in step.

use rand::Rng;
use std::time::Duration;

/// Capped exponential backoff with jitter. `max` below `min` is read as `min`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    pub min: Duration,
    pub max: Duration,
}

impl Backoff {
    pub fn new(min: Duration, max: Duration) -> Self {
        Backoff {
            min,
            max: max.max(min),
        }
    }

    /// The cap for the `n`th retry (0: the first): `min·2^n`, at most `max`.
    pub fn ceiling(&self, n: u32) -> Duration {
        self.min
            .checked_mul(2u32.saturating_pow(n.min(31)))
            .unwrap_or(self.max)
            .min(self.max.max(self.min))
    }

    /// The delay before the `n`th retry: uniform in `[max(ceiling/2, min), ceiling]`.
    pub fn delay(&self, n: u32) -> Duration {
        let cap = self.ceiling(n);
        let low = (cap / 2).max(self.min);
        if cap <= low {
            return cap;
        }
        rand::thread_rng().gen_range(low..=cap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stays_within_bounds_and_grows() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        for n in 0..100 {
            for _ in 0..50 {
                let d = b.delay(n);
                assert!(d >= b.min && d <= b.max, "{d:?} for {n}");
                assert!(d >= b.ceiling(n) / 2 && d <= b.ceiling(n), "{d:?} for {n}");
            }
        }
        assert_eq!(b.delay(0), b.min, "the first delay is exactly min");
        assert_eq!(b.ceiling(3), Duration::from_millis(800));
        assert!(b.delay(40) >= b.max / 2);
    }

    #[test]
    fn jitter_spreads_delays() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_secs(60));
        let seen: std::collections::HashSet<Duration> = (0..50).map(|_| b.delay(6)).collect();
        assert!(seen.len() > 10, "{seen:?}");
    }

    #[test]
    fn tolerates_odd_settings() {
        let zero = Backoff::new(Duration::ZERO, Duration::ZERO);
        assert_eq!(zero.delay(3), Duration::ZERO);
        let inverted = Backoff::new(Duration::from_secs(2), Duration::from_secs(1));
        assert_eq!(inverted.delay(10), Duration::from_secs(2));
        let huge = Backoff::new(Duration::from_secs(1), Duration::MAX);
        assert!(huge.delay(u32::MAX) >= Duration::from_secs(1));
    }
}
