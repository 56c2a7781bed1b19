//! The baselines on the AMQP side: a raw lapin publisher with pipelined publisher confirms,
//! a paced raw publisher (its confirm latency and its publish-to-consumer latency), and the
//! consumer that timestamps deliveries for the latency runs.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use amqp_outbox_broker::identity::{host_name, uuid_v7};
use amqp_outbox_testkit::amqp_admin::{self, runtime};
use futures_lite::StreamExt;
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
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

/// The properties the pipelined publisher sends with each message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RawProps {
    /// Only delivery_mode 2: the broker's floor.
    Bare,
    /// The worker's, for a row of `amqp.publish()` without headers or tags: what RabbitMQ
    /// spends on properties and headers, apart from what the worker spends.
    LikeOutbox,
}

// The headers the worker adds to every message (engine/src/message.rs, `HEADER_*`; a test
// checks the names). Not imported: that crate is the pgrx extension.
const HEADER_PRODUCER_PID: &str = "x-amqp-outbox-producer-pid";
const HEADER_PRODUCER_START: &str = "x-amqp-outbox-producer-start";
const HEADER_SEQUENCE: &str = "x-amqp-outbox-seq";
const HEADER_SYSTEM_ID: &str = "x-amqp-outbox-system-id";
const HEADER_HOST_ID: &str = "x-amqp-outbox-host-id";
const HEADER_BUSINESS_TYPE: &str = "x-amqp-outbox-business-type";
const HEADER_CREATED_AT: &str = "x-amqp-outbox-created-at";

/// Builds, per message, the properties the worker sends for a row of `amqp.publish()` without
/// headers or tags (engine/src/message.rs `to_message`, broker/src/outbound.rs `build`): the
/// same keys, value types and about the same sizes.
struct LikeOutbox {
    /// The producer's pid and start (Unix µs): the worker's come from the row's backend.
    pid: i64,
    started_us: i64,
    /// The defaults of the tags: the database's name, the host name and the routing key.
    system_id: String,
    host_id: String,
    business_type: String,
    /// xorshift64* state for the message ids' random bits: uniqueness is all that matters.
    rng: u64,
}

impl LikeOutbox {
    fn new(routing_key: &str) -> LikeOutbox {
        let started_us = now_us();
        LikeOutbox {
            pid: i64::from(std::process::id()),
            started_us,
            system_id: crate::env::DATABASE.to_string(),
            host_id: host_name(),
            business_type: routing_key.to_string(),
            rng: (started_us as u64 ^ (u64::from(std::process::id()) << 32)) | 1,
        }
    }

    fn next_random(&mut self) -> u64 {
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// The properties of message number `seq`.
    fn props(&mut self, seq: i64) -> BasicProperties {
        let created_us = now_us();
        let mut random = [0u8; 10];
        random[..8].copy_from_slice(&self.next_random().to_le_bytes());
        random[8..].copy_from_slice(&self.next_random().to_le_bytes()[..2]);
        let message_id = uuid_v7((created_us / 1000).max(0) as u64, random);
        // JSON numbers become long-long ints and strings long strings (broker/src/amqp_values.rs),
        // the pid included.
        let text = |s: &str| AMQPValue::LongString(LongString::from(s.as_bytes()));
        let mut headers = FieldTable::default();
        headers.insert(HEADER_PRODUCER_PID.into(), AMQPValue::LongLongInt(self.pid));
        headers.insert(
            HEADER_PRODUCER_START.into(),
            AMQPValue::LongLongInt(self.started_us),
        );
        headers.insert(HEADER_SEQUENCE.into(), AMQPValue::LongLongInt(seq));
        headers.insert(HEADER_SYSTEM_ID.into(), text(&self.system_id));
        headers.insert(HEADER_HOST_ID.into(), text(&self.host_id));
        headers.insert(HEADER_BUSINESS_TYPE.into(), text(&self.business_type));
        headers.insert(HEADER_CREATED_AT.into(), AMQPValue::LongLongInt(created_us));
        BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(ShortString::from(message_id))
            .with_timestamp((created_us.max(0) / 1_000_000) as u64)
            .with_headers(headers)
    }
}

/// Publishes `n` persistent, mandatory messages of `body` to `exchange` with up to `window`
/// unconfirmed, each with the properties `with` names; returns messages per second from the
/// first publish to the last confirm.
pub fn pipelined(
    uri: &str,
    exchange: &str,
    body: &[u8],
    n: u64,
    window: usize,
    with: RawProps,
) -> Result<f64, String> {
    const ROUTING_KEY: &str = "";
    runtime().block_on(async {
        let (conn, ch) = confirm_channel(uri).await?;
        let opts = BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        };
        let mut like = (with == RawProps::LikeOutbox).then(|| LikeOutbox::new(ROUTING_KEY));
        let mut pending = VecDeque::with_capacity(window);
        let t0 = Instant::now();
        for i in 0..n {
            if pending.len() >= window {
                let c: lapin::PublisherConfirm = pending.pop_front().expect("non-empty");
                check(c.await)?;
            }
            // Built here, per message, as the worker builds its own: the cost is the publisher's.
            let p = match like.as_mut() {
                Some(l) => l.props(i as i64 + 1),
                None => props(),
            };
            let c = ch
                .basic_publish(exchange.into(), ROUTING_KEY.into(), opts, body, p)
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

/// A publisher that runs beside a pgbench run: `rate` messages a second, sent every [`TICK`]
/// as one batch whose confirms it awaits before the next, with the worker's properties. What
/// delivering a given rate to this RabbitMQ costs the machine when a lean client does it,
/// whoever that is: the reference for what the worker's delivery costs beyond that.
pub struct Beside {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Result<u64, String>>,
}

/// The batching period of [`Beside`]: the worker's gap between claims at 2,000 msg/s.
const TICK: Duration = Duration::from_millis(2);

impl Beside {
    pub fn start(uri: &str, exchange: &str, body: &[u8], rate: f64) -> Result<Beside, String> {
        let rt = runtime();
        let (conn, ch) = rt.block_on(confirm_channel(uri))?;
        let stop = Arc::new(AtomicBool::new(false));
        let (exchange, body, halt) = (exchange.to_string(), body.to_vec(), stop.clone());
        let thread = std::thread::spawn(move || {
            rt.block_on(async move {
                let opts = BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                };
                let mut like = LikeOutbox::new("");
                let t0 = Instant::now();
                let mut sent = 0u64;
                while !halt.load(Ordering::Relaxed) {
                    let due = (t0.elapsed().as_secs_f64() * rate) as u64;
                    let mut confirms = Vec::new();
                    while sent < due {
                        sent += 1;
                        let p = like.props(sent as i64);
                        let c = ch
                            .basic_publish(exchange.as_str().into(), "".into(), opts, &body, p)
                            .await
                            .map_err(|e| format!("basic.publish: {e}"))?;
                        confirms.push(c);
                    }
                    for c in confirms {
                        check(c.await)?;
                    }
                    tokio::time::sleep(TICK).await;
                }
                let _ = conn.close(200, "done".into()).await;
                Ok(sent)
            })
        });
        Ok(Beside { stop, thread })
    }

    /// Stops it; the messages it published (all confirmed).
    pub fn stop(self) -> Result<u64, String> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .map_err(|_| "the publisher beside pgbench panicked".to_string())?
    }
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
/// time, each message has the properties `with` names. Confirms are awaited in order by another
/// task (pipelined, so the rate is not capped by the round trip). Returns (measured messages
/// sent, confirm latencies in µs).
pub fn paced(
    uri: &str,
    exchange: &str,
    pad: &str,
    rate: f64,
    warmup: Duration,
    secs: Duration,
    with: RawProps,
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
    let mut like = (with == RawProps::LikeOutbox).then(|| LikeOutbox::new(""));
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
        let p = match like.as_mut() {
            Some(l) => l.props(i as i64 + 1),
            None => props(),
        };
        let body = format!("{} {} {pad}", now_us(), if measured { "m" } else { "w" });
        let start = Instant::now();
        let c = rt
            .block_on(ch.basic_publish(exchange.into(), "".into(), opts, body.as_bytes(), p))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn header<'a>(p: &'a BasicProperties, key: &str) -> &'a AMQPValue {
        let h = p.headers().as_ref().expect("headers");
        &h.inner()[key]
    }

    #[test]
    fn bare_properties_are_only_persistence() {
        let p = props();
        assert_eq!(*p.delivery_mode(), Some(2));
        assert!(p.message_id().is_none() && p.timestamp().is_none() && p.headers().is_none());
    }

    #[test]
    fn like_outbox_properties_are_the_workers() {
        let mut like = LikeOutbox::new("");
        let p = like.props(7);
        assert_eq!(*p.delivery_mode(), Some(2));
        let id = p.message_id().as_ref().expect("message_id").to_string();
        // The worker's ids: lowercase canonical UUIDv7 (amqp._uuid7_time()'s pattern).
        assert_eq!(id.len(), 36, "{id}");
        for (i, c) in id.chars().enumerate() {
            match i {
                8 | 13 | 18 | 23 => assert_eq!(c, '-', "{id}"),
                14 => assert_eq!(c, '7', "{id}"),
                19 => assert!(matches!(c, '8' | '9' | 'a' | 'b'), "{id}"),
                _ => assert!(c.is_ascii_digit() || ('a'..='f').contains(&c), "{id}"),
            }
        }
        let ts = p.timestamp().expect("timestamp");
        assert!(ts.abs_diff(now_us() as u64 / 1_000_000) <= 2, "{ts}");
        assert_eq!(p.headers().as_ref().map(|h| h.inner().len()), Some(7));
        assert_eq!(
            *header(&p, HEADER_PRODUCER_PID),
            AMQPValue::LongLongInt(i64::from(std::process::id()))
        );
        assert!(matches!(
            header(&p, HEADER_PRODUCER_START),
            AMQPValue::LongLongInt(_)
        ));
        assert_eq!(*header(&p, HEADER_SEQUENCE), AMQPValue::LongLongInt(7));
        assert_eq!(
            *header(&p, HEADER_SYSTEM_ID),
            AMQPValue::LongString(crate::env::DATABASE.into())
        );
        assert!(matches!(header(&p, HEADER_HOST_ID), AMQPValue::LongString(h) if !h.is_empty()));
        assert_eq!(
            *header(&p, HEADER_BUSINESS_TYPE),
            AMQPValue::LongString("".into())
        );
        match header(&p, HEADER_CREATED_AT) {
            AMQPValue::LongLongInt(us) => assert_eq!(*us as u64 / 1_000_000, ts),
            other => panic!("created_at: {other:?}"),
        }
        let q = like.props(8);
        assert_ne!(p.message_id(), q.message_id());
        assert_eq!(*header(&q, HEADER_SEQUENCE), AMQPValue::LongLongInt(8));
    }

    /// The header names are the worker's: every `HEADER_*` of engine/src/message.rs but the
    /// two a row without tags does not carry.
    #[test]
    fn header_names_are_the_workers() {
        let source = include_str!("../../engine/src/message.rs");
        let mut theirs: Vec<&str> = source
            .lines()
            .filter(|l| l.trim_start().starts_with("pub const HEADER_"))
            .filter_map(|l| l.split('"').nth(1))
            .collect();
        theirs.sort_unstable();
        let mut ours = vec![
            HEADER_PRODUCER_PID,
            HEADER_PRODUCER_START,
            HEADER_SEQUENCE,
            HEADER_SYSTEM_ID,
            HEADER_HOST_ID,
            HEADER_BUSINESS_TYPE,
            HEADER_CREATED_AT,
            "x-amqp-outbox-business-key",
            "traceparent",
        ];
        ours.sort_unstable();
        assert_eq!(ours, theirs);
    }
}
