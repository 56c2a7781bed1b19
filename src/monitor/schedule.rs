//! The monitor's loop: the engine's rounds ([`amqp_outbox_engine::monitor`]) about once a
//! second while the extension is installed at the library's version, each statement in a
//! transaction of its own through SPI.

use super::compensation;
use crate::gucs;
use crate::inbox::guarded;
use crate::worker::pg;
use crate::worker::queries as outbox_queries;
use amqp_outbox_engine::monitor::{Due, MonitorHost, Schedule, ROUND_EVERY};
use amqp_outbox_engine::outbox::Caught;
use amqp_outbox_engine::telemetry::Level;
use pgrx::prelude::*;
use std::time::{Duration, Instant};

enum Presence {
    Ready,
    /// Installed at another version than the library's: the monitor waits for the update.
    Mismatch(String),
    Missing,
}

#[derive(Default)]
pub struct Monitor {
    schedule: Schedule,
    /// The version mismatch last logged (once per distinct one).
    mismatch_logged: Option<String>,
}

impl Monitor {
    pub fn run(mut self) -> ! {
        let mut settings = gucs::worker_settings();
        loop {
            if pg::shutdown_requested() {
                log!("amqp_outbox: monitor shutting down");
                // SAFETY: the main thread, between transactions; never returns. The launcher
                // starts it again unless its database is going away.
                unsafe { crate::pg_compat::proc_exit(0) };
            }
            if pg::reload_config_if_requested() {
                settings = gucs::worker_settings();
            }
            let started = Instant::now();
            match presence() {
                Presence::Ready => {
                    self.mismatch_logged = None;
                    let handler_timeout =
                        Duration::from_millis(gucs::HANDLER_TIMEOUT.get().max(0) as u64);
                    self.schedule.round(
                        &mut SpiMonitor,
                        &settings.retry_backoff(),
                        handler_timeout,
                    );
                }
                Presence::Mismatch(why) => {
                    if self.mismatch_logged.as_ref() != Some(&why) {
                        log!("amqp_outbox: monitor waits: {why}");
                        self.mismatch_logged = Some(why);
                    }
                }
                Presence::Missing => {
                    log!(
                        "amqp_outbox: extension not installed in this database; the monitor exits"
                    );
                    // SAFETY: as above.
                    unsafe { crate::pg_compat::proc_exit(0) };
                }
            }
            let rest = ROUND_EVERY.saturating_sub(started.elapsed());
            if !rest.is_zero() {
                pg::wait(None, rest, pg::WaitEvent::MonitorMain);
            }
        }
    }
}

/// The monitor's statements through SPI, each in a transaction of its own.
struct SpiMonitor;

impl MonitorHost for SpiMonitor {
    fn statement_alone(
        &mut self,
        what: &str,
        sql: &'static str,
        lock_wait: Option<Duration>,
    ) -> Result<Option<String>, Caught> {
        guarded::statement_alone(what, sql, lock_wait)
    }

    fn claim_compensation(
        &mut self,
        delay: &dyn Fn(i32) -> Duration,
    ) -> Result<Option<Due>, String> {
        compensation::claim(delay)
    }

    fn compensate(&mut self, due: &Due, timeout: Duration) -> Result<bool, Caught> {
        compensation::compensate(due, timeout)
    }

    fn compensation_failed(&mut self, due: &Due, error: &str) -> Result<(), String> {
        compensation::failed(due, error)
    }

    fn log(&mut self, level: Level, text: &str) {
        match level {
            Level::Debug => debug1!("amqp_outbox: {text}"),
            Level::Log => log!("amqp_outbox: {text}"),
            Level::Warning => warning!("amqp_outbox: {text}"),
        }
    }

    fn pause(&mut self, pause: Duration) -> bool {
        pg::wait(None, pause, pg::WaitEvent::MonitorMain);
        !pg::shutdown_requested()
    }
}

fn presence() -> Presence {
    pg::transaction("amqp_outbox monitor", || {
        if !outbox_queries::extension_exists() {
            Presence::Missing
        } else if let Some(why) = outbox_queries::version_mismatch() {
            Presence::Mismatch(why)
        } else {
            Presence::Ready
        }
    })
}
