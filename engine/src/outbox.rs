//! The outbox as the delivery sees it: the statements the claim and the settling of outcomes
//! run on `amqp.message` (and the read of the broker configuration), one method each, whatever runs them (the background worker through
//! SPI, a relay over a client connection). Every method runs inside the transaction the host
//! opened; none waits on the broker. Their texts are in [`crate::statements`], the same for
//! every host.

use crate::broker_tables::BrokerTables;
use crate::flight::Proof;
use crate::message::Origin;
use crate::row::Row;
use crate::scan_floor::Probe;
use amqp_outbox_broker::backoff::Backoff;
use std::time::Duration;

/// The statements of the claim and of the settling of outcomes, on `amqp.message`.
pub trait Outbox {
    /// Why a statement failed. Statements that raise an ERROR inside
    /// [`subtransaction`](Outbox::subtransaction) are reported as [`Caught`] instead.
    type Error: std::fmt::Display;

    /// The defaults of the system and host tags ([`crate::message`]): the database's name and
    /// the host's.
    fn origin(&self) -> Origin<'_>;

    /// The first rows above `after` (the scan floor, [`crate::scan_floor`]), in id order, that
    /// are not parked and are due, of these brokers; not those of `skip` (in flight or held
    /// back), at most `limit`, and no more body bytes than `max_bytes` (the first row always).
    fn claim(
        &mut self,
        brokers: &[i32],
        limit: usize,
        skip: &[i64],
        max_bytes: usize,
        after: i64,
    ) -> Result<Vec<Row>, Self::Error>;

    /// These rows, in id order, unless parked or gone (the suspects, published alone).
    fn claim_ids(&mut self, ids: &[i64]) -> Result<Vec<Row>, Self::Error>;

    /// The claim's snapshot and the id sequence's last value, for the scan floor; `None` when
    /// the floor cannot be trusted (see [`Probe`]). The probe and the claim after it must read
    /// in one snapshot, or a writer the probe saw running could commit in between and its rows
    /// above the floor go out before those below: the worker's claim transaction reads before
    /// it writes; a client runs it as REPEATABLE READ. The next transaction id must be read
    /// after the probe's statement, at least as late as every id handed out by then.
    fn probe(&mut self) -> Result<Option<Probe>, Self::Error>;

    /// Deletes rows whose delivery is proven, keeping their record in the production log when
    /// `keep_log` (`amqp_outbox.reconcile_window` is not 0) and counting them in the day's
    /// statistics. Returns how many rows existed.
    fn delete_delivered(&mut self, proofs: &[Proof], keep_log: bool) -> Result<usize, Self::Error>;

    /// Bounds the lock waits of the rest of the current (sub)transaction (`timeout` as
    /// PostgreSQL's `lock_timeout` takes it, e.g. [`DELETE_LOCK_WAIT`]).
    fn set_lock_timeout(&mut self, timeout: &str) -> Result<(), Self::Error>;

    /// Of these rows, the ones no other session holds, locked now for this transaction.
    fn lock_free(&mut self, ids: &[i64]) -> Result<Vec<i64>, Self::Error>;

    /// Of these rows, the ones still in the table.
    fn existing(&mut self, ids: &[i64]) -> Result<Vec<i64>, Self::Error>;

    /// A refused publish: counts the attempt, keeps the error, schedules the retry after the
    /// backoff for the attempts made so far (`delays`), or parks the row once `max_attempts` is
    /// reached. `None` when the row is gone, parked, or locked by another session: the worker
    /// never waits for a row lock that a user's transaction holds.
    fn record_failure(
        &mut self,
        id: i64,
        error: &str,
        max_attempts: i32,
        delays: &RetryDelays,
    ) -> Result<Option<Recorded>, Self::Error>;

    /// Messages known lost (gap rule) or without proof past the timeout: counts the attempt,
    /// keeps why, publishes again at once, or parks once `max_attempts` is reached. Returns the
    /// parked ids. Rows locked by another session are left uncounted.
    fn record_resend(
        &mut self,
        ids: &[i64],
        reason: &str,
        max_attempts: i32,
    ) -> Result<Vec<i64>, Self::Error>;

    /// Parks a row at once (it can never be published as it is). `false`: the row is gone,
    /// already parked, or locked by another session.
    fn park(&mut self, id: i64, error: &str) -> Result<bool, Self::Error>;

    /// The brokers and declarations ([`crate::statements::BROKER_HOSTS_SQL`] and the three
    /// statements after it), read in this transaction.
    fn broker_tables(&mut self) -> Result<BrokerTables, Self::Error>;

    /// Parks the rows whose broker_id names no broker
    /// ([`crate::statements::PARK_ORPHANS_SQL`]); returns how many.
    fn park_orphans(&mut self) -> Result<usize, Self::Error>;

    /// Ids of due delayed messages, at most `limit`, locked for this transaction
    /// ([`crate::statements::DUE_SCHEDULED_SQL`]).
    fn due_scheduled(&mut self, limit: i64) -> Result<Vec<i64>, Self::Error>;

    /// Moves these delayed messages into `amqp.message`; returns how many moved.
    fn move_scheduled(&mut self, ids: &[i64]) -> Result<usize, Self::Error>;

    /// A delayed message that could not move: kept with `error`, tried again in a minute.
    fn postpone_scheduled(&mut self, id: i64, error: &str) -> Result<(), Self::Error>;

    /// Milliseconds until the earliest delayed message is due; `None`: none is waiting.
    fn next_scheduled_ms(&mut self) -> Result<Option<f64>, Self::Error>;

    /// Deletes up to `limit` idempotency keys older than `window_minutes`.
    fn expire_keys(&mut self, window_minutes: i32, limit: i64) -> Result<(), Self::Error>;

    /// Runs `work` so that an error inside undoes only what `work` did, and the transaction
    /// goes on: a subtransaction in the background worker, a SAVEPOINT over a client
    /// connection. `Ok`: `work` ran to its end (its own result inside); `Err`: it raised an
    /// ERROR, everything it did is rolled back, and the error is returned.
    fn subtransaction<R>(
        &mut self,
        work: impl FnOnce(&mut Self) -> Result<R, Self::Error>,
    ) -> Result<Result<R, Self::Error>, Caught>;
}

/// An error caught in a subtransaction: what the status views and `amqp.inbox_failed` show.
#[derive(Debug, Clone)]
pub struct Caught {
    pub sqlstate: String,
    pub message: String,
}

/// SQLSTATE 55P03: `lock_timeout` ran out.
pub const LOCK_NOT_AVAILABLE: &str = "55P03";

/// The longest the worker's DELETE of delivered rows waits for a lock before it deletes only
/// the rows no other session holds ([`Outbox::lock_free`]).
pub const DELETE_LOCK_WAIT: &str = "100ms";

/// What [`Outbox::record_failure`] wrote.
pub struct Recorded {
    pub attempts: i32,
    pub parked: bool,
    /// How long until the retry is due.
    pub retry_in: Duration,
}

/// The retry delay for each count of earlier attempts, drawn from the product's one backoff
/// policy: index `n` is the delay after a failure that had `n` attempts before it; the last
/// entry (the cap) serves every count beyond. Bound as one array, so that the statement picks
/// the delay from the row's `attempts` as it updates it: one statement, no separate read.
pub struct RetryDelays(Vec<Duration>);

impl RetryDelays {
    pub fn new(backoff: &Backoff) -> Self {
        let mut delays = Vec::new();
        for n in 0u32.. {
            delays.push(backoff.delay(n));
            // Past this the cap no longer grows (`ceiling` stops doubling after n = 31).
            if backoff.ceiling(n) >= backoff.max || n >= 31 {
                break;
            }
        }
        RetryDelays(delays)
    }

    /// The delay the statement picked for a row whose attempts are now `attempts`: the same
    /// index as its `$4[least(greatest(attempts, 0), cardinality($4) - 1) + 1]`, taken before
    /// the increment.
    pub fn after(&self, attempts: i32) -> Duration {
        let before = usize::try_from(attempts.saturating_sub(1)).unwrap_or(0);
        self.0[before.min(self.0.len() - 1)]
    }

    /// The delays in microseconds, as the statement binds them.
    pub fn micros(&self) -> Vec<i64> {
        self.0
            .iter()
            .map(|d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_delays_follow_the_backoff_and_stop_at_its_cap() {
        let min = Duration::from_millis(200);
        let max = Duration::from_secs(60);
        let delays = RetryDelays::new(&Backoff::new(min, max));
        // 200 ms · 2^9 = 102.4 s is the first ceiling past 60 s.
        assert_eq!(delays.0.len(), 10);
        assert_eq!(delays.after(1), min, "first failure: exactly min");
        for attempts in 2..=40 {
            let d = delays.after(attempts);
            let cap = (min * 2u32.pow((attempts - 1).min(9) as u32)).min(max);
            assert!(
                d >= (cap / 2).max(min) && d <= cap,
                "{d:?} after {attempts}"
            );
        }
        assert_eq!(
            delays.after(0),
            min,
            "a row set back by hand takes the first delay"
        );
        assert_eq!(delays.micros()[0], 200_000);
    }

    #[test]
    fn retry_delays_tolerate_odd_settings() {
        let same = RetryDelays::new(&Backoff::new(
            Duration::from_secs(1),
            Duration::from_secs(1),
        ));
        assert_eq!(same.0, vec![Duration::from_secs(1)]);
        let zero = RetryDelays::new(&Backoff::new(Duration::ZERO, Duration::ZERO));
        assert_eq!(zero.after(7), Duration::ZERO);
        let huge = RetryDelays::new(&Backoff::new(Duration::from_millis(1), Duration::MAX));
        assert_eq!(huge.0.len(), 32, "the ceiling stops doubling after 31");
    }
}
