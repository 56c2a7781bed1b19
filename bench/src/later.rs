//! Section 12, delayed and idempotent publishing (#41). What `deliver_after` and
//! `idempotency_key` cost a publisher: pgbench, one message per transaction, 1 and 8 clients,
//! `amqp.publish_message()` with each option against the same call without it, interleaved, the
//! worker on. Then what a million messages scheduled for later cost the delivery of due ones:
//! the worker's CPU per delivered message while a client publishes, with 1,000,000 rows in
//! `amqp.scheduled_message` and with none, interleaved (the claim never reads them).
//!
//! Targets (#41): each option's publish rate ≥ 0.9 × the plain call's; the worker's CPU per
//! delivered message with a million scheduled about what it is without (ratio < 1.1).

use serde_json::json;

use crate::env::{payload, Env};
use crate::pgbench::{Load, System};
use crate::phases::{config_label, pgbench_once, pgbench_series, rotated, BODY_SIZE};
use crate::report::{Figure, Target};
use crate::{log, Opts, Run};

const SEC: &str = "12 delayed and idempotent publishing";

pub fn later(env: &mut Env, opts: &Opts, run: &mut Run) -> Result<(), String> {
    env.set_enabled(true)?;
    let systems = [
        System::PublishMessage,
        System::PublishLater,
        System::PublishKeyed,
    ];
    let mut details = Vec::new();
    for (i, clients) in [1, 8].into_iter().enumerate() {
        let load = Load {
            clients,
            per_txn: 1,
            size: BODY_SIZE,
            secs: opts.secs,
        };
        let (s, _) = pgbench_series(env, &systems, &load, opts.reps, i)?;
        let cfg = config_label(&load);
        let get = |k: &str| s.get(k).cloned().unwrap_or_default();
        for (name, key) in [
            ("publish with deliver_after", "publish_later"),
            ("publish with idempotency_key", "publish_keyed"),
        ] {
            run.fig(
                Figure::new(SEC, name, &cfg, "rows/s")
                    .samples(get(key))
                    .baseline("publish_message", get("publish_message"))
                    .target(Target::RatioAtLeast(0.9)),
            );
        }
        details.push(json!({ "config": cfg, "rows_per_sec": s }));
    }

    let scheduled = if opts.quick { 200_000 } else { 1_000_000 };
    let load = Load {
        clients: 1,
        per_txn: 1,
        size: BODY_SIZE,
        secs: opts.secs,
    };
    let body = payload(BODY_SIZE);
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for rep in 0..opts.reps {
        for full in rotated(&[false, true], rep) {
            env.sql("TRUNCATE amqp.scheduled_message")?;
            if full {
                env.sql(&format!(
                    "INSERT INTO amqp.scheduled_message (producer_started_at, broker_id, exchange, \
                       routing_key, body, deliver_at) \
                     SELECT now(), {}, 'bench.nowhere', 'later', '\\x00', now() + '1 day' \
                       FROM generate_series(1, {scheduled}); \
                     ANALYZE amqp.scheduled_message",
                    env.broker_id
                ))?;
            }
            let (out, w) = pgbench_once(env, System::Publish, &load, &body)?;
            let Some(w) = w else { continue };
            let per_msg = w.cpu_cores * 1e6 / w.delivered_per_sec.max(1.0);
            log(format!(
                "  {} scheduled: {:.0} msg/s published, worker {per_msg:.0} µs per delivered message",
                if full { scheduled } else { 0 },
                out.rows_per_sec
            ));
            if full { &mut with } else { &mut without }.push(per_msg);
        }
    }
    env.sql("TRUNCATE amqp.scheduled_message")?;
    run.fig(
        Figure::new(
            SEC,
            &format!("worker CPU per delivered message, {scheduled} scheduled for later"),
            &config_label(&load),
            "µs",
        )
        .samples(with.clone())
        .baseline("none scheduled", without.clone())
        .target(Target::RatioBelow(1.1)),
    );
    details.push(
        json!({ "scheduled": scheduled, "worker_us_per_msg_with": with,
                         "worker_us_per_msg_without": without }),
    );
    run.detail("later", json!(details));
    Ok(())
}
