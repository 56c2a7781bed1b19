//! The outbox's delivery for one database while this relay holds its lease: the engine's claim,
//! events and settling over a client connection, as the extension's background worker runs
//! them through SPI. A step is two transactions: the settling of outcomes (READ COMMITTED, as
//! the worker's) and the claim (REPEATABLE READ: the probe and the claim read one snapshot, see
//! [`crate::client_outbox`]); what the claim returns goes to the AMQP thread once it committed.
//!
//! Woken by the AMQP thread's events, by the lease's notices (a commit's NOTIFY, a reload), by a
//! retry coming due, and at the naptime. Any error of the database ends the delivery: the
//! relay connects again and starts afresh, as the worker is restarted after an ERROR; what was
//! in flight is still in the table and is published again (at least once, never lost).

use crate::client_outbox::{ClientOutbox, Session};
use crate::config::Config;
use crate::connect;
use crate::doorbell::Doorbell;
use crate::lease::Lease;
use crate::leased::Ended;
use crate::report::{self, RelayTelemetry, Report};
use crate::stop;
use amqp_outbox_broker::{BrokerConfig, BrokerHandle};
use amqp_outbox_engine::brokers::{self, Brokers};
use amqp_outbox_engine::cadence::Cadence;
use amqp_outbox_engine::claim::{self, Claimed};
use amqp_outbox_engine::events::{self, ThreadFailed};
use amqp_outbox_engine::faults::Faults;
use amqp_outbox_engine::flight::Flight;
use amqp_outbox_engine::scan_floor::ScanFloor;
use amqp_outbox_engine::scheduled::Scheduled;
use amqp_outbox_engine::settle::{self, Settlement, Sweep};
use postgres::{Client, IsolationLevel};
use std::time::{Duration, Instant};

/// This database's acknowledgement queue, named as the extension names it (the system
/// identifier and the database's oid), read from the install's own status function.
const ACK_QUEUE_SQL: &str = "SELECT ack_queue FROM amqp._worker_status()";

/// `amqp_outbox.idempotency_window` as the publishing sessions read it (minutes; the
/// database's or the relay role's `SET`, 1 day by default), for the expiry of keys.
const KEY_WINDOW_SQL: &str = "\
SELECT CASE WHEN w IS NULL OR w OPERATOR(pg_catalog.=) '' THEN 1440 \
            ELSE amqp._setting_integer('amqp_outbox.idempotency_window', w, 'min', 1, 2147483647) END \
  FROM (SELECT pg_catalog.current_setting('amqp_outbox.idempotency_window', true) AS w) s";

/// The key window when the database's setting cannot be read (a bad value: the publishing
/// sessions refuse it too), as the extension's default.
const KEY_WINDOW_DEFAULT: i32 = 1440;

pub struct Delivery<'a> {
    config: &'a Config,
    client: Client,
    session: Session,
    handle: BrokerHandle,
    telemetry: RelayTelemetry,
    template: BrokerConfig,
    generation: u64,
    flight: Flight,
    brokers: Brokers,
    report: Report,
    floor: ScanFloor,
    faults: Faults,
    scheduled: Scheduled,
    /// A NOTIFY 'scheduled' arrived: delayed messages were written.
    scheduled_noted: bool,
    key_window: i32,
    sweep: Sweep,
    cadence: Cadence,
    /// A commit's NOTIFY arrived since the last claim (or the doorbell asks for a claim).
    committed: bool,
    /// Whether publishers notify now ([`crate::doorbell`]).
    doorbell: Doorbell,
}

impl<'a> Delivery<'a> {
    /// Connects the statements' session and the AMQP thread for the lease's acquisition
    /// `generation`.
    pub fn start(
        config: &'a Config,
        url: &str,
        telemetry: RelayTelemetry,
        generation: u64,
    ) -> Result<Self, String> {
        let mut client = connect::connect(url, &config.postgres_tls)?;
        let session = Session::new(&mut client).map_err(|e| connect::describe(&e))?;
        let ack_queue: String = client
            .query_one(ACK_QUEUE_SQL, &[])
            .and_then(|r| r.try_get(0))
            .map_err(|e| format!("is the plain-SQL install there? {}", connect::describe(&e)))?;
        let key_window = match client.query_one(KEY_WINDOW_SQL, &[]) {
            Ok(r) => r.get(0),
            Err(e) => {
                telemetry.log.warning(&format!(
                    "amqp_outbox.idempotency_window cannot be read, keys expire after a day: {}",
                    connect::describe(&e)
                ));
                KEY_WINDOW_DEFAULT
            }
        };
        let handle = amqp_outbox_broker::spawn()
            .map_err(|e| format!("cannot start the AMQP thread: {e}"))?;
        let mut flight = Flight::default();
        Faults::configure(&config.settings, &mut flight);
        Ok(Delivery {
            config,
            client,
            session,
            handle,
            telemetry,
            template: brokers::template(&config.settings, ack_queue),
            generation,
            flight,
            brokers: Brokers::default(),
            report: Report::default(),
            floor: ScanFloor::default(),
            faults: Faults::default(),
            scheduled: Scheduled::default(),
            scheduled_noted: true,
            key_window,
            sweep: Sweep::default(),
            cadence: Cadence::default(),
            committed: true,
            doorbell: Doorbell::default(),
        })
    }

    /// Runs until the relay stops, the lease is lost or something fails; then stops the AMQP
    /// thread.
    pub fn run(mut self, lease: &Lease) -> Ended {
        let ended = self.serve(lease);
        if matches!(ended, Ended::Stopped) {
            self.delete_delivered(true).ok();
        }
        self.handle.shutdown(Duration::from_secs(2));
        ended
    }

    fn serve(&mut self, lease: &Lease) -> Ended {
        let config = self.config;
        let settings = &config.settings;
        loop {
            if stop::requested() {
                return Ended::Stopped;
            }
            if lease.held() != Some(self.generation) {
                return Ended::LeaseLost;
            }
            let notices = lease.take_notices();
            if notices.reload {
                self.brokers.request_reload();
            }
            if !notices.disconnect.is_empty() {
                self.brokers
                    .reconnect(Some(notices.disconnect), &self.handle, &self.telemetry);
            }
            self.scheduled_noted |= notices.scheduled;
            if notices.commits > 0 {
                self.telemetry.add(report::COMMIT_WAKEUPS, 1);
                self.committed = true;
            }
            let taken = events::take(
                self.handle.drain_events(),
                &self.telemetry,
                settings,
                &mut self.flight,
                &mut self.report,
            );
            let mut settlement = match taken {
                Ok(s) => s,
                Err(ThreadFailed(why)) => {
                    return Ended::Failed(format!("the AMQP thread failed: {why}"))
                }
            };
            self.sweep.run(
                &mut self.flight,
                settings.resend_after,
                &self.telemetry,
                &mut settlement,
            );
            if let Err(e) = self.step_if_needed(settlement) {
                return Ended::Failed(e);
            }
            if let Err(e) = self.delete_delivered(false) {
                return Ended::Failed(e);
            }
            if self.report.due(&self.flight) {
                let written = self.client.transaction().and_then(|mut t| {
                    self.report.write(&mut t, &self.telemetry, &self.flight)?;
                    t.commit()
                });
                if let Err(e) = written {
                    return Ended::Failed(connect::describe(&e));
                }
            }
            let timeout = self.timeout(lease);
            stop::wait(&[self.handle.wake_fd(), lease.fd()], timeout);
        }
    }

    /// A step when something asks for one ([`Cadence::nothing_to_claim`]): a commit, outcomes
    /// to record, a reload, a retry come due, a claim that left rows behind, an orphan check,
    /// delayed messages due, or the naptime.
    fn step_if_needed(&mut self, settlement: Settlement) -> Result<(), String> {
        let config = self.config;
        let settings = &config.settings;
        let settle_needed = !settlement.is_empty()
            || self.brokers.reload_pending()
            || self.brokers.orphan_check_due()
            || (settings.enabled && self.scheduled.due(self.scheduled_noted));
        if self.cadence.nothing_to_claim(
            &mut self.flight,
            &mut self.floor,
            settlement.reopened,
            settle_needed,
            self.committed,
            settings.naptime,
        ) {
            return Ok(());
        }
        if let Some(gap) = self.cadence.gap(settings.batch_interval) {
            // Commits that come fast are gathered into one claim (the worker's rule).
            stop::wait(&[], gap);
        }
        self.cadence.stepping();
        self.committed = false;
        self.telemetry.add(report::STEPS, 1);
        if settle_needed {
            self.settle(settlement)?;
        }
        if !settings.enabled {
            return Ok(());
        }
        let claimed = self.claim()?;
        self.cadence.claimed(&claimed, &self.flight);
        let messages: usize = claimed.commands.iter().map(|c| c.messages()).sum();
        let busy = self.cadence.more_work() || self.cadence.gap(settings.batch_interval).is_some();
        self.committed |= self
            .doorbell
            .after_claim(&mut self.client, messages, busy)
            .map_err(|e| connect::describe(&e))?;
        for command in claimed.commands {
            if !self.handle.send(command) {
                return Err("the AMQP thread has stopped".into());
            }
        }
        Ok(())
    }

    /// The first transaction: outcomes, the configuration, orphans.
    fn settle(&mut self, settlement: Settlement) -> Result<(), String> {
        if self.brokers.reload_pending() {
            // Brokers may come or go: rows are read again from the lowest id.
            self.floor.reset();
        }
        let mut t = self
            .client
            .transaction()
            .map_err(|e| connect::describe(&e))?;
        let mut outbox = ClientOutbox::new(&mut t, &mut self.session);
        settlement
            .record(
                &mut outbox,
                &self.telemetry,
                &self.config.settings,
                &mut self.flight,
            )
            .map_err(|e| connect::describe(&e))?;
        self.brokers
            .reload_if_requested(
                &mut outbox,
                &self.template,
                &self.telemetry,
                &mut self.flight,
                &mut self.report,
                &self.handle,
            )
            .map_err(|e| connect::describe(&e))?;
        if self.config.settings.enabled {
            self.brokers
                .park_orphans_when_due(&mut outbox, &self.telemetry)
                .map_err(|e| connect::describe(&e))?;
            let noted = std::mem::take(&mut self.scheduled_noted);
            if self.scheduled.due(noted) {
                let moved = self
                    .scheduled
                    .run_when_due(&mut outbox, &self.telemetry, noted, true, self.key_window)
                    .map_err(|e| connect::describe(&e))?;
                if moved > 0 {
                    // The moved rows keep their ids, below the floor by now (the claim that
                    // follows in this step reads from the lowest id).
                    self.floor.reset();
                }
            }
        }
        t.commit().map_err(|e| connect::describe(&e))
    }

    /// The second transaction: the claim, in one snapshot.
    fn claim(&mut self) -> Result<Claimed, String> {
        let mut t = self
            .client
            .build_transaction()
            .isolation_level(IsolationLevel::RepeatableRead)
            .start()
            .map_err(|e| connect::describe(&e))?;
        let claimed = claim::claim(
            &mut ClientOutbox::new(&mut t, &mut self.session),
            &self.telemetry,
            &self.config.settings,
            &mut self.flight,
            &mut self.floor,
            &mut self.faults,
        )
        .map_err(|e| connect::describe(&e))?;
        t.commit().map_err(|e| connect::describe(&e))?;
        Ok(claimed)
    }

    /// How long to wait for a wake-up: the cadence's time, sooner for a delayed message due,
    /// and in time to see the lease confirmed (or lost) and to report.
    fn timeout(&mut self, lease: &Lease) -> Duration {
        let mut timeout = self.cadence.timeout(
            &mut self.flight,
            &mut self.floor,
            self.config.settings.naptime,
            None,
        );
        if self.config.settings.enabled {
            // A delayed message is moved when it is due, whatever the naptime.
            timeout = timeout.min(self.scheduled.until_due(self.scheduled_noted));
        }
        if let Some(poll) = self.doorbell.poll(self.config.settings.batch_interval) {
            // Publishers do not notify meanwhile.
            timeout = timeout.min(poll);
        }
        timeout.min(lease.expires_in()).min(report::REPORT_EVERY)
    }

    /// Deletes the delivered rows once their batch is due, or all of them (`all`: at a clean
    /// stop, so that none is published again).
    fn delete_delivered(&mut self, all: bool) -> Result<(), String> {
        let (delivered, locked_before) = self.flight.take_deletable(Instant::now(), all);
        if delivered.is_empty() {
            return Ok(());
        }
        let mut t = self
            .client
            .transaction()
            .map_err(|e| connect::describe(&e))?;
        let still_locked = settle::delete_delivered(
            &mut ClientOutbox::new(&mut t, &mut self.session),
            delivered,
            locked_before,
            self.config.keep_log,
        )?;
        t.commit().map_err(|e| connect::describe(&e))?;
        if all && !still_locked.is_empty() {
            // Published again by the next relay: at least once, never lost.
            self.telemetry.log.warning(&format!(
                "{} delivered row(s) locked by another session were not deleted",
                still_locked.len()
            ));
        }
        self.flight.keep_locked(still_locked, Instant::now());
        Ok(())
    }
}
