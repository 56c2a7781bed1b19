//! One database: its lease, and while this relay holds it the delivery (this thread), the
//! consuming side ([`crate::consume`]) and the monitor ([`crate::monitor`]), each on a thread
//! and connection of its own and started again after every failure, until the relay stops.

use crate::config::Config;
use crate::connect;
use crate::delivery::Delivery;
use crate::lease::Lease;
use crate::leased::Ended;
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
    std::thread::scope(|scope| {
        let consuming = std::thread::Builder::new()
            .name("consume".into())
            .spawn_scoped(scope, || crate::consume::serve(url, config, &lease, &log));
        if let Err(e) = consuming {
            log.warning(&format!("cannot start the consuming side: {e}"));
        }
        let monitoring = std::thread::Builder::new()
            .name("monitor".into())
            .spawn_scoped(scope, || crate::monitor::serve(url, config, &lease, &log));
        if let Err(e) = monitoring {
            log.warning(&format!("cannot start the monitor: {e}"));
        }
        deliver(url, config, &lease, &log);
    });
    log.log("stopped");
}

/// The delivery while the lease is held, until the relay stops.
fn deliver(url: &str, config: &Config, lease: &Lease, log: &Log) {
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
            Ok(delivery) => delivery.run(lease),
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
}
