//! The subscription worker's loop: takes the AMQP thread's events (deliveries, connection
//! states), handles deliveries in batches (one transaction each, acknowledged after commit),
//! retries failed messages when due, runs the retention of consumption records, and sleeps on
//! latch + socket otherwise.

use super::guarded;
use super::handling::{self, Outcome, SpiInbox};
use super::queries;
use super::subscriptions::{self, Subscriptions};
use crate::gucs::{self, WorkerSettings};
use crate::shmem;
use crate::shmem::handler_trap::{self, Ended};
use crate::worker::pg;
use crate::worker::queries as outbox_queries;
use crate::worker::standbys::{self, StandbyWait};
use amqp_outbox_broker::inbox::{InboxCommand, InboxHandle};
use amqp_outbox_engine::consume::acks::{Acks, Staged};
use amqp_outbox_engine::consume::book::Book;
use amqp_outbox_engine::consume::events::{Fatal, Taken};
use amqp_outbox_engine::consume::message::Message;
use amqp_outbox_engine::consume::statements::ROTATE_SQL;
use amqp_outbox_engine::telemetry::Level;
use pgrx::prelude::*;
use std::time::{Duration, Instant};

/// Longest sleep: the fallback for anything no wake-up announced.
const NAPTIME: Duration = Duration::from_secs(1);
/// How often the retention of consumption records is looked at.
const ROTATE_EVERY: Duration = Duration::from_secs(60);
/// The longest the retention waits for a lock; then it is tried again after [`ROTATE_RETRY`].
const ROTATE_LOCK_WAIT: Duration = Duration::from_millis(200);
const ROTATE_RETRY: Duration = Duration::from_secs(5);
/// How often subscriptions that cannot run (a handler or owner gone, a privilege revoked) are
/// read again: what fixes them (CREATE FUNCTION, GRANT) tells the worker nothing.
const RECHECK_PROBLEMS: Duration = Duration::from_secs(5);
/// How often the rows of deliveries handed to lanes are looked at when no lane said it
/// committed (a wake-up lost to a lane's restart).
const STAGED_CHECK: Duration = Duration::from_secs(1);

pub struct Inbox {
    handle: InboxHandle,
    settings: WorkerSettings,
    subs: Subscriptions,
    book: Book,
    /// Deliveries not handled yet, and the queues seen empty.
    taken: Taken,
    need_reload: bool,
    present: bool,
    /// The extension is not installed: the worker exits (the launcher starts it again after
    /// CREATE EXTENSION).
    missing: bool,
    /// When the retention of consumption records is due (`None`: now).
    rotate_at: Option<Instant>,
    retry_at: Option<Instant>,
    /// When the subscriptions were last read.
    reloaded_at: Instant,
    /// The message whose handler ended the previous worker of this database, if one did.
    left_behind: Vec<(Ended, String, String)>,
    /// Deliveries put into `amqp.inbox_waiting` for lanes, by row id: acknowledged once their
    /// row is gone (handled, a duplicate, or kept in amqp.inbox_failed).
    staged: Staged,
    /// When the rows of `staged` were last looked at.
    staged_checked: Instant,
    /// Acknowledgements waiting for `amqp_outbox.standby_names` to have the handlers' commits:
    /// until then a failover could lose an effect whose message the broker already dropped.
    standbys: StandbyWait<InboxCommand>,
}

impl Inbox {
    pub fn new(handle: InboxHandle) -> Self {
        Inbox {
            handle,
            settings: gucs::worker_settings(),
            subs: Subscriptions::default(),
            book: Book::default(),
            taken: Taken::default(),
            need_reload: true,
            present: false,
            missing: false,
            rotate_at: None,
            retry_at: Some(Instant::now()),
            reloaded_at: Instant::now(),
            left_behind: handler_trap::take().into_iter().collect(),
            staged: Staged::default(),
            staged_checked: Instant::now(),
            standbys: StandbyWait::new(standbys::ACKNOWLEDGEMENTS),
        }
    }

    pub fn run(mut self) -> ! {
        self.standbys.configure(&self.settings.standby_names);
        loop {
            if pg::shutdown_requested() {
                log!("amqp_outbox: subscription worker shutting down");
                self.handle.shutdown(Duration::from_secs(2));
                // SAFETY: the main thread, between transactions; never returns. The launcher
                // starts it again unless its database is going away.
                unsafe { crate::pg_compat::proc_exit(0) };
            }
            if pg::reload_config_if_requested() {
                self.settings = gucs::worker_settings();
                self.need_reload = true;
                let now_free = self.standbys.configure(&self.settings.standby_names);
                self.send_all(now_free);
            }
            if shmem::take_inbox_reload() {
                self.need_reload = true;
            }
            self.take_events();
            self.note_caught_up();
            let flushed = self.standbys.poll();
            self.send_all(flushed);
            self.step();
            if self.missing {
                log!("amqp_outbox: extension not installed in this database; the subscription worker exits");
                self.handle.shutdown(Duration::from_secs(2));
                // SAFETY: the main thread, between transactions; never returns.
                unsafe { crate::pg_compat::proc_exit(0) };
            }
            let timeout = if !self.taken.pending.is_empty() {
                Duration::ZERO
            } else {
                self.retry_at
                    .map_or(NAPTIME, |t| t.saturating_duration_since(Instant::now()))
                    .min(NAPTIME)
            };
            if !timeout.is_zero() {
                self.standbys.wait(
                    self.handle.wake_fd(),
                    timeout,
                    pg::WaitEvent::SubscriptionMain,
                );
            }
        }
    }

    fn take_events(&mut self) {
        let taken = self.taken.take(
            self.handle.drain_events(),
            &mut self.book,
            &mut |level, text| match level {
                Level::Debug => debug1!("amqp_outbox: {text}"),
                Level::Log => log!("amqp_outbox: {text}"),
                Level::Warning => warning!("amqp_outbox: {text}"),
            },
        );
        if let Err(Fatal(why)) = taken {
            error!("amqp_outbox: the subscription worker's AMQP thread failed: {why}")
        }
    }

    /// See [`Taken::note_caught_up`]; handed to a lane is not handled yet.
    fn note_caught_up(&mut self) {
        let staged = &self.staged;
        self.taken
            .note_caught_up(&mut self.book, |sub| staged.holds(sub));
    }

    /// The retention of consumption records, in a transaction of its own that waits for no
    /// lock longer than [`ROTATE_LOCK_WAIT`]: a session that keeps the older table (an open
    /// transaction that called `consume_once`, a `pg_dump`) only postpones it. In the batch's
    /// transaction, its lock wait ran out after `lock_timeout` and took the batch and the
    /// worker down, again at every restart while that session lived.
    fn rotate(&mut self) {
        let done =
            guarded::statement_alone("amqp_outbox retention", ROTATE_SQL, Some(ROTATE_LOCK_WAIT));
        match done {
            Ok(done) => {
                self.rotate_at = Some(Instant::now() + ROTATE_EVERY);
                if let Some(done) = done.filter(|d| d.starts_with("rotated")) {
                    log!("amqp_outbox: consumption records {done}");
                }
            }
            Err(e) => {
                // Tried again soon, not only at the next regular look.
                self.rotate_at = Some(Instant::now() + ROTATE_RETRY);
                if e.sqlstate == guarded::LOCK_NOT_AVAILABLE {
                    debug1!(
                        "amqp_outbox: retention of consumption records postponed: {}",
                        e.message
                    );
                } else {
                    warning!(
                        "amqp_outbox: retention of consumption records failed (SQLSTATE {}): {}",
                        e.sqlstate,
                        e.message
                    );
                }
            }
        }
    }

    /// One transaction: presence, configuration, a batch of deliveries or due retries, the
    /// counters. Then the acknowledgements of what it committed.
    fn step(&mut self) {
        let batch_size = gucs::INBOX_BATCH_SIZE.get().max(1) as usize;
        let rules = handling::rules(&self.settings);
        let mut acks = Acks::default();
        let rotate_due = self.rotate_at.is_none_or(|t| t <= Instant::now());
        let retry_due = self.retry_at.is_some_and(|t| t <= Instant::now());
        if !self.subs.problems.is_empty() && self.reloaded_at.elapsed() >= RECHECK_PROBLEMS {
            self.need_reload = true;
        }
        let lanes_committed = shmem::take_lane_progress();
        let check_staged = !self.staged.is_empty()
            && (lanes_committed || self.staged_checked.elapsed() >= STAGED_CHECK);
        if self.taken.pending.is_empty()
            && !self.need_reload
            && !rotate_due
            && !retry_due
            && !check_staged
            && self.book.is_empty()
        {
            return;
        }
        let mut wake_lanes = false;
        let batch: Vec<Message> = {
            let n = self
                .taken
                .pending
                .len()
                .min(self.subs.batch_limit(batch_size));
            self.taken.pending.drain(..n).collect()
        };
        pg::transaction("amqp_outbox subscriptions", || {
            let exists = outbox_queries::extension_exists();
            let ready = exists && outbox_queries::version_mismatch().is_none();
            self.missing = !exists;
            if !ready {
                if self.present {
                    log!("amqp_outbox: extension not usable in this database; subscriptions stop");
                    self.subs.forget();
                    self.handle.send(InboxCommand::Configure(Vec::new()));
                }
                self.present = false;
                self.need_reload = true;
                return;
            }
            let first = !self.present;
            self.present = true;
            Spi::connect_mut(|client| -> pgrx::spi::SpiResult<()> {
                if first {
                    queries::reset_connections(client)?;
                }
                if self.need_reload {
                    self.need_reload = false;
                    self.reloaded_at = Instant::now();
                    // Handlers may have been replaced or dropped: plan their calls again.
                    outbox_queries::forget_plans();
                    if let Some(configs) =
                        subscriptions::reload(&mut self.subs, client, &self.settings)?
                    {
                        self.handle.send(InboxCommand::Configure(configs));
                    }
                    shmem::set_lanes_wanted(queries::lanes_wanted(client)?);
                    shmem::bump_subscriptions_generation();
                    wake_lanes = true;
                    for (name, why) in self.subs.problems.clone() {
                        let e = self.book.entry(&name);
                        e.connection = Some((false, None));
                        e.error = Some(Some(why));
                    }
                    self.retry_at = Some(Instant::now());
                }
                // Messages of subscriptions with lanes wait for them in amqp.inbox_waiting,
                // unacknowledged until their row is gone.
                let (for_lanes, mut work): (Vec<Message>, Vec<Message>) =
                    batch.into_iter().partition(|m| {
                        self.subs
                            .active
                            .get(&m.subscription)
                            .is_some_and(|s| s.has_lanes())
                    });
                for mut m in for_lanes {
                    let Some(sub) = self.subs.active.get(&m.subscription) else {
                        continue;
                    };
                    let message_id = match &m.message_id {
                        Some(id) => id.clone(),
                        None => queries::derived_message_id(client, m.digest_input())?,
                    };
                    m.key = sub.key_of(&m);
                    let staged = queries::stage(client, &m, &message_id)?;
                    self.staged.note(&m, staged, &mut acks);
                    self.book.entry(&m.subscription).delivered += 1;
                    wake_lanes = true;
                }
                if check_staged || (lanes_committed && !self.staged.is_empty()) {
                    self.staged_checked = Instant::now();
                    let gone = queries::gone_from_waiting(client, self.staged.rows())?;
                    self.staged.gone(gone, &mut acks);
                }
                let retry_due = self.retry_at.is_some_and(|t| t <= Instant::now());
                if retry_due && work.len() < batch_size {
                    let names: Vec<String> = self.subs.active.keys().cloned().collect();
                    let due =
                        queries::due_retries(client, names, (batch_size - work.len()) as i64)?;
                    let took_all = due.len() < batch_size - work.len();
                    // A retry that succeeds may free its key for the lanes.
                    wake_lanes |= due.iter().any(|m| m.key.is_some());
                    work.extend(due);
                    self.retry_at = if took_all { None } else { Some(Instant::now()) };
                }
                if !work.is_empty() {
                    let outcomes = handling::handle_all(
                        &mut SpiInbox::new(client, &mut self.left_behind),
                        &self.subs.active,
                        &work,
                        &rules,
                        &mut self.book,
                    )?;
                    for (m, o) in work.iter().zip(outcomes) {
                        if matches!(o, Outcome::CannotRun) {
                            // The next step reads the subscriptions again: this one stops,
                            // its state saying why, and the broker keeps its messages.
                            self.need_reload = true;
                        }
                        if o.acknowledged() {
                            acks.add(m);
                        }
                    }
                }
                if self.retry_at.is_none() {
                    let names: Vec<String> = self.subs.active.keys().cloned().collect();
                    self.retry_at = queries::next_retry_in(client, names)?
                        .map(|s| Instant::now() + Duration::from_secs_f64(s.clamp(0.0, 3600.0)));
                }
                queries::write_book(client, &mut self.book)
            })
            .unwrap_or_else(|e| error!("amqp_outbox: subscription worker: {e}"));
        });
        if wake_lanes {
            shmem::wake_lanes();
        }
        if rotate_due && self.present {
            self.rotate();
        }
        // Only now is the work committed: acknowledge it (once the standbys have it, when
        // amqp_outbox.standby_names names some).
        let acks = acks.commands();
        let ready = if self.standbys.active() {
            self.standbys.hold(acks, standbys::insert_position())
        } else {
            acks
        };
        self.send_all(ready);
    }

    fn send_all(&self, commands: Vec<InboxCommand>) {
        for command in commands {
            self.handle.send(command);
        }
    }
}
