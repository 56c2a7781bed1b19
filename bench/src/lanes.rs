//! 11. Lanes: a subscription's throughput with a parallelism, and with an ordering by key.
//!
//! Each run fills a queue with `n` persistent messages (unique `message_id`, a small JSON body,
//! with ordering the `x-amqp-outbox-business-key` header over `keys` keys), then times from
//! `amqp.subscribe(..., parallelism, ordering)` until the handler's effect table has `n` rows.
//! The handler records the message and sleeps the handler time (`pg_sleep`, standing for its
//! own work). Beside it, on its own copy of the queue, the application consumer of section 7
//! with the same parallelism: that many lapin consumers, each with its own PostgreSQL
//! connection, one transaction per message (dedup row, the same sleep, effect row), then the
//! ack. Target (#41): with 1 ms handlers, 8 lanes handle at least 4 times the messages per
//! second of one.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Instant;

use amqp_outbox_testkit::amqp_admin::runtime;
use lapin::types::FieldTable;
use serde_json::json;

use crate::consume::{
    app_close, app_connect, app_consume_shared, count, fill_keyed, load1, server_log,
    subscription_status, timeout_for, unsubscribe_if_any, wait_rows, Ctx, Outcome, PREFETCH,
};
use crate::env::{Env, PREFIX};
use crate::report::{median, Figure, Target};
use crate::{log, Opts, Run};

const SUBSCRIPTION: &str = "bench_lanes";

fn queue(who: &str) -> String {
    format!("{PREFIX}.lanes.{who}.q")
}

/// One configuration: messages in progress at once, the handler's time, keys (ordering).
#[derive(Clone, Copy, Debug)]
struct Shape {
    parallelism: i32,
    handler_ms: f64,
    keys: Option<u64>,
}

impl Shape {
    fn label(&self) -> String {
        match self.keys {
            None => format!(
                "parallelism {}, {} ms handler",
                self.parallelism, self.handler_ms
            ),
            Some(k) => format!(
                "parallelism {}, {} ms handler, ordered by key, {k} key(s)",
                self.parallelism, self.handler_ms
            ),
        }
    }
}

fn setup(env: &mut Env) -> Result<(), String> {
    env.set_enabled(true)?;
    unsubscribe_if_any(env, SUBSCRIPTION)?;
    for who in ["sub", "app"] {
        let _ = env.amqp.delete_queue(&queue(who));
        env.amqp
            .declare_queue(&queue(who), true, FieldTable::default())?;
    }
    env.sql(
        "DROP TABLE IF EXISTS public.bench_lane_effect, public.bench_lane_ms, public.app_dedup,
                              public.app_effect;
         CREATE TABLE public.bench_lane_effect (message_id text, n int);
         CREATE TABLE public.bench_lane_ms (ms float8 NOT NULL);
         INSERT INTO public.bench_lane_ms VALUES (0);
         CREATE OR REPLACE FUNCTION public.bench_lane_handler(d amqp.delivery) RETURNS void
             LANGUAGE plpgsql AS $$
         BEGIN
             PERFORM pg_sleep(ms / 1000.0) FROM public.bench_lane_ms WHERE ms > 0;
             INSERT INTO public.bench_lane_effect VALUES (d.message_id, 1);
         END $$;
         CREATE TABLE public.app_dedup (consumer text NOT NULL, message_id text NOT NULL,
                                        PRIMARY KEY (consumer, message_id));
         CREATE TABLE public.app_effect (message_id text, n int);",
    )
}

fn cleanup(env: &mut Env) {
    let _ = unsubscribe_if_any(env, SUBSCRIPTION);
    env.amqp.delete_all(
        &[queue("sub"), queue("app")],
        &[],
        std::time::Duration::from_secs(30),
    );
}

fn subscription_once(env: &mut Env, shape: Shape, n: u64, tag: &str) -> Result<Outcome, String> {
    let q = queue("sub");
    unsubscribe_if_any(env, SUBSCRIPTION)?;
    env.sql("TRUNCATE public.bench_lane_effect")?;
    env.admin
        .execute(
            "UPDATE public.bench_lane_ms SET ms = $1",
            &[&shape.handler_ms],
        )
        .map_err(|e| format!("handler time: {e}"))?;
    fill_keyed(&Ctx::of(env), &q, tag, n, shape.keys)?;
    env.sql("CHECKPOINT")?;
    let ordering = if shape.keys.is_some() {
        "business_key"
    } else {
        "none"
    };
    let load = load1();
    let t0 = Instant::now();
    env.admin
        .execute(
            "SELECT amqp.subscribe($1, $2, $3, 'public.bench_lane_handler(amqp.delivery)'::regprocedure, \
                                   $4, parallelism => $5, ordering => $6)",
            &[
                &SUBSCRIPTION,
                &env.broker_id,
                &q,
                &i32::from(PREFETCH),
                &shape.parallelism,
                &ordering,
            ],
        )
        .map_err(|e| format!("amqp.subscribe: {e}"))?;
    let done = wait_rows(
        &mut Ctx::of(env),
        "bench_lane_effect",
        n,
        timeout_for(n),
        || None,
    );
    let done = match done {
        Ok(d) => d,
        Err(e) => {
            let status = subscription_status(env, SUBSCRIPTION);
            let _ = unsubscribe_if_any(env, SUBSCRIPTION);
            return Err(format!(
                "lanes ({}): {e}; amqp.subscription_status: {status}\n--- server log ---\n{}",
                shape.label(),
                server_log(env, 200)
            ));
        }
    };
    let secs = (done - t0).as_secs_f64();
    let status = subscription_status(env, SUBSCRIPTION);
    unsubscribe_if_any(env, SUBSCRIPTION)?;
    let rows = count(&mut Ctx::of(env), "bench_lane_effect")?;
    if rows != n as i64 {
        return Err(format!(
            "lanes ({}): expected exactly {n} effects, got {rows}; status {status}",
            shape.label()
        ));
    }
    env.purge(&q)?;
    Ok(Outcome {
        rate: n as f64 / secs,
        secs,
        load,
        extra: json!({ "lanes": status.get("lanes"), "failed": status.get("failed") }),
    })
}

/// The application consumer with the same parallelism: that many consumers and connections.
fn app_once(cx: &mut Ctx, shape: Shape, n: u64, tag: &str) -> Result<Outcome, String> {
    let q = queue("app");
    cx.sql("TRUNCATE public.app_effect")?;
    fill_keyed(cx, &q, tag, n, None)?;
    cx.sql("CHECKPOINT")?;
    let lanes = shape.parallelism.max(1) as u16;
    let prefetch = (PREFETCH / lanes).max(1);
    let apps = runtime().block_on(async {
        let mut v = Vec::new();
        for _ in 0..lanes {
            v.push(app_connect(&cx.pg_conn, &cx.amqp_uri).await?);
        }
        Ok::<_, String>(v)
    })?;
    let load = load1();
    let done_count = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let tasks: Vec<_> = apps
        .into_iter()
        .map(|app| {
            runtime().spawn(app_consume_shared(
                app,
                q.clone(),
                n,
                done_count.clone(),
                prefetch,
                shape.handler_ms / 1000.0,
            ))
        })
        .collect();
    let done = wait_rows(cx, "app_effect", n, timeout_for(n), || {
        tasks
            .iter()
            .any(|t| t.is_finished())
            .then(|| "an app consumer stopped before app_effect had every row".to_string())
            .filter(|_| done_count.load(std::sync::atomic::Ordering::Acquire) < n)
    })?;
    let secs = (done - t0).as_secs_f64();
    for t in tasks {
        let (_, app) = runtime()
            .block_on(t)
            .map_err(|e| format!("app consumer task: {e}"))??;
        runtime().block_on(app_close(app));
    }
    let rows = count(cx, "app_effect")?;
    if rows != n as i64 {
        return Err(format!(
            "app consumer ({}): expected {n} rows, got {rows}",
            shape.label()
        ));
    }
    cx.amqp.purge_queue(&q)?;
    Ok(Outcome {
        rate: n as f64 / secs,
        secs,
        load,
        extra: json!({}),
    })
}

/// 11. Lanes.
pub fn lanes(env: &mut Env, opts: &Opts, run: &mut Run) -> Result<(), String> {
    setup(env)?;
    let r = measure(env, opts, run);
    cleanup(env);
    r
}

fn measure(env: &mut Env, opts: &Opts, run: &mut Run) -> Result<(), String> {
    let handler_ms: &[f64] = if opts.quick {
        &[1.0]
    } else {
        &[0.0, 1.0, 10.0]
    };
    let parallelism = [1, 2, 4, 8];
    let sec = "11 lanes";
    let mut details = Vec::new();
    let mut by_shape: Vec<(Shape, f64, f64)> = Vec::new();
    for &h in handler_ms {
        // Long handlers: fewer messages, about the same time per run.
        let n = if h >= 10.0 {
            opts.lanes_n / 4
        } else {
            opts.lanes_n
        };
        for &p in &parallelism {
            let shape = Shape {
                parallelism: p,
                handler_ms: h,
                keys: None,
            };
            let s = subscription_once(env, shape, n, &format!("lanes-{p}-{h}"))?;
            let a = app_once(&mut Ctx::of(env), shape, n, &format!("app-{p}-{h}"))?;
            log(format!(
                "  lanes {}: subscription {:.0} msg/s, application {:.0} msg/s (load {:.1})",
                shape.label(),
                s.rate,
                a.rate,
                s.load
            ));
            details.push(
                json!({"shape": shape.label(), "n": n, "subscription": s.rate,
                                "app": a.rate, "secs": s.secs, "extra": s.extra}),
            );
            by_shape.push((shape, s.rate, a.rate));
            run.fig(
                Figure::new(
                    sec,
                    &format!("subscription / application consumer, {}", shape.label()),
                    &format!("{n} messages"),
                    "msg/s",
                )
                .samples(vec![s.rate])
                .baseline("app", vec![a.rate]),
            );
        }
    }
    for keys in [1u64, 10, 1000] {
        let shape = Shape {
            parallelism: 8,
            handler_ms: 1.0,
            keys: Some(keys),
        };
        let n = opts.lanes_n;
        let s = subscription_once(env, shape, n, &format!("keys-{keys}"))?;
        log(format!("  lanes {}: {:.0} msg/s", shape.label(), s.rate));
        details
            .push(json!({"shape": shape.label(), "n": n, "subscription": s.rate, "secs": s.secs}));
        by_shape.push((shape, s.rate, f64::NAN));
    }
    let rate = |p: i32, keys: Option<u64>| {
        by_shape
            .iter()
            .filter(|(s, _, _)| s.parallelism == p && s.handler_ms == 1.0 && s.keys == keys)
            .map(|(_, r, _)| *r)
            .collect::<Vec<f64>>()
    };
    let (one, eight) = (rate(1, None), rate(8, None));
    run.fig(
        Figure::new(
            sec,
            "8 lanes / 1 lane, 1 ms handlers (target ≥ 4)",
            &format!("{} messages", opts.lanes_n),
            "msg/s",
        )
        .samples(eight.clone())
        .baseline("1 lane", one.clone())
        .target(Target::RatioAtLeast(4.0)),
    );
    let ratio = median(&eight) / median(&one);
    run.summary.push(format!(
        "lanes (1 ms handlers): 1 lane {:.0} msg/s, 8 lanes {:.0} msg/s, ratio {ratio:.2} (target ≥ 4: {}); \
         ordered by key with 8 lanes: 1 key {:.0}, 10 keys {:.0}, 1,000 keys {:.0} msg/s",
        median(&one),
        median(&eight),
        if ratio >= 4.0 { "met" } else { "**not met**" },
        median(&rate(8, Some(1))),
        median(&rate(8, Some(10))),
        median(&rate(8, Some(1000))),
    ));
    run.detail("lanes", json!({ "runs": details }));
    Ok(())
}
