//! Case 26: silent consumers at scale. 10,000 × scale monitored messages whose consumer never
//! answers ('resend', max_resends 1), a second monitored type whose consumer (a subscription of
//! the same database, sending receipts) does answer, a steady flow of unmonitored messages on
//! the rig's route, and a broker outage longer than `lost_after`. The silent messages must get
//! at most one copy each, never two waiting at once, and end lost; the answered ones, delivered
//! late by the outage, are never resent, lost or compensated; the monitor keeps looking at
//! what is due; every committed message of the route arrives. The answering consumer is named
//! like the business type it answers for: its receipts (routing key: the consumer's name) must
//! not be taken for messages of that type (they were, and each was lost and compensated).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use amqp_outbox_e2e::chaos::scaled;
use amqp_outbox_e2e::eventually;
use postgres::Client;

use super::harness::*;

const SCHEMA: &str = "
    CREATE TABLE public.answered (message_id text PRIMARY KEY);
    CREATE FUNCTION public.handle(d amqp.delivery) RETURNS void LANGUAGE sql AS
        $$ INSERT INTO public.answered VALUES (d.message_id) ON CONFLICT DO NOTHING $$;
    CREATE TABLE public.undone (message_id text, consumer text);
    CREATE FUNCTION public.undo(original amqp.produced, failure amqp.receipt) RETURNS void
        LANGUAGE sql AS $$ INSERT INTO public.undone VALUES (original.message_id, failure.consumer) $$;
    INSERT INTO amqp.monitor_rule (business_type, consumers, late_after, lost_after, action, max_resends)
    VALUES ('silent', '{nobody}', '2 s', '8 s', 'resend', 1),
           ('answered', '{answered}', '5 s', '20 s', 'compensate', 3);
    SELECT amqp.on_failure('answered', 'public.undo(amqp.produced, amqp.receipt)');";

fn count(client: &mut Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).map(|r| r.get(0)).unwrap_or(-1)
}

/// The longest a due look has waited (seconds), now.
fn due_lag(client: &mut Client) -> f64 {
    client
        .query_one(
            "SELECT coalesce(extract(epoch FROM max(now() - check_at)), 0)::float8 \
               FROM amqp.produced WHERE check_at <= now()",
            &[],
        )
        .map(|r| r.get(0))
        .unwrap_or(0.0)
}

#[test]
#[ignore = "slow: make chaos"]
fn case26_silent_consumers_at_scale_get_bounded_resends_and_late_ones_none() {
    let config = base_config().setting("amqp_outbox.receipts_exchange", "'chaos-26-receipts'");
    let mut rig = Rig::new("26 silent consumers at scale", config);
    let broker = rig.outbox.broker_id;
    rig.client.batch_execute(SCHEMA).unwrap();
    rig.client
        .query_one(
            "SELECT amqp.collect_receipts($1, 'chaos-26-receipts', 'chaos-26.q.receipts'),
                    amqp.exchange_declare($1, 'chaos-26', 'topic', false, true),
                    amqp.queue_declare($1, 'chaos-26.q.silent'),
                    amqp.queue_bind($1, 'chaos-26.q.silent', 'chaos-26', 'silent'),
                    amqp.queue_declare($1, 'chaos-26.q.answered'),
                    amqp.queue_bind($1, 'chaos-26.q.answered', 'chaos-26', 'answered'),
                    amqp.subscribe('answered', $1, 'chaos-26.q.answered',
                                   'public.handle(amqp.delivery)'::regprocedure)",
            &[&broker],
        )
        .unwrap();
    let client = &mut rig.client;
    eventually(WORKER_UP, "both subscriptions consuming", || {
        match count(
            client,
            "SELECT count(*) FROM amqp.subscription_status WHERE state = 'consuming'",
        ) {
            2 => Ok(()),
            n => Err(format!("{n} consuming")),
        }
    });

    // The silent flood, in large transactions.
    let silent = scaled(10_000) as i64;
    let mut published = 0;
    while published < silent {
        let n = (silent - published).min(2_000);
        rig.client
            .execute(
                "SELECT count(amqp.publish_message($1, 'chaos-26', 'silent', 's' || g, business_type => 'silent'))
                   FROM generate_series(1, $2::int8) g",
                &[&broker, &n],
            )
            .unwrap();
        published += n;
    }
    // The steady flows: unmonitored messages on the route (checked by the ledger), and
    // answered ones, about 40 a second, through the whole case.
    let producers = rig.producers("c26", 2, u64::MAX, 20, 0.05);
    let stop = Arc::new(AtomicBool::new(false));
    let answering = {
        let stop = stop.clone();
        let conninfo = rig.cluster.connection_string("e2e");
        std::thread::spawn(move || {
            let mut c = Client::connect(&conninfo, postgres::NoTls).expect("connect");
            let mut n = 0i64;
            while !stop.load(Ordering::Relaxed) {
                if c.execute(
                    "SELECT amqp.publish_message($1, 'chaos-26', 'answered', 'a' || $2::int8::text, business_type => 'answered')",
                    &[&broker, &n],
                )
                .is_ok()
                {
                    n += 1;
                }
                std::thread::sleep(Duration::from_millis(25));
            }
            n
        })
    };
    let client = &mut rig.client;
    eventually(
        drain_timeout(),
        "the silent flood delivered",
        || match count(
            client,
            "SELECT count(*) FROM amqp.produced WHERE business_type = 'silent'",
        ) {
            n if n >= silent => Ok(()),
            n => Err(format!("{n} of {silent} delivered")),
        },
    );

    // The outage: longer than lost_after. A copy made meanwhile waits in the outbox, one per
    // message at most (with receipts collected, none is made before the receipts queue is seen
    // again: until then an answer may be waiting there).
    rig.node.stop_app();
    let down = Instant::now();
    let (mut most_copies, mut max_lag) = (0i64, 0f64);
    while down.elapsed() < Duration::from_secs(20) {
        most_copies = most_copies.max(count(
            &mut rig.client,
            "SELECT coalesce(max(n), 0) FROM (SELECT count(*) AS n FROM amqp.message \
              WHERE business_type = 'silent' GROUP BY message_id) m",
        ));
        max_lag = max_lag.max(due_lag(&mut rig.client));
        std::thread::sleep(Duration::from_secs(2));
    }
    rig.node.start_app();
    let heal_at = Instant::now();

    // Every silent message is given up after its one resend.
    let client = &mut rig.client;
    eventually(drain_timeout(), "every silent message lost", || {
        let lag = due_lag(client);
        if lag > max_lag {
            max_lag = lag;
        }
        match count(
            client,
            "SELECT count(*) FROM amqp.produced WHERE business_type = 'silent' AND outcome = 'lost'",
        ) {
            n if n >= silent => Ok(()),
            n => Err(format!("{n} of {silent} lost")),
        }
    });
    stop.store(true, Ordering::Relaxed);
    let answered_published = answering.join().expect("the answering publisher");
    join_all(producers);
    let report = rig.finish(
        Some(heal_at),
        MAX_IN_FLIGHT + CONSUMER_PREFETCH,
        &[],
        &format!("{silent} silent monitored messages; due looks waited {max_lag:.1} s at most"),
    );
    assert!(report.lost.is_empty());

    let client = &mut rig.client;
    let most_resends = count(
        client,
        "SELECT coalesce(max(resends), 0)::int8 FROM amqp.produced WHERE business_type = 'silent'",
    );
    assert_eq!(most_resends, 1, "resends beyond max_resends");
    assert!(most_copies <= 1, "two copies of a message waited at once");
    // The answered ones: each handled, complete, never resent, lost or compensated.
    eventually(drain_timeout(), "every answered message complete", || {
        match count(
            client,
            "SELECT count(*) FROM amqp.produced WHERE business_type = 'answered' AND outcome = 'complete'",
        ) {
            n if n >= answered_published => Ok(()),
            n => Err(format!("{n} of {answered_published} complete")),
        }
    });
    let wrong = count(
        client,
        "SELECT count(*) FROM amqp.produced WHERE business_type = 'answered' \
          AND (resends > 0 OR lost_at IS NOT NULL OR outcome <> 'complete')",
    );
    let compensated = count(client, "SELECT count(*) FROM public.undone");
    if wrong > 0 {
        // What happened to a few of them, for the failure's report.
        let stories = client
            .query(
                "SELECT p.message_id, string_agg(to_char(t.at, 'HH24:MI:SS.MS') || ' ' || t.event || ' ' || t.detail, E'\n  ' ORDER BY t.at)
                   FROM (SELECT message_id FROM amqp.produced WHERE business_type = 'answered'
                          AND (resends > 0 OR lost_at IS NOT NULL OR outcome <> 'complete') LIMIT 3) p,
                        amqp.trace(p.message_id) t GROUP BY 1",
                &[],
            )
            .map(|rows| {
                rows.iter()
                    .map(|r| format!("{}:\n  {}", r.get::<_, String>(0), r.get::<_, String>(1)))
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .unwrap_or_default();
        eprintln!("answered messages that went wrong:\n{stories}");
    }
    assert_eq!(
        (wrong, compensated),
        (0, 0),
        "answered messages resent, lost or compensated"
    );
    assert!(
        max_lag < 60.0,
        "the monitor fell {max_lag:.1} s behind its schedule"
    );
}
