//! Cases 2 and 3: the worker or PostgreSQL dies under load.

use std::time::{Duration, Instant};

use amqp_outbox_e2e::chaos::send_signal;
use amqp_outbox_e2e::{eventually, StopMode};

use super::harness::*;

// ------------------------------------------------------------------------------------------
// 2. worker killed
// ------------------------------------------------------------------------------------------

#[test]
fn case02_worker_killed_comes_back_and_loses_nothing() {
    let mut rig = Rig::new("2 worker killed", base_config());
    let producers = rig.producers("wk", 3, u64::MAX, 10, 0.05);
    let terminations = 3;
    let mut previous: Option<i32> = None;
    let mut restart_times = Vec::new();
    for kill in 0..=terminations {
        let since = rig.collector.len();
        rig.wait_more_deliveries(since, 200, &format!("deliveries before kill #{kill}"));
        let pid = rig.worker_pid().expect("worker running");
        assert_ne!(Some(pid), previous, "the killed worker is still there");
        let t = Instant::now();
        if kill < terminations {
            // SIGTERM through pg_terminate_backend: the worker must exit non-zero (restart).
            let ok: bool = rig
                .client
                .query_one("SELECT pg_terminate_backend($1)", &[&pid])
                .unwrap()
                .get(0);
            assert!(ok);
        } else {
            // SIGKILL: the postmaster restarts the whole cluster (crash recovery).
            send_signal(pid, libc::SIGKILL).unwrap();
            rig.reconnect();
        }
        let cluster = &rig.cluster;
        let client = &mut rig.client;
        let new = eventually(WORKER_UP, "the worker back", || {
            if client.is_closed() {
                *client = cluster.try_client()?;
            }
            match cluster.worker_pid(client) {
                Ok(Some(p)) if p != pid => Ok(p),
                Ok(other) => Err(format!("worker {other:?}")),
                Err(e) => {
                    if let Ok(c) = cluster.try_client() {
                        *client = c;
                    }
                    Err(e)
                }
            }
        });
        restart_times.push(t.elapsed());
        eprintln!("kill #{kill}: worker {pid} -> {new} in {:?}", t.elapsed());
        previous = Some(pid);
    }
    let heal_at = Instant::now();
    rig.wait_more_deliveries(rig.collector.len(), 200, "deliveries after the last kill");
    join_all(producers);
    let max_restart = restart_times.iter().max().copied().unwrap_or_default();
    let report = rig.finish(
        Some(heal_at),
        (terminations + 1) * MAX_IN_FLIGHT,
        &[],
        &format!(
            "{terminations}x pg_terminate_backend + 1x kill -9; worker back in max {:.1}s",
            max_restart.as_secs_f64()
        ),
    );
    assert!(report.committed > 1000, "{report}");
    // The launcher starts a stopped worker after 2 s (after kill -9 the postmaster restarts the
    // launcher after 5 s); allow for a loaded machine and crash recovery.
    assert!(
        max_restart < Duration::from_secs(30),
        "worker restart took {max_restart:?}"
    );
}

/// Every process of the product terminated at once, again and again, under load, as a
/// maintenance script that ends every backend named like ours would: the launcher, the outbox
/// worker, the subscription worker, the monitor and the subscription's two lanes all come back
/// each time, nothing committed is lost, and the subscription (on a second queue bound to the
/// same route, handled by its lanes) handles each message once.
#[test]
fn case02_every_process_terminated_at_once_comes_back_and_loses_nothing() {
    let mut rig = Rig::new("2 all processes terminated", base_config());
    let rabbit = rig.node.rabbit();
    let sub_queue = rabbit.declare_queue("chaos-all-sub");
    rabbit.bind_queue(
        &sub_queue.queue,
        &rig.route.exchange,
        &rig.route.routing_key,
    );
    rig.client
        .batch_execute(
            "CREATE TABLE public.handled (body text PRIMARY KEY, calls integer NOT NULL DEFAULT 1);
             CREATE FUNCTION public.handle(d amqp.delivery) RETURNS void LANGUAGE sql AS
             $$ INSERT INTO public.handled (body) VALUES (amqp.body_text(d))
                ON CONFLICT (body) DO UPDATE SET calls = handled.calls + 1 $$;",
        )
        .unwrap();
    rig.client
        .execute(
            "SELECT amqp.subscribe('chaos', $1, $2, 'public.handle(amqp.delivery)', \
                                   parallelism => 2)",
            &[&rig.outbox.broker_id, &sub_queue.queue],
        )
        .unwrap();
    let producers = rig.producers("all", 3, u64::MAX, 10, 0.05);
    let rounds = 5;
    let mut terminated = Vec::new();
    for round in 0..rounds {
        let since = rig.collector.len();
        rig.wait_more_deliveries(since, 100, &format!("deliveries before round {round}"));
        let n: i64 = rig
            .client
            .query_one(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                  WHERE backend_type LIKE 'amqp_outbox%'",
                &[],
            )
            .unwrap()
            .get(0);
        terminated.push(n);
        std::thread::sleep(Duration::from_secs(3));
    }
    eprintln!("processes terminated per round: {terminated:?}");
    let back = Instant::now();
    let client = &mut rig.client;
    eventually(
        WORKER_UP,
        "launcher, outbox worker, subscription worker, monitor and two lanes back",
        || {
            let kinds: Vec<String> = client
                .query(
                    "SELECT backend_type FROM pg_stat_activity \
                  WHERE backend_type LIKE 'amqp_outbox%' ORDER BY 1",
                    &[],
                )
                .map_err(|e| e.to_string())?
                .iter()
                .map(|r| r.get(0))
                .collect();
            let want = [
                "amqp_outbox",
                "amqp_outbox lane",
                "amqp_outbox lane",
                "amqp_outbox launcher",
                "amqp_outbox monitor",
                "amqp_outbox subscriptions",
            ];
            if kinds == want {
                Ok(())
            } else {
                client
                    .batch_execute("SELECT pg_stat_clear_snapshot()")
                    .map_err(|e| e.to_string())?;
                Err(format!("{kinds:?}"))
            }
        },
    );
    let heal_at = Instant::now();
    rig.wait_more_deliveries(rig.collector.len(), 200, "deliveries after the last round");
    join_all(producers);
    let report = rig.finish(
        Some(heal_at),
        (rounds + 1) * (MAX_IN_FLIGHT + CONSUMER_PREFETCH),
        &[],
        &format!(
            "{rounds}x every amqp_outbox process terminated at once ({terminated:?}); all back {:.1}s after the last",
            back.elapsed().as_secs_f64()
        ),
    );
    assert!(terminated.iter().all(|n| *n >= 2), "{terminated:?}");
    // The consuming side: every committed message handled, each once.
    let committed = report.committed as i64;
    let client = &mut rig.client;
    let (handled, most_calls) = eventually(drain_timeout(), "every message handled", || {
        let r = client
            .query_one(
                "SELECT count(*), coalesce(max(calls), 0) FROM public.handled \
                  WHERE body NOT LIKE 'e2e.marker.%'",
                &[],
            )
            .map_err(|e| e.to_string())?;
        let (n, calls): (i64, i32) = (r.get(0), r.get(1));
        if n >= committed {
            Ok((n, calls))
        } else {
            Err(format!("{n} of {committed} handled"))
        }
    });
    assert_eq!(most_calls, 1, "a message was handled more than once");
    eventually(
        WORKER_UP,
        "the subscription's two lanes, nothing left waiting",
        || {
            let r = client
                .query_one("SELECT lanes, waiting FROM amqp.subscription_status", &[])
                .map_err(|e| e.to_string())?;
            let (lanes, waiting): (i32, i64) = (r.get(0), r.get(1));
            if (lanes, waiting) == (2, 0) {
                Ok(())
            } else {
                Err(format!("lanes {lanes}, waiting {waiting}"))
            }
        },
    );
    assert!(
        handled <= committed + report.unknown_delivered.len() as i64,
        "{handled} handled, {committed} committed: {report}"
    );
}

// ------------------------------------------------------------------------------------------
// 3. PostgreSQL crash
// ------------------------------------------------------------------------------------------

#[test]
fn case03_postgres_immediate_stop_under_load() {
    let mut rig = Rig::new("3 PostgreSQL crash", base_config());
    let producers = rig.producers("pc", 4, u64::MAX, 3, 0.1);
    let since = rig.collector.len();
    rig.wait_more_deliveries(since, 500, "deliveries before the crash");
    rig.cluster.stop(StopMode::Immediate);
    rig.cluster.start();
    let heal_at = Instant::now();
    rig.reconnect();
    wait_published(
        &producers,
        500,
        "producers to commit again after the restart",
    );
    let stats = join_all(producers);
    let unknown: u64 = stats.iter().map(|s| s.unknown).sum();
    let report = rig.finish(
        Some(heal_at),
        MAX_IN_FLIGHT + CONSUMER_PREFETCH,
        &[],
        &format!(
            "pg_ctl stop -m immediate + start; {unknown} messages with COMMIT outcome unknown"
        ),
    );
    assert!(report.aborted > 0, "{report}");
}
