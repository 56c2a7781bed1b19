//! 9. Monitor: the reconciliation monitor at scale; `amqp.health()` with a large outbox (#36).
//!
//! (1) An unrelated subscription (its own queue, a trivial SQL handler that records the time it
//! ran) receives a steady flow of raw lapin messages, each body starting with its publish time
//! in Unix µs. Its handler's latency (publish → handler) is measured in three kinds of window,
//! interleaved: **none open**, no monitored message at all; **loaded**, `BENCH_MONITOR_OPEN`
//! (100,000) open monitored messages plus a steady `BENCH_MONITOR_RATE` (500) new ones per
//! second through `amqp.publish_message(…, business_type => …)`, delivered by the worker; and,
//! for reference, **unmonitored**: the same publishing with a business type no rule names, so
//! that what the monitor costs is told apart from what publishing and delivering costs on the
//! same cores. The rule (action `report`, consumers `{never}`, late after 5 s, lost after 1 hour)
//! keeps the monitored messages open until the monitor gives them up.
//!
//! The open ones are inserted into `amqp.produced` directly, as the worker would have written
//! them (the first look when the message would be lost): seeding takes seconds instead of
//! publishing and draining them through the shared broker. Two sets of `BENCH_MONITOR_OPEN`
//! each: one delivered in the last minute, late and not due before an hour (what a silent
//! consumer leaves behind), and one delivered an hour ago, whose looks are spread evenly over
//! the 60 s from the window's start, so that the monitor gives them up as lost during the window
//! (open ÷ 60 looks a second on top of the new messages', whatever the window's length) instead
//! of all at once before it. Each row's delivery is its first look minus `lost_after`, so when
//! the monitor reaches it, it is exactly a message delivered then. Meanwhile, every second: the
//! backlog of due looks (`now() - min(check_at)` of what is due, the same as `max(now() -
//! check_at)`, read from the `check_at` index); over the window, the CPU time of the
//! `amqp_outbox monitor` backend from `/proc/<pid>/stat`, and of the unrelated subscription's
//! worker (per message it handled: at 200 msg/s most of a message's latency is that worker's own
//! CPU). Stalls of the handler (messages over 100 ms, grouped) go to the details.
//!
//! (2) `amqp.health()` with `BENCH_MONITOR_PENDING` (1,000,000) pending messages, inserted with
//! `amqp_outbox.enabled = off` by `INSERT … SELECT` into `amqp.message` (the columns
//! `amqp.publish()` sets; the defaults give each row its message_id and producer key), then
//! VACUUM ANALYZE: `BENCH_MONITOR_CALLS` calls timed, alternating with the naive check
//! `SELECT count(*) FROM amqp.message`.

use std::time::{Duration, Instant, SystemTime};

use postgres::Client;
use serde_json::{json, Value};

use crate::capacity::sleep_until;
use crate::consume::{
    load1, server_log, subscription_available, subscription_status, unsubscribe_if_any,
};
use crate::env::{payload, proc_cpu_secs, Env, Route};
use crate::phases::PacedOutbox;
use crate::raw::{self, RawProps};
use crate::report::{median, percentile, Figure, Target};
use crate::{log, Opts, Run};

const SEC: &str = "9 monitor";
const SUBSCRIPTION: &str = "bench_monitor_unrelated";
/// The business type of the monitored messages (its rule is made and removed here).
const KIND: &str = "bench_monitor_open";
/// The business type of the reference flow: no rule names it.
const UNRULED: &str = "bench_monitor_unruled";
const LATE_AFTER_SECS: u64 = 5;
const LOST_AFTER_SECS: u64 = 3600;
/// The seeded messages' first looks are spread over this long from the window's start: the
/// monitor's work a second does not depend on the window's length (quick or full).
const SPREAD: Duration = Duration::from_secs(60);
/// A handler latency above this counts towards a stall (details only).
const STALL_US: i64 = 100_000;
/// Before each window: the subscription settles, the open messages are seeded, and the new
/// monitored messages reach their first look (`late_after`).
const WARMUP: Duration = Duration::from_secs(10);
const BODY_SIZE: usize = 100;
/// Rows per statement when seeding and filling the outbox (each commits: progress is visible).
const CHUNK: u64 = 50_000;
/// The backlog of due looks, in seconds. `min(check_at)` rather than `max(now() - check_at)`:
/// the same number, one index probe per partition instead of reading every due row.
const BACKLOG_SQL: &str = "SELECT coalesce(extract(epoch FROM now() - min(check_at)), 0)::float8 \
                           FROM amqp.produced WHERE check_at <= now()";
const OPEN_SQL: &str = "SELECT count(*) FROM amqp.produced \
                        WHERE business_type = $1 AND expected IS NOT NULL AND completed_at IS NULL";
/// Looks that found a message late (every look that decides a message here: nobody answers).
const LATE_SQL: &str =
    "SELECT coalesce(sum(late), 0)::bigint FROM amqp._daily_stat WHERE business_type = $1";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Case {
    /// No monitored message open, none published.
    NoneOpen,
    /// The open messages seeded and the new ones flowing.
    Loaded,
    /// The same publishing, not monitored (reference).
    Unmonitored,
}

impl Case {
    fn key(self) -> &'static str {
        match self {
            Case::NoneOpen => "none_open",
            Case::Loaded => "loaded",
            Case::Unmonitored => "unmonitored",
        }
    }
}

/// The two routes of the phase: the unrelated subscription's and the monitored messages'.
fn routes() -> [Route; 2] {
    [
        Route::new("monitor.unrelated", false),
        Route::new("monitor.monitored", false),
    ]
}

/// What the watcher saw over one window.
#[derive(Debug, Default)]
struct Watched {
    /// Backlog of due looks, one sample a second, in seconds.
    backlog: Vec<f64>,
    /// CPU seconds of the monitor backend over the window (None: pid or /proc unreadable).
    cpu: Option<f64>,
    /// CPU seconds of the unrelated subscription's worker (all its threads) over the window.
    subscription_cpu: Option<f64>,
    secs: f64,
    /// Messages found late over the window.
    looks: i64,
    /// Open monitored messages at the start and at the end of the window.
    open: (i64, i64),
}

/// One window of one case.
#[derive(Debug)]
struct Window {
    case: Case,
    /// Handler latency publish → handler: p50, p99, max (ms), over `handled` messages of `sent`.
    p50: f64,
    p99: f64,
    max: f64,
    handled: usize,
    sent: u64,
    watched: Watched,
    stalls: Vec<Stall>,
    /// Messages of the 500 msg/s flow published during the measured window (loaded and
    /// unmonitored).
    monitored_sent: u64,
    /// Seconds the seeding (and its ANALYZE) took, from the start of the warm-up.
    seed_secs: Option<f64>,
    load1: f64,
}

impl Window {
    fn backlog_pct(&self, p: f64) -> f64 {
        let mut ms: Vec<i64> = self
            .watched
            .backlog
            .iter()
            .map(|s| (s * 1000.0).round() as i64)
            .collect();
        ms.sort_unstable();
        percentile(&ms, p) / 1000.0
    }

    fn backlog_max(&self) -> f64 {
        self.watched
            .backlog
            .iter()
            .copied()
            .fold(f64::NAN, f64::max)
    }

    /// Share of one core the monitor used, in %.
    fn cpu_pct(&self) -> f64 {
        self.watched
            .cpu
            .map_or(f64::NAN, |c| c / self.watched.secs * 100.0)
    }

    /// CPU ms per second (one round a second while the monitor keeps up: ≈ per pass).
    fn cpu_ms_per_sec(&self) -> f64 {
        self.cpu_pct() * 10.0
    }

    /// CPU µs per open message per second.
    fn cpu_us_per_open(&self) -> f64 {
        let (a, b) = self.watched.open;
        self.cpu_ms_per_sec() * 1000.0 / ((a + b) as f64 / 2.0)
    }

    /// CPU µs of the unrelated subscription's worker per message of its flow in the window
    /// (every message it handles costs it this much; at this rate, one message a step).
    fn subscription_us_per_msg(&self) -> f64 {
        match self.watched.subscription_cpu {
            Some(c) if self.sent > 0 => c * 1e6 / self.sent as f64,
            _ => f64::NAN,
        }
    }

    /// CPU µs per message looked at (found late).
    fn cpu_us_per_look(&self) -> f64 {
        match self.watched.cpu {
            Some(c) if self.watched.looks > 0 => c * 1e6 / self.watched.looks as f64,
            _ => f64::NAN,
        }
    }

    fn to_json(&self) -> Value {
        json!({
            "case": self.case.key(), "load1_at_start": self.load1,
            "handler_p50_ms": self.p50, "handler_p99_ms": self.p99, "handler_max_ms": self.max,
            "handled": self.handled, "sent": self.sent,
            "backlog_s": self.watched.backlog, "backlog_p95_s": self.backlog_pct(95.0),
            "backlog_max_s": self.backlog_max(),
            "monitor_cpu_secs": self.watched.cpu, "window_secs": self.watched.secs,
            "monitor_cpu_pct_of_core": self.cpu_pct(), "monitor_cpu_ms_per_sec": self.cpu_ms_per_sec(),
            "monitor_cpu_us_per_open_msg_per_sec": self.cpu_us_per_open(),
            "monitor_cpu_us_per_look": self.cpu_us_per_look(),
            "subscription_worker_cpu_secs": self.watched.subscription_cpu,
            "subscription_worker_cpu_us_per_msg": self.subscription_us_per_msg(),
            "looks": self.watched.looks, "open_at_start": self.watched.open.0, "open_at_end": self.watched.open.1,
            "monitored_sent": self.monitored_sent, "seed_secs": self.seed_secs,
            "handler_stalls_over_100ms": self.stalls.iter().take(20)
                .map(|s| json!({"at_s": s.at_s, "messages": s.messages, "max_ms": s.max_ms}))
                .collect::<Vec<_>>(),
        })
    }
}

/// 9. Monitor.
pub fn monitor(env: &mut Env, opts: &Opts, run: &mut Run) -> Result<(), String> {
    let scale = if monitor_available(env)? {
        let r = setup(env).and_then(|()| measure_scale(env, opts, run));
        cleanup(env);
        r
    } else {
        run.notes.push(
            "monitor: no amqp._monitor() or amqp.subscribe() in this build: only amqp.health() was measured"
                .into(),
        );
        Ok(())
    };
    let health = health(env, opts, run);
    scale.and(health)
}

fn monitor_available(env: &mut Env) -> Result<bool, String> {
    let monitor: bool = env
        .admin
        .query_one(
            "SELECT to_regprocedure('amqp._monitor(integer)') IS NOT NULL",
            &[],
        )
        .map(|r| r.get(0))
        .map_err(|e| format!("looking for amqp._monitor: {}", db_error(&e)))?;
    Ok(monitor && subscription_available(env)?)
}

fn setup(env: &mut Env) -> Result<(), String> {
    env.set_enabled(true)?;
    env.set_proof("ack_queue")?;
    env.set_production_log(true)?;
    for r in routes() {
        env.declare(&r)?;
    }
    unsubscribe_if_any(env, SUBSCRIPTION)?;
    remove_messages(env)?;
    // Today's partitions now, not by the monitor's upkeep in the middle of a window (moving
    // what the default partition holds under a table lock). One transaction each, as the
    // upkeep does: its table locks are taken in its own order.
    for table in ["produced", "receipt"] {
        sql(
            env,
            &format!("SELECT amqp._history_day('{table}', amqp._day(now()))"),
        )?;
    }
    sql(
        env,
        &format!(
            "DROP TABLE IF EXISTS public.bench_monitor_seen;
         CREATE TABLE public.bench_monitor_seen (flag text, sent_us bigint, handled_us bigint);
         CREATE OR REPLACE FUNCTION public.bench_monitor_handler(d amqp.delivery) RETURNS void
             LANGUAGE sql AS $$
             INSERT INTO public.bench_monitor_seen
             SELECT split_part(b, ' ', 2), split_part(b, ' ', 1)::bigint,
                    (extract(epoch FROM clock_timestamp()) * 1000000)::bigint
               FROM amqp.body_text(d) AS b $$;
         INSERT INTO amqp.monitor_rule (business_type, consumers, late_after, lost_after, action)
         VALUES ('{KIND}', '{{never}}', '{LATE_AFTER_SECS} seconds', '{LOST_AFTER_SECS} seconds', 'report')
         ON CONFLICT (business_type) DO UPDATE
            SET consumers = excluded.consumers, late_after = excluded.late_after,
                lost_after = excluded.lost_after, action = excluded.action;"
        ),
    )?;
    let [unrelated, _] = routes();
    env.admin
        .execute(
            "SELECT amqp.subscribe($1, $2, $3, 'public.bench_monitor_handler(amqp.delivery)'::regprocedure)",
            &[&SUBSCRIPTION, &env.broker_id, &unrelated.queue],
        )
        .map_err(|e| format!("amqp.subscribe: {}", db_error(&e)))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let status = subscription_status(env, SUBSCRIPTION);
        if status.get("state").and_then(Value::as_str) == Some("consuming") {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "subscription {SUBSCRIPTION} not consuming after 30 s: {status}\n--- server log ---\n{}",
                server_log(env, 100)
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The messages this phase published or seeded and their counts go (a rerun and the next
/// window start from none).
fn remove_messages(env: &mut Env) -> Result<(), String> {
    let kinds = [KIND, UNRULED];
    // The table lock first: the monitor's pass updates these rows in another order, and the
    // two would deadlock row by row. The pass and the worker's writes wait meanwhile (the
    // outbox is empty by now).
    let removed = env.admin.transaction().and_then(|mut tx| {
        tx.batch_execute("LOCK TABLE amqp.produced IN SHARE ROW EXCLUSIVE MODE")?;
        tx.execute(
            "DELETE FROM amqp.produced WHERE business_type = ANY ($1)",
            &[&&kinds[..]],
        )?;
        tx.execute(
            "DELETE FROM amqp._daily_stat WHERE business_type = ANY ($1)",
            &[&&kinds[..]],
        )?;
        tx.commit()
    });
    removed.map_err(|e| format!("removing the monitored messages: {}", db_error(&e)))?;
    sql(env, "VACUUM ANALYZE amqp.produced")
}

/// A PostgreSQL error with its message (the client's `Display` says only "db error").
fn db_error(e: &postgres::Error) -> String {
    e.as_db_error()
        .map_or_else(|| e.to_string(), |d| d.to_string())
}

/// [`Env::sql`] with the server's message in the error.
fn sql(env: &mut Env, text: &str) -> Result<(), String> {
    env.admin
        .batch_execute(text)
        .map_err(|e| format!("{text}: {}", db_error(&e)))
}

fn cleanup(env: &mut Env) {
    let _ = unsubscribe_if_any(env, SUBSCRIPTION);
    let _ = env.wait_outbox_empty(Duration::from_secs(60));
    let _ = env.admin.execute(
        "DELETE FROM amqp.monitor_rule WHERE business_type = $1",
        &[&KIND],
    );
    let _ = remove_messages(env);
    let _ = env.sql(
        "DROP FUNCTION IF EXISTS public.bench_monitor_handler(amqp.delivery);
         DROP TABLE IF EXISTS public.bench_monitor_seen;",
    );
    let rs = routes();
    let queues: Vec<String> = rs.iter().map(|r| r.queue.clone()).collect();
    let exchanges: Vec<String> = rs.iter().map(|r| r.exchange.clone()).collect();
    env.amqp
        .delete_all(&queues, &exchanges, Duration::from_secs(30));
}

/// Inserts `n` open monitored messages into `amqp.produced` as the worker writes them on
/// delivery, their first looks (when they would be lost) spread evenly over [`base`, `base +
/// spread`].
fn seed(env: &mut Env, n: u64, base: SystemTime, spread: Duration) -> Result<(), String> {
    let [_, monitored] = routes();
    let body = payload(BODY_SIZE).into_bytes();
    let stmt = env
        .admin
        .prepare(
            "INSERT INTO amqp.produced (message_id, message_at, seq, broker_id, exchange, routing_key,
                 system_id, host_id, business_type, producer_pid, producer_started_at, created_at,
                 published_at, confirmed_at, acknowledged_at, delivered_at, expected, body,
                 delivery_mode, check_at)
             SELECT s.id, amqp._uuid7_time(s.id), s.g, $1, $2, '', current_database(), 'bench', $3,
                    pg_backend_pid(), now(), now(), s.due - r.lost_after, s.due - r.lost_after,
                    s.due - r.lost_after, s.due - r.lost_after, r.consumers, $4, 2, s.due
               FROM (SELECT g, amqp._new_message_id() AS id,
                            $5::timestamptz + random() * $6::float8 * interval '1 second' AS due
                       FROM generate_series(1, $7::int) g) s
               JOIN amqp.monitor_rule r ON r.business_type = $3",
        )
        .map_err(|e| format!("prepare the seeding: {}", db_error(&e)))?;
    let mut left = n;
    while left > 0 {
        let k = left.min(CHUNK) as i32;
        env.admin
            .execute(
                &stmt,
                &[
                    &env.broker_id,
                    &monitored.exchange,
                    &KIND,
                    &body,
                    &base,
                    &spread.as_secs_f64(),
                    &k,
                ],
            )
            .map_err(|e| format!("seeding amqp.produced: {}", db_error(&e)))?;
        left -= k as u64;
    }
    // Statistics that know the seeded rows, as autovacuum's ANALYZE soon would: the monitor's
    // plans are made from them.
    sql(env, "ANALYZE amqp.produced")
}

/// Samples the backlog every second from `from` for `secs`, and the monitor's CPU and looks
/// (and the subscription worker's CPU, `subscription`) over that window, on a session of its own.
fn watch(
    mut c: Client,
    pid: Option<i32>,
    subscription: Option<i32>,
    from: Instant,
    secs: Duration,
) -> Result<Watched, String> {
    let q = |c: &mut Client, text: &str| -> Result<i64, String> {
        c.query_one(text, &[&KIND])
            .map(|r| r.get(0))
            .map_err(|e| format!("watcher: {}", db_error(&e)))
    };
    sleep_until(from);
    let open0 = q(&mut c, OPEN_SQL)?;
    let late0 = q(&mut c, LATE_SQL)?;
    let cpu0 = pid.and_then(proc_cpu_secs);
    let sub0 = subscription.and_then(proc_cpu_secs);
    let t0 = Instant::now();
    let mut backlog = Vec::new();
    for k in 0.. {
        let at = t0 + Duration::from_secs(k);
        if at >= t0 + secs {
            break;
        }
        sleep_until(at);
        let b: f64 = c
            .query_one(BACKLOG_SQL, &[])
            .map(|r| r.get(0))
            .map_err(|e| format!("watcher: backlog: {}", db_error(&e)))?;
        backlog.push(b);
    }
    sleep_until(t0 + secs);
    let cpu1 = pid.and_then(proc_cpu_secs);
    let sub1 = subscription.and_then(proc_cpu_secs);
    let window = t0.elapsed().as_secs_f64();
    let late1 = q(&mut c, LATE_SQL)?;
    let open1 = q(&mut c, OPEN_SQL)?;
    Ok(Watched {
        backlog,
        cpu: cpu0.zip(cpu1).map(|(a, b)| b - a),
        subscription_cpu: sub0.zip(sub1).map(|(a, b)| b - a),
        secs: window,
        looks: late1 - late0,
        open: (open0, open1),
    })
}

fn joined<T>(h: std::thread::JoinHandle<Result<T, String>>, what: &str) -> Result<T, String> {
    h.join().map_err(|_| format!("{what}: thread panicked"))?
}

/// One window of `case`: the unrelated flow for the warm-up and the window, with (loaded) the
/// monitored flow and the seeding meanwhile.
fn window(env: &mut Env, opts: &Opts, case: Case) -> Result<Window, String> {
    let [unrelated, monitored] = routes();
    sql(env, "TRUNCATE public.bench_monitor_seen")?;
    env.purge(&unrelated.queue)?;
    env.purge(&monitored.queue)?;
    let secs = Duration::from_secs(opts.monitor_secs);
    let pid = env.backend_pid("amqp_outbox monitor")?;
    let subscription_pid = env.backend_pid("amqp_outbox subscriptions")?;
    if pid.is_none() {
        return Err(format!(
            "no amqp_outbox monitor process for the database\n--- server log ---\n{}",
            server_log(env, 100)
        ));
    }
    let load = load1();
    let watcher = env.cluster.try_client()?;
    let monitored_flow = match case {
        Case::Loaded | Case::Unmonitored => Some(PacedOutbox::connect(
            env,
            &monitored.exchange,
            Some(if case == Case::Loaded { KIND } else { UNRULED }),
            opts.monitor_rate,
        )?),
        Case::NoneOpen => None,
    };
    if case == Case::Loaded {
        // Left behind by a silent consumer in the last minute, not due for an hour: seeded
        // before the warm-up, whose seeding is timed (the ones due in the window).
        let behind = SystemTime::now() + Duration::from_secs(LOST_AFTER_SECS) - SPREAD;
        seed(env, opts.monitor_open, behind, SPREAD)?;
    }
    let pad = payload(BODY_SIZE - 20);
    let start = Instant::now();
    let base = SystemTime::now() + WARMUP;
    let flow = {
        let (uri, exchange, pad) = (env.amqp_uri(), unrelated.exchange.clone(), pad.clone());
        let rate = opts.monitor_flow;
        // With a message_id, as another producer's message has one (without it the
        // subscription derives one from a digest of the message).
        std::thread::spawn(move || {
            raw::paced(
                &uri,
                &exchange,
                &pad,
                rate,
                WARMUP,
                secs,
                RawProps::LikeOutbox,
            )
        })
    };
    let watcher =
        std::thread::spawn(move || watch(watcher, pid, subscription_pid, start + WARMUP, secs));
    let monitored_flow = monitored_flow.map(|p| {
        let pad = pad.clone();
        std::thread::spawn(move || p.run(WARMUP, secs, &pad))
    });
    let seeded = if case == Case::Loaded {
        let r = seed(env, opts.monitor_open, base, SPREAD);
        let took = start.elapsed().as_secs_f64();
        if r.is_ok() && took > WARMUP.as_secs_f64() {
            log(format!(
                "  monitor: seeding took {took:.1} s, longer than the {} s warm-up",
                WARMUP.as_secs()
            ));
        }
        Some(r.map(|()| took))
    } else {
        None
    };
    let sent = joined(flow, "unrelated flow");
    let watched = joined(watcher, "watcher");
    let monitored_sent = monitored_flow.map(|h| joined(h, "monitored flow"));
    let seed_secs = seeded.transpose()?;
    let (sent, _) = sent?;
    let watched = watched?;
    let monitored_sent = monitored_sent.transpose()?.unwrap_or(0);
    let (lat, stalls) = handler_latencies(env, sent)?;
    if case != Case::NoneOpen {
        env.wait_outbox_empty(Duration::from_secs(60))?;
        remove_messages(env)?;
        env.purge(&monitored.queue)?;
    }
    let status = subscription_status(env, SUBSCRIPTION);
    if status.get("failed").and_then(Value::as_i64).unwrap_or(0) > 0 {
        return Err(format!(
            "the handler of {SUBSCRIPTION} failed: {status}\n--- server log ---\n{}",
            server_log(env, 100)
        ));
    }
    let mut us = lat;
    us.sort_unstable();
    let ms = |p: f64| percentile(&us, p) / 1000.0;
    Ok(Window {
        case,
        p50: ms(50.0),
        p99: ms(99.0),
        max: us.last().map_or(f64::NAN, |x| *x as f64 / 1000.0),
        handled: us.len(),
        sent,
        watched,
        stalls,
        monitored_sent,
        seed_secs,
        load1: load,
    })
}

/// A run of consecutive messages (by publish time) the handler took more than [`STALL_US`] for.
#[derive(Debug, Clone, PartialEq)]
struct Stall {
    /// Seconds from the first measured message to the first of the run.
    at_s: f64,
    messages: usize,
    max_ms: f64,
}

/// Groups `(sent_us, latency_us)` sorted by `sent_us` into stalls: slow messages whose
/// publish times are less than 200 ms apart belong to one.
fn stalls(samples: &[(i64, i64)]) -> Vec<Stall> {
    let Some(first) = samples.first().map(|s| s.0) else {
        return Vec::new();
    };
    let mut out: Vec<Stall> = Vec::new();
    let mut last_slow: Option<i64> = None;
    for &(sent, lat) in samples.iter().filter(|s| s.1 > STALL_US) {
        match (last_slow, out.last_mut()) {
            (Some(prev), Some(s)) if sent - prev < 200_000 => {
                s.messages += 1;
                s.max_ms = s.max_ms.max(lat as f64 / 1000.0);
            }
            _ => out.push(Stall {
                at_s: (sent - first) as f64 / 1e6,
                messages: 1,
                max_ms: lat as f64 / 1000.0,
            }),
        }
        last_slow = Some(sent);
    }
    out
}

/// Publish → handler latencies (µs) of the `sent` measured messages, once the handler has seen
/// them all (or 30 s passed), and the stalls among them.
fn handler_latencies(env: &mut Env, sent: u64) -> Result<(Vec<i64>, Vec<Stall>), String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let n: i64 = env
            .admin
            .query_one(
                "SELECT count(*) FROM public.bench_monitor_seen WHERE flag = 'm'",
                &[],
            )
            .map(|r| r.get(0))
            .map_err(|e| format!("count bench_monitor_seen: {}", db_error(&e)))?;
        if n as u64 >= sent || Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let samples: Vec<(i64, i64)> = env
        .admin
        .query(
            "SELECT sent_us, handled_us - sent_us FROM public.bench_monitor_seen
              WHERE flag = 'm' ORDER BY sent_us",
            &[],
        )
        .map(|rows| rows.iter().map(|r| (r.get(0), r.get(1))).collect())
        .map_err(|e| format!("reading bench_monitor_seen: {}", db_error(&e)))?;
    let found = stalls(&samples);
    Ok((samples.into_iter().map(|s| s.1).collect(), found))
}

fn measure_scale(env: &mut Env, opts: &Opts, run: &mut Run) -> Result<(), String> {
    let mut got: Vec<Window> = Vec::new();
    for rep in 0..opts.monitor_reps {
        let cases = [Case::NoneOpen, Case::Loaded, Case::Unmonitored];
        for case in crate::phases::rotated(&cases, rep) {
            let w = window(env, opts, case)?;
            log(format!(
                "  monitor {}: handler p50 {:.2} ms p99 {:.2} ms max {:.1} ms ({} of {}); backlog p95 {:.2} s max {:.2} s; \
                 monitor {:.2} % of a core, {:.1} ms/s, {} looks, open {}→{}; subscription worker {:.0} µs/msg; load {:.1}",
                case.key(),
                w.p50,
                w.p99,
                w.max,
                w.handled,
                w.sent,
                w.backlog_pct(95.0),
                w.backlog_max(),
                w.cpu_pct(),
                w.cpu_ms_per_sec(),
                w.watched.looks,
                w.watched.open.0,
                w.watched.open.1,
                w.subscription_us_per_msg(),
                w.load1
            ));
            got.push(w);
        }
    }
    let lost: u64 = got
        .iter()
        .map(|w| w.sent.saturating_sub(w.handled as u64))
        .sum();
    if lost > 0 {
        run.notes.push(format!(
            "monitor: {lost} messages of the unrelated flow were not handled within 30 s of the window's end"
        ));
    }
    let of = |case: Case, f: fn(&Window) -> f64| -> Vec<f64> {
        got.iter().filter(|w| w.case == case).map(f).collect()
    };
    let (l, q, u) = (Case::Loaded, Case::NoneOpen, Case::Unmonitored);
    // Whether PostgreSQL may JIT-compile the monitor's pass changes its cost per pass a lot.
    let jit: String = env
        .admin
        .query_one("SELECT current_setting('jit')", &[])
        .map(|r| r.get(0))
        .unwrap_or_else(|_| "?".into());
    let cfg = format!(
        "{} open + {:.0} msg/s new monitored (report, late 5 s, lost 1 h); unrelated subscription {:.0} msg/s; {} s windows × {}; jit {jit}",
        opts.monitor_open, opts.monitor_rate, opts.monitor_flow, opts.monitor_secs, opts.monitor_reps
    );
    let looks_per_sec = median(&of(l, |w| w.watched.looks as f64 / w.watched.secs));
    let figs = [
        Figure::new(
            SEC,
            "unrelated subscription's handler p99 (publish → handler), monitor loaded / none open",
            &cfg,
            "ms",
        )
        .samples(of(l, |w| w.p99))
        .baseline("none open", of(q, |w| w.p99))
        .target(Target::RatioBelow(1.1)),
        Figure::new(
            SEC,
            "unrelated subscription's handler p50 (publish → handler), monitor loaded / none open",
            &cfg,
            "ms",
        )
        .samples(of(l, |w| w.p50))
        .baseline("none open", of(q, |w| w.p50)),
        Figure::new(
            SEC,
            "unrelated subscription's handler p99, monitor loaded / the same publishing unmonitored (reference: the monitor's share)",
            &cfg,
            "ms",
        )
        .samples(of(l, |w| w.p99))
        .baseline("unmonitored", of(u, |w| w.p99)),
        Figure::new(
            SEC,
            "unrelated subscription's handler p99, publishing unmonitored / none open (reference: publishing's share)",
            &cfg,
            "ms",
        )
        .samples(of(u, |w| w.p99))
        .baseline("none open", of(q, |w| w.p99)),
        Figure::new(
            SEC,
            "monitor: backlog of due looks, p95 (sampled every second)",
            &cfg,
            "s",
        )
        .samples(of(l, |w| w.backlog_pct(95.0)))
        .target(Target::AtMost(2.0))
        .note(format!(
            "none open: {:.2} s",
            median(&of(q, |w| w.backlog_pct(95.0)))
        )),
        Figure::new(SEC, "monitor: backlog of due looks, max", &cfg, "s")
            .samples(of(l, Window::backlog_max)),
        Figure::new(
            SEC,
            "monitor CPU (utime + stime of its backend)",
            &cfg,
            "% of a core",
        )
        .samples(of(l, Window::cpu_pct))
        .target(Target::AtMost(10.0))
        .note(format!(
            "none open: {:.2} %, unmonitored publishing: {:.2} %",
            median(&of(q, Window::cpu_pct)),
            median(&of(u, Window::cpu_pct))
        )),
        Figure::new(
            SEC,
            "monitor CPU per second (a round a second while it keeps up)",
            &cfg,
            "ms",
        )
            .samples(of(l, Window::cpu_ms_per_sec))
            .note(format!(
                "none open: {:.2} ms",
                median(&of(q, Window::cpu_ms_per_sec))
            )),
        Figure::new(SEC, "monitor CPU per open message per second", &cfg, "µs")
            .samples(of(l, Window::cpu_us_per_open)),
        Figure::new(SEC, "monitor CPU per message looked at", &cfg, "µs")
            .samples(of(l, Window::cpu_us_per_look))
            .note(format!("{looks_per_sec:.0} looks/s")),
        Figure::new(
            SEC,
            "unrelated subscription's worker CPU per message it handled (all its threads), monitor loaded / none open",
            &cfg,
            "µs",
        )
        .samples(of(l, Window::subscription_us_per_msg))
        .baseline("none open", of(q, Window::subscription_us_per_msg)),
    ];
    let met = |f: &Figure| match f.met() {
        Some(true) => "met",
        Some(false) => "**not met**",
        None => "",
    };
    run.summary.push(format!(
        "monitor ({} open + {:.0} msg/s monitored, {} s windows, {} repetitions): unrelated handler p99 {:.2} ms loaded, \
         {:.2} ms none open, ratio {:.2} (target < 1.1, {}); due looks backlog p95 {:.2} s (target ≤ 2 s, {}), max {:.2} s; \
         monitor {:.2} % of a core (target ≤ 10 %, {}), {:.1} ms per second, {:.3} µs per open message per second, \
         {:.1} µs per look ({looks_per_sec:.0} looks/s); reference: handler p99 loaded / unmonitored publishing {:.2} \
         ({:.2} ms unmonitored)",
        opts.monitor_open,
        opts.monitor_rate,
        opts.monitor_secs,
        opts.monitor_reps,
        figs[0].median(),
        figs[0].baseline_median(),
        figs[0].ratio().unwrap_or(f64::NAN),
        met(&figs[0]),
        figs[4].median(),
        met(&figs[4]),
        figs[5].median(),
        figs[6].median(),
        met(&figs[6]),
        figs[7].median(),
        figs[8].median(),
        figs[9].median(),
        figs[2].ratio().unwrap_or(f64::NAN),
        figs[2].baseline_median(),
    ));
    for f in figs {
        run.fig(f);
    }
    run.detail(
        "monitor_scale",
        json!({
            "open": opts.monitor_open, "monitored_rate": opts.monitor_rate,
            "unrelated_rate": opts.monitor_flow, "window_secs": opts.monitor_secs,
            "warmup_secs": WARMUP.as_secs(), "reps": opts.monitor_reps, "jit": jit,
            "seeding": "direct INSERT into amqp.produced: as many delivered in the last minute (due in an hour), and as many delivered an hour ago, their looks spread evenly over 60 s from the window's start",
            "spread_secs": SPREAD.as_secs(),
            "windows": got.iter().map(Window::to_json).collect::<Vec<_>>(),
        }),
    );
    Ok(())
}

/// (2) `amqp.health()` with a large outbox, the worker off.
fn health(env: &mut Env, opts: &Opts, run: &mut Run) -> Result<(), String> {
    env.clear_outbox()?;
    let r = health_measure(env, opts, run);
    let cleared = env.clear_outbox();
    let enabled = env.set_enabled(true);
    r.and(cleared).and(enabled)
}

fn timed(c: &mut Client, sql: &str) -> Result<(f64, Vec<postgres::Row>), String> {
    let t = Instant::now();
    let rows = c
        .query(sql, &[])
        .map_err(|e| format!("{sql}: {}", db_error(&e)))?;
    Ok((t.elapsed().as_secs_f64() * 1000.0, rows))
}

fn health_measure(env: &mut Env, opts: &Opts, run: &mut Run) -> Result<(), String> {
    let n = opts.health_pending;
    let [_, monitored] = routes();
    let body = payload(BODY_SIZE).into_bytes();
    let t0 = Instant::now();
    let mut left = n;
    while left > 0 {
        let k = left.min(CHUNK * 4) as i32;
        env.admin
            .execute(
                "INSERT INTO amqp.message (broker_id, exchange, routing_key, body)
                 SELECT $1, $2, '', $3 FROM generate_series(1, $4::int)",
                &[&env.broker_id, &monitored.exchange, &body, &k],
            )
            .map_err(|e| format!("filling amqp.message: {}", db_error(&e)))?;
        left -= k as u64;
    }
    let fill_secs = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    sql(env, "VACUUM ANALYZE amqp.message")?;
    let vacuum_secs = t1.elapsed().as_secs_f64();
    log(format!(
        "  health: {n} rows in amqp.message in {fill_secs:.1} s ({:.0} rows/s), VACUUM ANALYZE {vacuum_secs:.1} s",
        n as f64 / fill_secs
    ));
    let c = &mut env.admin;
    // The first call plans the function's statements: timed apart.
    let (first, _) = timed(c, "SELECT * FROM amqp.health()")?;
    let (first_count, rows) = timed(c, "SELECT count(*) FROM amqp.message")?;
    let counted: i64 = rows[0].get(0);
    if counted as u64 != n {
        return Err(format!("amqp.message holds {counted} rows, not {n}"));
    }
    let mut health = Vec::new();
    let mut count = Vec::new();
    let mut last = Vec::new();
    for _ in 0..opts.health_calls {
        let (ms, rows) = timed(c, "SELECT * FROM amqp.health()")?;
        health.push(ms);
        last = rows;
        count.push(timed(c, "SELECT count(*) FROM amqp.message")?.0);
    }
    let checks: Vec<Value> = last
        .iter()
        .map(|r| {
            json!({"component": r.get::<_, String>(0), "status": r.get::<_, String>(1),
                   "detail": r.get::<_, Option<String>>(2)})
        })
        .collect();
    let outbox = checks
        .iter()
        .find(|c| c["component"] == "outbox")
        .map(|c| c["detail"].as_str().unwrap_or_default().to_string())
        .unwrap_or_default();
    let max = health.iter().copied().fold(f64::NAN, f64::max);
    let cfg = format!(
        "{n} pending in amqp.message (amqp_outbox.enabled = off), after VACUUM ANALYZE; {} calls",
        opts.health_calls
    );
    let fig = Figure::new(
        SEC,
        "amqp.health() / SELECT count(*) FROM amqp.message (the naive check)",
        &cfg,
        "ms",
    )
    .samples(health.clone())
    .baseline("count(*)", count.clone())
    .target(Target::AtMost(50.0))
    .note(format!("outbox check: \"{outbox}\""));
    let fig_max = Figure::new(SEC, "amqp.health(), slowest call", &cfg, "ms")
        .samples(vec![max])
        .target(Target::AtMost(50.0));
    let met = |f: &Figure| {
        if f.met() == Some(true) {
            "met"
        } else {
            "**not met**"
        }
    };
    run.summary.push(format!(
        "monitor, amqp.health() with {n} pending: median {:.2} ms, max {max:.2} ms over {} calls (target < 50 ms: median {}, max {}); \
         SELECT count(*) FROM amqp.message {:.1} ms, ratio {:.3}",
        fig.median(),
        opts.health_calls,
        met(&fig),
        met(&fig_max),
        fig.baseline_median(),
        fig.ratio().unwrap_or(f64::NAN),
    ));
    run.detail(
        "monitor_health",
        json!({
            "pending": n, "fill_secs": fill_secs, "vacuum_analyze_secs": vacuum_secs,
            "first_health_ms": first, "first_count_ms": first_count,
            "health_ms": health, "count_ms": count, "checks": checks,
        }),
    );
    run.fig(fig);
    run.fig(fig_max);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window_with(backlog: Vec<f64>, cpu: Option<f64>, looks: i64) -> Window {
        Window {
            case: Case::Loaded,
            p50: 1.0,
            p99: 2.0,
            max: 3.0,
            handled: 10,
            sent: 10,
            watched: Watched {
                backlog,
                cpu,
                subscription_cpu: cpu.map(|c| c / 100.0),
                secs: 10.0,
                looks,
                open: (100_000, 120_000),
            },
            stalls: Vec::new(),
            monitored_sent: 0,
            seed_secs: None,
            load1: 0.0,
        }
    }

    #[test]
    fn backlog_percentiles_are_nearest_rank() {
        let w = window_with((1..=20).map(|i| i as f64 / 10.0).collect(), None, 0);
        assert_eq!(w.backlog_pct(95.0), 1.9);
        assert_eq!(w.backlog_max(), 2.0);
        assert!(window_with(Vec::new(), None, 0).backlog_max().is_nan());
    }

    #[test]
    fn cpu_figures_follow_from_the_window() {
        // 0.5 s of CPU over 10 s: 5 % of a core, 50 ms a round, 50 ms / 110,000 open messages,
        // 0.5 s / 25,000 looks.
        let w = window_with(Vec::new(), Some(0.5), 25_000);
        assert!((w.cpu_pct() - 5.0).abs() < 1e-9);
        assert!((w.cpu_ms_per_sec() - 50.0).abs() < 1e-9);
        assert!((w.cpu_us_per_open() - 50_000.0 / 110_000.0).abs() < 1e-9);
        assert!((w.cpu_us_per_look() - 20.0).abs() < 1e-9);
        // The subscription worker: 5 ms over the window's 10 messages.
        assert!((w.subscription_us_per_msg() - 500.0).abs() < 1e-9);
        let unknown = window_with(Vec::new(), None, 0);
        assert!(unknown.cpu_pct().is_nan() && unknown.cpu_us_per_look().is_nan());
        assert!(unknown.subscription_us_per_msg().is_nan());
    }

    #[test]
    fn stalls_group_slow_messages_close_in_time() {
        // Two slow runs, split by more than 200 ms of publish time; fast messages in between.
        let ms = |t: i64, lat: i64| (t * 1000, lat * 1000);
        let samples = [
            ms(0, 1),
            ms(5, 900),
            ms(10, 850),
            ms(15, 1),
            ms(100, 120),
            ms(700, 300),
            ms(705, 2),
        ];
        assert_eq!(
            stalls(&samples),
            vec![
                Stall {
                    at_s: 0.005,
                    messages: 3,
                    max_ms: 900.0
                },
                Stall {
                    at_s: 0.7,
                    messages: 1,
                    max_ms: 300.0
                },
            ]
        );
        assert!(stalls(&[]).is_empty());
    }
}
