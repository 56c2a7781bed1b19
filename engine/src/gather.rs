//! How long commits gather before the worker's next claim. Plain Rust, no PostgreSQL calls.
//!
//! Why: every step costs the worker and the broker about the same whether it carries one
//! message or twenty (a transaction, a publish batch, a share of an acknowledgement record, the
//! wake-ups between threads). At a few hundred commits a second a claim per commit costs little
//! and keeps the latency at its floor; at a few thousand it would spend a core on fixed costs.
//! So the gap between two claims follows the commit rate: none while commits are rare, growing
//! in proportion to the rate up to `amqp_outbox.batch_interval` at [`FULL_RATE`]. Above it the
//! gap keeps growing, with the square of the rate, up to [`STRETCH`] times `batch_interval` at
//! twice that rate: a step's fixed costs (about a millisecond of CPU between the worker and the
//! broker, whatever it carries) then fall per second as the rate rises, and the cores go to the
//! sessions that commit. A message waits at most that long, and the wait is spent where it buys
//! the most.

use std::time::{Duration, Instant};

/// The rate (messages per second) at which the gap reaches `batch_interval`.
pub const FULL_RATE: f64 = 2_000.0;
/// How many times `batch_interval` the gap reaches at twice [`FULL_RATE`] and above.
pub const STRETCH: f64 = 4.0;
/// Below this rate commits never wait: a lone commit is claimed at once.
const FREE_RATE: f64 = 250.0;
/// How fast the rate estimate follows a change (time constant of its exponential average).
const TAU: Duration = Duration::from_millis(250);

#[derive(Debug, Default)]
pub struct Gather {
    /// Messages claimed per second, smoothed, as of `at`.
    rate: f64,
    at: Option<Instant>,
}

impl Gather {
    /// A claim at `now` took `messages`.
    pub fn claimed(&mut self, messages: usize, now: Instant) {
        let Some(at) = self.at else {
            self.at = Some(now);
            return;
        };
        let dt = now.saturating_duration_since(at).as_secs_f64();
        let tau = TAU.as_secs_f64();
        // The average of the rate over the last TAU, continuous in time: what came is spread
        // over TAU, what was estimated decays over the time since.
        self.rate = self.rate * (-dt / tau).exp() + messages as f64 / tau;
        self.at = Some(now);
    }

    /// The estimated commit rate at `now` (decayed over the time since the last claim).
    pub fn rate(&self, now: Instant) -> f64 {
        match self.at {
            None => 0.0,
            Some(at) => {
                let dt = now.saturating_duration_since(at).as_secs_f64();
                self.rate * (-dt / TAU.as_secs_f64()).exp()
            }
        }
    }

    /// The shortest time between the previous claim and the next at this rate: `max` at
    /// [`FULL_RATE`], at most [`STRETCH`] times `max`.
    pub fn interval(&self, max: Duration, now: Instant) -> Duration {
        let rate = self.rate(now);
        if rate <= FREE_RATE {
            return Duration::ZERO;
        }
        let scale = if rate <= FULL_RATE {
            (rate - FREE_RATE) / (FULL_RATE - FREE_RATE)
        } else {
            (rate / FULL_RATE).powi(2).min(STRETCH)
        };
        max.mul_f64(scale)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);
    const MAX: Duration = Duration::from_millis(2);

    /// Claims `per_claim` messages every `every` for `total`, from `t0`; returns the end.
    fn steady(
        g: &mut Gather,
        t0: Instant,
        every: Duration,
        per_claim: usize,
        total: Duration,
    ) -> Instant {
        let mut t = t0;
        while t < t0 + total {
            t += every;
            g.claimed(per_claim, t);
        }
        t
    }

    #[test]
    fn rare_commits_never_wait() {
        let mut g = Gather::default();
        let t = steady(&mut g, Instant::now(), 5 * MS, 1, Duration::from_secs(2));
        let r = g.rate(t);
        assert!((150.0..250.0).contains(&r), "rate {r}");
        assert_eq!(g.interval(MAX, t), Duration::ZERO);
    }

    #[test]
    fn the_gap_grows_with_the_rate_up_to_the_setting() {
        let mut g = Gather::default();
        let t = steady(&mut g, Instant::now(), MS, 1, Duration::from_secs(2));
        let r = g.rate(t);
        assert!((900.0..1_100.0).contains(&r), "rate {r}");
        let half = g.interval(MAX, t);
        assert!(half > Duration::ZERO && half < MAX, "{half:?}");

        // Four per claim every 2 ms: 2,000 a second, the setting itself.
        let t = steady(&mut g, t, 2 * MS, 4, Duration::from_secs(2));
        let full = g.interval(MAX, t);
        assert!(
            full > MAX.mul_f64(0.95) && full < MAX.mul_f64(1.05),
            "{full:?}"
        );
        // The setting at 0 never gathers.
        assert_eq!(g.interval(Duration::ZERO, t), Duration::ZERO);
    }

    #[test]
    fn above_full_rate_the_gap_keeps_growing_up_to_its_stretch() {
        let mut g = Gather::default();
        // 3,000 a second: (1.5)² = 2.25 times the setting.
        let t = steady(&mut g, Instant::now(), MS, 3, Duration::from_secs(2));
        let gap = g.interval(MAX, t);
        assert!(
            gap > MAX.mul_f64(2.1) && gap < MAX.mul_f64(2.4),
            "{gap:?} at {}",
            g.rate(t)
        );
        // 10,000 a second: capped at STRETCH times the setting.
        let t = steady(&mut g, t, 2 * MS, 20, Duration::from_secs(2));
        assert_eq!(g.interval(MAX, t), MAX.mul_f64(STRETCH));
        assert_eq!(g.interval(Duration::ZERO, t), Duration::ZERO);
    }

    #[test]
    fn an_idle_pause_forgets_the_rate() {
        let mut g = Gather::default();
        let t = steady(
            &mut g,
            Instant::now(),
            Duration::from_micros(200),
            1,
            Duration::from_secs(1),
        );
        // 5,000 a second: stretched.
        assert_eq!(g.interval(MAX, t), MAX.mul_f64(STRETCH));
        // A commit after a second of silence is claimed at once.
        assert_eq!(g.interval(MAX, t + Duration::from_secs(1)), Duration::ZERO);
    }

    #[test]
    fn the_estimate_does_not_depend_on_how_claims_are_cut() {
        let t0 = Instant::now();
        let (mut a, mut b) = (Gather::default(), Gather::default());
        let ta = steady(&mut a, t0, MS, 2, Duration::from_secs(2));
        let tb = steady(&mut b, t0, 4 * MS, 8, Duration::from_secs(2));
        let (ra, rb) = (a.rate(ta), b.rate(tb));
        assert!((ra - rb).abs() / ra < 0.05, "{ra} vs {rb}");
    }
}
