//! Whether the extension is installed in the worker's database, at the version of this library:
//! while it is at another version, the worker publishes nothing and says why once; when it is
//! not installed at all, the worker exits.

use super::queries;
use pgrx::prelude::*;

#[derive(Default)]
pub struct Presence {
    present: bool,
    /// Not installed at the last look (not merely at another version).
    missing: bool,
    /// "Not installed" was logged (once per absence, not per step).
    announced_missing: bool,
    /// The installed version last warned about, while it differs from the library's.
    announced_version: Option<String>,
    /// `amqp.message`'s oid when the extension was last found.
    table: Option<pg_sys::Oid>,
}

pub enum Found {
    /// Installed, at this library's version. `appeared`: it was not at the last step, so the
    /// configuration must be read.
    Ready { appeared: bool },
    /// Missing or at another version. `unusable_now`: it just became so; the AMQP thread must
    /// drop its brokers.
    Waiting { unusable_now: bool },
}

impl Presence {
    /// Installed and usable at the last step.
    pub fn present(&self) -> bool {
        self.present
    }

    /// Not installed at the last step: the worker has nothing to do in this database.
    pub fn missing(&self) -> bool {
        self.missing
    }

    /// The extension was not found outside [`Presence::check`]: the next step looks properly.
    pub fn doubt(&mut self) {
        self.present = false;
    }

    /// Whether the extension is still installed, looked at inside the current transaction (and
    /// `amqp.message` locked, see [`queries::extension_exists`]); if it is gone, the next step
    /// looks properly ([`Presence::check`]).
    ///
    /// Every step asks, so it asks cheaply: `amqp.message` locked and still the table that was
    /// there when the extension was last found is enough (a DROP EXTENSION drops it, a new
    /// CREATE EXTENSION makes another); only otherwise is the extension looked up by name (a scan
    /// of `pg_extension`, which has no cache: 2–3 % of the worker's CPU at 2,000 messages/s).
    pub fn still_installed(&mut self) -> bool {
        if self.table.is_some() && crate::message_table::lock(pg_sys::AccessShareLock) == self.table
        {
            return true;
        }
        self.table = queries::installed_table();
        if self.table.is_none() {
            self.doubt();
        }
        self.table.is_some()
    }

    /// Looks, inside the step's transaction (and locks `amqp.message`, see
    /// [`queries::extension_exists`]).
    pub fn check(&mut self) -> Found {
        self.table = queries::installed_table();
        self.missing = self.table.is_none();
        if self.missing {
            queries::forget_plans();
            let unusable_now = self.present || !self.announced_missing;
            // The worker exits now (see main_loop); it says so there.
            self.announced_missing = true;
            self.present = false;
            return Found::Waiting { unusable_now };
        }
        if self.present {
            return Found::Ready { appeared: false };
        }
        if let Some(version) = queries::version_mismatch() {
            let unusable_now = self.announced_version.as_deref() != Some(version.as_str());
            if unusable_now {
                warning!(
                    "amqp_outbox: the extension in this database is version {version} but the library is {}: messages wait until ALTER EXTENSION amqp_outbox UPDATE",
                    queries::LIBRARY_VERSION
                );
                self.announced_version = Some(version);
            }
            return Found::Waiting { unusable_now };
        }
        self.present = true;
        self.announced_missing = false;
        self.announced_version = None;
        Found::Ready { appeared: true }
    }
}
