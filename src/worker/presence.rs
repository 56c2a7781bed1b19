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
    pub fn still_installed(&mut self) -> bool {
        let installed = queries::extension_exists();
        if !installed {
            self.doubt();
        }
        installed
    }

    /// Looks, inside the step's transaction (and locks `amqp.message`, see
    /// [`queries::extension_exists`]).
    pub fn check(&mut self) -> Found {
        self.missing = !queries::extension_exists();
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
