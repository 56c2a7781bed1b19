//! The relay's lanes: for subscriptions with a parallelism, threads that each handle waiting
//! messages on a connection of their own, as the extension's lane processes do (the engine's
//! [`amqp_outbox_engine::consume::lanes`] says which each takes). The consuming side's thread
//! is lane 0: it puts deliveries into `amqp.inbox_waiting` and acknowledges them once their row
//! is gone; lanes 1 and up only claim, handle and delete. Started as the subscriptions ask for
//! them, stopped with the consuming side.

use crate::client_inbox::{ClientInbox, InboxSession};
use crate::config::Config;
use crate::connect;
use crate::log::Log;
use crate::stop;
use amqp_outbox_engine::consume::book::Book;
use amqp_outbox_engine::consume::handling::{self, Rules};
use amqp_outbox_engine::consume::lanes::{self, Serving};
use amqp_outbox_engine::consume::message::Sub;
use postgres::Client;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle lane sleeps before it looks for waiting messages again.
const IDLE: Duration = Duration::from_millis(50);
/// How often a busy lane writes its counters.
const BOOK_EVERY: Duration = Duration::from_secs(1);

/// What the consuming side's thread tells its lanes.
#[derive(Default)]
pub struct Shared {
    stop: AtomicBool,
    /// Lanes the subscriptions want (the largest parallelism); lane n works while n is below.
    wanted: AtomicUsize,
    /// Bumped when the subscriptions were read again: each lane reads them too.
    generation: AtomicU64,
    /// Whether a receipts exchange is set (as the consuming side read it).
    receipts: AtomicBool,
}

/// The lanes of one consuming side.
#[derive(Default)]
pub struct Lanes {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl Lanes {
    /// After the subscriptions were read: as many lanes as they want (lane 0 is the caller).
    pub fn configure(
        &mut self,
        subs: &BTreeMap<String, Sub>,
        receipts: bool,
        config: &Config,
        url: &str,
        log: &Log,
    ) {
        let wanted = lanes::wanted(subs);
        self.shared.wanted.store(wanted, Ordering::SeqCst);
        self.shared.receipts.store(receipts, Ordering::SeqCst);
        self.shared.generation.fetch_add(1, Ordering::SeqCst);
        while self.threads.len() + 1 < wanted {
            let n = self.threads.len() + 1;
            let (shared, lane_config, lane_url, lane_log) = (
                self.shared.clone(),
                config.clone(),
                url.to_owned(),
                log.clone(),
            );
            let spawned = std::thread::Builder::new()
                .name(format!("lane {n}"))
                .spawn(move || serve(n, &shared, &lane_config, &lane_url, &lane_log));
            match spawned {
                Ok(t) => self.threads.push(t),
                Err(e) => {
                    log.warning(&format!("cannot start lane {n}: {e}"));
                    break;
                }
            }
        }
    }
}

impl Drop for Lanes {
    /// Stops the lanes (a handler running finishes first) and waits for them.
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Shared {
    fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst) || stop::requested()
    }
}

/// Lane `n` until the consuming side stops it, connecting again after a failure.
fn serve(n: usize, shared: &Shared, config: &Config, url: &str, log: &Log) {
    let mut backoff = Duration::from_millis(500);
    while !shared.stopping() {
        if let Err(e) = run(n, shared, config, url, log) {
            log.warning(&format!("lane {n} stopped, starting again: {e}"));
            stop::wait(&[], backoff);
            backoff = (backoff * 2).min(Duration::from_secs(10));
        }
    }
}

/// One connection's lane.
fn run(n: usize, shared: &Shared, config: &Config, url: &str, log: &Log) -> Result<(), String> {
    let describe = |e: postgres::Error| connect::describe(&e);
    let mut client = connect::connect(url, &config.postgres_tls)?;
    let mut session = InboxSession::new(&mut client).map_err(describe)?;
    let mut subs: BTreeMap<String, Sub> = BTreeMap::new();
    let mut generation = None;
    let mut book = Book::default();
    let mut booked_at = Instant::now();
    while !shared.stopping() {
        if n >= shared.wanted.load(Ordering::SeqCst) {
            stop::wait(&[], IDLE * 4);
            continue;
        }
        let now = shared.generation.load(Ordering::SeqCst);
        if generation != Some(now) {
            subs = read_subscriptions(&mut client, &mut session, log)?;
            generation = Some(now);
        }
        let Serving {
            names,
            mut limit,
            ordered,
        } = lanes::serving(&subs, n);
        if names.is_empty() {
            stop::wait(&[], IDLE);
            continue;
        }
        let rules = Rules {
            handler_timeout: config.handler_timeout,
            receipts: shared.receipts.load(Ordering::SeqCst),
            backoff: config.settings.retry_backoff(),
        };
        let mut t = client.transaction().map_err(describe)?;
        let mut inbox = ClientInbox::new(&mut t, &mut session, log);
        if let Some(parallelism) = ordered {
            let heads = inbox.claimable(&names).map_err(describe)?;
            limit = lanes::ordered_limit(limit, heads, parallelism);
        }
        let claimed = inbox
            .claim_waiting(&names, limit as i64)
            .map_err(describe)?;
        if claimed.is_empty() {
            if !book.is_empty() {
                inbox.write_book(&mut book).map_err(describe)?;
            }
            t.commit().map_err(describe)?;
            stop::wait(&[], IDLE);
            continue;
        }
        let outcomes = handling::handle_all(&mut inbox, &subs, &claimed, &rules, &mut book)
            .map_err(describe)?;
        let mut done = Vec::with_capacity(claimed.len());
        for (m, o) in claimed.iter().zip(outcomes) {
            if o.acknowledged() {
                done.extend(m.waiting_id);
            } else if o == handling::Outcome::CannotRun {
                // Read again at the next look (it then is not served until it can run).
                generation = None;
            }
        }
        inbox.done_waiting(&done).map_err(describe)?;
        if booked_at.elapsed() >= BOOK_EVERY {
            booked_at = Instant::now();
            inbox.write_book(&mut book).map_err(describe)?;
        }
        t.commit().map_err(describe)?;
    }
    Ok(())
}

/// The subscriptions as the lane runs them: those whose owner it may act as.
fn read_subscriptions(
    client: &mut Client,
    session: &mut InboxSession,
    log: &Log,
) -> Result<BTreeMap<String, Sub>, String> {
    let describe = |e: postgres::Error| connect::describe(&e);
    let mut t = client.transaction().map_err(describe)?;
    let subs = ClientInbox::new(&mut t, session, log)
        .subscriptions()
        .map_err(describe)?;
    t.commit().map_err(describe)?;
    let owners: BTreeSet<u32> = subs
        .iter()
        .filter(|s| s.handler.is_some())
        .map(|s| s.owner)
        .collect();
    session.make_runners(client, owners);
    Ok(subs
        .into_iter()
        .filter_map(|mut s| {
            if session.runner_problem(s.owner).is_some() {
                s.handler = None;
            }
            s.handler.is_some().then(|| (s.name.clone(), s))
        })
        .collect())
}
