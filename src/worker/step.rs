//! One step of the worker, in two short transactions: the first records what the events
//! settled (refusals, resends; not deliveries, whose DELETE follows the step), reads the
//! configuration when asked and parks orphans (skipped when there is none of that to do); the
//! second claims the next rows. What the claim returns is sent to the AMQP thread only after its
//! transaction has committed.
//!
//! Why two: the claim's probe and its read of `amqp.message` must see one snapshot (the scan
//! floor trusts that a transaction the probe saw running is not yet visible to the claim, see
//! [`super::scan_floor`]). A transaction that has written takes a new snapshot for every
//! statement, so the claim runs in a transaction of its own that reads before it writes.

use super::brokers::template;
use super::claim::{self, Claimed};
use super::host::{SpiOutbox, WorkerTelemetry};
use super::main_loop::Worker;
use super::presence::Found;
use super::settle::Settlement;
use crate::shmem;
use pgrx::prelude::*;

impl Worker {
    /// The claim, and the WAL position its batch waits for the standbys to have (by it, the
    /// commits of the claimed rows are flushed: [`super::standbys::commit_position`]; 0 while
    /// `amqp_outbox.standby_names` names none).
    pub(super) fn step(&mut self, settlement: Settlement) -> (Claimed, u64) {
        if self.settle_needed(&settlement) {
            let claim_now =
                super::pg::transaction("amqp_outbox: settle", || self.settle(settlement));
            if !claim_now {
                return (Claimed::nothing(), 0);
            }
        }
        super::pg::transaction("amqp_outbox: claim", || {
            // After the snapshot (taken as the transaction began), before the claim's own WAL
            // (a read prunes pages): every commit the claim sees ends before it.
            let at_snapshot = self
                .standbys
                .active()
                .then(super::standbys::insert_position);
            // Under the extension's share lock, as the first transaction (a DROP EXTENSION in
            // between leaves the claim for the next step, which finds it gone).
            if !self.presence.still_installed() {
                return (Claimed::nothing(), 0);
            }
            let result = Spi::connect_mut(|client| {
                claim::claim(
                    &mut SpiOutbox::new(client),
                    &WorkerTelemetry,
                    &self.settings,
                    &mut self.flight,
                    &mut self.floor,
                    &mut self.faults,
                )
            });
            let claimed = match result {
                Ok(claimed) => claimed,
                Err(e) => error!("amqp_outbox: worker query failed: {e}"),
            };
            // The commits of the rows the batch holds, often well before the insert position
            // (a publisher between its INSERT and its COMMIT).
            let wal = at_snapshot.map_or(0, |fallback| {
                super::standbys::commit_position(&claimed.writers, fallback)
            });
            (claimed, wal)
        })
    }

    /// Whether the first transaction has anything to do. Under a steady load most steps have
    /// nothing to write (deletes are batched) and nothing due, and go straight to the claim,
    /// which looks for the extension too.
    pub(super) fn settle_needed(&self, settlement: &Settlement) -> bool {
        !settlement.is_empty()
            || !self.presence.present()
            || !self.settings.enabled
            || self.brokers.reload_pending()
            || self.brokers.orphan_check_due()
            || self.scheduled.due(shmem::scheduled_noted())
            || self.status.count_due(self.settings.max_pending)
    }

    /// The first transaction; returns whether a claim follows.
    fn settle(&mut self, settlement: Settlement) -> bool {
        match self.presence.check() {
            Found::Waiting { unusable_now } => {
                if unusable_now {
                    self.brokers.configure(
                        Vec::new(),
                        &mut self.flight,
                        &mut self.status,
                        &self.handle,
                    );
                }
                return false;
            }
            Found::Ready { appeared: true } => self.brokers.request_reload(),
            Found::Ready { appeared: false } => {}
        }
        if self.brokers.reload_pending() {
            // Brokers may come or go (or the extension appeared): rows are read again from the
            // lowest id.
            self.floor.reset();
        }
        let result = Spi::connect_mut(|client| {
            settlement.record(
                &mut SpiOutbox::new(client),
                &WorkerTelemetry,
                &self.settings,
                &mut self.flight,
            )?;
            self.brokers.reload_if_requested(
                &mut SpiOutbox::new(client),
                &template(&self.settings),
                &WorkerTelemetry,
                &mut self.flight,
                &mut self.status,
                &self.handle,
            )?;
            self.status
                .count_pending(client, self.settings.max_pending)?;
            if !self.settings.enabled {
                return Ok(false);
            }
            self.brokers
                .park_orphans_when_due(&mut SpiOutbox::new(client), &WorkerTelemetry)?;
            // Taken before the statements: a commit after this notes it again.
            let noted = shmem::take_scheduled();
            let moved = if self.scheduled.due(noted) {
                self.scheduled.run_when_due(
                    &mut SpiOutbox::new(client),
                    &WorkerTelemetry,
                    noted,
                    crate::scheduled_move::tables_present(),
                    crate::gucs::IDEMPOTENCY_WINDOW.get(),
                )?
            } else {
                0
            };
            if moved > 0 {
                // The moved rows keep their ids, below the floor by now.
                self.floor.reset();
            }
            Ok::<_, pgrx::spi::SpiError>(true)
        });
        match result {
            Ok(claim_now) => claim_now,
            Err(e) => error!("amqp_outbox: worker query failed: {e}"),
        }
    }
}
