//! 8. Capacity: the highest publish rate each system sustains end to end.
//!
//! 8 clients commit one message per transaction at a paced rate. Three systems, each with its
//! own fanout exchange, classic durable queue and auto-ack lapin consumer (which subtracts the
//! client's timestamp at the start of each ~100-byte body from its receive time):
//!
//! - **outbox**: `SELECT amqp.publish(…)` with the worker on (`ack_queue` mode, the default).
//! - **relay**: what users write instead (Spring Modulith, MassTransit, Namastack…): a plain
//!   table `relay_outbox (id bigserial, exchange, routing_key, body bytea, created_at)` that the
//!   clients INSERT into, and one relay task (tokio-postgres and lapin on a thread and a
//!   one-worker tokio runtime of its own) looping `BEGIN; SELECT … ORDER BY id LIMIT 100 FOR
//!   UPDATE SKIP LOCKED;` publish each row with confirms, await them all, `DELETE … WHERE id =
//!   ANY(…); COMMIT`, and sleeping 100 ms when it found nothing (batch 100, poll 100 ms: the
//!   usual defaults).
//! - **floor**: what the machine can do at all: the same INSERTs into a plain table of the same
//!   shape, and a raw lapin publisher (its own threads likewise; confirms awaited in order by
//!   another task, never ahead of the offered rate) publishing the same messages side by side.
//!
//! A step offers rate R: 8 sessions (connected once) each commit every 8th message of a schedule
//! at R msg/s (catching up when late, never ahead), for a warm-up and then a window. The step is
//! *sustained* when over the window the clients kept ≥ 95 % of R (for the floor, the INSERTs and
//! the raw publisher each), the consumer received ≥ 95 % of R, the backlog (sent − received) grew
//! by at most 5 % of what the window offered, and the p99 commit→consumer latency of what
//! arrived in the window is ≤ 1 s. The search per system doubles from 2,000 msg/s until a step
//! fails (halves if the first fails), then bisects geometrically between the highest sustained
//! and the lowest failed rate, for a fixed number of rounds; the capacity is the highest
//! sustained rate. Each round runs the three systems one after the other in rotated order, so
//! they see the same machine. After each step the system gets a few seconds to deliver what is
//! left; what it did not is cleared (outbox: disabled and truncated; relay table truncated;
//! queue purged), and bodies carry the step number so late deliveries are not counted.
//!
//! CPU per delivered message over each window, from `/proc`: the amqp_outbox worker process, the
//! RabbitMQ node (`beam.smp`, the listener on the AMQP port), the relay's own threads (its
//! thread, its runtime's worker and its connection's `lapin-io-loop` thread) and its PostgreSQL
//! backend, and the raw publisher's own threads; reported at each system's capacity.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use amqp_outbox_testkit::amqp_admin::{self, runtime, CONNECT_TIMEOUT};
use futures_lite::StreamExt;
use lapin::options::BasicPublishOptions;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Confirmation, Connection, ExchangeKind};
use serde_json::{json, Value};

use crate::env::{self, payload, Env, PREFIX};
use crate::phases::rotated;
use crate::raw::now_us;
use crate::report::{median, Figure, Target};
use crate::{log, Opts, Run};

const CLIENTS: usize = 8;
const RELAY_BATCH: i64 = 100;
const RELAY_POLL: Duration = Duration::from_millis(100);
/// Padding after "<16-digit µs> <step> ": bodies of about 100 bytes.
const PAD: usize = 80;
/// A step is sustained when the clients and the consumer keep this share of the offered rate…
const KEEP: f64 = 0.95;
/// …the backlog grows by at most this share of the window's offered messages…
const GROWTH: f64 = 0.05;
/// …and the p99 commit→consumer latency stays below this.
const MAX_P99_MS: f64 = 1000.0;
const MIN_RATE: f64 = 100.0;
const MAX_RATE: f64 = 64_000.0;
const START_RATE: f64 = 2_000.0;

#[derive(Clone, Copy, PartialEq, Eq, Debug, PartialOrd, Ord)]
enum Sys {
    Outbox,
    Relay,
    Floor,
}

const SYSTEMS: [Sys; 3] = [Sys::Outbox, Sys::Relay, Sys::Floor];

impl Sys {
    fn key(self) -> &'static str {
        match self {
            Sys::Outbox => "outbox",
            Sys::Relay => "relay",
            Sys::Floor => "floor",
        }
    }

    fn exchange(self) -> String {
        format!("{PREFIX}.capacity.{}", self.key())
    }

    fn queue(self) -> String {
        format!("{}.q", self.exchange())
    }

    fn sql(self) -> &'static str {
        match self {
            Sys::Outbox => "SELECT amqp.publish($1, $2, '', $3::text)",
            Sys::Relay => {
                "INSERT INTO public.relay_outbox (exchange, routing_key, body) VALUES ($1, '', $2)"
            }
            Sys::Floor => {
                "INSERT INTO public.capacity_plain (exchange, routing_key, body) VALUES ($1, '', $2)"
            }
        }
    }
}

/// Sizes of the search.
#[derive(Clone, Copy, Debug)]
struct Plan {
    rounds: usize,
    reps: usize,
    warmup: Duration,
    window: Duration,
    /// How long a step may take to deliver what is left before it is cleared.
    drain: Duration,
}

impl Plan {
    fn of(opts: &Opts) -> Plan {
        Plan {
            rounds: opts.capacity_rounds,
            reps: opts.capacity_reps,
            warmup: Duration::from_secs(if opts.quick { 1 } else { 2 }),
            window: Duration::from_secs(opts.capacity_secs),
            drain: Duration::from_secs(if opts.quick { 3 } else { 10 }),
        }
    }
}

/// A doubling-then-bisecting search for the highest sustained rate.
#[derive(Clone, Copy, Debug, Default)]
struct Search {
    pass: Option<f64>,
    fail: Option<f64>,
}

impl Search {
    /// The next rate to try; None when there is nothing left to learn within the bounds.
    fn next(&self) -> Option<f64> {
        let r = match (self.pass, self.fail) {
            (None, None) => START_RATE,
            (Some(p), None) if p >= MAX_RATE => return None,
            (Some(p), None) => (p * 2.0).min(MAX_RATE),
            (None, Some(f)) if f / 2.0 < MIN_RATE => return None,
            (None, Some(f)) => f / 2.0,
            (Some(p), Some(f)) => (p * f).sqrt(),
        };
        Some(r.round())
    }

    fn record(&mut self, rate: f64, sustained: bool) {
        if sustained {
            self.pass = Some(self.pass.map_or(rate, |p| p.max(rate)));
        } else {
            self.fail = Some(self.fail.map_or(rate, |f| f.min(rate)));
        }
    }

    fn capacity(&self) -> f64 {
        self.pass.unwrap_or(0.0)
    }
}

/// What one window saw.
#[derive(Clone, Debug, Default)]
struct Window {
    rate: f64,
    secs: f64,
    /// Messages sent in the window by each sending side (clients; for the floor also the raw
    /// publisher).
    sent: Vec<u64>,
    received: u64,
    /// Backlog growth over the window (sent − received, at its end minus at its start).
    growth: i64,
    p99_ms: f64,
}

/// Ok when the window was sustained, else why not.
fn verdict(w: &Window) -> Result<(), String> {
    let offered = w.rate * w.secs;
    let mut why = Vec::new();
    for &s in &w.sent {
        if (s as f64) < KEEP * offered {
            why.push(format!("sent {:.0}/s", s as f64 / w.secs));
        }
    }
    if (w.received as f64) < KEEP * offered {
        why.push(format!("received {:.0}/s", w.received as f64 / w.secs));
    }
    if w.growth as f64 > GROWTH * offered {
        why.push(format!("backlog grew by {}", w.growth));
    }
    if w.p99_ms.is_nan() || w.p99_ms > MAX_P99_MS {
        why.push(format!("p99 {:.0} ms", w.p99_ms));
    }
    if why.is_empty() {
        Ok(())
    } else {
        Err(why.join(", "))
    }
}

/// An auto-ack consumer counting the deliveries of the current step, with their receive time
/// and latency (both in Unix µs) from the body's `<µs> <step> …`.
struct StepConsumer {
    step: Arc<AtomicU64>,
    received: Arc<AtomicU64>,
    samples: Arc<Mutex<Vec<(i64, i64)>>>,
    conn: Connection,
}

impl StepConsumer {
    fn start(uri: &str, queue: &str) -> Result<StepConsumer, String> {
        let step = Arc::new(AtomicU64::new(u64::MAX));
        let received = Arc::new(AtomicU64::new(0));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let (st, rc, sa) = (step.clone(), received.clone(), samples.clone());
        let conn = runtime().block_on(async {
            let c = amqp_admin::connect(uri, CONNECT_TIMEOUT).await?;
            let mut consumer = amqp_admin::start_consumer(&c, queue, Some(1000), true).await?;
            tokio::spawn(async move {
                while let Some(Ok(d)) = consumer.next().await {
                    let t = now_us();
                    let mut it = d.data.splitn(3, |b| *b == b' ');
                    let num = |f: Option<&[u8]>| -> Option<i64> {
                        std::str::from_utf8(f?).ok()?.parse().ok()
                    };
                    let (sent, step) = (num(it.next()), num(it.next()));
                    if let (Some(sent), Some(step)) = (sent, step) {
                        if step as u64 == st.load(Ordering::Relaxed) {
                            sa.lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .push((t, t - sent));
                            rc.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            });
            Ok::<_, String>(c)
        })?;
        Ok(StepConsumer {
            step,
            received,
            samples,
            conn,
        })
    }

    fn begin(&self, step: u64) {
        self.samples
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        self.received.store(0, Ordering::Relaxed);
        self.step.store(step, Ordering::Relaxed);
    }

    fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    fn close(self) {
        let _ = runtime().block_on(self.conn.close(200, "done".into()));
    }

    /// Latencies in ms of the deliveries received between `from` and `to` (Unix µs), sorted.
    fn latencies_ms(&self, from: i64, to: i64) -> Vec<f64> {
        let mut v: Vec<f64> = self
            .samples
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(t, _)| *t >= from && *t <= to)
            .map(|(_, l)| *l as f64 / 1000.0)
            .collect();
        v.sort_by(|a, b| a.total_cmp(b));
        v
    }
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn check(c: lapin::Result<Confirmation>) -> Result<(), String> {
    match c {
        Ok(Confirmation::Ack(None)) => Ok(()),
        Ok(other) => Err(format!("not confirmed cleanly: {other:?}")),
        Err(e) => Err(format!("confirm: {e}")),
    }
}

fn publish_opts() -> BasicPublishOptions {
    BasicPublishOptions {
        mandatory: true,
        ..Default::default()
    }
}

fn props() -> BasicProperties {
    BasicProperties::default().with_delivery_mode(2)
}

/// A task on its own thread with a tokio runtime of its own, so its CPU time can be read from
/// `/proc/self/task`: that thread, the runtime's worker, and the `lapin-io-loop` thread of its
/// AMQP connection.
struct OwnThread {
    tids: Vec<i32>,
    handle: Option<JoinHandle<Result<(), String>>>,
}

impl OwnThread {
    /// Starts `setup` then `body` on a new thread named `name`; returns once `setup` is done,
    /// with what it sent back.
    fn start<S, B, T, FS, FB>(name: &str, setup: S, body: B) -> Result<(OwnThread, i32), String>
    where
        S: FnOnce() -> FS + Send + 'static,
        FS: std::future::Future<Output = Result<(T, i32), String>>,
        B: FnOnce(T) -> FB + Send + 'static,
        FB: std::future::Future<Output = Result<(), String>>,
    {
        let io_before = env::threads_named("lapin-io-loop");
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(i32, i32), String>>();
        let label = name.to_string();
        // Thread names show in /proc/self/task/*/comm, cut to 15 bytes.
        let rt_name = format!("{name}-rt");
        let rt_name2 = rt_name.clone();
        let handle = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                // One worker of its own (it drives the sockets while this thread runs the
                // task), so nothing else in the bench shares these threads.
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .thread_name(rt_name2)
                    .enable_all()
                    .build()
                    .map_err(|e| format!("{label}: tokio runtime: {e}"));
                let rt = match rt {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.clone()));
                        return Err(e);
                    }
                };
                rt.block_on(async move {
                    match setup().await {
                        Ok((state, extra)) => {
                            let _ = ready_tx.send(Ok((env::gettid(), extra)));
                            body(state).await
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e.clone()));
                            Err(e)
                        }
                    }
                })
            })
            .map_err(|e| format!("{name}: cannot start its thread: {e}"))?;
        let (tid, extra) = ready_rx
            .recv_timeout(Duration::from_secs(60))
            .map_err(|_| format!("{name}: no answer from its thread"))??;
        let mut tids = vec![tid];
        tids.extend(env::threads_named(&rt_name));
        tids.extend(
            env::threads_named("lapin-io-loop")
                .into_iter()
                .filter(|t| !io_before.contains(t)),
        );
        Ok((
            OwnThread {
                tids,
                handle: Some(handle),
            },
            extra,
        ))
    }

    /// CPU seconds of each of its threads so far (None: gone, e.g. an idle blocking thread).
    fn cpu_secs(&self) -> Vec<Option<f64>> {
        self.tids.iter().map(|t| env::thread_cpu_secs(*t)).collect()
    }

    fn finished(&self) -> bool {
        self.handle.as_ref().is_none_or(|h| h.is_finished())
    }

    /// Waits (bounded) for the thread to end; its error, if it failed.
    fn join(&mut self, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        while !self.finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        match self.handle.take() {
            Some(h) if h.is_finished() => h.join().map_err(|_| "thread panicked".to_string())?,
            Some(h) => {
                // Leave it running detached rather than hang the run.
                drop(h);
                Err("did not stop in time".into())
            }
            None => Ok(()),
        }
    }
}

/// The application-side relay.
struct Relay {
    thread: OwnThread,
    stop: Arc<AtomicBool>,
    backend_pid: i32,
}

impl Relay {
    fn start(pg_conn: &str, uri: &str) -> Result<Relay, String> {
        let stop = Arc::new(AtomicBool::new(false));
        let (pg_conn, uri, stop2) = (pg_conn.to_string(), uri.to_string(), stop.clone());
        let setup = move || async move {
            let (pg, conn) = tokio_postgres::connect(&pg_conn, tokio_postgres::NoTls)
                .await
                .map_err(|e| format!("relay: connecting to PostgreSQL: {e}"))?;
            tokio::spawn(async move {
                let _ = conn.await;
            });
            let pid: i32 = pg
                .query_one("SELECT pg_backend_pid()", &[])
                .await
                .map_err(|e| format!("relay: pg_backend_pid: {e}"))?
                .get(0);
            let amqp = amqp_admin::connect(&uri, CONNECT_TIMEOUT).await?;
            let ch = amqp_admin::confirm_channel(&amqp).await?;
            Ok(((pg, amqp, ch), pid))
        };
        let body = move |(pg, amqp, ch): (tokio_postgres::Client, Connection, Channel)| async move {
            let r = relay_loop(pg, &ch, &stop2).await;
            let _ = amqp.close(200, "done".into()).await;
            r
        };
        let (thread, backend_pid) = OwnThread::start("bench-relay", setup, body)?;
        Ok(Relay {
            thread,
            stop,
            backend_pid,
        })
    }

    fn stop(mut self) -> Result<(), String> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join(Duration::from_secs(30))
            .map_err(|e| format!("relay: {e}"))
    }
}

/// The loop users write: claim a batch with `FOR UPDATE SKIP LOCKED`, publish it with confirms,
/// delete it, commit; sleep for the poll interval when there was nothing.
async fn relay_loop(
    mut pg: tokio_postgres::Client,
    ch: &Channel,
    stop: &AtomicBool,
) -> Result<(), String> {
    let select = pg
        .prepare(
            "SELECT id, exchange, routing_key, body FROM public.relay_outbox \
             ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED",
        )
        .await
        .map_err(|e| format!("relay: prepare: {e}"))?;
    let delete = pg
        .prepare("DELETE FROM public.relay_outbox WHERE id = ANY($1)")
        .await
        .map_err(|e| format!("relay: prepare: {e}"))?;
    while !stop.load(Ordering::Relaxed) {
        let tx = pg
            .transaction()
            .await
            .map_err(|e| format!("relay: BEGIN: {e}"))?;
        let rows = tx
            .query(&select, &[&RELAY_BATCH])
            .await
            .map_err(|e| format!("relay: SELECT: {e}"))?;
        if rows.is_empty() {
            tx.commit()
                .await
                .map_err(|e| format!("relay: COMMIT: {e}"))?;
            tokio::time::sleep(RELAY_POLL).await;
            continue;
        }
        let mut ids = Vec::with_capacity(rows.len());
        let mut confirms = Vec::with_capacity(rows.len());
        for r in &rows {
            ids.push(r.get::<_, i64>(0));
            let exchange: &str = r.get(1);
            let routing_key: &str = r.get(2);
            let body: &[u8] = r.get(3);
            let c = ch
                .basic_publish(
                    exchange.into(),
                    routing_key.into(),
                    publish_opts(),
                    body,
                    props(),
                )
                .await
                .map_err(|e| format!("relay: basic.publish: {e}"))?;
            confirms.push(c);
        }
        for c in confirms {
            check(c.await).map_err(|e| format!("relay: {e}"))?;
        }
        tx.execute(&delete, &[&ids])
            .await
            .map_err(|e| format!("relay: DELETE: {e}"))?;
        tx.commit()
            .await
            .map_err(|e| format!("relay: COMMIT: {e}"))?;
    }
    Ok(())
}

/// One paced run asked of the raw publisher.
struct PaceCmd {
    rate: f64,
    t0: Instant,
    end: Instant,
    step: u64,
    published: Arc<AtomicU64>,
    done: mpsc::Sender<Result<(), String>>,
}

/// The floor's raw lapin publisher, on its own thread.
struct RawPublisher {
    thread: OwnThread,
    cmds: Option<tokio::sync::mpsc::UnboundedSender<PaceCmd>>,
}

impl RawPublisher {
    fn start(uri: &str, exchange: &str) -> Result<RawPublisher, String> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<PaceCmd>();
        let (uri, exchange) = (uri.to_string(), exchange.to_string());
        let setup = move || async move {
            let amqp = amqp_admin::connect(&uri, CONNECT_TIMEOUT).await?;
            let ch = amqp_admin::confirm_channel(&amqp).await?;
            Ok(((amqp, ch), 0))
        };
        let body = move |(amqp, ch): (Connection, Channel)| async move {
            let mut rx = rx;
            let pad = payload(PAD);
            while let Some(cmd) = rx.recv().await {
                let r = paced(&ch, &exchange, &pad, &cmd).await;
                let _ = cmd.done.send(r);
            }
            let _ = amqp.close(200, "done".into()).await;
            Ok(())
        };
        let (thread, _) = OwnThread::start("bench-rawpub", setup, body)?;
        Ok(RawPublisher {
            thread,
            cmds: Some(tx),
        })
    }

    fn run(
        &self,
        rate: f64,
        t0: Instant,
        end: Instant,
        step: u64,
        published: Arc<AtomicU64>,
    ) -> Result<mpsc::Receiver<Result<(), String>>, String> {
        let (done, rx) = mpsc::channel();
        self.cmds
            .as_ref()
            .ok_or("raw publisher stopped")?
            .send(PaceCmd {
                rate,
                t0,
                end,
                step,
                published,
                done,
            })
            .map_err(|_| "raw publisher: its thread has ended".to_string())?;
        Ok(rx)
    }

    fn stop(mut self) -> Result<(), String> {
        self.cmds = None;
        self.thread
            .join(Duration::from_secs(30))
            .map_err(|e| format!("raw publisher: {e}"))
    }
}

/// Publishes on the schedule of `cmd` (never ahead of it); confirms are awaited in order by
/// another task, so the rate is not capped by the round trip.
async fn paced(ch: &Channel, exchange: &str, pad: &str, cmd: &PaceCmd) -> Result<(), String> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<lapin::PublisherConfirm>();
    let collector = tokio::spawn(async move {
        let mut err = None;
        while let Some(c) = rx.recv().await {
            if let Err(e) = check(c.await) {
                err.get_or_insert(e);
            }
        }
        err
    });
    let mut i = 0u64;
    loop {
        let due = cmd.t0 + Duration::from_secs_f64(i as f64 / cmd.rate);
        if due >= cmd.end || Instant::now() >= cmd.end {
            break;
        }
        if due > Instant::now() {
            tokio::time::sleep_until(tokio::time::Instant::from_std(due)).await;
        }
        let body = format!("{} {} {pad}", now_us(), cmd.step);
        let c = ch
            .basic_publish(
                exchange.into(),
                "".into(),
                publish_opts(),
                body.as_bytes(),
                props(),
            )
            .await
            .map_err(|e| format!("raw publisher: basic.publish: {e}"))?;
        cmd.published.fetch_add(1, Ordering::Relaxed);
        let _ = tx.send(c);
        i += 1;
    }
    drop(tx);
    match collector.await {
        Ok(None) => Ok(()),
        Ok(Some(e)) => Err(format!("raw publisher: {e}")),
        Err(e) => Err(format!("raw publisher: confirm collector: {e}")),
    }
}

type ClientThread = JoinHandle<(postgres::Client, Result<(), String>)>;

/// Starts the 8 paced sessions of one step: session k commits messages k, k + 8, … of a
/// schedule at `rate`, one per transaction, until `end`.
#[allow(clippy::too_many_arguments)]
fn spawn_clients(
    clients: Vec<postgres::Client>,
    sys: Sys,
    broker_id: i32,
    rate: f64,
    t0: Instant,
    end: Instant,
    step: u64,
    committed: &Arc<AtomicU64>,
) -> Vec<ClientThread> {
    let n = clients.len() as u64;
    clients
        .into_iter()
        .enumerate()
        .map(|(k, mut client)| {
            let committed = committed.clone();
            let exchange = sys.exchange();
            std::thread::spawn(move || {
                let pad = payload(PAD);
                let r = (|| -> Result<(), String> {
                    let stmt = client
                        .prepare(sys.sql())
                        .map_err(|e| format!("{}: prepare: {e}", sys.key()))?;
                    let mut i = 0u64;
                    loop {
                        let slot = i * n + k as u64;
                        let due = t0 + Duration::from_secs_f64(slot as f64 / rate);
                        let now = Instant::now();
                        if due >= end || now >= end {
                            return Ok(());
                        }
                        if due > now {
                            std::thread::sleep(due - now);
                        }
                        let body = format!("{} {step} {pad}", now_us());
                        let done = match sys {
                            Sys::Outbox => client.execute(&stmt, &[&broker_id, &exchange, &body]),
                            Sys::Relay | Sys::Floor => {
                                client.execute(&stmt, &[&exchange, &body.as_bytes()])
                            }
                        };
                        done.map_err(|e| format!("{} client: {e}", sys.key()))?;
                        committed.fetch_add(1, Ordering::Relaxed);
                        i += 1;
                    }
                })();
                (client, r)
            })
        })
        .collect()
}

fn join_clients(
    handles: Vec<ClientThread>,
    into: &mut Vec<postgres::Client>,
) -> Result<(), String> {
    let mut err = None;
    for h in handles {
        match h.join() {
            Ok((c, r)) => {
                into.push(c);
                if let Err(e) = r {
                    err.get_or_insert(e);
                }
            }
            Err(_) => {
                err.get_or_insert("a client thread panicked".to_string());
            }
        }
    }
    err.map_or(Ok(()), Err)
}

/// CPU seconds so far of each process or thread group measured (NaN when unknown).
#[derive(Clone, Copy, Debug)]
struct Cpu {
    worker: f64,
    broker: f64,
    relay: f64,
    relay_backend: f64,
    raw: f64,
}

impl Cpu {
    fn minus(&self, o: &Cpu) -> Cpu {
        Cpu {
            worker: self.worker - o.worker,
            broker: self.broker - o.broker,
            relay: self.relay - o.relay,
            relay_backend: self.relay_backend - o.relay_backend,
            raw: self.raw - o.raw,
        }
    }
}

/// Counters and CPU at one instant.
#[derive(Clone, Debug)]
struct Snap {
    unix_us: i64,
    relay_threads: Vec<Option<f64>>,
    raw_threads: Vec<Option<f64>>,
    committed: u64,
    published: u64,
    received: u64,
    cpu: Cpu,
}

/// Everything the phase keeps between steps.
struct Ctx {
    clients: Vec<postgres::Client>,
    consumers: BTreeMap<Sys, StepConsumer>,
    relay: Option<Relay>,
    raw: Option<RawPublisher>,
    broker_pid: Option<i32>,
    plan: Plan,
    step: u64,
}

impl Ctx {
    fn snap(&self, worker: Option<i32>, committed: u64, published: u64, sys: Sys) -> Snap {
        let cpu = |p: Option<i32>| p.and_then(env::proc_cpu_secs).unwrap_or(f64::NAN);
        Snap {
            unix_us: now_us(),
            relay_threads: self
                .relay
                .as_ref()
                .map_or_else(Vec::new, |r| r.thread.cpu_secs()),
            raw_threads: self
                .raw
                .as_ref()
                .map_or_else(Vec::new, |r| r.thread.cpu_secs()),
            committed,
            published,
            received: self.consumers.get(&sys).map_or(0, |c| c.received()),
            cpu: Cpu {
                worker: cpu(worker),
                broker: cpu(self.broker_pid),
                // Per thread: see `threads_delta`.
                relay: f64::NAN,
                relay_backend: cpu(self.relay.as_ref().map(|r| r.backend_pid)),
                raw: f64::NAN,
            },
        }
    }
}

/// The outcome of one step.
#[derive(Clone, Debug)]
struct Step {
    sys: Sys,
    rate: f64,
    sustained: bool,
    why: String,
    window: Window,
    p50_ms: f64,
    max_ms: f64,
    /// CPU µs per message received in the window.
    cpu_us: Cpu,
    /// The outbox worker's steps (settle-and-claim transactions) per message received in the
    /// window; NaN for the other systems.
    steps_per_msg: f64,
    /// Rows left in the system's table right after the window (outbox, relay).
    rows_after: i64,
    drained: bool,
}

impl Step {
    fn to_json(&self) -> Value {
        let f = |x: f64| if x.is_finite() { json!(x) } else { Value::Null };
        json!({
            "system": self.sys.key(), "offered_per_sec": self.rate, "sustained": self.sustained,
            "why_not": self.why, "window_secs": self.window.secs,
            "sent_per_sec": self.window.sent.iter().map(|s| *s as f64 / self.window.secs).collect::<Vec<_>>(),
            "received_per_sec": self.window.received as f64 / self.window.secs,
            "backlog_growth": self.window.growth,
            "latency_ms": {"p50": f(self.p50_ms), "p99": f(self.window.p99_ms), "max": f(self.max_ms)},
            "cpu_us_per_msg": {
                "worker": f(self.cpu_us.worker), "rabbitmq": f(self.cpu_us.broker),
                "relay_threads": f(self.cpu_us.relay), "relay_backend": f(self.cpu_us.relay_backend),
                "raw_publisher_threads": f(self.cpu_us.raw),
            },
            "worker_steps_per_msg": f(self.steps_per_msg),
            "table_rows_after_window": self.rows_after, "drained": self.drained,
        })
    }
}

fn count(env: &mut Env, table: &str) -> i64 {
    env.admin
        .query_one(&format!("SELECT count(*) FROM {table}"), &[])
        .map(|r| r.get(0))
        .unwrap_or(-1)
}

/// CPU seconds used between two readings of the same threads, counting those readable at both
/// (NaN when none was).
fn threads_delta(a: &[Option<f64>], b: &[Option<f64>]) -> f64 {
    let d: Vec<f64> = a
        .iter()
        .zip(b)
        .filter_map(|(x, y)| Some((*y)? - (*x)?))
        .collect();
    if d.is_empty() {
        f64::NAN
    } else {
        d.iter().sum()
    }
}

/// The outbox worker's step counter (`amqp.worker_status`).
fn worker_steps(env: &mut Env) -> Option<i64> {
    env.admin
        .query_one(
            "SELECT steps FROM amqp.worker_status WHERE database = current_database()",
            &[],
        )
        .ok()
        .map(|r| r.get(0))
}

pub(crate) fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}

/// One step: `sys` offered `rate` for the warm-up and the window.
fn step(env: &mut Env, cx: &mut Ctx, sys: Sys, rate: f64) -> Result<Step, String> {
    cx.step += 1;
    let id = cx.step;
    let plan = cx.plan;
    if sys == Sys::Relay && cx.relay.as_ref().is_none_or(|r| r.thread.finished()) {
        let why = cx.relay.take().map_or(Ok(()), Relay::stop);
        return Err(format!("the relay has stopped: {why:?}"));
    }
    let worker = if sys == Sys::Outbox {
        env.worker_pid()?
    } else {
        None
    };
    cx.consumers.get(&sys).ok_or("no consumer")?.begin(id);
    let committed = Arc::new(AtomicU64::new(0));
    let published = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now() + Duration::from_millis(200);
    let end = t0 + plan.warmup + plan.window;
    let raw_done = match (sys, cx.raw.as_ref()) {
        (Sys::Floor, Some(raw)) => Some(raw.run(rate, t0, end, id, published.clone())?),
        (Sys::Floor, None) => return Err("no raw publisher".into()),
        _ => None,
    };
    let handles = spawn_clients(
        std::mem::take(&mut cx.clients),
        sys,
        env.broker_id,
        rate,
        t0,
        end,
        id,
        &committed,
    );
    let take = |cx: &Ctx| {
        cx.snap(
            worker,
            committed.load(Ordering::Relaxed),
            published.load(Ordering::Relaxed),
            sys,
        )
    };
    sleep_until(t0 + plan.warmup);
    let s0 = take(cx);
    let steps0 = (sys == Sys::Outbox).then(|| worker_steps(env)).flatten();
    sleep_until(end);
    let s1 = take(cx);
    let steps1 = (sys == Sys::Outbox).then(|| worker_steps(env)).flatten();
    let joined = join_clients(handles, &mut cx.clients);
    let raw_r = raw_done.map(|rx| {
        rx.recv_timeout(Duration::from_secs(60))
            .map_err(|_| "raw publisher: no end of its run".to_string())
            .and_then(|r| r)
    });
    joined?;
    if let Some(r) = raw_r {
        r?;
    }
    let rows_after = match sys {
        Sys::Outbox => count(env, "amqp.message"),
        Sys::Relay => count(env, "public.relay_outbox"),
        Sys::Floor => 0,
    };
    // What was sent in total, to be delivered before the next step.
    let total = if sys == Sys::Floor {
        published.load(Ordering::Relaxed)
    } else {
        committed.load(Ordering::Relaxed)
    };
    let consumer = cx.consumers.get(&sys).ok_or("no consumer")?;
    let deadline = Instant::now() + plan.drain;
    while consumer.received() < total && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let drained = consumer.received() >= total;
    let lat = consumer.latencies_ms(s0.unix_us, s1.unix_us);
    let secs = (s1.unix_us - s0.unix_us) as f64 / 1e6;
    let backlog = |s: &Snap| {
        let sent = if sys == Sys::Floor {
            s.published
        } else {
            s.committed
        };
        sent as i64 - s.received as i64
    };
    let mut sent = vec![s1.committed - s0.committed];
    if sys == Sys::Floor {
        sent.push(s1.published - s0.published);
    }
    let window = Window {
        rate,
        secs,
        sent,
        received: s1.received - s0.received,
        growth: backlog(&s1) - backlog(&s0),
        p99_ms: pct(&lat, 99.0),
    };
    let v = verdict(&window);
    let mut d = s1.cpu.minus(&s0.cpu);
    d.relay = threads_delta(&s0.relay_threads, &s1.relay_threads);
    d.raw = threads_delta(&s0.raw_threads, &s1.raw_threads);
    let received = window.received.max(1) as f64;
    let per = |x: f64| x * 1e6 / received;
    let out = Step {
        sys,
        rate,
        sustained: v.is_ok(),
        why: v.err().unwrap_or_default(),
        p50_ms: pct(&lat, 50.0),
        max_ms: lat.last().copied().unwrap_or(f64::NAN),
        window,
        cpu_us: Cpu {
            worker: per(d.worker),
            broker: per(d.broker),
            relay: per(d.relay),
            relay_backend: per(d.relay_backend),
            raw: per(d.raw),
        },
        steps_per_msg: match (steps0, steps1) {
            (Some(a), Some(b)) => (b - a) as f64 / received,
            _ => f64::NAN,
        },
        rows_after,
        drained,
    };
    // Start the next step from empty tables and queues.
    match sys {
        Sys::Outbox if !drained => {
            env.clear_outbox()?;
            env.set_enabled(true)?;
        }
        Sys::Relay if !drained => env.sql("TRUNCATE public.relay_outbox")?,
        Sys::Floor => env.sql("TRUNCATE public.capacity_plain")?,
        _ => {}
    }
    env.purge(&sys.queue())?;
    Ok(out)
}

/// After a step failed with an error: empty tables and queue, all 8 sessions there again.
fn recover(env: &mut Env, cx: &mut Ctx, sys: Sys) -> Result<(), String> {
    match sys {
        Sys::Outbox => {
            env.clear_outbox()?;
            env.set_enabled(true)?;
        }
        Sys::Relay => env.sql("TRUNCATE public.relay_outbox")?,
        Sys::Floor => env.sql("TRUNCATE public.capacity_plain")?,
    }
    env.purge(&sys.queue())?;
    while cx.clients.len() < CLIENTS {
        cx.clients.push(env.cluster.try_client()?);
    }
    Ok(())
}

fn setup(env: &mut Env, plan: Plan) -> Result<Ctx, String> {
    env.set_enabled(true)?;
    env.set_proof("ack_queue")?;
    env.clear_outbox()?;
    env.set_enabled(true)?;
    env.sql(
        "DROP TABLE IF EXISTS public.relay_outbox, public.capacity_plain;
         CREATE TABLE public.relay_outbox (
             id bigserial PRIMARY KEY,
             exchange text NOT NULL,
             routing_key text NOT NULL,
             body bytea NOT NULL,
             created_at timestamptz NOT NULL DEFAULT now());
         CREATE TABLE public.capacity_plain (
             id bigserial PRIMARY KEY,
             exchange text NOT NULL,
             routing_key text NOT NULL,
             body bytea NOT NULL,
             created_at timestamptz NOT NULL DEFAULT now());",
    )?;
    let uri = env.amqp_uri();
    let mut consumers = BTreeMap::new();
    for sys in SYSTEMS {
        // A leftover of an interrupted run may have other arguments: start afresh.
        let _ = env.amqp.delete_queue(&sys.queue());
        env.amqp
            .declare_exchange(&sys.exchange(), ExchangeKind::Fanout, true)?;
        env.amqp
            .declare_queue(&sys.queue(), true, FieldTable::default())?;
        env.amqp
            .bind_queue(&sys.queue(), &sys.exchange(), "", FieldTable::default())?;
        consumers.insert(sys, StepConsumer::start(&uri, &sys.queue())?);
    }
    let clients = (0..CLIENTS)
        .map(|_| env.cluster.try_client())
        .collect::<Result<Vec<_>, _>>()?;
    let pg_conn = env.cluster.connection_string(env::DATABASE);
    let relay = Relay::start(&pg_conn, &uri)?;
    let raw = RawPublisher::start(&uri, &Sys::Floor.exchange())?;
    Ok(Ctx {
        clients,
        consumers,
        relay: Some(relay),
        raw: Some(raw),
        broker_pid: env::broker_pid(env.amqp_port),
        plan,
        step: 0,
    })
}

fn cleanup(env: &mut Env, cx: &mut Ctx) -> Result<(), String> {
    let relay = cx.relay.take().map_or(Ok(()), Relay::stop);
    let raw = cx.raw.take().map_or(Ok(()), RawPublisher::stop);
    for (_, c) in std::mem::take(&mut cx.consumers) {
        c.close();
    }
    cx.clients.clear();
    drop_objects(env);
    relay.and(raw)
}

/// The phase's queues, exchanges and tables.
fn drop_objects(env: &mut Env) {
    let queues: Vec<String> = SYSTEMS.iter().map(|s| s.queue()).collect();
    let exchanges: Vec<String> = SYSTEMS.iter().map(|s| s.exchange()).collect();
    env.amqp
        .delete_all(&queues, &exchanges, Duration::from_secs(30));
    let _ = env.sql("DROP TABLE IF EXISTS public.relay_outbox, public.capacity_plain");
}

fn reps_text(n: usize) -> String {
    if n == 1 {
        "1 repetition".into()
    } else {
        format!("{n} repetitions")
    }
}

/// 8. Capacity.
pub fn capacity(env: &mut Env, opts: &Opts, run: &mut Run) -> Result<(), String> {
    let plan = Plan::of(opts);
    let mut cx = match setup(env, plan) {
        Ok(cx) => cx,
        Err(e) => {
            drop_objects(env);
            return Err(e);
        }
    };
    let r = measure(env, &mut cx, run);
    let c = cleanup(env, &mut cx);
    r.and(c)
}

fn measure(env: &mut Env, cx: &mut Ctx, run: &mut Run) -> Result<(), String> {
    let plan = cx.plan;
    let load_start = crate::loadavg();
    // Per repetition: each system's capacity and the step that found it.
    let mut caps: BTreeMap<Sys, Vec<f64>> = BTreeMap::new();
    let mut at_cap: BTreeMap<Sys, Vec<Option<Step>>> = BTreeMap::new();
    // The first step of each search, at the same rate for the three: CPU at equal load.
    let mut at_start: BTreeMap<Sys, Vec<Step>> = BTreeMap::new();
    let mut steps = Vec::new();
    // Systems whose step failed with an error: their search stops there.
    let mut broken: BTreeMap<Sys, String> = BTreeMap::new();
    for rep in 0..plan.reps {
        let mut search: BTreeMap<Sys, Search> =
            SYSTEMS.iter().map(|s| (*s, Search::default())).collect();
        let mut best: BTreeMap<Sys, Step> = BTreeMap::new();
        for round in 0..plan.rounds {
            for sys in rotated(&SYSTEMS, round + rep) {
                let Some(rate) = search.get(&sys).and_then(Search::next) else {
                    continue;
                };
                if broken.contains_key(&sys) {
                    continue;
                }
                let s = match step(env, cx, sys, rate) {
                    Ok(s) => s,
                    Err(e) => {
                        let e = format!("{} at {rate:.0}/s: {e}", sys.key());
                        run.error("capacity", e.clone());
                        recover(env, cx, sys)?;
                        broken.insert(sys, e);
                        continue;
                    }
                };
                log(format!(
                    "  capacity rep {rep} round {round}: {} at {rate:.0}/s: {}; received {:.0}/s, backlog {:+}, p50 {:.1} ms, p99 {:.1} ms; \
                     CPU µs/msg: worker {:.1}, RabbitMQ {:.1}, relay {:.1} + backend {:.1}, raw {:.1}; worker steps/msg {:.2}{}",
                    sys.key(),
                    if s.sustained { "sustained".to_string() } else { format!("NOT sustained ({})", s.why) },
                    s.window.received as f64 / s.window.secs,
                    s.window.growth,
                    s.p50_ms,
                    s.window.p99_ms,
                    s.cpu_us.worker,
                    s.cpu_us.broker,
                    s.cpu_us.relay,
                    s.cpu_us.relay_backend,
                    s.cpu_us.raw,
                    s.steps_per_msg,
                    if s.drained { "" } else { "; not drained: cleared" }
                ));
                if let Some(se) = search.get_mut(&sys) {
                    se.record(rate, s.sustained);
                }
                if s.sustained && best.get(&sys).is_none_or(|b| b.rate < rate) {
                    best.insert(sys, s.clone());
                }
                if rate == START_RATE {
                    at_start.entry(sys).or_default().push(s.clone());
                }
                steps.push(json!({"rep": rep, "round": round, "step": s.to_json()}));
            }
        }
        for sys in SYSTEMS {
            let c = search.get(&sys).map_or(0.0, Search::capacity);
            caps.entry(sys).or_default().push(c);
            at_cap.entry(sys).or_default().push(best.remove(&sys));
        }
    }
    let load_end = crate::loadavg();
    for (sys, e) in &broken {
        run.notes.push(format!(
            "capacity: the {} search stopped at an error ({e}); its capacity is the highest rate sustained before it",
            sys.key()
        ));
    }
    let get = |s: Sys| caps.get(&s).cloned().unwrap_or_default();
    let (o, r, f) = (get(Sys::Outbox), get(Sys::Relay), get(Sys::Floor));
    // Median over repetitions of a CPU figure at a system's capacity.
    let cpu_at = |s: Sys, pick: fn(&Cpu) -> f64| -> Vec<f64> {
        at_cap
            .get(&s)
            .map(|v| v.iter().flatten().map(|st| pick(&st.cpu_us)).collect())
            .unwrap_or_default()
    };
    let cpu_start = |s: Sys, pick: fn(&Cpu) -> f64| -> Vec<f64> {
        at_start
            .get(&s)
            .map(|v| v.iter().map(|st| pick(&st.cpu_us)).collect())
            .unwrap_or_default()
    };
    type Pick = fn(&Cpu) -> f64;
    let cpu_rows: [(&str, Sys, Pick); 7] = [
        ("worker (outbox)", Sys::Outbox, |c| c.worker),
        ("RabbitMQ (outbox)", Sys::Outbox, |c| c.broker),
        (
            "relay's threads: tokio + lapin I/O (relay)",
            Sys::Relay,
            |c| c.relay,
        ),
        ("relay's PostgreSQL backend (relay)", Sys::Relay, |c| {
            c.relay_backend
        }),
        ("RabbitMQ (relay)", Sys::Relay, |c| c.broker),
        (
            "raw publisher's threads: tokio + lapin I/O (floor)",
            Sys::Floor,
            |c| c.raw,
        ),
        ("RabbitMQ (floor)", Sys::Floor, |c| c.broker),
    ];
    let at = |i: usize| median(&cpu_at(cpu_rows[i].1, cpu_rows[i].2));
    let at2k = |i: usize| median(&cpu_start(cpu_rows[i].1, cpu_rows[i].2));
    let sec = "8 capacity";
    let cfg = format!(
        "{CLIENTS} clients, 1 msg/txn, ~100 B; sustained over {} s windows; {} rounds × {}",
        plan.window.as_secs(),
        plan.rounds,
        reps_text(plan.reps)
    );
    let relay_label = format!(
        "relay (FOR UPDATE SKIP LOCKED, batch {RELAY_BATCH}, poll {} ms)",
        RELAY_POLL.as_millis()
    );
    let ratio = |x: &[f64], y: &[f64]| {
        Figure::new("", "", "", "")
            .samples(x.to_vec())
            .baseline("", y.to_vec())
            .ratio()
            .unwrap_or(f64::NAN)
    };
    let load = format!("load average {load_start} at start, {load_end} at end");
    run.fig(
        Figure::new(
            sec,
            &format!("sustained rate, outbox / application {relay_label}"),
            &cfg,
            "msg/s",
        )
        .samples(o.clone())
        .baseline("relay", r.clone())
        .target(Target::RatioAtLeast(2.0))
        .note(load),
    );
    run.fig(
        Figure::new(
            sec,
            "sustained rate, outbox / floor (plain INSERTs + raw lapin publisher side by side)",
            &cfg,
            "msg/s",
        )
        .samples(o.clone())
        .baseline("floor", f.clone())
        .target(Target::RatioAtLeast(0.8)),
    );
    run.fig(
        Figure::new(
            sec,
            "sustained rate, relay / floor (reference)",
            &cfg,
            "msg/s",
        )
        .samples(r.clone())
        .baseline("floor", f.clone()),
    );
    for (name, sys, pick) in cpu_rows {
        run.fig(
            Figure::new(
                sec,
                &format!("CPU per delivered message, {name}, at its capacity"),
                &cfg,
                "µs/msg",
            )
            .samples(cpu_at(sys, pick)),
        );
    }
    let start_cfg = format!(
        "{CLIENTS} clients, 1 msg/txn, ~100 B, {:.0} msg/s offered",
        START_RATE
    );
    for (name, sys, pick) in cpu_rows {
        run.fig(
            Figure::new(
                sec,
                &format!("CPU per delivered message, {name}"),
                &start_cfg,
                "µs/msg",
            )
            .samples(cpu_start(sys, pick)),
        );
    }
    let (ro_r, ro_f) = (ratio(&o, &r), ratio(&o, &f));
    let met = |x: f64, t: f64| if x >= t { "met" } else { "**not met**" };
    run.summary.push(format!(
        "capacity ({CLIENTS} clients, 1 msg/txn, {} s windows, {}): outbox {:.0} msg/s, relay {:.0} msg/s, \
         floor {:.0} msg/s; outbox / relay {:.2} (target ≥ 2, {}), outbox / floor {:.2} (target ≥ 0.8, {}); \
         CPU µs per delivered message at each one's capacity: worker {:.1}, relay {:.1} + its backend {:.1}, \
         raw publisher {:.1}, RabbitMQ {:.1} / {:.1} / {:.1} (outbox / relay / floor); at {:.0} msg/s: \
         worker {:.1}, relay {:.1} + {:.1}, raw publisher {:.1}, RabbitMQ {:.1} / {:.1} / {:.1}",
        plan.window.as_secs(),
        reps_text(plan.reps),
        median(&o),
        median(&r),
        median(&f),
        ro_r,
        met(ro_r, 2.0),
        ro_f,
        met(ro_f, 0.8),
        at(0),
        at(2),
        at(3),
        at(5),
        at(1),
        at(4),
        at(6),
        START_RATE,
        at2k(0),
        at2k(2),
        at2k(3),
        at2k(5),
        at2k(1),
        at2k(4),
        at2k(6),
    ));
    run.detail(
        "capacity",
        json!({
            "clients": CLIENTS, "body_bytes": 100, "proof": "ack_queue",
            "relay": {"batch": RELAY_BATCH, "poll_ms": RELAY_POLL.as_millis() as u64},
            "sustained_when": {
                "sent_at_least": KEEP, "received_at_least": KEEP,
                "backlog_growth_at_most": GROWTH, "p99_ms_at_most": MAX_P99_MS,
            },
            "rounds": plan.rounds, "reps": plan.reps,
            "warmup_secs": plan.warmup.as_secs_f64(), "window_secs": plan.window.as_secs_f64(),
            "capacity_msg_per_sec": {"outbox": o, "relay": r, "floor": f},
            "errors": broken.iter().map(|(k, v)| (k.key().to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "loadavg_start": load_start, "loadavg_end": load_end,
            "steps": steps,
        }),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn search_doubles_then_bisects() {
        let mut s = Search::default();
        assert_eq!(s.next(), Some(START_RATE));
        s.record(2000.0, true);
        assert_eq!(s.next(), Some(4000.0));
        s.record(4000.0, true);
        s.record(8000.0, false);
        assert_eq!(s.next(), Some(5657.0));
        s.record(5657.0, false);
        assert_eq!(s.capacity(), 4000.0);
        let mut f = Search::default();
        f.record(2000.0, false);
        assert_eq!(f.next(), Some(1000.0));
        f.record(100.0, false);
        assert_eq!(f.next(), None);
        assert_eq!(f.capacity(), 0.0);
    }

    #[test]
    fn thread_cpu_counts_threads_seen_at_both_readings() {
        let d = threads_delta(&[Some(1.0), Some(2.0), None], &[Some(1.5), None, Some(9.0)]);
        assert_eq!(d, 0.5);
        assert!(threads_delta(&[None], &[Some(1.0)]).is_nan());
    }

    #[test]
    fn verdict_needs_pace_receipt_bounded_backlog_and_latency() {
        let ok = Window {
            rate: 1000.0,
            secs: 4.0,
            sent: vec![3990, 3995],
            received: 3980,
            growth: 10,
            p99_ms: 12.0,
        };
        assert!(verdict(&ok).is_ok());
        let slow_client = Window {
            sent: vec![3990, 3000],
            ..ok.clone()
        };
        assert!(verdict(&slow_client).is_err());
        let growing = Window {
            growth: 400,
            ..ok.clone()
        };
        assert!(verdict(&growing).is_err());
        let late = Window {
            p99_ms: 1500.0,
            ..ok.clone()
        };
        assert!(verdict(&late).is_err());
        let nothing = Window {
            p99_ms: f64::NAN,
            received: 0,
            ..ok
        };
        assert!(verdict(&nothing).is_err());
    }
}
