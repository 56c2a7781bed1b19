//! The worker's loop, on its main (PostgreSQL) thread. It only schedules: it takes signals and
//! requests, paces the steps, times the sweep, and sleeps on latch + socket until the next
//! commit, event, retry or naptime. What a step does is in [`super::step`].

use super::brokers::Brokers;
use super::events;
use super::faults::Faults;
use super::flight::Flight;
use super::gather::Gather;
use super::host::{SpiOutbox, WorkerTelemetry};
use super::pg;
use super::presence::Presence;
use super::scan_floor::ScanFloor;
use super::scheduled::Scheduled;
use super::settle::{self, Settlement, Sweep};
use super::shrink::Shrink;
use super::standbys::{self, StandbyWait};
use super::status::{Status, STATUS_EVERY};
use crate::gucs::{self, WorkerSettings};
use crate::shmem;
use amqp_outbox_broker::{BrokerHandle, Command};
use pgrx::prelude::*;
use std::time::{Duration, Instant};

// Coalescing: a commit wakes the worker only once per step (the first commit after the step
// armed the wake-up), but confirms and acknowledgements wake it as they arrive, and one step per
// wake-up would spend a transaction (and a broker round trip) on a few messages, taking the CPU
// the publishing sessions need. So while commits come fast a step starts a gap after the
// previous one and takes everything committed meanwhile; the gap follows the commit rate
// ([`Gather`]), up to `amqp_outbox.batch_interval`. Rare commits are claimed at once, and so is
// a backlog: after a claim that filled its batch, the next step runs without waiting.

/// With `amqp_outbox.enabled = off`, commits do not start a step; this often one still runs, so
/// the status views and configuration stay current.
const DISABLED_STEP_EVERY: Duration = Duration::from_secs(1);

pub struct Worker {
    pub(super) settings: WorkerSettings,
    pub(super) handle: BrokerHandle,
    pub(super) flight: Flight,
    pub(super) brokers: Brokers,
    pub(super) presence: Presence,
    pub(super) status: Status,
    pub(super) faults: Faults,
    /// Where the claim starts reading.
    pub(super) floor: ScanFloor,
    pub(super) scheduled: Scheduled,
    shrink: Shrink,
    sweep: Sweep,
    stepped_at: Option<Instant>,
    /// The commit rate, and from it how long commits gather before a claim.
    gather: Gather,
    /// Claimed batches waiting for `amqp_outbox.standby_names`.
    standbys: StandbyWait<Command>,
    /// The last claim filled its batch: claim again without sleeping.
    more_work: bool,
    /// The last claim took everything due, when [`Flight::released`] was this.
    claimed_all: Option<u64>,
    /// A retry or hold came due: the next step claims.
    due_to_claim: bool,
}

impl Worker {
    pub fn new(handle: BrokerHandle) -> Self {
        let settings = gucs::worker_settings();
        let mut flight = Flight::default();
        Faults::configure(&settings, &mut flight);
        Worker {
            settings,
            handle,
            flight,
            brokers: Brokers::default(),
            presence: Presence::default(),
            status: Status::default(),
            faults: Faults::default(),
            floor: ScanFloor::default(),
            scheduled: Scheduled::default(),
            shrink: Shrink::default(),
            sweep: Sweep::default(),
            stepped_at: None,
            gather: Gather::default(),
            standbys: StandbyWait::new(standbys::MESSAGES),
            more_work: false,
            claimed_all: None,
            due_to_claim: false,
        }
    }

    pub fn run(mut self) -> ! {
        let now_free = self.standbys.configure(&self.settings.standby_names);
        let now_free = standbys::sent(&mut self.flight, now_free);
        self.send_all(now_free);
        loop {
            if pg::shutdown_requested() {
                log!("amqp_outbox: worker shutting down");
                self.delete_delivered(true);
                // The launcher starts it again unless its database is going away: a SIGTERM
                // from pg_terminate_backend() is not a reason to stop publishing.
                self.exit();
            }
            if pg::reload_config_if_requested() {
                self.settings = gucs::worker_settings();
                Faults::configure(&self.settings, &mut self.flight);
                self.brokers.request_reload();
                let now_free = self.standbys.configure(&self.settings.standby_names);
                let now_free = standbys::sent(&mut self.flight, now_free);
                self.send_all(now_free);
            }
            let requests = shmem::take_requests();
            if requests.reload {
                self.brokers.request_reload();
            }
            self.brokers
                .reconnect(requests.disconnect, &self.handle, &WorkerTelemetry);

            let taken = events::take(
                self.handle.drain_events(),
                &WorkerTelemetry,
                &self.settings,
                &mut self.flight,
                &mut self.status,
            );
            let mut settlement = match taken {
                Ok(settlement) => settlement,
                Err(events::ThreadFailed(why)) => {
                    error!("amqp_outbox: the AMQP thread failed: {why}")
                }
            };
            self.sweep.run(
                &mut self.flight,
                self.settings.resend_after,
                &WorkerTelemetry,
                &mut settlement,
            );
            let flushed = self.standbys.poll();
            let flushed = standbys::sent(&mut self.flight, flushed);
            self.send_all(flushed);
            if pg::in_recovery() {
                // A standby publishes nothing; after promotion this loop takes over.
                pg::wait(None, self.settings.naptime, pg::WaitEvent::OutboxMain);
                continue;
            }
            if self.idle_while_disabled(&settlement) {
                self.delete_delivered(false);
                self.status.report(&self.flight);
                let timeout = self.deletes_due(DISABLED_STEP_EVERY);
                self.wait(timeout);
                continue;
            }
            if self.nothing_to_claim(&settlement) {
                // Woken by confirms or acknowledgements only: no transaction, and the commit
                // wake-up stays armed. A step here would also hold the next commit's claim
                // back by the gathering gap.
                self.delete_delivered(false);
                let reported = self.status.report(&self.flight);
                let timeout = self.timeout(reported);
                self.wait(timeout);
                continue;
            }
            if !self.more_work {
                let interval = self
                    .gather
                    .interval(self.settings.batch_interval, Instant::now());
                if let Some(gap) = self
                    .stepped_at
                    .and_then(|t| interval.checked_sub(t.elapsed()))
                    .filter(|gap| !gap.is_zero())
                {
                    pg::sleep(gap, pg::WaitEvent::OutboxBatchGap);
                }
            }
            // Before the snapshot of this step: a commit it does not see will wake the worker.
            shmem::arm_commit_wake(self.settings.enabled);
            self.stepped_at = Some(Instant::now());
            self.due_to_claim = false;
            shmem::count(|c| &c.steps, 1);
            let claimed = self.step(settlement);
            if self.presence.missing() {
                // A probe finding nothing is routine (every database is looked at once).
                if shmem::launch::probe_only() {
                    debug1!("amqp_outbox: extension not installed in this database");
                } else {
                    log!("amqp_outbox: extension no longer installed in this database; the worker exits until CREATE EXTENSION");
                }
                shmem::launch::mark_absent();
                self.exit();
            }
            if shmem::launch::probe_only() {
                // Started only to look: the launcher starts both workers if there is room.
                self.exit();
            }
            let messages = claimed.commands.iter().map(Command::messages).sum();
            self.gather.claimed(messages, Instant::now());
            self.more_work = claimed.more;
            self.claimed_all = claimed.complete.then_some(self.flight.released());
            // Nothing to publish and nothing in flight: the table may be empty.
            let idle = claimed.commands.is_empty()
                && !claimed.more
                && self.flight.is_empty()
                && self.settings.enabled
                && self.presence.present();
            let ready =
                standbys::hold_claimed(&mut self.standbys, claimed.commands, &mut self.flight);
            self.send_all(ready);
            // After the claimed messages are on their way: in front of the claim, the DELETE
            // would delay them (the claim skips the delivered rows until then).
            self.delete_delivered(false);
            if idle {
                self.shrink.when_idle();
            }
            let reported = self.status.report(&self.flight);
            // Events are drained at the top of the loop, whatever woke the worker.
            let timeout = self.timeout(reported);
            self.wait(timeout);
        }
    }

    /// Whether this wake-up can go without a step: the last claim took everything it saw
    /// ([`Claimed::complete`]), and since then no commit came, nothing left flight without proof,
    /// no connection changed, nothing came due and nothing needs writing. The naptime's step
    /// still runs (rows inserted without `amqp.publish()`, a `COMMIT PREPARED`).
    fn nothing_to_claim(&mut self, s: &Settlement) -> bool {
        // First, whatever else holds: a retry come due lowers the scan floor for this step.
        self.next_due();
        !self.due_to_claim
            && self.claimed_all == Some(self.flight.released())
            && !self.more_work
            && !s.reopened
            && !self.settle_needed(s)
            && !shmem::commit_wake_taken()
            && self
                .stepped_at
                .is_some_and(|t| t.elapsed() < self.settings.naptime)
    }

    /// How long until a retry or hold comes due. One that came due since the last look is
    /// claimed by the next step, reading from the lowest id (its row may be below the scan floor).
    fn next_due(&mut self) -> Option<Duration> {
        let due = self.flight.holds.until_next_due(Instant::now());
        if due.is_some_and(|d| d.is_zero()) {
            self.floor.reset();
            self.due_to_claim = true;
        }
        due
    }

    /// How long to wait for a wake-up after a step (or a wake-up that needed none).
    fn timeout(&mut self, reported: bool) -> Duration {
        let since_step = self.stepped_at.map_or(Duration::ZERO, |t| t.elapsed());
        let mut timeout = if self.more_work {
            Duration::ZERO
        } else if !reported {
            STATUS_EVERY.min(self.settings.naptime)
        } else {
            self.settings.naptime.saturating_sub(since_step)
        };
        // What has come due since this step's claim is claimed by the next one.
        if let Some(due) = self.next_due() {
            timeout = timeout.min(due);
        }
        let mut timeout = self.deletes_due(timeout);
        if self.settings.enabled {
            // A delayed message is moved when it is due, whatever the naptime.
            timeout = timeout.min(self.scheduled.until_due(shmem::scheduled_noted()));
        }
        if self.settings.enabled && shmem::commit_wake_taken() {
            // A commit came during this step: the next one claims it, even if a wait inside
            // the step's transactions reset the latch it set.
            timeout = Duration::ZERO;
        }
        timeout
    }

    /// Waits for a commit, an event or `timeout` (shorter while a batch waits for the
    /// standbys).
    fn wait(&self, timeout: Duration) {
        self.standbys
            .wait(self.handle.wake_fd(), timeout, pg::WaitEvent::OutboxMain);
    }

    fn send_all(&self, commands: Vec<Command>) {
        for command in commands {
            if !self.handle.send(command) {
                error!("amqp_outbox: the AMQP thread has stopped");
            }
        }
    }

    /// `timeout`, or less if delivered rows come due for their DELETE before.
    fn deletes_due(&self, timeout: Duration) -> Duration {
        self.flight
            .proven_due_in(Instant::now())
            .map_or(timeout, |due| timeout.min(due))
    }

    /// Deletes the delivered rows once their batch is due ([`Flight::take_proven`]), or all of
    /// them (`all`: at a clean shutdown, so that none is published again).
    fn delete_delivered(&mut self, all: bool) {
        let (delivered, locked_before) = self.flight.take_deletable(Instant::now(), all);
        if delivered.is_empty() || !self.presence.present() {
            return;
        }
        let presence = &mut self.presence;
        let still_locked = pg::transaction("amqp_outbox: delete delivered rows", || {
            // Under the extension's share lock, as every step.
            if !presence.still_installed() {
                return Vec::new();
            }
            let keep_log = crate::gucs::RECONCILE_WINDOW.get() > 0;
            let result = Spi::connect_mut(|client| {
                settle::delete_delivered(
                    &mut SpiOutbox::new(client),
                    delivered,
                    locked_before,
                    keep_log,
                )
            });
            match result {
                Ok(locked) => locked,
                // Exiting anyway: say so and go.
                Err(e) if all => {
                    warning!("amqp_outbox: could not delete delivered rows: {e}");
                    Vec::new()
                }
                Err(e) => error!("amqp_outbox: worker query failed: {e}"),
            }
        });
        if all && !still_locked.is_empty() {
            // Published again after the restart: at least once, never lost.
            warning!(
                "amqp_outbox: {} delivered row(s) locked by another session were not deleted",
                still_locked.len()
            );
        }
        self.flight.keep_locked(still_locked, Instant::now());
    }

    fn exit(self) -> ! {
        self.handle.shutdown(Duration::from_secs(2));
        // SAFETY: the main thread, between transactions; proc_exit runs PostgreSQL's exit
        // callbacks (ours included) and never returns.
        unsafe { crate::pg_compat::proc_exit(0) }
    }

    /// Disabled, with nothing to record and no configuration to reload: a commit's wake-up is
    /// not worth a transaction.
    fn idle_while_disabled(&self, s: &Settlement) -> bool {
        !self.settings.enabled
            && self.presence.present()
            && !self.brokers.reload_pending()
            && s.nothing_to_record()
            && self
                .stepped_at
                .is_some_and(|t| t.elapsed() < DISABLED_STEP_EVERY)
    }
}
