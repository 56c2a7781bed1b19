//! The baselines on the AMQP side: a raw lapin publisher with pipelined publisher confirms,
//! a paced raw publisher (its confirm latency and its publish-to-consumer latency), and the
//! consumer that timestamps deliveries for the latency runs.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use amqp_outbox_testkit::amqp_admin::{self, runtime};
use futures_lite::StreamExt;
use lapin::options::BasicPublishOptions;
use lapin::{BasicProperties, Channel, Confirmation, Connection};

pub fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

async fn confirm_channel(uri: &str) -> Result<(Connection, Channel), String> {
    let c = amqp_admin::connect(uri, amqp_admin::CONNECT_TIMEOUT).await?;
    let ch = amqp_admin::confirm_channel(&c).await?;
    Ok((c, ch))
}

fn check(c: lapin::Result<Confirmation>) -> Result<(), String> {
    match c {
        Ok(Confirmation::Ack(None)) => Ok(()),
        Ok(other) => Err(format!("raw publish not confirmed cleanly: {other:?}")),
        Err(e) => Err(format!("raw publish confirm: {e}")),
    }
}

fn props() -> BasicProperties {
    BasicProperties::default().with_delivery_mode(2)
}

/// Publishes `n` persistent, mandatory messages of `body` to `exchange` with up to `window`
/// unconfirmed; returns messages per second from the first publish to the last confirm.
pub fn pipelined(
    uri: &str,
    exchange: &str,
    body: &[u8],
    n: u64,
    window: usize,
) -> Result<f64, String> {
    runtime().block_on(async {
        let (conn, ch) = confirm_channel(uri).await?;
        let opts = BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        };
        let mut pending = VecDeque::with_capacity(window);
        let t0 = Instant::now();
        for _ in 0..n {
            if pending.len() >= window {
                let c: lapin::PublisherConfirm = pending.pop_front().expect("non-empty");
                check(c.await)?;
            }
            let c = ch
                .basic_publish(exchange.into(), "".into(), opts, body, props())
                .await
                .map_err(|e| format!("basic.publish: {e}"))?;
            pending.push_back(c);
        }
        while let Some(c) = pending.pop_front() {
            check(c.await)?;
        }
        let rate = n as f64 / t0.elapsed().as_secs_f64();
        let _ = conn.close(200, "done".into()).await;
        Ok(rate)
    })
}

/// Latency samples of one run, in microseconds.
#[derive(Default, Clone)]
pub struct Samples {
    pub us: Vec<i64>,
}

/// A consumer (auto-ack) that records receive time minus the publish timestamp at the start
/// of each body (`<unix µs> <m|w> …`; only `m` bodies are measured).
pub struct LatencyConsumer {
    samples: Arc<Mutex<Vec<i64>>>,
    received: Arc<AtomicU64>,
    _conn: Connection,
}

impl LatencyConsumer {
    pub fn start(uri: &str, queue: &str) -> Result<LatencyConsumer, String> {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let received = Arc::new(AtomicU64::new(0));
        let (s2, r2) = (samples.clone(), received.clone());
        let conn = runtime().block_on(async {
            let c = amqp_admin::connect(uri, amqp_admin::CONNECT_TIMEOUT).await?;
            let mut consumer = amqp_admin::start_consumer(&c, queue, Some(1000), true).await?;
            tokio::spawn(async move {
                while let Some(Ok(d)) = consumer.next().await {
                    let t = now_us();
                    let text = String::from_utf8_lossy(&d.data);
                    let mut it = text.splitn(3, ' ');
                    let sent: Option<i64> = it.next().and_then(|s| s.parse().ok());
                    let flag = it.next();
                    if let (Some(sent), Some("m")) = (sent, flag) {
                        s2.lock().unwrap_or_else(|e| e.into_inner()).push(t - sent);
                        r2.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
            Ok::<_, String>(c)
        })?;
        Ok(LatencyConsumer {
            samples,
            received,
            _conn: conn,
        })
    }

    pub fn reset(&self) {
        self.samples
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        self.received.store(0, Ordering::Relaxed);
    }

    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// Waits (bounded) until `n` measured messages arrived; returns the samples.
    pub fn wait_for(&self, n: u64, timeout: Duration) -> Samples {
        let deadline = Instant::now() + timeout;
        while self.received() < n && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        Samples {
            us: self
                .samples
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        }
    }
}

/// A raw publisher at a steady `rate` for `warmup + secs`: each body starts with its publish
/// time. Confirms are awaited in order by another task (pipelined, so the rate is not capped
/// by the round trip). Returns (measured messages sent, confirm latencies in µs).
pub fn paced(
    uri: &str,
    exchange: &str,
    pad: &str,
    rate: f64,
    warmup: Duration,
    secs: Duration,
) -> Result<(u64, Samples), String> {
    let rt = runtime();
    let (conn, ch) = rt.block_on(confirm_channel(uri))?;
    let (tx, mut rx) =
        tokio::sync::mpsc::unbounded_channel::<(Instant, bool, lapin::PublisherConfirm)>();
    let collector = rt.spawn(async move {
        let mut lat = Vec::new();
        let mut err = None;
        while let Some((sent, measured, c)) = rx.recv().await {
            let r = c.await;
            let elapsed = sent.elapsed().as_micros() as i64;
            if let Err(e) = check(r) {
                err.get_or_insert(e);
            }
            if measured {
                lat.push(elapsed);
            }
        }
        (lat, err)
    });
    let opts = BasicPublishOptions {
        mandatory: true,
        ..Default::default()
    };
    let t0 = Instant::now();
    let total = warmup + secs;
    let mut sent = 0u64;
    let mut i = 0u64;
    loop {
        let due = t0 + Duration::from_secs_f64(i as f64 / rate);
        if due >= t0 + total {
            break;
        }
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        let measured = due >= t0 + warmup;
        let body = format!("{} {} {pad}", now_us(), if measured { "m" } else { "w" });
        let start = Instant::now();
        let c = rt
            .block_on(ch.basic_publish(exchange.into(), "".into(), opts, body.as_bytes(), props()))
            .map_err(|e| format!("basic.publish: {e}"))?;
        let _ = tx.send((start, measured, c));
        if measured {
            sent += 1;
        }
        i += 1;
    }
    drop(tx);
    let (lat, err) = rt
        .block_on(collector)
        .map_err(|e| format!("confirm collector: {e}"))?;
    let _ = rt.block_on(conn.close(200, "done".into()));
    if let Some(e) = err {
        return Err(e);
    }
    Ok((sent, Samples { us: lat }))
}
