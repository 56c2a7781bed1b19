//! The consuming side for one database while this relay holds its lease: the subscriptions'
//! consumers (the broker crate's inbox thread), their messages handled in batches by the
//! engine's handling ([`amqp_outbox_engine::consume`]) over a connection of its own, each
//! batch one transaction, acknowledged to the broker after it committed; failed messages
//! retried when due; the retention of consumption records. Its own thread, beside the
//! delivery's, so that a slow handler never holds up publishing.
//!
//! Messages of a subscription with a `parallelism` or an `ordering` go through
//! `amqp.inbox_waiting` as the extension's lanes take them: this thread is lane 0, threads of
//! [`crate::lanes`] the others; a key's messages one after another in arrival order, held back
//! behind a failed one until it is handled or dead.

use crate::client_inbox::{ClientInbox, InboxSession};
use crate::client_outbox::{ClientOutbox, Session};
use crate::config::Config;
use crate::connect;
use crate::lanes::Lanes;
use crate::lease::Lease;
use crate::leased::Ended;
use crate::log::Log;
use crate::report::RelayTelemetry;
use crate::stop;
use amqp_outbox_broker::inbox::{InboxCommand, InboxHandle};
use amqp_outbox_engine::brokers;
use amqp_outbox_engine::consume::acks::{Acks, Staged};
use amqp_outbox_engine::consume::book::Book;
use amqp_outbox_engine::consume::events::{Fatal, Taken};
use amqp_outbox_engine::consume::handling::{self, InboxHost, Rules};
use amqp_outbox_engine::consume::lanes::{self, Serving};
use amqp_outbox_engine::consume::message::{Message, Sub};
use amqp_outbox_engine::consume::statements::ROTATE_SQL;
use amqp_outbox_engine::consume::subscriptions::Subscriptions;
use amqp_outbox_engine::outbox::Outbox;
use postgres::Client;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

/// Longest sleep: the fallback for anything no wake-up announced (the lease's notices among
/// them, which this thread looks at when it wakes).
const NAPTIME: Duration = Duration::from_millis(250);
/// How often the retention of consumption records runs.
const ROTATE_EVERY: Duration = Duration::from_secs(60);
/// After a retention that could not have its lock at once.
const ROTATE_RETRY: Duration = Duration::from_secs(5);
/// How often subscriptions that cannot run are read again: what fixes them (CREATE FUNCTION,
/// GRANT) sends no notice.
const RECHECK_PROBLEMS: Duration = Duration::from_secs(5);

/// Whether a receipts exchange is set for this database (`amqp_outbox.receipts_exchange`, as
/// `amqp.send_receipt()` reads it).
const RECEIPTS_SQL: &str = "SELECT COALESCE(pg_catalog.current_setting('amqp_outbox.receipts_exchange', true), '') OPERATOR(pg_catalog.<>) ''";

/// The consuming session's pid, for `amqp.worker_status` and `amqp.health()` (the extension's
/// subscription worker's pid there).
const SUBSCRIPTION_PID_SQL: &str = "\
INSERT INTO amqp._relay_counters AS c (one, subscription_pid) \
VALUES (true, pg_catalog.pg_backend_pid()) \
ON CONFLICT (one) DO UPDATE SET subscription_pid = excluded.subscription_pid";

/// The retention, with a short lock wait: a session keeping the older table only postpones it.
const ROTATE_LOCK_SQL: &str = "SET LOCAL lock_timeout = '200ms'";

pub struct Consumer<'a> {
    config: &'a Config,
    url: &'a str,
    /// Lanes 1 and up, for subscriptions with a parallelism (this thread is lane 0).
    lanes: Lanes,
    client: Client,
    session: InboxSession,
    handle: InboxHandle,
    log: Log,
    generation: u64,
    subs: Subscriptions,
    book: Book,
    /// Deliveries not handled yet, and the queues seen empty.
    taken: Taken,
    need_reload: bool,
    receipts: bool,
    reloaded_at: Instant,
    retry_at: Option<Instant>,
    rotate_at: Instant,
    /// Deliveries put into `amqp.inbox_waiting`: acknowledged once their row is gone.
    staged: Staged,
    /// Waiting messages may be claimable now (some were staged, a key was freed, a claim was
    /// full, or the relay just started).
    claim_waiting: bool,
    waiting_checked: Instant,
}

impl<'a> Consumer<'a> {
    /// Connects its session and the AMQP thread for the lease's acquisition `generation`.
    pub fn start(
        config: &'a Config,
        url: &'a str,
        log: Log,
        generation: u64,
    ) -> Result<Self, String> {
        let mut client = connect::connect(url, &config.postgres_tls)?;
        let session = InboxSession::new(&mut client).map_err(|e| connect::describe(&e))?;
        let handle = amqp_outbox_broker::inbox::spawn()
            .map_err(|e| format!("cannot start the consumers' AMQP thread: {e}"))?;
        let mut consumer = Consumer {
            config,
            url,
            lanes: Lanes::default(),
            client,
            session,
            handle,
            log,
            generation,
            subs: Subscriptions::default(),
            book: Book::default(),
            taken: Taken::default(),
            need_reload: true,
            receipts: false,
            reloaded_at: Instant::now(),
            retry_at: Some(Instant::now()),
            rotate_at: Instant::now(),
            staged: Staged::default(),
            claim_waiting: true,
            waiting_checked: Instant::now(),
        };
        let mut t = consumer
            .client
            .transaction()
            .map_err(|e| connect::describe(&e))?;
        ClientInbox::new(&mut t, &mut consumer.session, &consumer.log)
            .reset_connections()
            .and_then(|()| t.execute(SUBSCRIPTION_PID_SQL, &[]))
            .and_then(|_| t.commit())
            .map_err(|e| connect::describe(&e))?;
        Ok(consumer)
    }

    /// Runs until the relay stops, the lease is lost or something fails; then closes the
    /// consumers (unacknowledged messages go back to their queues).
    pub fn run(mut self, lease: &Lease) -> Ended {
        let ended = self.serve(lease);
        self.handle.shutdown(Duration::from_secs(2));
        ended
    }

    fn serve(&mut self, lease: &Lease) -> Ended {
        loop {
            if stop::requested() {
                return Ended::Stopped;
            }
            if lease.held() != Some(self.generation) {
                return Ended::LeaseLost;
            }
            if lease.take_subscriptions_changed() {
                self.need_reload = true;
            }
            if let Err(why) = self.take_events() {
                return Ended::Failed(why);
            }
            let staged = &self.staged;
            self.taken
                .note_caught_up(&mut self.book, |sub| staged.holds(sub));
            if let Err(e) = self.step() {
                return Ended::Failed(e);
            }
            if self.rotate_at <= Instant::now() {
                self.rotate();
            }
            let timeout = if self.taken.pending.is_empty() {
                self.retry_at
                    .map_or(NAPTIME, |t| t.saturating_duration_since(Instant::now()))
                    .min(NAPTIME)
                    .min(lease.expires_in())
            } else {
                Duration::ZERO
            };
            if !timeout.is_zero() {
                stop::wait(&[self.handle.wake_fd()], timeout);
            }
        }
    }

    fn take_events(&mut self) -> Result<(), String> {
        let log = &self.log;
        self.taken
            .take(
                self.handle.drain_events(),
                &mut self.book,
                &mut |level, text| log.line(level, text),
            )
            .map_err(|Fatal(why)| format!("the consumers' AMQP thread failed: {why}"))
    }

    /// Reads the subscriptions and the brokers, prepares to run as each owner, and tells the
    /// AMQP thread what to consume. Outside a transaction block (each owner's function is made
    /// in a transaction of its own).
    fn reload(&mut self) -> Result<(), String> {
        let describe = |e: postgres::Error| connect::describe(&e);
        self.need_reload = false;
        self.reloaded_at = Instant::now();
        let mut t = self.client.transaction().map_err(describe)?;
        let tables = ClientOutbox::new(&mut t, &mut Session::plain())
            .broker_tables()
            .map_err(describe)?;
        let mut subs = ClientInbox::new(&mut t, &mut self.session, &self.log)
            .subscriptions()
            .map_err(describe)?;
        self.receipts = t
            .query_one(RECEIPTS_SQL, &[])
            .and_then(|r| r.try_get(0))
            .map_err(describe)?;
        t.commit().map_err(describe)?;
        let template = brokers::template(&self.config.settings, String::new());
        let telemetry = RelayTelemetry::new(self.log.clone());
        let brokers = brokers::assemble(tables, &template, &telemetry);
        let owners: BTreeSet<u32> = subs
            .iter()
            .filter(|s| s.handler.is_some())
            .map(|s| s.owner)
            .collect();
        self.session.make_runners(&mut self.client, owners);
        for sub in &mut subs {
            refuse_what_cannot_run(sub, &self.session);
        }
        if let Some(configs) = self.subs.update(subs, &brokers) {
            self.handle.send(InboxCommand::Configure(configs));
        }
        self.lanes.configure(
            &self.subs.active,
            self.receipts,
            self.config,
            self.url,
            &self.log,
        );
        for (name, why) in self.subs.problems.clone() {
            let e = self.book.entry(&name);
            e.connection = Some((false, None));
            e.error = Some(Some(why));
        }
        self.retry_at = Some(Instant::now());
        Ok(())
    }

    /// One transaction: a batch of deliveries and due retries, the messages of subscriptions
    /// with an ordering put into `amqp.inbox_waiting` and those that may go now taken from it,
    /// the counters; then the acknowledgements of what it committed.
    fn step(&mut self) -> Result<(), String> {
        if !self.subs.problems.is_empty() && self.reloaded_at.elapsed() >= RECHECK_PROBLEMS {
            self.need_reload = true;
        }
        if self.need_reload {
            self.reload()?;
        }
        let retry_due = self.retry_at.is_some_and(|t| t <= Instant::now());
        // Waiting messages are looked at again while some are held back (a key waits for its
        // failed message's retry), at the naptime.
        let waiting_due = self.claim_waiting
            || (!self.staged.is_empty() && self.waiting_checked.elapsed() >= NAPTIME);
        if self.taken.pending.is_empty() && !retry_due && !waiting_due && self.book.is_empty() {
            return Ok(());
        }
        let batch_size = self.config.inbox_batch_size.max(1);
        let batch: Vec<Message> = {
            let n = self
                .taken
                .pending
                .len()
                .min(self.subs.batch_limit(batch_size));
            self.taken.pending.drain(..n).collect()
        };
        let rules = Rules {
            handler_timeout: self.config.handler_timeout,
            receipts: self.receipts,
            backoff: self.config.settings.retry_backoff(),
        };
        let describe = |e: postgres::Error| connect::describe(&e);
        let mut acks = Acks::default();
        let mut t = self.client.transaction().map_err(describe)?;
        let mut inbox = ClientInbox::new(&mut t, &mut self.session, &self.log);
        let names: Vec<String> = self.subs.active.keys().cloned().collect();
        // Messages of subscriptions with an ordering wait in amqp.inbox_waiting, unacknowledged
        // until their row is gone: a key is held back behind an earlier or failed message.
        let (ordered, mut work): (Vec<Message>, Vec<Message>) = batch.into_iter().partition(|m| {
            self.subs
                .active
                .get(&m.subscription)
                .is_some_and(|s| s.handler.is_some() && s.has_lanes())
        });
        // Staged in this transaction: invisible to the other lanes until it commits, so lane 0
        // leaves them to the next step rather than taking a share before the others can.
        let staged_now = !ordered.is_empty() && lanes::wanted(&self.subs.active) > 1;
        for mut m in ordered {
            let Some(sub) = self.subs.active.get(&m.subscription) else {
                continue;
            };
            let message_id = match &m.message_id {
                Some(id) => id.clone(),
                None => inbox
                    .derived_message_id(m.digest_input())
                    .map_err(describe)?,
            };
            m.key = sub.key_of(&m);
            let staged = inbox.stage(&m, &message_id).map_err(describe)?;
            self.staged.note(&m, staged, &mut acks);
            self.book.entry(&m.subscription).delivered += 1;
            self.claim_waiting = true;
        }
        if retry_due && work.len() < batch_size {
            let room = batch_size - work.len();
            let due = inbox.due_retries(&names, room as i64).map_err(describe)?;
            let took_all = due.len() < room;
            // A retry that succeeds may free its key.
            self.claim_waiting |= due.iter().any(|m| m.key.is_some());
            work.extend(due);
            self.retry_at = if took_all { None } else { Some(Instant::now()) };
        }
        if (self.claim_waiting || waiting_due) && !staged_now {
            // As lane 0: its share of the waiting messages (the other lanes take theirs).
            self.waiting_checked = Instant::now();
            let Serving {
                names: serving,
                limit,
                ordered,
            } = lanes::serving(&self.subs.active, 0);
            let mut room = batch_size.saturating_sub(work.len()).clamp(1, limit);
            if let Some(parallelism) = ordered {
                let heads = inbox.claimable(&serving).map_err(describe)?;
                room = lanes::ordered_limit(room, heads, parallelism);
            }
            let claimed = inbox
                .claim_waiting(&serving, room as i64)
                .map_err(describe)?;
            self.claim_waiting = claimed.len() >= room;
            work.extend(claimed);
        }
        if !work.is_empty() {
            let outcomes =
                handling::handle_all(&mut inbox, &self.subs.active, &work, &rules, &mut self.book)
                    .map_err(describe)?;
            let mut done = Vec::new();
            for (m, o) in work.iter().zip(outcomes) {
                if o == handling::Outcome::CannotRun {
                    self.need_reload = true;
                }
                if !o.acknowledged() {
                    continue;
                }
                acks.add(m);
                done.extend(m.waiting_id);
                // A failed or handled keyed message may hold back or free others.
                self.claim_waiting |= m.key.is_some();
            }
            if !done.is_empty() {
                inbox.done_waiting(&done).map_err(describe)?;
            }
        }
        if !self.staged.is_empty() {
            let gone = inbox
                .gone_from_waiting(&self.staged.rows())
                .map_err(describe)?;
            self.staged.gone(gone, &mut acks);
        }
        if self.retry_at.is_none() {
            self.retry_at = inbox
                .next_retry_in(&names)
                .map_err(describe)?
                .map(|s| Instant::now() + Duration::from_secs_f64(s.clamp(0.0, 3600.0)));
        }
        inbox.write_book(&mut self.book).map_err(describe)?;
        t.commit().map_err(describe)?;
        // Only now is the work committed: acknowledge it.
        for command in acks.commands() {
            self.handle.send(command);
        }
        Ok(())
    }

    /// The retention of consumption records, in a transaction of its own that waits for no
    /// lock longer than 200 ms.
    fn rotate(&mut self) {
        let done = self.client.transaction().and_then(|mut t| {
            t.batch_execute(ROTATE_LOCK_SQL)?;
            let done: Option<String> = t.query_one(ROTATE_SQL, &[])?.try_get(0)?;
            t.commit()?;
            Ok(done)
        });
        match done {
            Ok(done) => {
                self.rotate_at = Instant::now() + ROTATE_EVERY;
                if let Some(done) = done.filter(|d| d.starts_with("rotated")) {
                    self.log.log(&format!("consumption records {done}"));
                }
            }
            Err(e) => {
                self.rotate_at = Instant::now() + ROTATE_RETRY;
                self.log.debug(&format!(
                    "retention of consumption records postponed: {}",
                    connect::describe(&e)
                ));
            }
        }
    }
}

/// A subscription the relay cannot serve keeps its messages in its queue, and says why.
fn refuse_what_cannot_run(sub: &mut Sub, session: &InboxSession) {
    if sub.handler.is_none() {
        return;
    }
    if let Some(why) = session.runner_problem(sub.owner) {
        sub.handler = None;
        sub.problem = Some(why);
    }
}

/// Serves the consuming side of the database of `url` while the lease is held, starting again
/// after every failure, until the relay stops.
pub fn serve(url: &str, config: &Config, lease: &Lease, log: &Log) {
    crate::leased::while_leased("consuming", lease, log, |generation| match Consumer::start(
        config,
        url,
        log.clone(),
        generation,
    ) {
        Ok(consumer) => consumer.run(lease),
        Err(e) => Ended::Failed(e),
    });
}
