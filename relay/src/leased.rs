//! A part of the relay that runs while this relay holds a database's lease, and how a run
//! ends: the delivery, the consuming side and the monitor each end the same ways, and the
//! latter two are started again by [`while_leased`] ([`crate::database`] starts the delivery
//! again itself).

use crate::lease::Lease;
use crate::log::Log;
use crate::stop;
use std::time::Duration;

/// Why a run ended.
pub enum Ended {
    /// SIGTERM or SIGINT: delivered rows were deleted.
    Stopped,
    /// The lease ran out or was taken again: another relay may serve the database now.
    LeaseLost,
    /// The database or the AMQP thread failed.
    Failed(String),
}

/// Runs `run` for each acquisition of the lease (its generation), until the relay stops: what
/// the consuming side and the monitor do on their threads. A failure is logged as `what`
/// stopped and run again after a backoff; a lost lease waits for the next acquisition.
pub fn while_leased(what: &str, lease: &Lease, log: &Log, mut run: impl FnMut(u64) -> Ended) {
    let mut backoff = Duration::from_millis(500);
    while !stop::requested() {
        let Some(generation) = lease.held() else {
            stop::wait(&[], Duration::from_millis(200));
            continue;
        };
        match run(generation) {
            Ended::Stopped => break,
            Ended::LeaseLost => backoff = Duration::from_millis(500),
            Ended::Failed(e) => {
                log.warning(&format!("{what} stopped, starting again: {e}"));
                stop::wait(&[], backoff);
                backoff = (backoff * 2).min(Duration::from_secs(10));
            }
        }
    }
}
