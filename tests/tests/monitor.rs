//! The reconciliation monitor's promises, each against a real broker (a private one where it
//! is stopped) and a real PostgreSQL with the monitor in its own process:
//!
//! - a message is timed from its delivery to the broker: an outage before delivery makes
//!   nothing lost, and nothing is compensated for messages the consumer handled;
//! - a silent consumer gets at most `max_resends` copies, never two waiting at once, and the
//!   message is then given up as lost (finished);
//! - a compensation never runs for a consumer that answered ok before it ran;
//! - being late needs no look: it shows as it comes, and is recorded when the message is
//!   decided.

use std::time::{Duration, Instant};

use amqp_outbox_e2e::chaos::proc_stat_field;
use amqp_outbox_e2e::outbox::{add_broker, create_extension};
use amqp_outbox_e2e::{eventually, AmqpEndpoint, PgCluster, PgConfig, PrivateRabbit, Rabbit};
use amqp_outbox_testkit::amqp_admin::AmqpAdmin;
use postgres::Client;

const UP: Duration = Duration::from_secs(60);
const MONITOR: &str = "amqp_outbox monitor";

/// A database `shop` whose monitor runs, with a broker and (`receipts`: exchange, queue) the
/// receipts collected by its own subscription.
fn shop(
    endpoint: &AmqpEndpoint,
    receipts: Option<(&str, &str)>,
    settings: &[(&str, &str)],
) -> (PgCluster, Client, i32) {
    let mut config = PgConfig {
        database: "shop".to_string(),
        ..PgConfig::default()
    }
    .setting("amqp_outbox.database", "'shop'");
    if let Some((exchange, _)) = receipts {
        config = config.setting("amqp_outbox.receipts_exchange", format!("'{exchange}'"));
    }
    for (k, v) in settings {
        config = config.setting(k, *v);
    }
    let cluster = PgCluster::new(config);
    let mut c = cluster.client_db("shop");
    create_extension(&mut c);
    let broker = add_broker(&mut c, endpoint);
    if let Some((exchange, queue)) = receipts {
        c.query_one(
            "SELECT amqp.collect_receipts($1, $2, $3)",
            &[&broker, &exchange, &queue],
        )
        .unwrap_or_else(|e| panic!("collect_receipts: {e}"));
    }
    c.batch_execute(
        "CREATE SEQUENCE undo_calls;
         CREATE TABLE undone (message_id text, consumer text);
         -- Fails on its first call, records the compensation after.
         CREATE FUNCTION undo(original amqp.produced, failure amqp.receipt) RETURNS void
             LANGUAGE plpgsql AS $$
         BEGIN
             IF nextval('undo_calls') = 1 THEN
                 RAISE EXCEPTION 'compensation fails once';
             END IF;
             INSERT INTO undone VALUES (original.message_id, failure.consumer);
         END $$;",
    )
    .unwrap_or_else(|e| panic!("compensation handler: {e}"));
    (cluster, c, broker)
}

fn scalar(c: &mut Client, sql: &str) -> Result<i64, String> {
    c.query_one(sql, &[])
        .map(|r| r.get::<_, i64>(0))
        .map_err(|e| e.to_string())
}

fn wait_consuming(c: &mut Client, n: i64) {
    eventually(
        UP,
        &format!("{n} subscription(s) consuming"),
        || match scalar(
            c,
            "SELECT count(*) FROM amqp.subscription_status WHERE state = 'consuming'",
        )? {
            m if m == n => Ok(()),
            m => {
                let states: Vec<String> = c
                    .query(
                        "SELECT format('%s %s %s', subscription, state, last_error) FROM amqp.subscription_status",
                        &[],
                    )
                    .map_err(|e| e.to_string())?
                    .iter()
                    .map(|r| r.get(0))
                    .collect();
                Err(format!("{m} consuming: {states:?}"))
            }
        },
    );
}

fn publish(
    c: &mut Client,
    broker: i32,
    exchange: &str,
    business_type: &str,
    n: i32,
) -> Vec<String> {
    let mut tx = c.transaction().expect("BEGIN");
    tx.query(
        "SELECT amqp.publish_message($1, $2, $3, 'message ' || i, business_type => $3)
           FROM generate_series(1, $4) i",
        &[&broker, &exchange, &business_type, &n],
    )
    .unwrap_or_else(|e| panic!("publishing {business_type}: {e}"));
    let ids = tx
        .query(
            "SELECT message_id FROM amqp.message WHERE business_type = $1 AND resends = 0",
            &[&business_type],
        )
        .expect("message ids")
        .iter()
        .map(|r| r.get(0))
        .collect();
    tx.commit().expect("COMMIT");
    ids
}

/// Broker down for 15 s (three times `lost_after`) while 200 messages are committed; the
/// consumer handles them once it is back. Timed from their creation they were all lost at the
/// monitor's first look and compensated (139 of 200 after they had completed); timed from
/// their delivery none is.
///
/// Every connection comes back within a second of the broker (`retry_backoff_max`): with the
/// default backoff (200 ms doubling to 60 s, jittered) the outbox worker and the consumer `mail`
/// each drew their own reconnect after the 15 s outage, and `mail` was often back more than
/// `lost_after` after the messages had been delivered (12 s in one run): then it really was a
/// silent consumer, rightly compensated, and the test failed on any version.
#[test]
fn an_outage_before_delivery_makes_nothing_lost_and_nothing_compensated() {
    let mut rabbit = PrivateRabbit::prepare();
    rabbit.boot();
    let (cluster, mut c, broker) = shop(
        &rabbit.endpoint(),
        Some(("receipts", "q.receipts")),
        &[("amqp_outbox.retry_backoff_max", "1000")],
    );
    c.batch_execute(
        "CREATE TABLE handled (message_id text PRIMARY KEY);
         CREATE FUNCTION handle(d amqp.delivery) RETURNS void LANGUAGE sql AS
             $$ INSERT INTO handled VALUES (d.message_id) ON CONFLICT DO NOTHING $$;
         INSERT INTO amqp.monitor_rule (business_type, consumers, late_after, lost_after, action)
         VALUES ('signup', '{mail}', '2 s', '5 s', 'compensate');
         SELECT amqp.on_failure('signup', 'undo(amqp.produced, amqp.receipt)');",
    )
    .expect("rule");
    c.query_one(
        "SELECT amqp.exchange_declare($1, 'biz', 'topic', false, true),
                amqp.queue_declare($1, 'q.mail'), amqp.queue_bind($1, 'q.mail', 'biz', 'signup'),
                amqp.subscribe('mail', $1, 'q.mail', 'handle(amqp.delivery)'::regprocedure)",
        &[&broker],
    )
    .expect("mail's subscription");
    wait_consuming(&mut c, 2);

    rabbit.stop_app();
    let ids = publish(&mut c, broker, "biz", "signup", 200);
    assert_eq!(ids.len(), 200);
    std::thread::sleep(Duration::from_secs(15));
    rabbit.start_app();

    eventually(
        Duration::from_secs(180),
        "200 messages complete",
        || match scalar(
            &mut c,
            "SELECT count(*) FROM amqp.produced WHERE outcome = 'complete'",
        )? {
            200 => Ok(()),
            n => Err(format!("{n} complete\n{}", cluster.log_tail(5))),
        },
    );
    let handled = scalar(&mut c, "SELECT count(*) FROM handled").expect("handled");
    let given_up = scalar(
        &mut c,
        "SELECT count(*) FROM amqp.produced WHERE lost_at IS NOT NULL",
    )
    .expect("lost");
    let compensations =
        scalar(&mut c, "SELECT count(*) FROM amqp.compensation").expect("compensations");
    let undone = scalar(&mut c, "SELECT count(*) FROM undone").expect("undone");
    let lost_stat = scalar(
        &mut c,
        "SELECT coalesce(sum(lost), 0)::int8 FROM amqp.daily_stats WHERE business_type = 'signup'",
    )
    .expect("daily_stats");
    assert_eq!(
        (handled, given_up, compensations, undone, lost_stat),
        (200, 0, 0, 0, 0),
        "(handled, lost, compensations queued, compensated, lost in daily_stats)"
    );
}

/// A consumer that never answers, under 'resend' with max_resends 2: while the broker is down
/// the copy waits in the outbox and no second one joins it (one per lost_after piled up and
/// went out in a burst); after the broker is back, the message is resent twice in all and then
/// given up as lost, finished: its queue holds exactly three copies of each message.
#[test]
fn a_silent_consumer_gets_at_most_max_resends_copies_never_two_at_once() {
    let mut rabbit = PrivateRabbit::prepare();
    rabbit.boot();
    let endpoint = rabbit.endpoint();
    let (_cluster, mut c, broker) = shop(&endpoint, None, &[]);
    c.batch_execute(
        "INSERT INTO amqp.monitor_rule (business_type, consumers, late_after, lost_after, action, max_resends)
         VALUES ('audit', '{archive}', '1 s', '2 s', 'resend', 2);",
    )
    .expect("rule");
    c.query_one(
        "SELECT amqp.exchange_declare($1, 'biz', 'topic', false, true),
                amqp.queue_declare($1, 'q.archive'), amqp.queue_bind($1, 'q.archive', 'biz', 'audit')",
        &[&broker],
    )
    .expect("archive's queue");
    let ids = publish(&mut c, broker, "biz", "audit", 3);
    eventually(UP, "3 messages delivered", || {
        match scalar(&mut c, "SELECT count(*) FROM amqp.produced")? {
            3 => Ok(()),
            n => Err(format!("{n} delivered")),
        }
    });

    rabbit.stop_app();
    let down = Instant::now();
    let mut most = 0i64;
    let mut copies_seen = 0i64;
    while down.elapsed() < Duration::from_secs(12) {
        let r = c
            .query_one(
                "SELECT coalesce(max(n), 0), count(*) FROM
                   (SELECT message_id, count(*) AS n FROM amqp.message GROUP BY 1) m",
                &[],
            )
            .expect("copies");
        most = most.max(r.get(0));
        copies_seen = copies_seen.max(r.get(1));
        std::thread::sleep(Duration::from_millis(300));
    }
    rabbit.start_app();
    assert!(
        copies_seen > 0,
        "no copy was made while the broker was down"
    );
    assert_eq!(
        most, 1,
        "a second copy of a message joined one still waiting"
    );

    eventually(
        Duration::from_secs(120),
        "3 messages lost",
        || match scalar(
            &mut c,
            "SELECT count(*) FROM amqp.produced WHERE outcome = 'lost' AND resends = 2",
        )? {
            3 => Ok(()),
            n => Err(format!("{n} given up after 2 resends")),
        },
    );
    // Time for a resend too many, had the bound not held.
    std::thread::sleep(Duration::from_secs(6));
    let resends: Vec<i32> = c
        .query("SELECT resends FROM amqp.produced ORDER BY 1", &[])
        .expect("resends")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(resends, vec![2, 2, 2]);
    let admin = AmqpAdmin::connect(&endpoint.uri()).expect("admin connection");
    let in_queue = eventually(UP, "every copy in the queue", || {
        match admin.queue_counts("q.archive")? {
            Some(q) if q.messages == 9 => Ok(q.messages),
            other => Err(format!("{other:?}")),
        }
    });
    assert_eq!(in_queue, 9, "the 3 messages and 2 copies of each");
    let stats = c
        .query_one(
            "SELECT late::int8, lost::int8, resent::int8 FROM amqp.daily_stats WHERE business_type = 'audit'",
            &[],
        )
        .expect("daily_stats");
    assert_eq!(
        (
            stats.get::<_, i64>(0),
            stats.get::<_, i64>(1),
            stats.get::<_, i64>(2)
        ),
        (3, 3, 6),
        "(late, lost, resent)"
    );
    for id in &ids {
        let events: Vec<String> = c
            .query("SELECT event FROM amqp.trace($1)", &[id])
            .expect("trace")
            .iter()
            .map(|r| r.get(0))
            .collect();
        for want in ["late", "resent", "delivered again", "lost", "finished"] {
            assert!(
                events.iter().any(|e| e == want),
                "{id} lacks {want}: {events:?}"
            );
        }
    }
}

/// billing answers 'failed', the compensation fails once (retried after 10 s), and billing
/// answers ok meanwhile: the compensation is cancelled and never runs, and the message
/// completes. (It ran at its retry, after the message had completed.)
#[test]
fn a_compensation_never_runs_for_a_consumer_that_answered_ok_before_it() {
    let rabbit = Rabbit::shared();
    let tag = format!("monitor_cancel_{}", std::process::id());
    let (exchange, receipts, receipts_queue, queue) = (
        format!("{tag}.biz"),
        format!("{tag}.receipts"),
        format!("{tag}.q.receipts"),
        format!("{tag}.q.billing"),
    );
    let (_cluster, mut c, broker) = shop(
        rabbit.endpoint(),
        Some((&receipts, &receipts_queue)),
        &[
            ("amqp_outbox.retry_backoff_min", "10000"),
            ("amqp_outbox.retry_backoff_max", "10000"),
        ],
    );
    c.batch_execute(
        "INSERT INTO amqp.monitor_rule (business_type, consumers, late_after, lost_after, action)
         VALUES ('refund', '{billing}', '60 s', '120 s', 'compensate');
         SELECT amqp.on_failure('refund', 'undo(amqp.produced, amqp.receipt)');",
    )
    .expect("rule");
    c.query_one(
        "SELECT amqp.exchange_declare($1, $2, 'topic', false, true),
                amqp.queue_declare($1, $3), amqp.queue_bind($1, $3, $2, 'refund')",
        &[&broker, &exchange, &queue],
    )
    .expect("billing's queue");
    wait_consuming(&mut c, 1);
    let id = publish(&mut c, broker, &exchange, "refund", 1).remove(0);
    eventually(UP, "the refund delivered", || {
        match scalar(&mut c, "SELECT count(*) FROM amqp.produced")? {
            1 => Ok(()),
            n => Err(format!("{n}")),
        }
    });
    // As billing would answer, through its own outbox.
    c.query_one(
        "SELECT amqp.send_receipt($1, 'billing', $2, false, 'billing down', 'refund')",
        &[&broker, &id],
    )
    .expect("failed receipt");
    eventually(UP, "the compensation's first failure", || {
        let r = c
            .query_opt(
                "SELECT attempts, last_error FROM amqp.compensation WHERE message_id = $1",
                &[&id],
            )
            .map_err(|e| e.to_string())?;
        match r.map(|r| (r.get::<_, i32>(0), r.get::<_, Option<String>>(1))) {
            Some((1, Some(e))) if e.contains("compensation fails once") => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    c.query_one(
        "SELECT amqp.send_receipt($1, 'billing', $2, true, NULL, 'refund')",
        &[&broker, &id],
    )
    .expect("ok receipt");
    eventually(UP, "the refund complete", || {
        let outcome: Option<String> = c
            .query_one(
                "SELECT outcome FROM amqp.produced WHERE message_id = $1",
                &[&id],
            )
            .map_err(|e| e.to_string())?
            .get(0);
        match outcome.as_deref() {
            Some("complete") => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    // Past the retry's time: it must not come.
    std::thread::sleep(Duration::from_secs(12));
    let state: String = c
        .query_one(
            "SELECT state FROM amqp.compensation WHERE message_id = $1",
            &[&id],
        )
        .expect("compensation")
        .get(0);
    let calls = scalar(
        &mut c,
        "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM undo_calls",
    )
    .expect("calls");
    let undone = scalar(&mut c, "SELECT count(*) FROM undone").expect("undone");
    assert_eq!(
        (state.as_str(), calls, undone),
        ("cancelled", 1, 0),
        "(compensation state, handler calls, compensations made)"
    );
    let events: Vec<String> = c
        .query("SELECT event FROM amqp.trace($1)", &[&id])
        .expect("trace")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(
        events.iter().any(|e| e == "compensation cancelled"),
        "{events:?}"
    );
    // The receipts themselves are of their own business type, monitored by no rule.
    let kinds: Vec<(String, String)> = c
        .query(
            "SELECT DISTINCT routing_key, business_type FROM amqp.produced WHERE exchange = $1",
            &[&receipts],
        )
        .expect("the receipts' records")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        kinds,
        vec![("billing".to_string(), "amqp_outbox.receipt".to_string())]
    );
    if let Ok(admin) = AmqpAdmin::connect(&rabbit.endpoint().uri()) {
        admin.delete_all(
            &[receipts_queue, queue],
            &[exchange, receipts],
            Duration::from_secs(10),
        );
    }
}

/// Being late needs no look: a silent message shows late in `amqp.reconciliation` and
/// `amqp.health()` as soon as `late_after` has passed, while its record stays as delivery left
/// it (the monitor wrote every message at that time, 2,000 looks a second for a consumer's
/// backlog). The look that decides a message records when it became late and counts it: one
/// answered after `late_after` and one given up as lost are late, one answered in time is not.
#[test]
fn being_late_needs_no_look_and_is_counted_when_the_message_is_decided() {
    let rabbit = Rabbit::shared();
    let tag = format!("monitor_late_{}", std::process::id());
    let (exchange, queue) = (format!("{tag}.biz"), format!("{tag}.q.archive"));
    let (_cluster, mut c, broker) = shop(rabbit.endpoint(), None, &[]);
    c.batch_execute(
        "INSERT INTO amqp.monitor_rule (business_type, consumers, late_after, lost_after, action)
         VALUES ('audit', '{archive,billing}', '2 s', '9 s', 'report');",
    )
    .expect("rule");
    c.query_one(
        "SELECT amqp.exchange_declare($1, $2, 'topic', false, true),
                amqp.queue_declare($1, $3), amqp.queue_bind($1, $3, $2, 'audit')",
        &[&broker, &exchange, &queue],
    )
    .expect("archive's queue");
    let ids = publish(&mut c, broker, &exchange, "audit", 3);
    let (in_time, answered_late, silent) = (&ids[0], &ids[1], &ids[2]);
    eventually(UP, "3 messages delivered", || {
        match scalar(&mut c, "SELECT count(*) FROM amqp.produced")? {
            3 => Ok(()),
            n => Err(format!("{n} delivered")),
        }
    });
    // As the receipts collection would record them.
    let answer = |c: &mut Client, id: &str, consumer: &str| {
        c.execute(
            "INSERT INTO amqp.receipt (message_id, message_at, consumer, status, business_type)
             SELECT message_id, message_at, $2, 'ok', business_type FROM amqp.produced
              WHERE message_id = $1",
            &[&id, &consumer],
        )
        .unwrap_or_else(|e| panic!("receipt of {consumer} for {id}: {e}"));
    };
    for consumer in ["archive", "billing"] {
        answer(&mut c, in_time, consumer);
    }
    answer(&mut c, answered_late, "archive");
    eventually(
        UP,
        "the message answered in time complete",
        || match scalar(
            &mut c,
            "SELECT count(*) FROM amqp.produced WHERE outcome = 'complete'",
        )? {
            1 => Ok(()),
            n => Err(format!("{n} complete")),
        },
    );

    // Late from 2 s after delivery: shown without a write to its record.
    let record = "SELECT xmin::text || ' ' || coalesce(late_at::text, '-') || ' ' || check_at::text
                    FROM amqp.produced WHERE message_id = $1";
    let before: String = c
        .query_one(record, &[silent])
        .expect("the silent message's record")
        .get(0);
    eventually(Duration::from_secs(20), "health reports 2 late", || {
        let late: Vec<String> = c
            .query(
                "SELECT message_id FROM amqp.reconciliation WHERE status = 'late' ORDER BY 1",
                &[],
            )
            .map_err(|e| e.to_string())?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let health: String = c
            .query_one(
                "SELECT status || ': ' || detail FROM amqp.health() WHERE component = 'late'",
                &[],
            )
            .map_err(|e| e.to_string())?
            .get(0);
        let mut want = vec![answered_late.clone(), silent.clone()];
        want.sort();
        if late == want && health.starts_with("warning: 2 late") {
            Ok(())
        } else {
            Err(format!("late {late:?}, health {health}"))
        }
    });
    let after: String = c
        .query_one(record, &[silent])
        .expect("the silent message's record")
        .get(0);
    assert_eq!(after, before, "the monitor wrote a message for being late");
    let first_look_when_lost: bool = c
        .query_one(
            "SELECT late_at IS NULL AND check_at = delivered_at + interval '9 s'
               FROM amqp.produced WHERE message_id = $1",
            &[silent],
        )
        .expect("the silent message's record")
        .get(0);
    assert!(
        first_look_when_lost,
        "the silent message is looked at first when it would be lost: {after}"
    );
    let late_stat =
        "SELECT coalesce(sum(late), 0)::int8 FROM amqp.daily_stats WHERE business_type = 'audit'";
    assert_eq!(
        scalar(&mut c, late_stat),
        Ok(0),
        "late counted before any was decided"
    );

    // billing answers the second one now, late: it completes, late.
    answer(&mut c, answered_late, "billing");
    eventually(UP, "the late answer decided", || {
        match scalar(
            &mut c,
            "SELECT count(*) FROM amqp.produced WHERE outcome = 'complete'",
        )? {
            2 => Ok(()),
            n => Err(format!("{n} complete")),
        }
    });
    eventually(
        Duration::from_secs(30),
        "the silent one lost",
        || match scalar(
            &mut c,
            "SELECT count(*) FROM amqp.produced WHERE outcome = 'lost'",
        )? {
            1 => Ok(()),
            n => Err(format!("{n} lost")),
        },
    );
    let rows = c
        .query(
            "SELECT message_id, late_at IS NOT NULL,
                    coalesce(late_at = delivered_at + interval '2 s', false), outcome
               FROM amqp.produced ORDER BY message_id",
            &[],
        )
        .expect("records");
    let got: Vec<(String, bool, bool, String)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    let mut want = vec![
        (in_time.clone(), false, false, "complete".to_string()),
        (answered_late.clone(), true, true, "complete".to_string()),
        (silent.clone(), true, true, "lost".to_string()),
    ];
    want.sort();
    assert_eq!(
        got, want,
        "(message, late, late_at when it became late, outcome)"
    );
    assert_eq!(scalar(&mut c, late_stat), Ok(2), "late in daily_stats");
    let events: Vec<String> = c
        .query("SELECT event FROM amqp.trace($1)", &[silent])
        .expect("trace")
        .iter()
        .map(|r| r.get(0))
        .collect();
    for want in ["late", "lost", "finished"] {
        assert!(
            events.iter().any(|e| e == want),
            "{silent} lacks {want}: {events:?}"
        );
    }
}

/// The broker blocks publishers (a disk alarm) while a subscription works through 30 messages
/// with receipts on and `amqp_outbox.max_pending` 5: the receipts beyond it are refused
/// (53400). Each refusal failed its message and rolled back its effect, again at every retry;
/// now a receipt that cannot be sent is logged and the message is handled all the same, once.
#[test]
fn receipts_refused_at_max_pending_undo_no_handling() {
    let mut rabbit = PrivateRabbit::prepare();
    rabbit.boot();
    let endpoint = rabbit.endpoint();
    let (cluster, mut c, broker) = shop(
        &endpoint,
        None,
        &[
            ("amqp_outbox.receipts_exchange", "'receipts'"),
            ("amqp_outbox.max_pending", "5"),
        ],
    );
    c.batch_execute(
        "CREATE TABLE handled (body text PRIMARY KEY, calls integer NOT NULL DEFAULT 1);
         CREATE FUNCTION handle(d amqp.delivery) RETURNS void LANGUAGE sql AS
             $$ INSERT INTO handled VALUES (amqp.body_text(d))
                ON CONFLICT (body) DO UPDATE SET calls = handled.calls + 1 $$;",
    )
    .expect("handler");
    c.query_one(
        "SELECT amqp.exchange_declare($1, 'receipts', 'topic', false, true),
                amqp.queue_declare($1, 'q.app'),
                amqp.subscribe('app', $1, 'q.app', 'handle(amqp.delivery)'::regprocedure, 10, 3)",
        &[&broker],
    )
    .expect("subscription");
    wait_consuming(&mut c, 1);
    let worker = |c: &mut Client| -> Option<i32> {
        c.query_one(
            "SELECT subscription_worker_pid FROM amqp.worker_status WHERE database = current_database()",
            &[],
        )
        .ok()
        .and_then(|r| r.get(0))
    };
    let before = worker(&mut c);
    c.batch_execute("SELECT amqp.pause_subscription('app')")
        .expect("pause");
    let admin = AmqpAdmin::connect(&endpoint.uri()).expect("admin connection");
    for i in 0..30 {
        admin
            .publish(
                "",
                "q.app",
                format!("m-{i}").as_bytes(),
                lapin::BasicProperties::default()
                    .with_message_id(format!("id-{i}").into())
                    .with_delivery_mode(2),
            )
            .unwrap_or_else(|e| panic!("publishing: {e}"));
    }
    rabbit.set_disk_free_limit("100000GB");
    eventually(UP, "the disk alarm", || match rabbit.has_alarm()? {
        true => Ok(()),
        false => Err("no alarm yet".into()),
    });
    // The outbox fills up to max_pending while the broker refuses to take anything.
    c.query_one(
        "SELECT count(amqp.publish($1, 'receipts', 'filler', 'f' || g)) FROM generate_series(1, 10) g",
        &[&broker],
    )
    .expect("filler");
    eventually(UP, "the outbox at max_pending", || {
        match scalar(
            &mut c,
            "SELECT coalesce(max(pending), 0) FROM amqp.broker_status",
        )? {
            n if n >= 5 => Ok(()),
            n => Err(format!("{n} pending")),
        }
    });
    c.batch_execute("SELECT amqp.resume_subscription('app')")
        .expect("resume");
    eventually(UP, "30 messages handled", || {
        match scalar(&mut c, "SELECT count(*) FROM handled")? {
            30 => Ok(()),
            n => Err(format!("{n} handled")),
        }
    });
    assert!(
        rabbit.has_alarm().unwrap_or(false),
        "the alarm must still be up"
    );
    let log = cluster.log();
    assert!(
        log.contains("no receipt for message") && log.contains("53400"),
        "no receipt was refused: the test did not reach max_pending\n{}",
        cluster.log_tail(20)
    );
    let twice = scalar(&mut c, "SELECT count(*) FROM handled WHERE calls > 1").expect("calls");
    let failed = scalar(&mut c, "SELECT count(*) FROM amqp.inbox_failed").expect("failed");
    assert_eq!(
        (twice, failed),
        (0, 0),
        "(handled twice, recorded as failed)"
    );
    assert_eq!(worker(&mut c), before, "the subscription worker restarted");
    rabbit.set_disk_free_limit("50MB");
}

/// The production log's upkeep (a new day's partition) waits at most 200 ms for its lock and
/// tries again later: a session holding `amqp.produced` for 25 s while messages are delivered
/// delays no delivery by more than a moment. (Waiting with the default lock_timeout, the
/// upkeep's queued lock request held every delivery's insert into the log for 10 s at a time.)
#[test]
fn the_production_logs_upkeep_never_holds_deliveries_behind_a_lock() {
    let rabbit = Rabbit::shared();
    let route = rabbit.declare_route("monitor-upkeep");
    let (cluster, mut c, broker) = shop(rabbit.endpoint(), None, &[]);
    let mut holder = cluster.client_db("shop");
    holder
        .batch_execute("BEGIN; LOCK TABLE amqp.produced IN ROW EXCLUSIVE MODE")
        .expect("the holder's lock");
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(25) {
        c.query_one(
            "SELECT amqp.publish($1, $2, $3, 'tick')",
            &[&broker, &route.exchange, &route.routing_key],
        )
        .expect("publish");
        std::thread::sleep(Duration::from_millis(200));
    }
    eventually(UP, "every tick delivered", || {
        match scalar(&mut c, "SELECT count(*) FROM amqp.message")? {
            0 => Ok(()),
            n => Err(format!("{n} waiting")),
        }
    });
    // Still no day partition: the upkeep gave way each time.
    let days = scalar(
        &mut c,
        "SELECT count(*) FROM pg_inherits WHERE inhparent = 'amqp.produced'::regclass",
    )
    .expect("days");
    assert_eq!(days, 1, "only the default partition while the lock is held");
    let slowest: f64 = c
        .query_one(
            "SELECT extract(epoch FROM max(delivered_at - created_at))::float8 FROM amqp.produced",
            &[],
        )
        .expect("delivery times")
        .get(0);
    assert!(
        slowest < 3.0,
        "a delivery waited {slowest:.1} s behind the upkeep's lock request"
    );
    holder.batch_execute("COMMIT").expect("release");
    eventually(UP, "the day made once the lock is gone", || {
        match scalar(
            &mut c,
            "SELECT count(*) FROM pg_inherits WHERE inhparent = 'amqp.produced'::regclass",
        )? {
            2 => Ok(()),
            n => Err(format!("{n} partitions")),
        }
    });
}

/// A compensation function that catches its cancel and never returns: the monitor is ended at
/// the hard deadline (twice `handler_timeout`), comes back, and goes on with everything else;
/// that compensation waits for its backoff instead of taking the monitor again at once. (The
/// monitor stayed inside it for good: nothing else was classified or compensated.)
#[test]
fn a_compensation_that_never_returns_does_not_keep_the_monitor() {
    let rabbit = Rabbit::shared();
    let tag = format!("monitor_stuck_{}", std::process::id());
    let (exchange, receipts, receipts_queue) = (
        format!("{tag}.biz"),
        format!("{tag}.receipts"),
        format!("{tag}.q.receipts"),
    );
    let (_cluster, mut c, broker) = shop(
        rabbit.endpoint(),
        Some((&receipts, &receipts_queue)),
        &[
            ("amqp_outbox.handler_timeout", "'1s'"),
            ("amqp_outbox.retry_backoff_min", "20000"),
            ("amqp_outbox.retry_backoff_max", "20000"),
        ],
    );
    c.batch_execute(
        "CREATE FUNCTION stubborn(original amqp.produced, failure amqp.receipt) RETURNS void
             LANGUAGE plpgsql AS $$
         BEGIN
             LOOP
                 BEGIN
                     PERFORM pg_sleep(10);
                 EXCEPTION WHEN query_canceled THEN
                     NULL;
                 END;
             END LOOP;
         END $$;
         INSERT INTO amqp.monitor_rule (business_type, consumers, late_after, lost_after, action)
         VALUES ('refund', '{billing}', '60 s', '120 s', 'compensate'),
                ('ping', '{pinger}', '60 s', '120 s', 'report');
         SELECT amqp.on_failure('refund', 'stubborn(amqp.produced, amqp.receipt)');",
    )
    .expect("rules");
    let queue = format!("{tag}.q");
    c.query_one(
        "SELECT amqp.exchange_declare($1, $2, 'topic', false, true),
                amqp.queue_declare($1, $3), amqp.queue_bind($1, $3, $2, '#')",
        &[&broker, &exchange, &queue],
    )
    .expect("exchange and its queue");
    wait_consuming(&mut c, 1);
    let monitor = |c: &mut Client| -> i32 {
        c.query_one(
            "SELECT coalesce(monitor_pid, 0) FROM amqp.worker_status WHERE database = current_database()",
            &[],
        )
        .map(|r| r.get(0))
        .unwrap_or(0)
    };
    let first = eventually(UP, "the monitor", || match monitor(&mut c) {
        0 => Err("none".to_string()),
        p => Ok(p),
    });
    let refund = publish(&mut c, broker, &exchange, "refund", 1).remove(0);
    let ping = publish(&mut c, broker, &exchange, "ping", 1).remove(0);
    eventually(UP, "both delivered", || {
        match scalar(
            &mut c,
            "SELECT count(*) FROM amqp.produced WHERE expected IS NOT NULL",
        )? {
            2 => Ok(()),
            n => Err(format!("{n}")),
        }
    });
    c.query_one(
        "SELECT amqp.send_receipt($1, 'billing', $2, false, 'billing down', 'refund')",
        &[&broker, &refund],
    )
    .expect("failed receipt");
    let second = eventually(
        UP,
        "the monitor ended inside the function, and back",
        || match monitor(&mut c) {
            p if p != 0 && p != first => Ok(p),
            p => Err(format!("monitor {p}")),
        },
    );
    // The monitor goes on: another message's answer is taken and it completes.
    c.query_one(
        "SELECT amqp.send_receipt($1, 'pinger', $2, true, NULL, 'ping')",
        &[&broker, &ping],
    )
    .expect("ok receipt");
    eventually(UP, "the ping complete", || {
        let outcome: Option<String> = c
            .query_one(
                "SELECT outcome FROM amqp.produced WHERE message_id = $1",
                &[&ping],
            )
            .map_err(|e| e.to_string())?
            .get(0);
        match outcome.as_deref() {
            Some("complete") => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    let (state, attempts): (String, i32) = {
        let r = c
            .query_one(
                "SELECT state, attempts FROM amqp.compensation WHERE message_id = $1",
                &[&refund],
            )
            .expect("the compensation");
        (r.get(0), r.get(1))
    };
    assert_eq!(
        (state.as_str(), attempts),
        ("pending", 1),
        "the stubborn compensation waits for its backoff"
    );
    assert_eq!(monitor(&mut c), second, "the monitor ended again");
    if let Ok(admin) = AmqpAdmin::connect(&rabbit.endpoint().uri()) {
        admin.delete_all(
            &[receipts_queue, queue],
            &[exchange, receipts],
            Duration::from_secs(10),
        );
    }
}

/// A process's niceness (field 19 of `/proc/<pid>/stat`).
fn niceness(pid: i32) -> Result<i64, String> {
    proc_stat_field(pid, 19).ok_or_else(|| format!("no niceness for process {pid}"))
}

/// A thread's scheduler slice in ns (`se.slice` of `/proc/.../sched`), where the kernel shows it.
fn slice_of(path: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().find(|l| l.starts_with("se.slice"))?;
    line.split(':').nth(1)?.trim().parse().ok()
}

/// `sched_setattr(2)` on the calling thread: SCHED_OTHER at niceness 0, a slice of `ns` (0: the
/// kernel's default).
fn set_own_slice(ns: u64) -> bool {
    // struct sched_attr, first version: size, policy, flags, nice, priority, runtime, deadline,
    // period.
    #[repr(C)]
    struct Attr(u32, u32, u64, i32, u32, u64, u64, u64);
    let attr = Attr(std::mem::size_of::<Attr>() as u32, 0, 0, 0, 0, ns, 0, 0);
    // SAFETY: the kernel reads `size` bytes of a live struct of that size; 0 is this thread.
    unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const Attr, 0) == 0 }
}

/// Whether this kernel lets a process choose its slice (Linux 6.12 and later): tried on this
/// test's own thread, then undone.
fn custom_slices_supported() -> bool {
    let supported = set_own_slice(100_000) && slice_of("/proc/thread-self/sched") == Some(100_000);
    set_own_slice(0);
    supported
}

/// The database's processes of the given kind (`backend_type`), by pid.
fn pids_of(c: &mut Client, backend_type: &str) -> Vec<i32> {
    c.query(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND backend_type = $1",
        &[&backend_type],
    )
    .map(|rows| rows.iter().map(|r| r.get(0)).collect())
    .unwrap_or_default()
}

/// The monitor is background work: it runs at niceness 10, so that where the CPU is short the
/// delivery and the subscriptions' handlers beside it come first; they keep the server's. Where
/// the kernel lets a process choose its slice, the monitor's is the shortest (100 µs), so that
/// a woken handler does not wait for the rest of a longer one. A monitor that was terminated
/// comes back with both.
#[test]
fn the_monitor_gives_way_to_the_delivery_and_the_handlers() {
    let rabbit = Rabbit::shared();
    let (_cluster, mut c, _broker) = shop(rabbit.endpoint(), None, &[]);
    let first = eventually(UP, "the monitor at niceness 10", || {
        match pids_of(&mut c, MONITOR).as_slice() {
            [pid] => match niceness(*pid)? {
                10 => Ok(*pid),
                n => Err(format!("monitor {pid} at niceness {n}")),
            },
            other => Err(format!("monitors: {other:?}")),
        }
    });
    for kind in ["amqp_outbox", "amqp_outbox subscriptions"] {
        let pid = eventually(UP, kind, || match pids_of(&mut c, kind).as_slice() {
            [pid] => Ok(*pid),
            other => Err(format!("{other:?}")),
        });
        assert_eq!(niceness(pid), Ok(0), "{kind} keeps the server's niceness");
    }
    let slices = custom_slices_supported();
    if slices {
        assert_eq!(
            slice_of(&format!("/proc/{first}/sched")),
            Some(100_000),
            "the monitor's slice"
        );
    } else {
        eprintln!("this kernel does not let a process choose its slice: not checked");
    }
    c.query_one("SELECT pg_terminate_backend($1)", &[&first])
        .expect("pg_terminate_backend");
    eventually(
        UP,
        "a new monitor at niceness 10 (and the short slice)",
        || match pids_of(&mut c, MONITOR).as_slice() {
            [pid] if *pid != first => match niceness(*pid)? {
                10 if slices => match slice_of(&format!("/proc/{pid}/sched")) {
                    Some(100_000) => Ok(()),
                    other => Err(format!("monitor {pid} with the slice {other:?}")),
                },
                10 => Ok(()),
                n => Err(format!("monitor {pid} at niceness {n}")),
            },
            other => Err(format!("monitors: {other:?}")),
        },
    );
}
