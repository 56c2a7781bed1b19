//! The worker's loop, on its main (PostgreSQL) thread: take the AMQP thread's events, settle
//! rows in one short transaction, claim the next rows, hand them over, sleep on latch + socket.

use super::flight::{Flight, Room, Verdict};
use super::pg::{self, Woken};
use super::queries::{self, Row};
use crate::gucs::WorkerSettings;
use crate::shmem;
use amqp_outbox_broker::{
    AckQueueConfig, BrokerConfig, BrokerHandle, Command, Event, Failure, LogLevel, OutboundMessage,
    ProofMode,
};
use pgrx::prelude::*;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Messages in flight that are copied to the status views on every change.
const COPY_AT_ONCE: usize = 256;

/// Above that, the status views are refreshed at most this often while messages flow.
const STATUS_EVERY: Duration = Duration::from_millis(100);

/// How often rows naming no broker are looked for (and on every configuration change).
const ORPHAN_CHECK_EVERY: Duration = Duration::from_secs(10);

/// At most one log line about nacks this often.
const NACK_LOG_EVERY: Duration = Duration::from_secs(10);

/// `min · 2^n`, capped at `max`.
fn backoff(min: Duration, max: Duration, n: u32) -> Duration {
    min.checked_mul(2u32.saturating_pow(n.min(31)))
        .unwrap_or(max)
        .min(max.max(min))
}

// Coalescing: under load every commit and every confirm wakes the worker, and one step per
// wake-up would spend a transaction (and a broker round trip) on each message, taking the CPU
// the publishing sessions need. Steps are at least `amqp_outbox.batch_interval` apart, so one
// claim takes everything committed meanwhile. An idle worker is not delayed: a commit arriving
// after the interval is claimed at once.

/// With `amqp_outbox.enabled = off`, commits do not start a step; this often one still runs, so
/// the status views and configuration stay current.
const DISABLED_STEP_EVERY: Duration = Duration::from_secs(1);

/// How often the worker looks for messages in flight past `amqp_outbox.resend_after`.
const SWEEP_EVERY: Duration = Duration::from_millis(100);

/// What the events of one wake-up ask the database to do.
#[derive(Default)]
struct Settlement {
    delivered: Vec<i64>,
    rejected: Vec<(i64, String)>,
    /// Can never be published as it is: parked at once.
    unsendable: Vec<(i64, String)>,
    /// Lost (gap rule) or without proof past the timeout: publish again, counting an attempt.
    resend: Vec<(Vec<i64>, &'static str)>,
}

pub struct Worker {
    settings: WorkerSettings,
    handle: BrokerHandle,
    flight: Flight,
    /// The configuration last sent to the AMQP thread.
    brokers: Vec<BrokerConfig>,
    extension_present: bool,
    /// The installed extension version last warned about, while it differs from the library's.
    announced_version: Option<String>,
    need_reload: bool,
    /// Counts first publishes, for the `test_lose_one_in` fault injection.
    published_count: u64,
    swept_at: Instant,
    /// The last claim filled its batch: claim again without sleeping.
    more_work: bool,
    /// A connection changed state: publish the broker table to shared memory.
    status_changed: bool,
    status_reported_at: Option<std::time::Instant>,
    reported_changes: u64,
    orphans_checked_at: Option<Instant>,
    /// "Not installed" was logged (once per absence, not per loop).
    announced_missing: bool,
    /// Nacked messages held back until the instant, with how many nacks each had.
    held: std::collections::HashMap<i64, (Instant, u32)>,
    nacked_since_log: u64,
    nack_logged_at: Option<Instant>,
    /// Backlog per broker, counted about once a second while `max_pending` is set.
    pending: std::collections::HashMap<i32, i64>,
    pending_counted_at: Option<Instant>,
    stepped_at: Option<Instant>,
    /// When refused or nacked messages are due again (earliest first): the worker wakes then
    /// instead of at its naptime, so retries keep to their backoff.
    retry_due: std::collections::BinaryHeap<std::cmp::Reverse<Instant>>,
}

impl Worker {
    pub fn new(handle: BrokerHandle) -> Self {
        Worker {
            settings: WorkerSettings::snapshot(),
            handle,
            flight: Flight::default(),
            brokers: Vec::new(),
            extension_present: false,
            announced_version: None,
            need_reload: true,
            published_count: 0,
            swept_at: Instant::now(),
            more_work: false,
            status_changed: true,
            status_reported_at: None,
            reported_changes: 0,
            announced_missing: false,
            orphans_checked_at: None,
            held: Default::default(),
            nacked_since_log: 0,
            nack_logged_at: None,
            pending: Default::default(),
            pending_counted_at: None,
            stepped_at: None,
            retry_due: Default::default(),
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

            if !self.more_work {
                if let Some(gap) = self
                    .stepped_at
                    .and_then(|t| self.settings.batch_interval.checked_sub(t.elapsed()))
                    .filter(|gap| !gap.is_zero())
                {
                    pg::sleep(gap);
                }
            }
            // Before the snapshot of this step: a commit it does not see will wake the worker.
            shmem::arm_commit_wake(self.settings.enabled);
            let mut settlement = self.take_events();
            self.sweep(&mut settlement);
            if pg::in_recovery() {
                // A standby publishes nothing; after promotion this loop takes over.
                pg::wait(None, self.settings.naptime);
                continue;
            }
            if self.idle_while_disabled(&settlement) {
                self.report_status();
                pg::wait(Some(self.handle.wake_fd()), DISABLED_STEP_EVERY);
                continue;
            }
            self.stepped_at = Some(Instant::now());
            shmem::count(|c| &c.steps, 1);
            let publishes =
                pg::transaction("amqp_outbox: settle and claim", || self.step(settlement));
            for command in publishes {
                if !self.handle.send(command) {
                    error!("amqp_outbox: the AMQP thread has stopped");
                }
            }
            let reported = self.report_status();
            let mut timeout = if self.more_work {
                Duration::ZERO
            } else if !reported {
                STATUS_EVERY.min(self.settings.naptime)
            } else {
                self.settings.naptime
            };
            // What has come due since this step's claim is claimed by the next one.
            let now = Instant::now();
            let mut came_due = false;
            while self.retry_due.peek().is_some_and(|due| due.0 <= now) {
                self.retry_due.pop();
                came_due = true;
            }
            if came_due {
                timeout = Duration::ZERO;
            } else if let Some(due) = self.retry_due.peek() {
                timeout = timeout.min(due.0 - now);
            }
            if let Woken::Events = pg::wait(Some(self.handle.wake_fd()), timeout) {
                // Drained at the top of the loop.
            }
        }
    }

    /// Disabled, with nothing to record and no configuration to reload: a commit's wake-up is
    /// not worth a transaction.
    fn idle_while_disabled(&self, s: &Settlement) -> bool {
        !self.settings.enabled
            && self.extension_present
            && !self.need_reload
            && s.delivered.is_empty()
            && s.rejected.is_empty()
            && s.resend.is_empty()
            && self
                .stepped_at
                .is_some_and(|t| t.elapsed() < DISABLED_STEP_EVERY)
    }

    /// Connection states at once when they change; in-flight counts and messages at most every
    /// 100 ms.
    /// Returns false when a change is left to report later (throttled).
    fn report_status(&mut self) -> bool {
        let changes = self.flight.changes();
        if !self.status_changed && changes == self.reported_changes {
            return true;
        }
        // A small window is copied at once, so the views are never behind a state the tables
        // already show; a large one at most every STATUS_EVERY, to bound the copying.
        let due = self.flight.len() <= COPY_AT_ONCE
            || self
                .status_reported_at
                .is_none_or(|t| t.elapsed() >= STATUS_EVERY);
        if !self.status_changed && !due {
            return false;
        }
        self.reported_changes = changes;
        let mut reports: Vec<shmem::BrokerReport<'_>> = self
            .flight
            .brokers()
            .map(|(id, b)| shmem::BrokerReport {
                broker_id: *id,
                connected: b.connected,
                host: b.host.as_deref(),
                epoch: b.epoch,
                error: b.error.as_deref(),
                in_flight: b.in_flight,
                pending: self.pending.get(id).copied().unwrap_or(0),
            })
            .collect();
        reports.sort_by_key(|r| r.broker_id);
        shmem::report_brokers(&reports);
        shmem::report_in_flight(&self.flight.snapshot());
        self.status_changed = false;
        self.status_reported_at = Some(std::time::Instant::now());
        true
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
                    self.flight.forget_unconfirmed(broker_id);
                    let b = self.flight.broker(broker_id);
                    b.connected = true;
                    b.epoch = epoch;
                    b.error = None;
                    self.status_changed = true;
                    log!("amqp_outbox: broker {broker_id} connected to {host} (channel {epoch})");
                    b.host = Some(host);
                }
                Event::Disconnected { broker_id, error } => {
                    self.flight.forget_unconfirmed(broker_id);
                    let b = self.flight.broker(broker_id);
                    b.connected = false;
                    b.host = None;
                    warning!("amqp_outbox: broker {broker_id} unavailable: {error}");
                    b.error = Some(error);
                    self.status_changed = true;
                }
                Event::Confirmed { ids, .. } => {
                    shmem::count(|c| &c.confirmed, ids.len() as u64);
                    for id in ids {
                        self.held.remove(&id);
                        if self.flight.confirmed(id) == Verdict::Delivered {
                            s.delivered.push(id);
                        }
                    }
                }
                Event::Acked { ids, .. } => {
                    shmem::count(|c| &c.acknowledged, ids.len() as u64);
                    for id in ids {
                        if self.flight.acked(id) == Verdict::Delivered {
                            s.delivered.push(id);
                        }
                    }
                }
                Event::Lost { ids, .. } => {
                    let mut lost = Vec::new();
                    for id in ids {
                        match self.flight.lost(id) {
                            Verdict::Delivered => s.delivered.push(id),
                            Verdict::Resend => lost.push(id),
                            _ => {}
                        }
                    }
                    if !lost.is_empty() {
                        shmem::count(|c| &c.resent_gap, lost.len() as u64);
                        log!(
                            "amqp_outbox: {} message(s) lost in transit (a later acknowledgement arrived first), publishing again: {lost:?}",
                            lost.len()
                        );
                        s.resend.push((lost, "lost in transit: a later message of the same channel was acknowledged first"));
                    }
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
                        Failure::Nacked => {
                            self.flight.broker(broker_id).suspects.remove(&id);
                            self.hold_nacked(id);
                        }
                        Failure::Rejected => {
                            self.flight.broker(broker_id).suspects.remove(&id);
                            shmem::count(|c| &c.failed, 1);
                            s.rejected.push((id, error));
                        }
                        Failure::Unsendable => {
                            self.flight.broker(broker_id).suspects.remove(&id);
                            shmem::count(|c| &c.failed, 1);
                            s.unsendable.push((id, error));
                        }
                    }
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

    /// A nacked message waits before it is published again, longer each time, without counting
    /// an attempt (a nack is the broker's trouble, not the message's). One log line a while.
    fn hold_nacked(&mut self, id: i64) {
        let nacks = self.held.get(&id).map_or(0, |h| h.1) + 1;
        let delay = backoff(
            self.settings.retry_backoff_min,
            self.settings.retry_backoff_max,
            nacks - 1,
        );
        let until = Instant::now() + delay;
        self.held.insert(id, (until, nacks));
        self.retry_at(until);
        self.nacked_since_log += 1;
        if self
            .nack_logged_at
            .is_none_or(|t| t.elapsed() >= NACK_LOG_EVERY)
        {
            log!(
                "amqp_outbox: {} message(s) nacked by the broker since the last report; each is published again after a growing delay",
                self.nacked_since_log
            );
            self.nacked_since_log = 0;
            self.nack_logged_at = Some(Instant::now());
        }
    }

    /// The timeout sweep: what has been in flight past `resend_after` without proof of delivery
    /// is taken back and published again.
    fn sweep(&mut self, s: &mut Settlement) {
        if self.swept_at.elapsed() < SWEEP_EVERY {
            return;
        }
        self.swept_at = Instant::now();
        let expired = self.flight.expire(self.settings.resend_after);
        if !expired.is_empty() {
            shmem::count(|c| &c.resent_timeout, expired.len() as u64);
            log!(
                "amqp_outbox: {} message(s) without proof of delivery after amqp_outbox.resend_after, publishing again",
                expired.len()
            );
            s.resend.push((
                expired,
                "no proof of delivery within amqp_outbox.resend_after",
            ));
        }
    }

    /// One short transaction: record outcomes, reload configuration, claim rows. Returns the
    /// publish commands to send once it has committed.
    fn step(&mut self, settlement: Settlement) -> Vec<Command> {
        if !queries::extension_exists() {
            queries::forget_plans();
            if self.extension_present || !self.announced_missing {
                log!("amqp_outbox: extension not installed in this database; waiting for CREATE EXTENSION");
                self.announced_missing = true;
                self.configure(Vec::new());
            }
            self.extension_present = false;
            self.more_work = false;
            return Vec::new();
        }
        if !self.extension_present {
            if let Some(version) = queries::version_mismatch() {
                if self.announced_version.as_deref() != Some(version.as_str()) {
                    warning!(
                        "amqp_outbox: the extension in this database is version {version} but the library is {}: messages wait until ALTER EXTENSION amqp_outbox UPDATE",
                        queries::LIBRARY_VERSION
                    );
                    self.announced_version = Some(version);
                    self.configure(Vec::new());
                }
                self.more_work = false;
                return Vec::new();
            }
            self.extension_present = true;
            self.announced_missing = false;
            self.announced_version = None;
            self.need_reload = true;
        }
        let result = Spi::connect_mut(|client| {
            if !settlement.delivered.is_empty() {
                queries::delete_delivered(client, &settlement.delivered)?;
            }
            for (id, error) in &settlement.rejected {
                self.record_rejection(client, *id, error)?;
            }
            for (id, error) in &settlement.unsendable {
                park_now(client, *id, error)?;
            }
            for (ids, reason) in &settlement.resend {
                let parked =
                    queries::record_resend(client, ids, reason, self.settings.max_attempts)?;
                for id in parked {
                    shmem::count(|c| &c.parked, 1);
                    warning!("amqp_outbox: message {id} parked after amqp_outbox.max_attempts attempts: {reason}");
                }
            }
            if self.need_reload {
                let brokers = queries::load_brokers(client, &self.broker_template())?;
                self.need_reload = false;
                self.configure(brokers);
                self.orphans_checked_at = None;
            }

            self.count_pending(client)?;
            if !self.settings.enabled {
                self.more_work = false;
                return Ok(Vec::new());
            }
            if self
                .orphans_checked_at
                .is_none_or(|t| t.elapsed() >= ORPHAN_CHECK_EVERY)
            {
                let parked = queries::park_orphans(client)?;
                if parked > 0 {
                    shmem::count(|c| &c.parked, parked as u64);
                    warning!("amqp_outbox: {parked} message(s) parked: their broker_id names no row of amqp.broker");
                }
                self.orphans_checked_at = Some(Instant::now());
            }
            self.claim(client)
        });
        match result {
            Ok(commands) => commands,
            Err(e) => error!("amqp_outbox: worker query failed: {e}"),
        }
    }

    fn count_pending(&mut self, client: &pgrx::spi::SpiClient<'_>) -> pgrx::spi::SpiResult<()> {
        if self.settings.max_pending <= 0 {
            if !self.pending.is_empty() {
                self.pending.clear();
                self.status_changed = true;
            }
            return Ok(());
        }
        if self
            .pending_counted_at
            .is_some_and(|t| t.elapsed() < Duration::from_secs(1))
        {
            return Ok(());
        }
        self.pending = queries::count_pending(client)?;
        self.pending_counted_at = Some(Instant::now());
        self.status_changed = true;
        Ok(())
    }

    /// Wake up at `when` at the latest (a retry becomes due).
    fn retry_at(&mut self, when: Instant) {
        self.retry_due.push(std::cmp::Reverse(when));
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
                let retry_in = r.retry_in.unwrap_or_default();
                self.retry_at(Instant::now() + retry_in);
                log!(
                    "amqp_outbox: message {id} refused (attempt {}), will retry in {:.2} s: {error}",
                    r.attempts,
                    retry_in.as_secs_f64()
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
            randomize_hosts: s.randomize_hosts,
            exchanges: Vec::new(),
            queues: Vec::new(),
            bindings: Vec::new(),
            proof: ProofMode::AckQueue,
            ack_queue: AckQueueConfig {
                name: queries::ack_queue_name(),
                quorum: s.ack_queue_quorum,
            },
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
        for b in &brokers {
            self.flight.broker(b.broker_id).proof = b.proof;
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
                self.flight.mark_sent(broker_id, m.id, m.body.len());
            }
            if !messages.is_empty() {
                commands.push(Command::Publish {
                    broker_id,
                    messages,
                    solo: true,
                });
            }
        }

        let open = self.flight.open_brokers(
            self.settings.max_in_flight,
            self.settings.max_in_flight_bytes,
        );
        if open.is_empty() {
            self.more_work = false;
            return Ok(commands);
        }
        let mut room: BTreeMap<i32, Room> = open.into_iter().map(|r| (r.broker_id, r)).collect();
        let broker_ids: Vec<i32> = room.keys().copied().collect();
        let now = Instant::now();
        self.held.retain(|_, (until, _)| {
            // Forget holds long past, so the map stays as small as the recent nacks.
            now < *until + self.settings.retry_backoff_max
        });
        // What is in flight or held back is not read again (bodies included).
        let mut skip: Vec<i64> = self.flight.ids().collect();
        skip.extend(
            self.held
                .iter()
                .filter(|(_, (until, _))| now < *until)
                .map(|(id, _)| *id),
        );
        let budget: usize = room.values().map(|r| r.bytes.max(1)).sum();
        let limit = self.settings.batch_size;
        let rows = queries::claim(client, &broker_ids, limit, &skip, budget)?;
        let fetched: usize = rows.iter().map(|r| r.body.len()).sum();
        // A full batch, or one cut short by the byte budget: there is probably more.
        let mut more = rows.len() == limit || fetched.saturating_mul(2) >= budget;
        let mut taken = 0;
        let mut batches: BTreeMap<i32, Vec<Row>> = BTreeMap::new();
        for row in rows {
            // A broker whose window is full (messages or bytes) takes nothing more until what
            // it has in flight settles.
            let fits = room
                .get_mut(&row.broker_id)
                .is_some_and(|r| r.take(row.body.len()));
            if fits {
                taken += 1;
                batches.entry(row.broker_id).or_default().push(row);
            }
        }
        if taken == 0 || room.values().all(|r| r.messages == 0 || r.bytes == 0) {
            // Nothing more fits until confirms arrive (they wake the worker).
            more = false;
        }
        self.more_work = more;
        for (broker_id, rows) in batches {
            let messages = self.prepare(client, rows, max_size)?;
            if messages.is_empty() {
                continue;
            }
            for m in &messages {
                self.flight.mark_sent(broker_id, m.id, m.body.len());
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

    /// The `test_lose_one_in` fault injection (0, the default, never loses anything): one first
    /// publish in N is handed over marked "lose in transit".
    fn lose_this_one(&mut self, first_attempt: bool) -> bool {
        let n = self.settings.lose_one_in as u64;
        if n == 0 || !first_attempt {
            return false;
        }
        self.published_count += 1;
        self.published_count.is_multiple_of(n)
    }

    /// Turns rows into messages; parks rows that can never be published as they are.
    fn prepare(
        &mut self,
        client: &mut pgrx::spi::SpiClient<'_>,
        rows: Vec<Row>,
        max_size: usize,
    ) -> pgrx::spi::SpiResult<Vec<OutboundMessage>> {
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            if row.body.len() > max_size {
                let why = format!(
                    "body is {} bytes, over amqp_outbox.max_message_size ({max_size} bytes)",
                    row.body.len()
                );
                park_now(client, row.id, &why)?;
                continue;
            }
            let headers = match crate::headers::json_object(row.headers.as_deref()) {
                Ok(headers) => headers,
                Err(why) => {
                    // Retrying cannot help: the row is parked at once, the others go on.
                    park_now(client, row.id, &format!("headers {why}"))?;
                    continue;
                }
            };
            let first_attempt = row.attempts == 0;
            let mut message = to_message(row, headers);
            message.lose_in_transit = self.lose_this_one(first_attempt);
            out.push(message);
        }
        Ok(out)
    }
}

/// Parks a message that can never be published as it is (retrying cannot help), says so in the
/// log and counts it.
fn park_now(client: &mut pgrx::spi::SpiClient<'_>, id: i64, why: &str) -> pgrx::spi::SpiResult<()> {
    warning!("amqp_outbox: message {id} parked: {why}");
    queries::park(client, id, why)?;
    shmem::count(|c| &c.parked, 1);
    Ok(())
}

/// Header names the worker adds to every message.
pub const HEADER_PRODUCER_PID: &str = "x-amqp-outbox-producer-pid";
pub const HEADER_PRODUCER_START: &str = "x-amqp-outbox-producer-start";
pub const HEADER_SEQUENCE: &str = "x-amqp-outbox-seq";

fn to_message(
    row: Row,
    mut headers: serde_json::Map<String, serde_json::Value>,
) -> OutboundMessage {
    headers.insert(HEADER_PRODUCER_PID.into(), row.producer_pid.into());
    headers.insert(HEADER_PRODUCER_START.into(), row.producer_started_at.into());
    headers.insert(HEADER_SEQUENCE.into(), row.id.into());
    OutboundMessage {
        id: row.id,
        message_id: row.message_id,
        exchange: row.exchange,
        routing_key: row.routing_key,
        body: row.body,
        delivery_mode: if row.delivery_mode == 1 { 1 } else { 2 },
        content_type: row.content_type,
        reply_to: row.reply_to,
        correlation_id: row.correlation_id,
        timestamp: (row.created_at.max(0) / 1_000_000) as u64,
        headers,
        lose_in_transit: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(headers: Option<serde_json::Value>, delivery_mode: i16) -> OutboundMessage {
        let headers = match headers {
            Some(serde_json::Value::Object(map)) => map,
            _ => serde_json::Map::new(),
        };
        to_message(row(delivery_mode), headers)
    }

    fn row(delivery_mode: i16) -> Row {
        Row {
            id: 42,
            message_id: "0190f0e2-1c3a-7b41-9d2e-5a6b7c8d9e0f".into(),
            broker_id: 1,
            exchange: "orders".into(),
            routing_key: "order.created".into(),
            body: b"{}".to_vec(),
            delivery_mode,
            content_type: Some("application/json".into()),
            reply_to: None,
            correlation_id: Some("c-1".into()),
            headers: None,
            producer_pid: 1234,
            producer_started_at: 1_700_000_000_123_456,
            created_at: 1_700_000_100_999_999,
            attempts: 0,
        }
    }

    #[test]
    fn a_message_carries_its_stable_id_producer_headers_and_properties() {
        let m = message(Some(serde_json::json!({"tenant": "acme"})), 2);
        assert_eq!(m.message_id, "0190f0e2-1c3a-7b41-9d2e-5a6b7c8d9e0f");
        assert_eq!(m.delivery_mode, 2);
        assert_eq!(m.timestamp, 1_700_000_100);
        assert_eq!(m.headers["tenant"], "acme");
        assert_eq!(m.headers[HEADER_PRODUCER_PID], 1234);
        assert_eq!(m.headers[HEADER_PRODUCER_START], 1_700_000_000_123_456i64);
        assert_eq!(m.headers[HEADER_SEQUENCE], 42);
        assert_eq!(m.correlation_id.as_deref(), Some("c-1"));
        assert!(!m.lose_in_transit);
    }

    #[test]
    fn producer_headers_win_over_the_callers_and_transient_is_kept() {
        let m = message(Some(serde_json::json!({HEADER_SEQUENCE: "forged"})), 1);
        assert_eq!(m.headers[HEADER_SEQUENCE], 42);
        assert_eq!(m.delivery_mode, 1);
        let m = message(None, 2);
        assert_eq!(m.headers.len(), 3);
    }
}
