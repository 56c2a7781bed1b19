//! End-to-end test of reconciliation: a producer database (`users`) publishes tagged messages
//! of four business types; a consumer database (`services`) handles them with subscriptions
//! that send receipts; the producer collects the receipts (`amqp.collect_receipts()`), and its
//! monitor classifies each message against `amqp.monitor_rule`:
//!
//! - `signup` is consumed by `mail`: complete; its traceparent reaches the handler;
//! - `order` is lost on its way to `billing` (purged from the queue while the subscription is
//!   paused): late, then resent with the same message_id (its clock starts again when the copy
//!   reaches the broker), then complete — never counted lost;
//! - `audit` expects `archive`, which never answers: late, then lost, and only reported;
//! - `registration` fails at `coupon` (the message dies, a failed receipt comes back): it is
//!   compensated exactly once, although the compensation fails once and the producer's
//!   monitor is killed (SIGKILL) in the middle of the next attempt.
//!
//! `amqp.trace` tells each story, `amqp.daily_stats` matches the test's own ledger, and
//! `amqp.health()` turns critical while the (private) broker is stopped and ok after.

use std::collections::BTreeMap;
use std::time::Duration;

use amqp_outbox_e2e::chaos::send_signal;
use amqp_outbox_e2e::outbox::{add_broker, create_extension};
use amqp_outbox_e2e::{eventually, PgCluster, PgConfig, PrivateRabbit};
use amqp_outbox_testkit::amqp_admin::AmqpAdmin;
use postgres::Client;

const USERS: &str = "users";
const SERVICES: &str = "services";
const MONITOR: &str = "amqp_outbox monitor";
const UP: Duration = Duration::from_secs(60);
const WITHIN: Duration = Duration::from_secs(60);
const TRACE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

struct Rig {
    users: Client,
    services: Client,
    cluster: PgCluster,
    users_broker: i32,
}

impl Rig {
    fn reconnect(&mut self) {
        let cluster = &self.cluster;
        let (u, s) = (&mut self.users, &mut self.services);
        eventually(UP, "connections to both databases again", || {
            *u = cluster.try_client_db(USERS)?;
            *s = cluster.try_client_db(SERVICES)?;
            u.batch_execute("SELECT 1").map_err(|e| e.to_string())?;
            s.batch_execute("SELECT 1").map_err(|e| e.to_string())
        });
    }
}

fn scalar_i64(c: &mut Client, sql: &str) -> Result<i64, String> {
    c.query_one(sql, &[])
        .map(|r| r.get(0))
        .map_err(|e| format!("{sql}: {e}"))
}

fn text(c: &mut Client, sql: &str) -> Result<Option<String>, String> {
    c.query_opt(sql, &[])
        .map(|r| r.and_then(|r| r.get(0)))
        .map_err(|e| format!("{sql}: {e}"))
}

/// The status of each health check.
fn health(c: &mut Client) -> Result<BTreeMap<String, (String, String)>, String> {
    Ok(
        c.query("SELECT component, status, detail FROM amqp.health()", &[])
            .map_err(|e| format!("amqp.health(): {e}"))?
            .iter()
            .map(|r| (r.get(0), (r.get(1), r.get(2))))
            .collect(),
    )
}

fn all_ok(h: &BTreeMap<String, (String, String)>) -> Result<(), String> {
    match h.iter().find(|(_, (s, _))| s != "ok") {
        None => Ok(()),
        Some((c, (s, d))) => Err(format!("{c}: {s} ({d})")),
    }
}

/// The events of `amqp.trace(message_id)`, in order.
fn trace(c: &mut Client, message_id: &str) -> Vec<(String, String)> {
    c.query("SELECT event, detail FROM amqp.trace($1)", &[&message_id])
        .unwrap_or_else(|e| panic!("amqp.trace: {e}"))
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

fn events(t: &[(String, String)]) -> Vec<&str> {
    t.iter().map(|(e, _)| e.as_str()).collect()
}

/// Publishes one tagged message from `users` in its own transaction; returns its message_id.
fn publish(rig: &mut Rig, business_type: &str, key: &str, traceparent: Option<&str>) -> String {
    let mut tx = rig.users.transaction().expect("BEGIN");
    tx.query_one(
        "SELECT amqp.publish_message($1, 'biz', $2, $3, business_type => $2, business_key => $3, \
                traceparent => $4)",
        &[&rig.users_broker, &business_type, &key, &traceparent],
    )
    .unwrap_or_else(|e| panic!("publishing {business_type}: {e}"));
    let id: String = tx
        .query_one(
            "SELECT message_id FROM amqp.message WHERE id = amqp.last_message_id()",
            &[],
        )
        .expect("message_id")
        .get(0);
    tx.commit().expect("COMMIT");
    id
}

/// The message's status in `amqp.reconciliation` (None: finished).
fn status(c: &mut Client, message_id: &str) -> Result<Option<String>, String> {
    c.query_opt(
        "SELECT status FROM amqp.reconciliation WHERE message_id = $1 ORDER BY outbox LIMIT 1",
        &[&message_id],
    )
    .map(|r| r.map(|r| r.get(0)))
    .map_err(|e| e.to_string())
}

/// Waits until the monitor has stamped `column` (`late_at`, `lost_at`) on the message's record.
/// (A stamp, not a status: on a loaded machine the monitor may see a message late and lost in
/// one look.)
fn wait_stamp(c: &mut Client, message_id: &str, column: &str) {
    let sql = format!(
        "SELECT count(*) FROM amqp.produced WHERE message_id = $1 AND {column} IS NOT NULL"
    );
    eventually(WITHIN, &format!("{column} of {message_id}"), || {
        let n: i64 = c
            .query_one(&sql, &[&message_id])
            .map_err(|e| e.to_string())?
            .get(0);
        if n == 1 {
            Ok(())
        } else {
            Err("not yet".into())
        }
    });
}

fn wait_status(c: &mut Client, message_id: &str, want: Option<&str>, what: &str) {
    eventually(WITHIN, what, || match status(c, message_id)? {
        s if s.as_deref() == want => Ok(()),
        s => Err(format!("status {s:?}")),
    });
}

const SERVICES_SCHEMA: &str = "
CREATE TABLE handled (consumer text, message_id text, business_key text, traceparent text,
                      system_id text, business_type text, created_at text);
CREATE FUNCTION handle(d amqp.delivery) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF d.subscription = 'coupon' THEN
        RAISE EXCEPTION 'coupon service down';
    END IF;
    INSERT INTO handled VALUES (d.subscription, d.message_id, amqp.body_text(d),
        current_setting('amqp_outbox.traceparent', true),
        d.headers ->> 'x-amqp-outbox-system-id', d.headers ->> 'x-amqp-outbox-business-type',
        d.headers ->> 'x-amqp-outbox-created-at');
END $$;
";

const USERS_SCHEMA: &str = "
CREATE SEQUENCE undo_calls;
CREATE TABLE undone (message_id text, consumer text, business_key text, error text);
-- Fails on its first call, sleeps (and is killed) on its second, succeeds after.
CREATE FUNCTION undo_registration(original amqp.produced, failure amqp.receipt) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    n bigint := nextval('undo_calls');
BEGIN
    IF n = 1 THEN
        RAISE EXCEPTION 'compensation fails once';
    END IF;
    INSERT INTO undone VALUES (original.message_id, failure.consumer, original.business_key, failure.error);
    IF n = 2 THEN
        PERFORM pg_sleep(25);
    END IF;
END $$;
";

#[test]
fn lost_silent_and_failed_messages_are_classified_resent_and_compensated() {
    // A missing prerequisite fails the test: scripts/setup.sh installs it.
    assert!(
        amqp_outbox_testkit::rabbitmq_installed(),
        "rabbitmq-server is not installed (scripts/setup.sh installs it)"
    );
    let mut rabbit = PrivateRabbit::prepare();
    rabbit.boot();
    let endpoint = rabbit.endpoint();

    let config = PgConfig {
        database: USERS.to_string(),
        ..PgConfig::default()
    }
    .setting("amqp_outbox.database", format!("'{USERS}, {SERVICES}'"))
    .setting("amqp_outbox.receipts_exchange", "'receipts'")
    .setting("amqp_outbox.retry_backoff_min", "200")
    .setting("amqp_outbox.retry_backoff_max", "1000")
    .setting("amqp_outbox.system_id", "'accounts'");
    let cluster = PgCluster::new(config);
    cluster
        .client_db("postgres")
        .batch_execute(&format!("CREATE DATABASE {SERVICES}"))
        .expect("CREATE DATABASE services");
    let mut users = cluster.client_db(USERS);
    let mut services = cluster.client_db(SERVICES);
    create_extension(&mut users);
    create_extension(&mut services);
    let users_broker = add_broker(&mut users, &endpoint);
    let services_broker = add_broker(&mut services, &endpoint);

    // Consumers: one queue and subscription per service, all bound to the topic exchange biz.
    services
        .batch_execute(SERVICES_SCHEMA)
        .expect("services schema");
    services
        .query_one(
            "SELECT amqp.exchange_declare($1, 'biz', 'topic', false, true)",
            &[&services_broker],
        )
        .expect("exchange");
    for (consumer, key, attempts) in [
        ("mail", "signup", 10),
        ("billing", "order", 10),
        ("coupon", "registration", 1),
    ] {
        let queue = format!("q.{consumer}");
        services
            .query_one(
                "SELECT amqp.queue_declare($1, $2), amqp.queue_bind($1, $2, 'biz', $3)",
                &[&services_broker, &queue, &key],
            )
            .expect("queue");
        services
            .query_one(
                "SELECT amqp.subscribe($1, $2, $3, 'handle(amqp.delivery)'::regprocedure, 10, $4)",
                &[&consumer, &services_broker, &queue, &attempts],
            )
            .unwrap_or_else(|e| panic!("subscribe {consumer}: {e}"));
    }
    // archive's queue: bound, but nobody consumes it.
    services
        .query_one(
            "SELECT amqp.queue_declare($1, 'q.archive'), amqp.queue_bind($1, 'q.archive', 'biz', 'audit')",
            &[&services_broker],
        )
        .expect("archive queue");
    // Producer: receipts, rules, the compensation handler.
    users.batch_execute(USERS_SCHEMA).expect("users schema");
    users
        .query_one(
            "SELECT amqp.exchange_declare($1, 'biz', 'topic', false, true), \
                    amqp.collect_receipts($1, 'receipts', 'q.receipts')",
            &[&users_broker],
        )
        .expect("collect_receipts");
    users
        .batch_execute(
            "INSERT INTO amqp.monitor_rule (business_type, consumers, late_after, lost_after, action) VALUES
                ('signup', '{mail}', '10 s', '60 s', 'report'),
                ('order', '{billing}', '2 s', '10 s', 'resend'),
                ('audit', '{archive}', '2 s', '4 s', 'report'),
                ('registration', '{coupon}', '10 s', '60 s', 'compensate');
             SELECT amqp.on_failure('registration', 'undo_registration(amqp.produced, amqp.receipt)');",
        )
        .expect("rules");
    let mut rig = Rig {
        users,
        services,
        cluster,
        users_broker,
    };

    // Health: ok once the workers run and the broker is connected; critical while the broker
    // is down; ok again after.
    eventually(UP, "every health check ok", || {
        all_ok(&health(&mut rig.users)?)
    });
    rabbit.stop_app();
    let broker_row = format!("broker {users_broker}");
    eventually(WITHIN, "the broker check critical", || {
        let h = health(&mut rig.users)?;
        match h.get(&broker_row) {
            Some((s, _)) if s == "critical" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    rabbit.start_app();
    eventually(UP, "every health check ok again", || {
        all_ok(&health(&mut rig.users)?)
    });
    // The subscriptions consume (the receipts one too) before anything is published.
    eventually(UP, "four subscriptions consuming", || {
        let n = scalar_i64(
            &mut rig.services,
            "SELECT count(*) FROM amqp.subscription_status WHERE state = 'consuming'",
        )? + scalar_i64(
            &mut rig.users,
            "SELECT count(*) FROM amqp.subscription_status WHERE state = 'consuming'",
        )?;
        if n == 4 {
            Ok(())
        } else {
            Err(format!("{n} consuming"))
        }
    });

    // signup: consumed, complete; the trace context and the tags reach the handler.
    let signup = publish(&mut rig, "signup", "user-1", Some(TRACE));
    wait_status(&mut rig.users, &signup, None, "signup complete");
    let row = rig
        .services
        .query_one(
            "SELECT message_id, traceparent, system_id, business_type, created_at FROM handled \
              WHERE consumer = 'mail'",
            &[],
        )
        .expect("mail handled signup");
    assert_eq!(row.get::<_, String>(0), signup);
    assert_eq!(row.get::<_, Option<String>>(1).as_deref(), Some(TRACE));
    assert_eq!(row.get::<_, Option<String>>(2).as_deref(), Some("accounts"));
    assert_eq!(row.get::<_, Option<String>>(3).as_deref(), Some("signup"));
    assert!(
        row.get::<_, Option<String>>(4).is_some(),
        "created-at header"
    );

    // order: lost on its way to billing (purged while billing is paused), then resent.
    let admin = AmqpAdmin::connect(&endpoint.uri()).expect("admin connection");
    rig.services
        .batch_execute("SELECT amqp.pause_subscription('billing')")
        .expect("pause billing");
    eventually(WITHIN, "billing's consumer gone", || {
        match admin.queue_counts("q.billing")? {
            Some(c) if c.consumers == 0 => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    let order = publish(&mut rig, "order", "order-9", None);
    eventually(WITHIN, "the order in billing's queue", || {
        match admin.queue_counts("q.billing")? {
            Some(c) if c.messages == 1 => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    admin.purge_queue("q.billing").expect("purge");
    rig.services
        .batch_execute("SELECT amqp.resume_subscription('billing')")
        .expect("resume billing");
    wait_stamp(&mut rig.users, &order, "late_at");
    eventually(WITHIN, "order resent", || {
        let n = scalar_i64(
            &mut rig.users,
            &format!("SELECT resends::int8 FROM amqp.produced WHERE message_id = '{order}'"),
        )?;
        if n >= 1 {
            Ok(())
        } else {
            Err(format!("{n} resends"))
        }
    });
    wait_status(
        &mut rig.users,
        &order,
        None,
        "order complete after the resend",
    );
    let billed: Vec<String> = rig
        .services
        .query(
            "SELECT message_id FROM handled WHERE consumer = 'billing'",
            &[],
        )
        .expect("billing")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        billed,
        vec![order.clone()],
        "billed once, with the original message_id"
    );

    // audit: archive never answers: late, then lost, reported only (never resent).
    let audit = publish(&mut rig, "audit", "audit-1", None);
    wait_stamp(&mut rig.users, &audit, "late_at");
    wait_stamp(&mut rig.users, &audit, "lost_at");
    wait_status(&mut rig.users, &audit, Some("lost"), "audit lost");

    // registration: coupon fails; the compensation fails once, is killed once, then succeeds.
    let registration = publish(&mut rig, "registration", "user-2", None);
    eventually(WITHIN, "the compensation's first failure recorded", || {
        let e = text(
            &mut rig.users,
            "SELECT last_error FROM amqp.compensation WHERE consumer = 'coupon'",
        )?;
        match e {
            Some(e) if e.contains("compensation fails once") => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    eventually(WITHIN, "the second attempt under way", || {
        let n = scalar_i64(
            &mut rig.users,
            "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM undo_calls",
        )?;
        if n >= 2 {
            Ok(())
        } else {
            Err(format!("{n} calls"))
        }
    });
    let pid: i32 = rig
        .users
        .query_one(
            "SELECT pid FROM pg_stat_activity WHERE backend_type = $1 AND datname = $2",
            &[&MONITOR, &USERS],
        )
        .expect("the users monitor")
        .get(0);
    send_signal(pid, libc::SIGKILL).expect("SIGKILL the monitor");
    // The postmaster answers a killed backend by ending every other one: wait for that before
    // connecting again (a connection made before it would be closed under the test).
    let users = &mut rig.users;
    eventually(
        UP,
        "the crash restart to end the old connection",
        || match users.batch_execute("SELECT 1") {
            Err(_) => Ok(()),
            Ok(()) => Err("still connected".to_string()),
        },
    );
    rig.reconnect();
    wait_status(
        &mut rig.users,
        &registration,
        None,
        "registration compensated",
    );
    let undone = rig
        .users
        .query(
            "SELECT message_id, consumer, business_key, error FROM undone",
            &[],
        )
        .expect("undone");
    assert_eq!(undone.len(), 1, "compensated exactly once");
    assert_eq!(undone[0].get::<_, String>(0), registration);
    assert_eq!(undone[0].get::<_, String>(1), "coupon");
    assert_eq!(undone[0].get::<_, String>(2), "user-2");
    assert!(undone[0]
        .get::<_, Option<String>>(3)
        .is_some_and(|e| e.contains("coupon service down")));
    let (state, attempts): (String, i32) = {
        let r = rig
            .users
            .query_one(
                "SELECT state, attempts FROM amqp.compensation WHERE message_id = $1",
                &[&registration],
            )
            .expect("compensation row");
        (r.get(0), r.get(1))
    };
    assert_eq!(state, "done");
    assert_eq!(
        attempts, 3,
        "each try counted as it starts: the failure, the killed one, the success"
    );

    // Each story, told by amqp.trace.
    let t = trace(&mut rig.users, &order);
    let e = events(&t);
    for want in [
        "produced",
        "published",
        "confirmed",
        "acknowledged",
        "delivered",
        "late",
        "resent",
        "delivered again",
        "consumed",
        "finished",
    ] {
        assert!(e.contains(&want), "order trace lacks {want}: {t:#?}");
    }
    assert!(
        !e.contains(&"lost"),
        "order was resent, never given up: {t:#?}"
    );
    let t = trace(&mut rig.users, &audit);
    let e = events(&t);
    assert!(
        e.contains(&"lost") && !e.contains(&"resent") && !e.contains(&"consumed"),
        "{t:#?}"
    );
    let t = trace(&mut rig.users, &registration);
    let e = events(&t);
    for want in ["produced", "delivered", "failed", "compensated", "finished"] {
        assert!(e.contains(&want), "registration trace lacks {want}: {t:#?}");
    }
    assert!(
        t.iter()
            .any(|(e, d)| e == "failed" && d.contains("coupon service down")),
        "{t:#?}"
    );
    let t = trace(&mut rig.users, &signup);
    assert!(
        t.iter()
            .any(|(e, d)| e == "consumed" && d.starts_with("mail")),
        "{t:#?}"
    );

    // amqp.daily_stats against the test's own ledger.
    let ledger: BTreeMap<&str, [i64; 9]> = BTreeMap::from([
        //            produced delivered consumed late lost resent compensated parked failed
        ("audit", [1, 1, 0, 1, 1, 0, 0, 0, 0]),
        ("order", [1, 1, 1, 1, 0, 1, 0, 0, 0]),
        ("registration", [1, 1, 0, 0, 0, 0, 1, 0, 1]),
        ("signup", [1, 1, 1, 0, 0, 0, 0, 0, 0]),
    ]);
    let stats: BTreeMap<String, [i64; 9]> = rig
        .users
        .query(
            "SELECT business_type, sum(produced)::int8, sum(delivered)::int8, sum(consumed)::int8, \
                    sum(late)::int8, sum(lost)::int8, sum(resent)::int8, sum(compensated)::int8, \
                    sum(parked)::int8, sum(failed)::int8 \
               FROM amqp.daily_stats GROUP BY 1",
            &[],
        )
        .expect("daily_stats")
        .iter()
        .map(|r| {
            let mut v = [0i64; 9];
            for (i, x) in v.iter_mut().enumerate() {
                *x = r.get(i + 1);
            }
            (r.get(0), v)
        })
        .collect();
    let stats: BTreeMap<&str, [i64; 9]> = stats.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    assert_eq!(stats, ledger);

    // What is left unfinished: the audit message, lost, and health says so.
    let open: Vec<(String, String)> = rig
        .users
        .query("SELECT business_type, status FROM amqp.reconciliation", &[])
        .expect("reconciliation")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(open, vec![("audit".to_string(), "lost".to_string())]);
    let h = health(&mut rig.users).expect("health");
    assert_eq!(
        h.get("lost").map(|(s, _)| s.as_str()),
        Some("critical"),
        "{h:?}"
    );
}
