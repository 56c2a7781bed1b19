//! Section 10, failover safety: what `amqp_outbox.standby_names` costs the latency from commit to
//! consumer. A streaming standby of the bench's cluster (`pg_basebackup`, its own port and
//! directory, on the same machine), then the latency runs of section 3 (`ack_queue` mode, one
//! message per transaction, 200 and 2,000 msg/s) with the setting naming that standby and
//! without it, rotated, side by side; and the standby's own flush lag, sampled every 100 ms
//! from `pg_stat_replication` during the runs with the setting. Before them, the producer's
//! throughput as section 1 measures it (pgbench, `amqp.publish()` ÷ a plain INSERT, worker on,
//! 1 client, 1 message per transaction) with the setting and without it on the same primary,
//! interleaved, and the ratio between the two.
//!
//! Targets (#38): the p50 and p99 grow by no more than the standby's flush lag; producer
//! throughput does not change (nothing new on the commit path).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use amqp_outbox_e2e::chaos::Standby;
use serde_json::json;

use crate::env::{payload, Env};
use crate::pgbench::{Load, System};
use crate::phases::{
    config_label, paced_pad, pcts, pgbench_once, rotated, PacedOutbox, Pcts, BODY_SIZE,
};
use crate::raw::LatencyConsumer;
use crate::report::{median, Figure, Target};
use crate::{log, Opts, Run};

const NAME: &str = "bench_standby";

pub fn standby(env: &mut Env, opts: &Opts, run: &mut Run) -> Result<(), String> {
    let standby = Standby::create(
        &env.cluster,
        &[
            ("cluster_name", &format!("'{NAME}'")),
            ("hot_standby", "on"),
        ],
    )?;
    wait_streaming(env)?;
    env.set_enabled(true)?;
    env.set_proof("ack_queue")?;
    producer_throughput(env, opts, run)?;
    let route = env.routes.standby.clone();
    env.purge(&route.queue)?;
    let consumer = LatencyConsumer::start(&env.amqp_uri(), &route.queue)?;
    let pad = paced_pad();
    let warmup = Duration::from_secs(1);
    let mut details = Vec::new();
    for (rate, secs) in [(200.0, opts.lat_secs_low), (2000.0, opts.lat_secs_high)] {
        let secs = Duration::from_secs_f64(secs);
        let (mut on, mut off): (Vec<Pcts>, Vec<Pcts>) = (Vec::new(), Vec::new());
        let mut lag_ms: Vec<f64> = Vec::new();
        for rep in 0..opts.lat_reps {
            for gated in rotated(&[false, true], rep) {
                set_standby_names(env, if gated { NAME } else { "" })?;
                consumer.reset();
                let sampler = gated.then(|| LagSampler::start(env));
                let sent = PacedOutbox::connect(env, &route.exchange, None, rate)?
                    .run(warmup, secs, &pad)?;
                let samples = consumer.wait_for(sent, Duration::from_secs(30));
                if let Some(s) = sampler {
                    lag_ms.extend(s.finish());
                }
                let p = pcts(&samples);
                log(format!(
                    "  {rate}/s standby_names {}: {} of {sent} received, p50 {:.2} ms, p99 {:.2} ms",
                    if gated { NAME } else { "''" },
                    samples.us.len(),
                    p.p50,
                    p.p99
                ));
                if gated { &mut on } else { &mut off }.push(p);
                env.purge(&route.queue)?;
            }
        }
        let cfg = format!("{rate:.0} msg/s, 1 msg/txn, a streaming standby on the same machine");
        let sec = "10 standby";
        let pick = |v: &[Pcts], f: fn(&Pcts) -> f64| v.iter().map(f).collect::<Vec<_>>();
        for (what, f) in [
            ("p50", (|p: &Pcts| p.p50) as fn(&Pcts) -> f64),
            ("p99", |p: &Pcts| p.p99),
        ] {
            run.fig(
                Figure::new(
                    sec,
                    &format!("commit→consumer {what}, standby_names set / not set"),
                    &cfg,
                    "ms",
                )
                .samples(pick(&on, f))
                .baseline("not set", pick(&off, f)),
            );
        }
        lag_ms.sort_by(f64::total_cmp);
        let lag_p50 = median(&lag_ms);
        let lag_p99 = lag_ms
            .get(((lag_ms.len() as f64) * 0.99) as usize)
            .copied()
            .unwrap_or(f64::NAN);
        run.fig(
            Figure::new(
                sec,
                "the standby's flush lag (pg_stat_replication, every 100 ms), p50",
                &cfg,
                "ms",
            )
            .samples(vec![lag_p50])
            .note(format!("p99 {lag_p99:.2} ms, {} samples", lag_ms.len())),
        );
        // #38's target: the setting adds no more than the standby's own lag, percentile by
        // percentile (each repetition's set run less the unset run beside it).
        for (what, f, lag) in [
            ("p50", (|p: &Pcts| p.p50) as fn(&Pcts) -> f64, lag_p50),
            ("p99", |p: &Pcts| p.p99, lag_p99),
        ] {
            let added: Vec<f64> = on.iter().zip(&off).map(|(a, b)| f(a) - f(b)).collect();
            run.fig(
                Figure::new(
                    sec,
                    &format!("commit→consumer {what} added by standby_names (set − not set)"),
                    &cfg,
                    "ms",
                )
                .samples(added)
                .target(Target::AtMost(lag))
                .note(format!(
                    "target: the standby's flush lag {what}, {lag:.2} ms"
                )),
            );
        }
        details.push(json!({
            "rate": rate,
            "standby_names_set": on.iter().map(|p| json!({"p50_ms": p.p50, "p99_ms": p.p99})).collect::<Vec<_>>(),
            "standby_names_unset": off.iter().map(|p| json!({"p50_ms": p.p50, "p99_ms": p.p99})).collect::<Vec<_>>(),
            "flush_lag_ms": lag_ms,
        }));
    }
    set_standby_names(env, "")?;
    drop(consumer);
    drop(standby);
    run.detail("standby", json!(details));
    Ok(())
}

/// One run of the producer-throughput comparison.
#[derive(Clone, Copy)]
enum Producer {
    Insert,
    /// `amqp.publish()`, worker on, with `standby_names` naming the standby (`true`) or empty.
    Publish(bool),
}

/// `amqp.publish()` ÷ plain INSERT (pgbench, worker on, 1 client, 1 message per transaction)
/// with `standby_names` set and not set, interleaved on the same primary with its standby
/// streaming; then set ÷ not set. The setting acts only in the worker, after the commit: the
/// ratio should be 1 within the noise.
fn producer_throughput(env: &mut Env, opts: &Opts, run: &mut Run) -> Result<(), String> {
    let load = Load {
        clients: 1,
        per_txn: 1,
        size: BODY_SIZE,
        secs: opts.secs,
    };
    let body = payload(load.size);
    let mut rows: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let systems = [
        Producer::Insert,
        Producer::Publish(false),
        Producer::Publish(true),
    ];
    for rep in 0..opts.reps {
        for p in rotated(&systems, rep) {
            let (system, key, label) = match p {
                Producer::Insert => (System::Insert, "insert", "plain INSERT".to_string()),
                Producer::Publish(gated) => {
                    set_standby_names(env, if gated { NAME } else { "" })?;
                    let key = if gated {
                        "publish_set"
                    } else {
                        "publish_unset"
                    };
                    let label = format!(
                        "amqp.publish (worker on), standby_names {}",
                        if gated { NAME } else { "''" }
                    );
                    (System::Publish, key, label)
                }
            };
            let (out, _) = pgbench_once(env, system, &load, &body)?;
            log(format!(
                "  {} {label}: {:.0} rows/s (latency {:.2} ms)",
                config_label(&load),
                out.rows_per_sec,
                out.latency_ms
            ));
            rows.entry(key).or_default().push(out.rows_per_sec);
        }
    }
    set_standby_names(env, "")?;
    let get = |k: &str| rows.get(k).cloned().unwrap_or_default();
    let sec = "10 standby";
    let cfg = format!("{}, a streaming standby", config_label(&load));
    for (key, what) in [("publish_set", "set"), ("publish_unset", "not set")] {
        run.fig(
            Figure::new(
                sec,
                &format!("amqp.publish, worker on, standby_names {what} / plain INSERT"),
                &cfg,
                "rows/s",
            )
            .samples(get(key))
            .baseline("INSERT", get("insert")),
        );
    }
    let both = Figure::new(
        sec,
        "amqp.publish, worker on, standby_names set / not set",
        &cfg,
        "rows/s",
    )
    .samples(get("publish_set"))
    .baseline("not set", get("publish_unset"))
    .note("#38: must not change");
    log(format!(
        "  producer throughput, standby_names set / not set: {}",
        both.ratio()
            .map_or_else(|| "n/a".to_string(), |r| format!("{r:.3}"))
    ));
    run.fig(both);
    run.detail("standby_producer_rows_per_sec", json!(rows));
    Ok(())
}

fn wait_streaming(env: &mut Env) -> Result<(), String> {
    for _ in 0..600 {
        let n: i64 = env
            .admin
            .query_one(
                "SELECT count(*) FROM pg_stat_replication WHERE application_name = $1 AND state = 'streaming'",
                &[&NAME],
            )
            .map_err(|e| e.to_string())?
            .get(0);
        if n == 1 {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Err("the bench's standby did not start streaming within 60 s".into())
}

fn set_standby_names(env: &mut Env, names: &str) -> Result<(), String> {
    env.cluster
        .set_setting("amqp_outbox.standby_names", format!("'{names}'"));
    env.sql("SELECT pg_catalog.pg_reload_conf()")?;
    // Let the workers take the reload before the run relies on it.
    std::thread::sleep(Duration::from_millis(500));
    Ok(())
}

/// Samples the standby's `flush_lag` every 100 ms on a session of its own.
struct LagSampler {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<f64>>,
}

impl LagSampler {
    fn start(env: &Env) -> LagSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let client = env.cluster.try_client();
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut out = Vec::new();
            let Ok(mut c) = client else {
                return out;
            };
            while !flag.load(Ordering::Relaxed) {
                if let Ok(Some(row)) = c.query_opt(
                    "SELECT extract(epoch FROM flush_lag)::float8 * 1000 FROM pg_stat_replication WHERE application_name = $1",
                    &[&NAME],
                ) {
                    if let Some(ms) = row.get::<_, Option<f64>>(0) {
                        out.push(ms);
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            out
        });
        LagSampler { stop, thread }
    }

    fn finish(self) -> Vec<f64> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}
