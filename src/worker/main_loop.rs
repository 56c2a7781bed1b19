//! The worker's loop, on its main (PostgreSQL) thread. It only schedules: it takes signals and
//! requests, paces the steps, times the sweep, and sleeps on latch + socket until the next
//! commit, event, retry or naptime. What a step does is in [`super::step`].

use super::brokers::Brokers;
use super::events;
use super::faults::Faults;
use super::flight::Flight;
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
use amqp_outbox_engine::cadence::Cadence;
use pgrx::prelude::*;
use std::time::{Duration, Instant};

// When to claim, how long commits gather, how long to sleep: the engine's [`Cadence`], shared
// with the relay. A commit wakes the worker only once per step (the first commit after the step
// armed the wake-up).

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
    cadence: Cadence,
    /// Claimed batches waiting for `amqp_outbox.standby_names`.
    pub(super) standbys: StandbyWait<Command>,
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
            cadence: Cadence::default(),
            standbys: StandbyWait::new(standbys::MESSAGES),
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
            if let Some(gap) = self.cadence.gap(self.settings.batch_interval) {
                pg::sleep(gap, pg::WaitEvent::OutboxBatchGap);
            }
            // Before the snapshot of this step: a commit it does not see will wake the worker.
            shmem::arm_commit_wake(self.settings.enabled);
            self.cadence.stepping();
            shmem::count(|c| &c.steps, 1);
            let (claimed, claim_wal) = self.step(settlement);
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
            self.cadence.claimed(&claimed, &self.flight);
            // Nothing to publish and nothing in flight: the table may be empty.
            let idle = claimed.commands.is_empty()
                && !claimed.more
                && self.flight.is_empty()
                && self.settings.enabled
                && self.presence.present();
            let ready = standbys::hold_claimed(
                &mut self.standbys,
                claimed.commands,
                claim_wal,
                &mut self.flight,
            );
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

    /// Whether this wake-up can go without a step ([`Cadence::nothing_to_claim`]); a commit
    /// is one whose wake-up was taken.
    fn nothing_to_claim(&mut self, s: &Settlement) -> bool {
        let settle_needed = self.settle_needed(s);
        self.cadence.nothing_to_claim(
            &mut self.flight,
            &mut self.floor,
            s.reopened,
            settle_needed,
            shmem::commit_wake_taken(),
            self.settings.naptime,
        )
    }

    /// How long to wait for a wake-up after a step (or a wake-up that needed none): the
    /// cadence's time, sooner when the status is due for a report or a delayed message to move.
    fn timeout(&mut self, reported: bool) -> Duration {
        let mut timeout = self.cadence.timeout(
            &mut self.flight,
            &mut self.floor,
            self.settings.naptime,
            (!reported).then_some(STATUS_EVERY),
        );
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
                .cadence
                .stepped_at()
                .is_some_and(|t| t.elapsed() < DISABLED_STEP_EVERY)
    }
}
