//! 7. Consume: draining a pre-filled queue into PostgreSQL, exactly once.
//!
//! Three contenders, each on its own copy of the queue (filled just before its run with the same
//! `n` persistent messages, each with a unique `message_id` and a small JSON body), repeated
//! interleaved:
//!
//! - **subscription**: `amqp.subscribe()` of the extension; per message the subscription worker
//!   records `amqp.consume_once()` and calls a SQL handler that inserts one row into
//!   `bench_effect`, several messages per transaction, then acknowledges. Timed from the
//!   `subscribe()` call until `bench_effect` has `n` rows.
//! - **application consumer**: what a user would write instead, in this crate: a lapin consumer
//!   (prefetch 100, manual acks) and one tokio-postgres connection with prepared statements; per
//!   message `BEGIN; INSERT INTO app_dedup … ON CONFLICT DO NOTHING` (skipped when it was a
//!   duplicate) `; INSERT INTO app_effect …; COMMIT`, then the ack. Timed from its
//!   `basic.consume` until `app_effect` has `n` rows, seen by the same poll as the subscription.
//! - **ack-only consumer**: lapin, prefetch 100, acks each delivery and does nothing else: the
//!   broker's floor. Timed from its `basic.consume` until it has acknowledged `n` messages.
//!
//! The two lapin consumers connect (and the application prepares its statements) before their
//! clock starts, as a running application's would; the subscription's clock includes its worker
//! noticing the subscription and connecting. The dedup records of every repetition stay (the
//! subscription's in `amqp.consume_once()`'s tables, the application's in `app_dedup`), so both
//! grow alike; the effect tables are emptied before each run.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use amqp_outbox_testkit::amqp_admin::{self, runtime, AmqpAdmin, CONNECT_TIMEOUT};
use futures_lite::StreamExt;
use lapin::options::{BasicAckOptions, BasicPublishOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Confirmation, Connection};
use serde_json::json;

use crate::env::{payload, Env, PREFIX};
use crate::phases::rotated;
use crate::report::{median, Figure, Target};
use crate::{log, Opts, Run};

pub(crate) const PREFETCH: u16 = 100;
const SUBSCRIPTION: &str = "bench";
/// The poll of the effect tables (the same for the subscription and the application).
const POLL: Duration = Duration::from_millis(50);
/// A run fails when its effect table has not grown for this long.
const STALL: Duration = Duration::from_secs(30);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Who {
    Subscription,
    App,
    AckOnly,
}

impl Who {
    fn key(self) -> &'static str {
        match self {
            Who::Subscription => "subscription",
            Who::App => "app",
            Who::AckOnly => "ack_only",
        }
    }

    fn queue(self) -> String {
        format!("{PREFIX}.consume.{}.q", self.key())
    }
}

/// What the application and ack-only contenders need: a PostgreSQL session for the polls and
/// the tables, its connection string, and the broker (so they run against any server).
pub(crate) struct Ctx<'a> {
    pub(crate) admin: &'a mut postgres::Client,
    pub(crate) pg_conn: String,
    pub(crate) amqp: &'a AmqpAdmin,
    pub(crate) amqp_uri: String,
}

impl Ctx<'_> {
    pub(crate) fn of(env: &mut Env) -> Ctx<'_> {
        Ctx {
            pg_conn: env.cluster.connection_string(crate::env::DATABASE),
            amqp_uri: env.amqp_uri(),
            admin: &mut env.admin,
            amqp: &env.amqp,
        }
    }

    pub(crate) fn sql(&mut self, sql: &str) -> Result<(), String> {
        self.admin
            .batch_execute(sql)
            .map_err(|e| format!("{sql}: {e}"))
    }

    pub(crate) fn queue_len(&self, queue: &str) -> Result<u64, String> {
        self.amqp.queue_len(queue).map(u64::from)
    }
}

/// One run of one contender.
#[derive(Clone, Debug)]
pub(crate) struct Outcome {
    pub(crate) rate: f64,
    pub(crate) secs: f64,
    /// Load average (1 min) when the run started.
    pub(crate) load: f64,
    /// Whatever else the contender reports (JSON).
    pub(crate) extra: serde_json::Value,
}

pub(crate) fn load1() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

/// A small JSON body of about 100 bytes (the same for every contender).
fn body(i: u64, pad: &str) -> String {
    format!(r#"{{"order":{i},"amount":"19.99","currency":"EUR","note":"{pad}"}}"#)
}

/// Fills `queue` (through the default exchange) with `n` persistent messages whose
/// `message_id`s are `<tag>-<i>`, with up to 1,000 unconfirmed; waits until the queue holds them.
fn fill(cx: &Ctx, queue: &str, tag: &str, n: u64) -> Result<f64, String> {
    fill_keyed(cx, queue, tag, n, None)
}

/// [`fill`], and with `keys`, message `i` carries the business key `k<i % keys>` (the header
/// the outbox sets from `publish_message(..., business_key => ...)`).
pub(crate) fn fill_keyed(
    cx: &Ctx,
    queue: &str,
    tag: &str,
    n: u64,
    keys: Option<u64>,
) -> Result<f64, String> {
    cx.amqp.purge_queue(queue)?;
    let pad = payload(40);
    let uri = cx.amqp_uri.clone();
    let t0 = Instant::now();
    runtime().block_on(async {
        let c = amqp_admin::connect(&uri, CONNECT_TIMEOUT).await?;
        let ch = amqp_admin::confirm_channel(&c).await?;
        let opts = BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        };
        let check = |r: lapin::Result<Confirmation>| match r {
            Ok(Confirmation::Ack(None)) => Ok(()),
            Ok(other) => Err(format!("filling {queue}: not confirmed cleanly: {other:?}")),
            Err(e) => Err(format!("filling {queue}: {e}")),
        };
        let mut pending = VecDeque::with_capacity(1000);
        for i in 0..n {
            if pending.len() >= 1000 {
                let p: lapin::PublisherConfirm = pending.pop_front().expect("non-empty");
                check(p.await)?;
            }
            let id = format!("{tag}-{i}");
            let mut props = BasicProperties::default()
                .with_delivery_mode(2)
                .with_content_type("application/json".into())
                .with_message_id(id.as_str().into());
            if let Some(k) = keys {
                let mut headers = FieldTable::default();
                headers.insert(
                    "x-amqp-outbox-business-key".into(),
                    lapin::types::AMQPValue::LongString(format!("k{}", i % k.max(1)).into()),
                );
                props = props.with_headers(headers);
            }
            let p = ch
                .basic_publish(
                    "".into(),
                    queue.into(),
                    opts,
                    body(i, &pad).as_bytes(),
                    props,
                )
                .await
                .map_err(|e| format!("filling {queue}: basic.publish: {e}"))?;
            pending.push_back(p);
        }
        while let Some(p) = pending.pop_front() {
            check(p.await)?;
        }
        let _ = c.close(200, "filled".into()).await;
        Ok::<_, String>(())
    })?;
    let secs = t0.elapsed().as_secs_f64();
    let got = wait_queue(cx, queue, Duration::from_secs(60), |len| len >= n)?;
    if got != n {
        return Err(format!("filling {queue}: it holds {got} messages, not {n}"));
    }
    Ok(n as f64 / secs)
}

pub(crate) fn count(cx: &mut Ctx, table: &str) -> Result<i64, String> {
    cx.admin
        .query_one(&format!("SELECT count(*) FROM public.{table}"), &[])
        .map(|r| r.get(0))
        .map_err(|e| format!("count {table}: {e}"))
}

/// Polls `table` every [`POLL`] until it has `n` rows; returns when it first had. `failed`
/// is asked at each poll for the contender's own error (its task ended early).
pub(crate) fn wait_rows(
    cx: &mut Ctx,
    table: &str,
    n: u64,
    timeout: Duration,
    mut failed: impl FnMut() -> Option<String>,
) -> Result<Instant, String> {
    let start = Instant::now();
    let mut last = (0i64, Instant::now());
    loop {
        let c = count(cx, table)?;
        if c >= n as i64 {
            return Ok(Instant::now());
        }
        if let Some(e) = failed() {
            // The contender may have finished just after the count: count once more.
            if count(cx, table)? >= n as i64 {
                return Ok(Instant::now());
            }
            return Err(e);
        }
        if c != last.0 {
            last = (c, Instant::now());
        }
        if last.1.elapsed() >= STALL || start.elapsed() >= timeout {
            return Err(format!(
                "{table} has {c} of {n} rows after {:.0}s (no new row for {:.0}s)",
                start.elapsed().as_secs_f64(),
                last.1.elapsed().as_secs_f64()
            ));
        }
        std::thread::sleep(POLL);
    }
}

/// CPU µs per message of `pid` since `cpu0` (NaN when unknown).
pub(crate) fn cpu_us_per_msg(pid: Option<i32>, cpu0: Option<f64>, n: u64) -> f64 {
    match (cpu0, pid.and_then(crate::env::proc_cpu_secs)) {
        (Some(a), Some(b)) => (b - a) * 1e6 / n as f64,
        _ => f64::NAN,
    }
}

pub(crate) fn timeout_for(n: u64) -> Duration {
    Duration::from_secs((n / 200).max(180))
}

/// Waits (bounded) until the number of ready messages in `queue` is `ok`; returns it.
pub(crate) fn wait_queue(
    cx: &Ctx,
    queue: &str,
    timeout: Duration,
    ok: impl Fn(u64) -> bool,
) -> Result<u64, String> {
    let deadline = Instant::now() + timeout;
    loop {
        let len = cx.queue_len(queue)?;
        if ok(len) || Instant::now() >= deadline {
            return Ok(len);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub(crate) fn subscription_available(env: &mut Env) -> Result<bool, String> {
    env.admin
        .query_one(
            "SELECT EXISTS (SELECT FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace \
                             WHERE n.nspname = 'amqp' AND p.proname = 'subscribe')",
            &[],
        )
        .map(|r| r.get(0))
        .map_err(|e| format!("looking for amqp.subscribe: {e}"))
}

/// `amqp.subscription_status` of subscription `name`, as JSON (null when there is none).
pub(crate) fn subscription_status(env: &mut Env, name: &str) -> serde_json::Value {
    env.admin
        .query_opt(
            "SELECT row_to_json(s)::text FROM amqp.subscription_status s WHERE subscription = $1",
            &[&name],
        )
        .ok()
        .flatten()
        .and_then(|r| serde_json::from_str(&r.get::<_, String>(0)).ok())
        .unwrap_or(serde_json::Value::Null)
}

/// The server log's lines about amqp_outbox or an error, from the last `n` lines.
pub(crate) fn server_log(env: &Env, n: usize) -> String {
    env.cluster
        .log_tail(n)
        .lines()
        .filter(|l| {
            l.contains("amqp_outbox")
                || l.contains("ERROR")
                || l.contains("WARNING")
                || l.contains("FATAL")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

pub(crate) fn unsubscribe_if_any(env: &mut Env, name: &str) -> Result<(), String> {
    env.admin
        .execute(
            "SELECT amqp.unsubscribe(subscription) FROM amqp.subscription WHERE subscription = $1",
            &[&name],
        )
        .map(|_| ())
        .map_err(|e| format!("amqp.unsubscribe({name}): {e}"))
}

/// (s) The subscription: from `amqp.subscribe()` until `bench_effect` has `n` rows.
fn subscription_once(env: &mut Env, n: u64, tag: &str) -> Result<Outcome, String> {
    let queue = Who::Subscription.queue();
    unsubscribe_if_any(env, SUBSCRIPTION)?;
    env.sql("TRUNCATE public.bench_effect")?;
    fill(&Ctx::of(env), &queue, tag, n)?;
    env.sql("CHECKPOINT")?;
    let worker = env.backend_pid("amqp_outbox subscriptions")?;
    let cpu0 = worker.and_then(crate::env::proc_cpu_secs);
    let load = load1();
    let t0 = Instant::now();
    env.admin
        .execute(
            "SELECT amqp.subscribe($1, $2, $3, 'public.bench_handler(amqp.delivery)'::regprocedure, $4)",
            &[&SUBSCRIPTION, &env.broker_id, &queue, &i32::from(PREFETCH)],
        )
        .map_err(|e| format!("amqp.subscribe: {e}"))?;
    let mut first_row: Option<f64> = None;
    let done = {
        let mut probe = env.cluster.try_client()?;
        wait_rows(&mut Ctx::of(env), "bench_effect", n, timeout_for(n), || {
            if first_row.is_none() {
                let any = probe
                    .query_opt("SELECT 1 FROM public.bench_effect LIMIT 1", &[])
                    .ok()
                    .flatten()
                    .is_some();
                if any {
                    first_row = Some(t0.elapsed().as_secs_f64());
                }
            }
            None
        })
    };
    let done = match done {
        Ok(d) => d,
        Err(e) => {
            let status = subscription_status(env, SUBSCRIPTION);
            let failed: i64 = env
                .admin
                .query_one("SELECT count(*) FROM amqp.inbox_failed", &[])
                .map(|r| r.get(0))
                .unwrap_or(-1);
            let ready = env.queue_len(&queue).unwrap_or(u64::MAX);
            let _ = unsubscribe_if_any(env, SUBSCRIPTION);
            return Err(format!(
                "subscription: expected bench_effect to reach {n} rows; got: {e}. \
                 Queue {queue} has {ready} ready; amqp.inbox_failed has {failed} rows; \
                 amqp.subscription_status: {status}\n--- server log (amqp_outbox/errors) ---\n{}",
                server_log(env, 200)
            ));
        }
    };
    let secs = (done - t0).as_secs_f64();
    let cpu = cpu_us_per_msg(worker, cpu0, n);
    // Acks follow the commits: let them arrive before the consumer goes away.
    let left = wait_queue(&Ctx::of(env), &queue, Duration::from_secs(10), |l| l == 0)?;
    std::thread::sleep(Duration::from_millis(300));
    let status = subscription_status(env, SUBSCRIPTION);
    unsubscribe_if_any(env, SUBSCRIPTION)?;
    // What was handled but not acknowledged comes back to the queue now.
    std::thread::sleep(Duration::from_millis(500));
    let returned = env.queue_len(&queue)?;
    let rows = count(&mut Ctx::of(env), "bench_effect")?;
    let get = |k: &str| status.get(k).and_then(|v| v.as_i64()).unwrap_or(-1);
    if rows != n as i64 || get("failed") > 0 || left > 0 {
        return Err(format!(
            "subscription: expected exactly {n} rows in bench_effect, none failed and an empty queue; \
             got {rows} rows, status {status}, {left} still ready 10 s after the last row\n\
             --- server log (amqp_outbox/errors) ---\n{}",
            server_log(env, 200)
        ));
    }
    env.purge(&queue)?;
    Ok(Outcome {
        rate: n as f64 / secs,
        secs,
        load,
        extra: json!({
            "first_row_after_secs": first_row,
            "rate_after_first_row": first_row.map(|f| n as f64 / (secs - f)),
            "worker_pid": worker, "worker_cpu_us_per_msg": cpu, "worker_cores": cpu * n as f64 / secs / 1e6,
            "handled": get("handled"), "duplicates": get("duplicates"), "failed": get("failed"),
            "returned_to_queue_after_unsubscribe": returned,
        }),
    })
}

/// The application consumer's connections, made before its clock starts.
pub(crate) struct App {
    pg: tokio_postgres::Client,
    /// Its backend's pid (for its CPU time).
    pid: i32,
    pg_task: tokio::task::JoinHandle<()>,
    dedup: tokio_postgres::Statement,
    effect: tokio_postgres::Statement,
    amqp: Connection,
}

pub(crate) async fn app_connect(pg_conn: &str, amqp_uri: &str) -> Result<App, String> {
    let (pg, conn) = tokio_postgres::connect(pg_conn, tokio_postgres::NoTls)
        .await
        .map_err(|e| format!("app consumer: connecting to PostgreSQL: {e}"))?;
    let pg_task = tokio::spawn(async move {
        let _ = conn.await;
    });
    let dedup = pg
        .prepare(
            "INSERT INTO public.app_dedup (consumer, message_id) VALUES ($1, $2) \
             ON CONFLICT DO NOTHING",
        )
        .await
        .map_err(|e| format!("app consumer: prepare: {e}"))?;
    let effect = pg
        .prepare("INSERT INTO public.app_effect (message_id, n) VALUES ($1, 1)")
        .await
        .map_err(|e| format!("app consumer: prepare: {e}"))?;
    let pid: i32 = pg
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .map_err(|e| format!("app consumer: pg_backend_pid: {e}"))?
        .get(0);
    let amqp = amqp_admin::connect(amqp_uri, CONNECT_TIMEOUT).await?;
    Ok(App {
        pg,
        pid,
        pg_task,
        dedup,
        effect,
        amqp,
    })
}

/// What the application consumer counted.
#[derive(Debug, Default)]
pub(crate) struct AppCounts {
    pub(crate) handled: u64,
    pub(crate) duplicates: u64,
    /// Seconds from its `basic.consume` to its last ack.
    pub(crate) own_secs: f64,
}

/// The usual way: one transaction per message, then the ack.
/// Returns the connections too: the caller reads the backend's CPU time before closing them.
async fn app_consume(app: App, queue: String, n: u64) -> Result<(AppCounts, App), String> {
    let done = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    app_consume_shared(app, queue, n, done, PREFETCH, 0.0).await
}

/// [`app_consume`] as one of several consumers of `queue` (competing, `prefetch` each): each
/// message it takes adds one to `done`, and it stops once `done` reaches `n`. `sleep`: seconds
/// of `pg_sleep` in each message's transaction (a handler's own work).
pub(crate) async fn app_consume_shared(
    mut app: App,
    queue: String,
    n: u64,
    done: std::sync::Arc<std::sync::atomic::AtomicU64>,
    prefetch: u16,
    sleep: f64,
) -> Result<(AppCounts, App), String> {
    use std::sync::atomic::Ordering;
    let t0 = Instant::now();
    let mut consumer = amqp_admin::start_consumer(&app.amqp, &queue, Some(prefetch), false).await?;
    let mut c = AppCounts::default();
    let mut progress = Instant::now();
    while done.load(Ordering::Acquire) < n {
        let d = match tokio::time::timeout(Duration::from_millis(200), consumer.next()).await {
            Ok(Some(Ok(d))) => d,
            // The others may be taking the last ones.
            Err(_) if progress.elapsed() < STALL => continue,
            other => {
                return Err(format!(
                    "app consumer: {} of {n} handled, then {other:?}",
                    c.handled
                ))
            }
        };
        progress = Instant::now();
        let id = d
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str().to_string())
            .ok_or("app consumer: a delivery without message_id")?;
        let tx = app
            .pg
            .transaction()
            .await
            .map_err(|e| format!("app consumer: BEGIN: {e}"))?;
        let fresh = tx
            .execute(&app.dedup, &[&"bench", &id])
            .await
            .map_err(|e| format!("app consumer: INSERT INTO app_dedup: {e}"))?;
        if fresh == 1 {
            if sleep > 0.0 {
                tx.execute("SELECT pg_sleep($1)", &[&sleep])
                    .await
                    .map_err(|e| format!("app consumer: pg_sleep: {e}"))?;
            }
            tx.execute(&app.effect, &[&id])
                .await
                .map_err(|e| format!("app consumer: INSERT INTO app_effect: {e}"))?;
            c.handled += 1;
        } else {
            c.duplicates += 1;
        }
        done.fetch_add(1, Ordering::AcqRel);
        tx.commit()
            .await
            .map_err(|e| format!("app consumer: COMMIT: {e}"))?;
        d.ack(BasicAckOptions::default())
            .await
            .map_err(|e| format!("app consumer: basic.ack: {e}"))?;
    }
    c.own_secs = t0.elapsed().as_secs_f64();
    drop(consumer);
    Ok((c, app))
}

pub(crate) async fn app_close(app: App) {
    let _ = app.amqp.close(200, "done".into()).await;
    drop(app.pg);
    app.pg_task.abort();
}

/// (b) The application consumer: from its `basic.consume` until `app_effect` has `n` rows.
fn app_once(cx: &mut Ctx, n: u64, tag: &str) -> Result<Outcome, String> {
    let queue = Who::App.queue();
    cx.sql("TRUNCATE public.app_effect")?;
    fill(cx, &queue, tag, n)?;
    cx.sql("CHECKPOINT")?;
    let app = runtime().block_on(app_connect(&cx.pg_conn, &cx.amqp_uri))?;
    let backend = Some(app.pid);
    let cpu0 = backend.and_then(crate::env::proc_cpu_secs);
    let load = load1();
    let t0 = Instant::now();
    let task = runtime().spawn(app_consume(app, queue.clone(), n));
    let done = wait_rows(cx, "app_effect", n, timeout_for(n), || {
        if task.is_finished() {
            Some("the app consumer stopped before app_effect had every row".to_string())
        } else {
            None
        }
    });
    let cpu = cpu_us_per_msg(backend, cpu0, n);
    let (counts, app) = runtime()
        .block_on(async { tokio::time::timeout(Duration::from_secs(60), task).await })
        .map_err(|_| "app consumer: no end 60 s after its last row".to_string())?
        .map_err(|e| format!("app consumer task: {e}"))??;
    runtime().block_on(app_close(app));
    let done = done?;
    let secs = (done - t0).as_secs_f64();
    let left = wait_queue(cx, &queue, Duration::from_secs(10), |l| l == 0)?;
    let rows = count(cx, "app_effect")?;
    if rows != n as i64 || left > 0 {
        return Err(format!(
            "app consumer: expected {n} rows in app_effect and an empty queue; got {rows} rows, {left} ready; {counts:?}"
        ));
    }
    Ok(Outcome {
        rate: n as f64 / secs,
        secs,
        load,
        extra: json!({
            "handled": counts.handled, "duplicates": counts.duplicates,
            "own_secs_to_last_ack": counts.own_secs,
            "backend_cpu_us_per_msg": cpu, "backend_cores": cpu * n as f64 / secs / 1e6,
        }),
    })
}

/// (a) The ack-only consumer: from its `basic.consume` until it acknowledged `n` messages.
fn ack_only_once(cx: &mut Ctx, n: u64, tag: &str) -> Result<Outcome, String> {
    let queue = Who::AckOnly.queue();
    fill(cx, &queue, tag, n)?;
    cx.sql("CHECKPOINT")?;
    let uri = cx.amqp_uri.clone();
    let load = load1();
    let (secs, acked) = runtime().block_on(async {
        let c = amqp_admin::connect(&uri, CONNECT_TIMEOUT).await?;
        let t0 = Instant::now();
        let mut consumer = amqp_admin::start_consumer(&c, &queue, Some(PREFETCH), false).await?;
        let mut acked = 0u64;
        while acked < n {
            match tokio::time::timeout(STALL, consumer.next()).await {
                Ok(Some(Ok(d))) => {
                    d.ack(BasicAckOptions::default())
                        .await
                        .map_err(|e| format!("ack-only consumer: basic.ack: {e}"))?;
                    acked += 1;
                }
                other => {
                    return Err(format!(
                        "ack-only consumer: {acked} of {n} acknowledged, then {other:?}"
                    ))
                }
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        let _ = c.close(200, "done".into()).await;
        Ok::<_, String>((secs, acked))
    })?;
    let left = wait_queue(cx, &queue, Duration::from_secs(10), |l| l == 0)?;
    if left > 0 {
        return Err(format!(
            "ack-only consumer: {left} messages ready after {acked} acks"
        ));
    }
    Ok(Outcome {
        rate: n as f64 / secs,
        secs,
        load,
        extra: json!({}),
    })
}

/// The queues and the application's tables (the subscription's are made in `setup`).
fn setup_baselines(cx: &mut Ctx) -> Result<(), String> {
    for who in [Who::Subscription, Who::App, Who::AckOnly] {
        let q = who.queue();
        // A leftover of an interrupted run may have other arguments: start afresh.
        let _ = cx.amqp.delete_queue(&q);
        cx.amqp.declare_queue(&q, true, FieldTable::default())?;
    }
    cx.sql(
        "DROP TABLE IF EXISTS public.app_dedup, public.app_effect;
         CREATE TABLE public.app_dedup (consumer text NOT NULL, message_id text NOT NULL,
                                        PRIMARY KEY (consumer, message_id));
         CREATE TABLE public.app_effect (message_id text, n int);",
    )
}

fn delete_queues(amqp: &AmqpAdmin) {
    let queues: Vec<String> = [Who::Subscription, Who::App, Who::AckOnly]
        .iter()
        .map(|w| w.queue())
        .collect();
    amqp.delete_all(&queues, &[], Duration::from_secs(30));
}

fn setup(env: &mut Env, with_subscription: bool) -> Result<(), String> {
    env.set_enabled(true)?;
    setup_baselines(&mut Ctx::of(env))?;
    if with_subscription {
        unsubscribe_if_any(env, SUBSCRIPTION)?;
        env.sql(
            "DROP TABLE IF EXISTS public.bench_effect;
             CREATE TABLE public.bench_effect (message_id text, n int);
             CREATE OR REPLACE FUNCTION public.bench_handler(d amqp.delivery) RETURNS void
                 LANGUAGE sql AS $$ INSERT INTO public.bench_effect VALUES (d.message_id, 1) $$;",
        )?;
    }
    Ok(())
}

fn cleanup(env: &mut Env, with_subscription: bool) {
    if with_subscription {
        let _ = unsubscribe_if_any(env, SUBSCRIPTION);
    }
    delete_queues(&env.amqp);
}

/// 7. Consume.
pub fn consume(env: &mut Env, opts: &Opts, run: &mut Run) -> Result<(), String> {
    let with_sub = subscription_available(env)?;
    if !with_sub {
        run.notes.push(
            "consume: amqp.subscribe() is not in this build of the extension: only the application \
             consumer and the ack-only consumer were measured"
                .into(),
        );
    }
    setup(env, with_sub)?;
    let r = measure(env, opts, run, with_sub);
    cleanup(env, with_sub);
    r
}

fn measure(env: &mut Env, opts: &Opts, run: &mut Run, with_sub: bool) -> Result<(), String> {
    let n = opts.consume_n;
    let batch: String = env
        .admin
        .query_one(
            "SELECT coalesce(current_setting('amqp_outbox.inbox_batch_size', true), '?')",
            &[],
        )
        .map(|r| r.get(0))
        .unwrap_or_else(|_| "?".into());
    let who: Vec<Who> = if with_sub {
        vec![Who::Subscription, Who::App, Who::AckOnly]
    } else {
        vec![Who::App, Who::AckOnly]
    };
    let load_start = crate::loadavg();
    let mut got: std::collections::BTreeMap<&str, Vec<Outcome>> = Default::default();
    for rep in 0..opts.consume_reps {
        for w in rotated(&who, rep) {
            let tag = format!("{}-{rep}", w.key());
            let o = match w {
                Who::Subscription => subscription_once(env, n, &tag)?,
                Who::App => app_once(&mut Ctx::of(env), n, &tag)?,
                Who::AckOnly => ack_only_once(&mut Ctx::of(env), n, &tag)?,
            };
            log(format!(
                "  consume {n}: {} {:.0} msg/s ({:.1}s, load {:.1}) {}",
                w.key(),
                o.rate,
                o.secs,
                o.load,
                o.extra
            ));
            got.entry(w.key()).or_default().push(o);
        }
    }
    let load_end = crate::loadavg();
    let rates = |k: &str| -> Vec<f64> {
        got.get(k)
            .map(|v| v.iter().map(|o| o.rate).collect())
            .unwrap_or_default()
    };
    let (s, b, a) = (rates("subscription"), rates("app"), rates("ack_only"));
    let sec = "7 consume";
    let cfg = format!(
        "{n} × ~100 B JSON, classic durable queue, prefetch {PREFETCH}, inbox_batch_size {batch}"
    );
    let extra_median = |k: &str, field: &str| -> f64 {
        let v: Vec<f64> = got
            .get(k)
            .map(|v| {
                v.iter()
                    .filter_map(|o| o.extra.get(field)?.as_f64())
                    .collect()
            })
            .unwrap_or_default();
        median(&v)
    };
    let cpu = format!(
        "subscription worker {:.0} µs CPU/msg, application's backend {:.0} µs CPU/msg",
        extra_median("subscription", "worker_cpu_us_per_msg"),
        extra_median("app", "backend_cpu_us_per_msg")
    );
    let load = format!("load average {load_start} at start, {load_end} at end; {cpu}");
    if with_sub {
        run.fig(
            Figure::new(
                sec,
                "subscription / application consumer (dedup row + effect, 1 txn per message)",
                &cfg,
                "msg/s",
            )
            .samples(s.clone())
            .baseline("app", b.clone())
            .target(Target::RatioAtLeast(1.5))
            .note(load.clone()),
        );
        run.fig(
            Figure::new(
                sec,
                "subscription / ack-only lapin consumer (broker floor)",
                &cfg,
                "msg/s",
            )
            .samples(s.clone())
            .baseline("ack-only", a.clone()),
        );
    }
    run.fig(
        Figure::new(
            sec,
            "application consumer / ack-only lapin consumer (reference)",
            &cfg,
            "msg/s",
        )
        .samples(b.clone())
        .baseline("ack-only", a.clone())
        .note(if with_sub { String::new() } else { load }),
    );
    let ratio = |x: &[f64], y: &[f64]| {
        Figure::new("", "", "", "")
            .samples(x.to_vec())
            .baseline("", y.to_vec())
            .ratio()
            .unwrap_or(f64::NAN)
    };
    run.summary.push(if with_sub {
        format!(
            "consume ({n} messages, {} repetitions): subscription {:.0} msg/s, application consumer {:.0} msg/s, \
             ack-only consumer {:.0} msg/s; subscription / application {:.2} (target ≥ 1.5), \
             subscription / ack-only {:.2}; {}",
            opts.consume_reps,
            median(&s),
            median(&b),
            median(&a),
            ratio(&s, &b),
            ratio(&s, &a),
            if ratio(&s, &b) >= 1.5 { "met" } else { "**not met**" }
        )
    } else {
        format!(
            "consume ({n} messages): subscription not measured (no amqp.subscribe() in this build); \
             application consumer {:.0} msg/s, ack-only consumer {:.0} msg/s",
            median(&b),
            median(&a)
        )
    });
    let j = |k: &str| {
        got.get(k)
            .map(|v| {
                v.iter()
                    .map(|o| json!({"msg_per_sec": o.rate, "secs": o.secs, "load1_at_start": o.load, "extra": o.extra}))
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
    };
    run.detail(
        "consume",
        json!({
            "n": n, "reps": opts.consume_reps, "prefetch": PREFETCH,
            "inbox_batch_size": batch, "poll_ms": POLL.as_millis() as u64,
            "loadavg_start": load_start, "loadavg_end": load_end,
            "subscription": j("subscription"), "app": j("app"), "ack_only": j("ack_only"),
        }),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `cargo test -p amqp_outbox_bench -- --ignored --nocapture baselines`: the application
    /// and ack-only consumers against the shared servers (PostgreSQL 127.0.0.1:5432 in a scratch
    /// database that is dropped afterwards, RabbitMQ 127.0.0.1:5672), no extension needed.
    #[test]
    #[ignore]
    fn baselines_against_shared_servers() {
        let n: u64 = std::env::var("BENCH_CONSUME_N")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(5_000);
        let db = "amqp_outbox_bench_consume_test";
        let server = "host=127.0.0.1 port=5432 user=postgres";
        let mut root =
            postgres::Client::connect(&format!("{server} dbname=postgres"), postgres::NoTls)
                .expect("shared PostgreSQL");
        root.batch_execute(&format!("DROP DATABASE IF EXISTS {db}"))
            .expect("drop scratch database");
        root.batch_execute(&format!("CREATE DATABASE {db}"))
            .expect("create scratch database");
        let pg_conn = format!("{server} dbname={db}");
        let amqp_uri = "amqp://guest:guest@127.0.0.1:5672/%2f?heartbeat=30".to_string();
        let amqp = AmqpAdmin::connect(&amqp_uri).expect("shared RabbitMQ");
        let mut admin = postgres::Client::connect(&pg_conn, postgres::NoTls).expect("scratch db");
        let result = {
            let mut cx = Ctx {
                admin: &mut admin,
                pg_conn,
                amqp: &amqp,
                amqp_uri,
            };
            (|| -> Result<Vec<(Who, Outcome)>, String> {
                setup_baselines(&mut cx)?;
                let mut out = Vec::new();
                for rep in 0..2 {
                    for w in rotated(&[Who::App, Who::AckOnly], rep) {
                        let tag = format!("{}-{rep}", w.key());
                        let o = match w {
                            Who::App => app_once(&mut cx, n, &tag)?,
                            _ => ack_only_once(&mut cx, n, &tag)?,
                        };
                        eprintln!(
                            "{} {n}: {:.0} msg/s ({:.2}s) {}",
                            w.key(),
                            o.rate,
                            o.secs,
                            o.extra
                        );
                        out.push((w, o));
                    }
                }
                Ok(out)
            })()
        };
        delete_queues(&amqp);
        drop(admin);
        let _ = root.batch_execute(&format!("DROP DATABASE IF EXISTS {db}"));
        let out = result.expect("baselines");
        assert_eq!(out.len(), 4);
        assert!(out.iter().all(|(_, o)| o.rate.is_finite() && o.rate > 0.0));
    }
}
