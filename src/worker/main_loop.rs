//! The worker's loop, on its main (PostgreSQL) thread: take the AMQP thread's events, settle
//! rows in one short transaction, claim the next rows, hand them over, sleep on latch + socket.

use super::flight::Flight;
use super::pg::{self, Woken};
use super::queries::{self, Row};
use crate::gucs::WorkerSettings;
use crate::shmem;
use amqp_outbox_broker::{
    BrokerConfig, BrokerHandle, Command, Event, Failure, LogLevel, OutboundMessage,
};
use pgrx::prelude::*;
use std::collections::BTreeMap;
use std::time::Duration;

/// What the events of one wake-up ask the database to do.
#[derive(Default)]
struct Settlement {
    delivered: Vec<i64>,
    rejected: Vec<(i64, String)>,
}

pub struct Worker {
    settings: WorkerSettings,
    handle: BrokerHandle,
    flight: Flight,
    /// The configuration last sent to the AMQP thread.
    brokers: Vec<BrokerConfig>,
    extension_present: bool,
    message_id_prefix: Option<String>,
    need_reload: bool,
    /// Where the next claim starts; reset to 0 whenever a pass reaches the end.
    scan_from: i64,
    /// The last claim filled its batch: claim again without sleeping.
    more_work: bool,
    /// A connection changed state: publish the broker table to shared memory.
    status_changed: bool,
    status_reported_at: Option<std::time::Instant>,
}

impl Worker {
    pub fn new(handle: BrokerHandle) -> Self {
        Worker {
            settings: WorkerSettings::snapshot(),
            handle,
            flight: Flight::default(),
            brokers: Vec::new(),
            extension_present: false,
            message_id_prefix: None,
            need_reload: true,
            scan_from: 0,
            more_work: false,
            status_changed: true,
            status_reported_at: None,
        }
    }

    pub fn run(mut self) -> ! {
        loop {
            if pg::shutdown_requested() {
                log!("amqp_outbox: worker shutting down");
                self.handle.shutdown(Duration::from_secs(2));
                // Exit 1, not 0: exit 0 tells the postmaster never to restart the worker, and
                // a SIGTERM from pg_terminate_backend() is not a reason to stop publishing.
                unsafe { pg_sys::proc_exit(1) };
            }
            if pg::reload_config_if_requested() {
                self.settings = WorkerSettings::snapshot();
                self.need_reload = true;
            }
            let requests = shmem::take_requests();
            if requests.reload {
                self.need_reload = true;
            }
            self.handle_disconnect_requests(requests.disconnect);

            let settlement = self.take_events();
            if pg::in_recovery() {
                // A standby publishes nothing; after promotion this loop takes over.
                pg::wait(None, self.settings.naptime);
                continue;
            }
            let publishes =
                pg::transaction("amqp_outbox: settle and claim", || self.step(settlement));
            for command in publishes {
                if !self.handle.send(command) {
                    error!("amqp_outbox: the AMQP thread has stopped");
                }
            }
            self.report_status();
            let timeout = if self.more_work {
                Duration::ZERO
            } else {
                self.settings.naptime
            };
            if let Woken::Events = pg::wait(Some(self.handle.wake_fd()), timeout) {
                // Drained at the top of the loop.
            }
        }
    }

    /// Connection states at once when they change; in-flight counts at most once a second.
    fn report_status(&mut self) {
        let due = self
            .status_reported_at
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(1));
        if !self.status_changed && !due {
            return;
        }
        let mut reports: Vec<shmem::BrokerReport<'_>> = self
            .flight
            .brokers()
            .map(|(id, b)| shmem::BrokerReport {
                broker_id: *id,
                connected: b.connected,
                host: b.host.as_deref(),
                epoch: b.epoch,
                error: b.error.as_deref(),
                in_flight: b.in_flight.len(),
            })
            .collect();
        reports.sort_by_key(|r| r.broker_id);
        shmem::report_brokers(&reports);
        self.status_changed = false;
        self.status_reported_at = Some(std::time::Instant::now());
    }

    fn handle_disconnect_requests(&mut self, which: Option<Vec<i32>>) {
        let ids: Vec<i32> = match which {
            Some(ids) => ids,
            None => self.brokers.iter().map(|b| b.broker_id).collect(),
        };
        for broker_id in ids {
            log!("amqp_outbox: reconnecting broker {broker_id} as requested");
            self.handle.send(Command::Reconnect { broker_id });
        }
    }

    /// Applies connection changes at once; returns what needs the database.
    fn take_events(&mut self) -> Settlement {
        let mut s = Settlement::default();
        for event in self.handle.drain_events() {
            match event {
                Event::Connected {
                    broker_id,
                    host,
                    epoch,
                } => {
                    self.flight.forget_in_flight(broker_id);
                    let b = self.flight.broker(broker_id);
                    b.connected = true;
                    b.epoch = epoch;
                    b.error = None;
                    self.status_changed = true;
                    log!("amqp_outbox: broker {broker_id} connected to {host} (channel {epoch})");
                    b.host = Some(host);
                    self.scan_from = 0;
                }
                Event::Disconnected { broker_id, error } => {
                    self.flight.forget_in_flight(broker_id);
                    let b = self.flight.broker(broker_id);
                    b.connected = false;
                    b.host = None;
                    warning!("amqp_outbox: broker {broker_id} unavailable: {error}");
                    b.error = Some(error);
                    self.status_changed = true;
                }
                Event::Confirmed { ids, .. } => {
                    for id in &ids {
                        self.flight.settle(*id);
                    }
                    shmem::count(|c| &c.confirmed, ids.len() as u64);
                    s.delivered.extend(ids);
                }
                Event::Failed {
                    broker_id,
                    id,
                    failure,
                    error,
                } => {
                    self.flight.settle(id);
                    match failure {
                        // Claimed again once the broker is connected.
                        Failure::Transient => {}
                        Failure::Ambiguous => {
                            self.flight.broker(broker_id).suspects.insert(id);
                        }
                        Failure::Rejected => {
                            self.flight.broker(broker_id).suspects.remove(&id);
                            shmem::count(|c| &c.failed, 1);
                            s.rejected.push((id, error));
                        }
                    }
                    self.scan_from = 0;
                }
                Event::Log { level, message } => match level {
                    LogLevel::Debug => debug1!("amqp_outbox: {message}"),
                    LogLevel::Info => log!("amqp_outbox: {message}"),
                    LogLevel::Warning => warning!("amqp_outbox: {message}"),
                },
                Event::Fatal(why) => {
                    error!("amqp_outbox: the AMQP thread failed: {why}");
                }
            }
        }
        s
    }

    /// One short transaction: record outcomes, reload configuration, claim rows. Returns the
    /// publish commands to send once it has committed.
    fn step(&mut self, settlement: Settlement) -> Vec<Command> {
        if !queries::extension_exists() {
            if self.extension_present || !self.brokers.is_empty() {
                log!("amqp_outbox: extension not installed in this database; waiting for CREATE EXTENSION");
                self.configure(Vec::new());
            }
            self.extension_present = false;
            self.more_work = false;
            return Vec::new();
        }
        if !self.extension_present {
            self.extension_present = true;
            self.need_reload = true;
            self.message_id_prefix = None;
        }
        let result = Spi::connect_mut(|client| {
            if !settlement.delivered.is_empty() {
                queries::delete_delivered(client, &settlement.delivered)?;
            }
            for (id, error) in &settlement.rejected {
                self.record_rejection(client, *id, error)?;
            }
            if self.message_id_prefix.is_none() {
                self.message_id_prefix = Some(queries::message_id_prefix()?);
            }
            if self.need_reload {
                let brokers = queries::load_brokers(client, &self.broker_template())?;
                self.need_reload = false;
                self.configure(brokers);
            }
            if !self.settings.enabled {
                self.more_work = false;
                return Ok(Vec::new());
            }
            self.claim(client)
        });
        match result {
            Ok(commands) => commands,
            Err(e) => error!("amqp_outbox: worker query failed: {e}"),
        }
    }

    fn record_rejection(
        &mut self,
        client: &mut pgrx::spi::SpiClient<'_>,
        id: i64,
        error: &str,
    ) -> pgrx::spi::SpiResult<()> {
        let s = &self.settings;
        let recorded = queries::record_failure(
            client,
            id,
            error,
            s.max_attempts,
            s.retry_backoff_min.as_millis() as i64,
            s.retry_backoff_max.as_millis() as i64,
        )?;
        if let Some(r) = recorded {
            if r.parked {
                shmem::count(|c| &c.parked, 1);
                warning!(
                    "amqp_outbox: message {id} parked after {} failed attempts: {error}",
                    r.attempts
                );
            } else {
                log!(
                    "amqp_outbox: message {id} refused (attempt {}), will retry: {error}",
                    r.attempts
                );
            }
        }
        Ok(())
    }

    fn broker_template(&self) -> BrokerConfig {
        let s = &self.settings;
        BrokerConfig {
            broker_id: 0,
            hosts: Vec::new(),
            exchanges: Vec::new(),
            connect_timeout: s.connect_timeout,
            heartbeat_secs: s.heartbeat_secs,
            confirm_timeout: s.confirm_timeout,
            reconnect_min: s.retry_backoff_min,
            reconnect_max: s.retry_backoff_max,
        }
    }

    fn configure(&mut self, brokers: Vec<BrokerConfig>) {
        if brokers == self.brokers {
            return;
        }
        let ids: Vec<i32> = brokers.iter().map(|b| b.broker_id).collect();
        self.flight.retain_brokers(&ids);
        for id in &ids {
            self.flight.broker(*id);
        }
        self.brokers = brokers.clone();
        self.status_changed = true;
        self.handle.send(Command::Configure(brokers));
    }

    fn claim(
        &mut self,
        client: &mut pgrx::spi::SpiClient<'_>,
    ) -> pgrx::spi::SpiResult<Vec<Command>> {
        let mut commands = Vec::new();
        let max_size = self.settings.max_message_size;

        // Suspects first: alone on their channel, one at a time.
        for (broker_id, ids) in self.flight.isolation_ready() {
            let rows = queries::claim_ids(client, &ids)?;
            let found: Vec<i64> = rows.iter().map(|r| r.id).collect();
            let b = self.flight.broker(broker_id);
            b.suspects.retain(|id| found.contains(id));
            let messages = self.prepare(client, rows, max_size)?;
            for m in &messages {
                self.flight.mark_sent(broker_id, m.id);
            }
            if !messages.is_empty() {
                commands.push(Command::Publish {
                    broker_id,
                    messages,
                    solo: true,
                });
            }
        }

        let open = self.flight.open_brokers(self.settings.max_in_flight);
        if open.is_empty() {
            self.more_work = false;
            return Ok(commands);
        }
        let mut room: BTreeMap<i32, usize> = open.into_iter().collect();
        let broker_ids: Vec<i32> = room.keys().copied().collect();
        let limit = self.settings.batch_size;
        let rows = queries::claim(client, self.scan_from, &broker_ids, limit)?;
        let reached_end = rows.len() < limit;
        let last_id = rows.last().map(|r| r.id);
        let mut skipped_for_room = false;
        let mut batches: BTreeMap<i32, Vec<Row>> = BTreeMap::new();
        for row in rows {
            if self.flight.is_in_flight(row.id) {
                continue;
            }
            if row.attempts > 0 {
                // Failed before: publish it alone so its next error is its own.
                self.flight.broker(row.broker_id).suspects.insert(row.id);
                continue;
            }
            match room.get_mut(&row.broker_id) {
                Some(r) if *r > 0 => {
                    *r -= 1;
                    batches.entry(row.broker_id).or_default().push(row);
                }
                _ => skipped_for_room = true,
            }
        }
        self.scan_from = match last_id {
            Some(id) if !reached_end && !skipped_for_room => id,
            _ => 0,
        };
        self.more_work = !reached_end && !skipped_for_room;
        for (broker_id, rows) in batches {
            let messages = self.prepare(client, rows, max_size)?;
            if messages.is_empty() {
                continue;
            }
            for m in &messages {
                self.flight.mark_sent(broker_id, m.id);
            }
            shmem::count(|c| &c.published, messages.len() as u64);
            commands.push(Command::Publish {
                broker_id,
                messages,
                solo: false,
            });
        }
        Ok(commands)
    }

    /// Turns rows into messages; parks rows that can never be published as they are.
    fn prepare(
        &self,
        client: &mut pgrx::spi::SpiClient<'_>,
        rows: Vec<Row>,
        max_size: usize,
    ) -> pgrx::spi::SpiResult<Vec<OutboundMessage>> {
        let prefix = self.message_id_prefix.as_deref().unwrap_or("0");
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            if row.body.len() > max_size {
                let why = format!(
                    "body is {} bytes, over amqp_outbox.max_message_size ({max_size} bytes)",
                    row.body.len()
                );
                warning!("amqp_outbox: message {} parked: {why}", row.id);
                queries::park(client, row.id, &why)?;
                shmem::count(|c| &c.parked, 1);
                continue;
            }
            out.push(to_message(prefix, row));
        }
        Ok(out)
    }
}

/// Header names the worker adds to every message.
pub const HEADER_PRODUCER_PID: &str = "x-amqp-outbox-producer-pid";
pub const HEADER_PRODUCER_START: &str = "x-amqp-outbox-producer-start";
pub const HEADER_SEQUENCE: &str = "x-amqp-outbox-seq";

fn to_message(prefix: &str, row: Row) -> OutboundMessage {
    let mut headers = match row.headers {
        Some(serde_json::Value::Object(map)) => map,
        _ => serde_json::Map::new(),
    };
    headers.insert(HEADER_PRODUCER_PID.into(), row.producer_pid.into());
    headers.insert(HEADER_PRODUCER_START.into(), row.producer_started_at.into());
    headers.insert(HEADER_SEQUENCE.into(), row.id.into());
    OutboundMessage {
        id: row.id,
        message_id: format!("{prefix}-{}", row.id),
        exchange: row.exchange,
        routing_key: row.routing_key,
        body: row.body,
        delivery_mode: if row.delivery_mode == 1 { 1 } else { 2 },
        content_type: row.content_type,
        reply_to: row.reply_to,
        correlation_id: row.correlation_id,
        timestamp: (row.created_at.max(0) / 1_000_000) as u64,
        headers,
    }
}
