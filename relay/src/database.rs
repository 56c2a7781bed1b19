//! One database: its lease, and the delivery while this relay holds it; started again after
//! every failure, until the relay stops.

use crate::config::Config;
use crate::connect;
use crate::delivery::{Delivery, Ended};
use crate::lease::Lease;
use crate::log::Log;
use crate::report::RelayTelemetry;
use crate::stop;
use std::time::Duration;

/// Serves the database of `url` until a stop is requested.
pub fn serve(url: &str, config: &Config) {
    let log = Log {
        target: connect::target(url),
        verbose: config.verbose,
    };
    let lease = match Lease::start(
        url.to_owned(),
        config.postgres_tls.clone(),
        config.takeover_every,
        log.clone(),
    ) {
        Ok(lease) => lease,
        Err(e) => {
            log.warning(&format!("cannot start: {e}"));
            return;
        }
    };
    let mut backoff = Duration::from_millis(500);
    while !stop::requested() {
        let Some(generation) = lease.held() else {
            // Standing by: the lease's thread tries to take the lock and wakes this one.
            stop::wait(&[lease.fd()], Duration::from_secs(1));
            lease.take_notices();
            continue;
        };
        let telemetry = RelayTelemetry::new(log.clone());
        let ended = match Delivery::start(config, url, telemetry, generation) {
            Ok(delivery) => delivery.run(&lease),
            Err(e) => Ended::Failed(e),
        };
        match ended {
            Ended::Stopped => break,
            Ended::LeaseLost => {
                log.warning("stopped delivering: the lease on this database was lost");
                backoff = Duration::from_millis(500);
            }
            Ended::Failed(e) => {
                log.warning(&format!("delivery stopped, starting again: {e}"));
                stop::wait(&[], backoff);
                backoff = (backoff * 2).min(Duration::from_secs(10));
            }
        }
    }
    log.log("stopped");
}
