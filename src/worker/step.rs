//! One step of the worker: a short transaction that records what the events settled, reads the
//! configuration when asked, and claims the next rows. What it returns is sent to the AMQP thread
//! only after the transaction has committed.

use super::claim::{self, Claimed};
use super::main_loop::Worker;
use super::presence::Found;
use super::settle::Settlement;
use pgrx::prelude::*;

impl Worker {
    pub(super) fn step(&mut self, settlement: Settlement) -> Claimed {
        let nothing = || Claimed {
            commands: Vec::new(),
            more: false,
        };
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
                return nothing();
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
            settlement.record(client, &self.settings, &mut self.flight)?;
            self.brokers.reload_if_requested(
                client,
                &self.settings,
                &mut self.flight,
                &mut self.status,
                &self.handle,
            )?;
            self.status
                .count_pending(client, self.settings.max_pending)?;
            if !self.settings.enabled {
                return Ok(nothing());
            }
            self.brokers.park_orphans_when_due(client)?;
            claim::claim(
                client,
                &self.settings,
                &mut self.flight,
                &mut self.floor,
                &mut self.faults,
            )
        });
        match result {
            Ok(claimed) => claimed,
            Err(e) => error!("amqp_outbox: worker query failed: {e}"),
        }
    }
}
