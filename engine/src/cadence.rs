//! When the delivery's loop claims, for every host (the extension's worker, the relay): which
//! wake-ups need a step, how long commits gather before it, how long to sleep after it. The
//! hosts only add what is theirs (how they are woken, how they wait, their periodic upkeep).
//!
//! Coalescing: a commit wakes the loop once per step, but confirms and acknowledgements wake it
//! as they arrive, and one step per wake-up would spend a transaction (and a broker round trip)
//! on a few messages, taking the CPU the publishing sessions need. So while commits come fast a
//! step starts a gap after the previous one and takes everything committed meanwhile; the gap
//! follows the commit rate ([`Gather`]), up to `batch_interval`. Rare commits are claimed at
//! once, and so is a backlog: after a claim that filled its batch, the next step runs without
//! waiting.

use crate::claim::Claimed;
use crate::flight::Flight;
use crate::gather::Gather;
use crate::scan_floor::ScanFloor;
use std::time::{Duration, Instant};

#[derive(Default)]
pub struct Cadence {
    stepped_at: Option<Instant>,
    /// The commit rate, and from it how long commits gather before a claim.
    gather: Gather,
    /// The last claim filled its batch: claim again without sleeping.
    more_work: bool,
    /// The last claim took everything due, when [`Flight::released`] was this.
    claimed_all: Option<u64>,
    /// A retry or hold came due: the next step claims.
    due_to_claim: bool,
}

impl Cadence {
    /// How long until a retry or hold comes due. One that came due since the last look is
    /// claimed by the next step, reading from the lowest id (its row may be below the scan
    /// floor).
    pub fn next_due(&mut self, flight: &mut Flight, floor: &mut ScanFloor) -> Option<Duration> {
        let due = flight.holds.until_next_due(Instant::now());
        if due.is_some_and(|d| d.is_zero()) {
            floor.reset();
            self.due_to_claim = true;
        }
        due
    }

    /// Whether this wake-up can go without a step: the last claim took everything it saw
    /// ([`Claimed::complete`]), and since then no commit came (`committed`), nothing left
    /// flight without proof (`reopened`), nothing needs settling (`settle_needed`), nothing
    /// came due. The naptime's step still runs (rows inserted without `amqp.publish()`, a
    /// `COMMIT PREPARED`).
    #[allow(clippy::too_many_arguments)]
    pub fn nothing_to_claim(
        &mut self,
        flight: &mut Flight,
        floor: &mut ScanFloor,
        reopened: bool,
        settle_needed: bool,
        committed: bool,
        naptime: Duration,
    ) -> bool {
        // First, whatever else holds: a retry come due lowers the scan floor for this step.
        self.next_due(flight, floor);
        !self.due_to_claim
            && self.claimed_all == Some(flight.released())
            && !self.more_work
            && !reopened
            && !settle_needed
            && !committed
            && self.stepped_at.is_some_and(|t| t.elapsed() < naptime)
    }

    /// How long commits still gather before this step (none after a full claim, or while
    /// commits are rare).
    pub fn gap(&self, batch_interval: Duration) -> Option<Duration> {
        if self.more_work {
            return None;
        }
        let interval = self.gather.interval(batch_interval, Instant::now());
        self.stepped_at
            .and_then(|t| interval.checked_sub(t.elapsed()))
            .filter(|gap| !gap.is_zero())
    }

    /// A step starts now.
    pub fn stepping(&mut self) {
        self.stepped_at = Some(Instant::now());
        self.due_to_claim = false;
    }

    /// What the step's claim took.
    pub fn claimed(&mut self, claimed: &Claimed, flight: &Flight) {
        let messages = claimed.commands.iter().map(|c| c.messages()).sum();
        self.gather.claimed(messages, Instant::now());
        self.more_work = claimed.more;
        self.claimed_all = claimed.complete.then_some(flight.released());
    }

    /// The last claim filled its batch.
    pub fn more_work(&self) -> bool {
        self.more_work
    }

    /// When the last step started.
    pub fn stepped_at(&self) -> Option<Instant> {
        self.stepped_at
    }

    /// How long to sleep after a step (or a wake-up that needed none): until the naptime's
    /// step (or, when the host has something to report soon, `report_in`, at most the
    /// naptime), and less when a retry or hold, or delivered rows' DELETE, comes due before;
    /// none after a full claim.
    pub fn timeout(
        &mut self,
        flight: &mut Flight,
        floor: &mut ScanFloor,
        naptime: Duration,
        report_in: Option<Duration>,
    ) -> Duration {
        let since_step = self.stepped_at.map_or(Duration::ZERO, |t| t.elapsed());
        let mut timeout = if self.more_work {
            Duration::ZERO
        } else if let Some(report) = report_in {
            report.min(naptime)
        } else {
            naptime.saturating_sub(since_step)
        };
        // What has come due since this step's claim is claimed by the next one.
        if let Some(due) = self.next_due(flight, floor) {
            timeout = timeout.min(due);
        }
        match flight.proven_due_in(Instant::now()) {
            Some(due) => timeout.min(due),
            None => timeout,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NAPTIME: Duration = Duration::from_secs(1);

    fn complete(more: bool) -> Claimed {
        Claimed {
            commands: Vec::new(),
            more,
            complete: !more,
            writers: Vec::new(),
        }
    }

    #[test]
    fn a_wake_up_after_a_complete_claim_needs_no_step_unless_something_changed() {
        let (mut flight, mut floor) = (Flight::default(), ScanFloor::default());
        let mut c = Cadence::default();
        // Never stepped: the first wake-up steps.
        assert!(!c.nothing_to_claim(&mut flight, &mut floor, false, false, false, NAPTIME));
        c.stepping();
        c.claimed(&complete(false), &flight);
        assert!(c.nothing_to_claim(&mut flight, &mut floor, false, false, false, NAPTIME));
        // A commit, a message back from flight, something to settle: a step.
        assert!(!c.nothing_to_claim(&mut flight, &mut floor, false, false, true, NAPTIME));
        assert!(!c.nothing_to_claim(&mut flight, &mut floor, true, false, false, NAPTIME));
        assert!(!c.nothing_to_claim(&mut flight, &mut floor, false, true, false, NAPTIME));
        // The naptime's step.
        assert!(!c.nothing_to_claim(&mut flight, &mut floor, false, false, false, Duration::ZERO));
    }

    #[test]
    fn a_full_claim_claims_again_at_once_and_a_claim_that_was_not_complete_too() {
        let (mut flight, mut floor) = (Flight::default(), ScanFloor::default());
        let mut c = Cadence::default();
        c.stepping();
        c.claimed(&complete(true), &flight);
        assert!(c.more_work());
        assert_eq!(c.gap(Duration::from_millis(5)), None);
        assert_eq!(
            c.timeout(&mut flight, &mut floor, NAPTIME, None),
            Duration::ZERO
        );
        assert!(!c.nothing_to_claim(&mut flight, &mut floor, false, false, false, NAPTIME));
        c.stepping();
        c.claimed(&Claimed::nothing(), &flight);
        assert!(!c.more_work());
        assert!(!c.nothing_to_claim(&mut flight, &mut floor, false, false, false, NAPTIME));
    }

    #[test]
    fn the_sleep_runs_to_the_naptime_or_to_the_report() {
        let (mut flight, mut floor) = (Flight::default(), ScanFloor::default());
        let mut c = Cadence::default();
        c.stepping();
        c.claimed(&complete(false), &flight);
        let t = c.timeout(&mut flight, &mut floor, NAPTIME, None);
        assert!(t <= NAPTIME && t > NAPTIME / 2, "{t:?}");
        let report = Duration::from_millis(100);
        assert_eq!(
            c.timeout(&mut flight, &mut floor, NAPTIME, Some(report)),
            report
        );
        // Rare commits are claimed without a gap.
        assert_eq!(c.gap(Duration::from_millis(5)), None);
    }
}
