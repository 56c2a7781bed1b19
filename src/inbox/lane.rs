//! A lane: one of a database's processes that handle the messages of subscriptions with a
//! parallelism or an ordering. The subscription worker receives those messages and puts them
//! into `amqp.inbox_waiting` (unacknowledged); each lane claims some (`FOR UPDATE SKIP
//! LOCKED`), handles them in its own transaction exactly as the subscription worker handles
//! its own (consumption record, handler as the owner, receipt, failure kept in
//! `amqp.inbox_failed`) and deletes their rows; the subscription worker then acknowledges
//! them. Lane n serves the subscriptions whose parallelism is above n, so a subscription has
//! at most `parallelism` messages in progress; a key's next message is claimable only once no
//! earlier message with that key waits, runs or has failed (see `queries::claim_waiting`).
//! Lanes are started and restarted by the launcher, as many as the subscription worker asks
//! for.

use super::handling::{self, Outcome, SpiInbox};
use super::queries;
use crate::gucs::{self, WorkerSettings};
use crate::shmem;
use crate::shmem::handler_trap::{self, Ended};
use crate::worker::pg;
use crate::worker::queries as outbox_queries;
use amqp_outbox_engine::consume::book::Book;
use amqp_outbox_engine::consume::lanes::{self, Serving};
use amqp_outbox_engine::consume::message::Sub;
use pgrx::prelude::*;
use std::collections::BTreeMap;
use std::ffi::CString;
use std::time::{Duration, Instant};

/// Longest sleep when nothing wakes the lane.
const NAPTIME: Duration = Duration::from_secs(1);
/// How often a busy lane writes its counters (with the work of that transaction).
const BOOK_EVERY: Duration = Duration::from_secs(1);

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn amqp_outbox_lane_main(arg: pg_sys::Datum) {
    let lane = crate::worker::lane_of_argument(arg).min(shmem::MAX_LANES - 1);
    // Before the watchdog is installed: a handler that ends this lane is remembered in the
    // lane's own trap.
    handler_trap::use_lane_trap(lane);
    let database = super::start_user_code_process(arg);
    // Its message is acknowledged once this commit is durable (as the subscription worker's).
    pg::pin(c"synchronous_commit", c"on");
    // Shown in pg_stat_activity, where amqp.subscription_status counts the lanes.
    if let Ok(name) = CString::new(format!("amqp_outbox lane {}", lane + 1)) {
        pg::pin(c"application_name", &name);
    }
    crate::worker::announce(shmem::WorkerKind::Lane(lane), &database);
    log!(
        "amqp_outbox: lane {} started for database \"{database}\"",
        lane + 1
    );
    Lane::new(lane).run()
}

struct Lane {
    /// 0-based: serves subscriptions whose parallelism is above it.
    n: usize,
    settings: WorkerSettings,
    subs: BTreeMap<String, Sub>,
    /// `shmem::subscriptions_generation` when the subscriptions were read (`None`: not yet).
    generation: Option<u64>,
    book: Book,
    booked_at: Instant,
    /// Messages whose handler ended a previous lane here.
    left: Vec<(Ended, String, String)>,
    /// What this lane's previous process left in its trap, to be marked on its row.
    trapped: Option<(Ended, String, String)>,
}

impl Lane {
    fn new(n: usize) -> Self {
        Lane {
            n,
            settings: gucs::worker_settings(),
            subs: BTreeMap::new(),
            generation: None,
            book: Book::default(),
            booked_at: Instant::now(),
            left: Vec::new(),
            trapped: handler_trap::take(),
        }
    }

    fn run(mut self) -> ! {
        loop {
            if pg::shutdown_requested() {
                log!("amqp_outbox: lane {} shutting down", self.n + 1);
                // SAFETY: the main thread, between transactions; never returns. The launcher
                // starts it again while its database wants it.
                unsafe { crate::pg_compat::proc_exit(0) };
            }
            if pg::reload_config_if_requested() {
                self.settings = gucs::worker_settings();
            }
            if !self.step() {
                pg::wait(None, NAPTIME, pg::WaitEvent::LaneMain);
            }
        }
    }

    /// One transaction: claim, handle, delete. Returns whether it handled anything.
    fn step(&mut self) -> bool {
        let generation = shmem::subscriptions_generation();
        let rules = handling::rules(&self.settings);
        let mut handled = 0usize;
        // It took as many as it may: more may be waiting for the other lanes.
        let mut took_all = false;
        pg::transaction("amqp_outbox lane", || {
            if !outbox_queries::extension_exists() || outbox_queries::version_mismatch().is_some() {
                self.generation = None;
                return;
            }
            Spi::connect_mut(|client| -> pgrx::spi::SpiResult<()> {
                if self.generation != Some(generation) {
                    outbox_queries::forget_plans();
                    self.subs = queries::load_subscriptions(client)?
                        .into_iter()
                        .map(|s| (s.name.clone(), s))
                        .collect();
                    self.generation = Some(generation);
                }
                if let Some((ended, sub, id)) = self.trapped.take() {
                    queries::mark_ended(client, &sub, &id, i16::from(ended.code()))?;
                }
                let Serving {
                    names,
                    mut limit,
                    ordered,
                } = lanes::serving(&self.subs, self.n);
                if names.is_empty() {
                    return self.flush_book(client, true);
                }
                if let Some(parallelism) = ordered {
                    let heads = queries::claimable(client, names.clone())?;
                    limit = lanes::ordered_limit(limit, heads, parallelism);
                }
                let claimed = queries::claim_waiting(client, names, limit as i64)?;
                took_all = claimed.len() >= limit;
                if claimed.is_empty() {
                    return self.flush_book(client, true);
                }
                let mut messages = Vec::with_capacity(claimed.len());
                for (m, ended) in claimed {
                    let why = ended
                        .and_then(|c| u8::try_from(c).ok())
                        .and_then(Ended::from_code);
                    if let (Some(why), Some(id)) = (why, m.message_id.clone()) {
                        self.left.push((why, m.subscription.clone(), id));
                    }
                    messages.push(m);
                }
                let outcomes = handling::handle_all(
                    &mut SpiInbox::new(client, &mut self.left),
                    &self.subs,
                    &messages,
                    &rules,
                    &mut self.book,
                )?;
                let mut done = Vec::with_capacity(messages.len());
                for (m, o) in messages.iter().zip(outcomes) {
                    match o {
                        // Stays waiting: its subscription is gone or paused (the row goes with
                        // amqp.unsubscribe()), or asked to stop.
                        Outcome::Dropped => {}
                        // Stays waiting; the subscriptions are read again (this one then is
                        // not served until it can run).
                        Outcome::CannotRun => self.generation = None,
                        Outcome::Handled | Outcome::Duplicate | Outcome::Failed => {
                            done.extend(m.waiting_id);
                        }
                    }
                }
                handled = done.len();
                queries::done_waiting(client, done)?;
                self.flush_book(client, false)
            })
            .unwrap_or_else(|e| error!("amqp_outbox: lane {}: {e}", self.n + 1));
        });
        if handled > 0 {
            // Committed: the subscription worker acknowledges. A key freed here is taken by
            // this lane's next claim; the others are woken only when there may be more than
            // that (waking every lane at every commit of a busy key made them contend for it).
            shmem::note_lane_progress();
            if took_all {
                shmem::wake_lanes();
            }
        }
        handled > 0
    }

    /// Writes the counters: when idle (`now`), or at most once per [`BOOK_EVERY`] with work
    /// (every lane's transaction writing one row per subscription would make the lanes wait
    /// for each other's commits).
    fn flush_book(
        &mut self,
        client: &mut pgrx::spi::SpiClient<'_>,
        now: bool,
    ) -> pgrx::spi::SpiResult<()> {
        if self.book.is_empty() || (!now && self.booked_at.elapsed() < BOOK_EVERY) {
            return Ok(());
        }
        self.booked_at = Instant::now();
        queries::write_book(client, &mut self.book)
    }
}
