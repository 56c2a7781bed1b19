//! PostgreSQL failover with an asynchronous standby (`amqp_outbox.standby_names`): a message is
//! published only once the named standby has its commit, so a promotion after the primary died
//! never leaves a message for a commit the surviving database lacks. Without the setting it
//! does (the documented trade-off, asserted so the test can fail both ways).
//!
//! Each test has its own primary, standby (`pg_basebackup`, own port and directory) and queue on
//! the shared RabbitMQ; the servers it stops are its own.

use std::fs;
use std::io::Write;
use std::time::{Duration, Instant};

use amqp_outbox_e2e::chaos::{holds_for, ResultRow, Standby};
use amqp_outbox_e2e::{eventually, Outbox, PgConfig, Rabbit, StopMode, World};
use postgres::Client;

const ARRIVAL: Duration = Duration::from_secs(30);
const STANDBY: &str = "standby1";

fn config(standby_names: Option<&str>) -> PgConfig {
    let config = PgConfig::default()
        .setting("amqp_outbox.retry_backoff_min", 100)
        .setting("amqp_outbox.retry_backoff_max", 1000);
    match standby_names {
        Some(names) => config.setting("amqp_outbox.standby_names", format!("'{names}'")),
        None => config,
    }
}

/// A streaming standby named [`STANDBY`] (its walreceiver's `application_name` is its
/// `cluster_name`), caught up with the primary.
fn standby_of(w: &mut World) -> (Standby, Client) {
    let standby = Standby::create(
        &w.cluster,
        &[
            ("cluster_name", &format!("'{STANDBY}'")),
            ("hot_standby", "on"),
        ],
    )
    .unwrap_or_else(|e| panic!("cannot create the standby: {e}"));
    let db = w.cluster.config().database.clone();
    let sc = eventually(ARRIVAL, "the standby to accept connections", || {
        standby.client(&db)
    });
    wait_walsenders(&mut w.client, "the standby streaming under its name", 1);
    (standby, sc)
}

/// Stops the standby's replication (its WAL receiver goes; it keeps what it has).
fn cut_replication(w: &mut World, standby: &Standby, sc: &mut Client) {
    let auto = standby.data_dir().join("postgresql.auto.conf");
    let mut f = fs::OpenOptions::new()
        .append(true)
        .open(&auto)
        .unwrap_or_else(|e| panic!("open {}: {e}", auto.display()));
    f.write_all(b"\nprimary_conninfo = ''\n")
        .expect("write postgresql.auto.conf");
    sc.batch_execute("SELECT pg_reload_conf()")
        .expect("reload the standby");
    wait_walsenders(&mut w.client, "the standby to disconnect", 0);
}

/// Waits until `n` walsenders stream to [`STANDBY`].
fn wait_walsenders(client: &mut Client, what: &str, n: i64) {
    eventually(ARRIVAL, what, || {
        let now: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_stat_replication WHERE application_name = $1 AND state = 'streaming'",
                &[&STANDBY],
            )
            .map_err(|e| e.to_string())?
            .get(0);
        if now == n {
            Ok(())
        } else {
            Err(format!("{now} streaming"))
        }
    });
}

/// An order and its message, in one transaction.
fn order(client: &mut Client, broker_id: i32, w_route: (&str, &str), body: &str) {
    let mut tx = client.transaction().expect("BEGIN");
    tx.execute("INSERT INTO orders (body) VALUES ($1)", &[&body])
        .expect("INSERT INTO orders");
    tx.execute(
        "SELECT amqp.publish($1, $2, $3, $4)",
        &[&broker_id, &w_route.0, &w_route.1, &body],
    )
    .expect("amqp.publish");
    tx.commit().expect("COMMIT");
}

/// What a failover leaves: `before` published while streaming, `cut` committed on the primary
/// only, then the primary killed, the standby promoted and `after` published there. Returns the
/// collector's bodies at the end and how long the promoted standby took to deliver.
fn failover(standby_names: Option<&str>, name: &str) -> (Vec<String>, Duration) {
    let rabbit = Rabbit::shared();
    let mut w = World::new(name, config(standby_names), &rabbit);
    w.client
        .batch_execute("CREATE TABLE orders (body text PRIMARY KEY)")
        .expect("CREATE TABLE orders");
    let (mut standby, mut sc) = standby_of(&mut w);
    let (broker_id, exchange, key) = (
        w.outbox.broker_id,
        w.route.exchange.clone(),
        w.route.routing_key.clone(),
    );
    for i in 0..20 {
        order(
            &mut w.client,
            broker_id,
            (&exchange, &key),
            &format!("before:{i}"),
        );
    }
    for i in 0..20 {
        w.collector.wait_for_body(&format!("before:{i}"), ARRIVAL);
    }
    Outbox::wait_drained(&mut w.client, ARRIVAL);

    cut_replication(&mut w, &standby, &mut sc);
    for i in 0..30 {
        order(
            &mut w.client,
            broker_id,
            (&exchange, &key),
            &format!("cut:{i}"),
        );
    }
    if standby_names.is_some() {
        let collector = &w.collector;
        holds_for(
            Duration::from_secs(3),
            "nothing of the cut commits goes out",
            || {
                let leaked: Vec<String> = collector
                    .bodies()
                    .into_iter()
                    .filter(|b| b.starts_with("cut:"))
                    .collect();
                if leaked.is_empty() {
                    Ok(())
                } else {
                    Err(format!("published before the standby had them: {leaked:?}"))
                }
            },
        )
        .unwrap();
    } else {
        // The trade-off without the setting: they go out at once.
        for i in 0..30 {
            w.collector.wait_for_body(&format!("cut:{i}"), ARRIVAL);
        }
    }

    w.cluster.stop(StopMode::Immediate);
    standby.promote().unwrap_or_else(|e| panic!("promote: {e}"));
    let promoted = Instant::now();
    let db = w.cluster.config().database.clone();
    let mut pc = eventually(ARRIVAL, "a connection to the promoted standby", || {
        standby.client(&db)
    });
    eventually(ARRIVAL, "the promoted standby's worker", || {
        let n: i64 = pc
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'amqp_outbox'",
                &[],
            )
            .map_err(|e| e.to_string())?
            .get(0);
        if n > 0 {
            Ok(())
        } else {
            Err("no worker yet".to_string())
        }
    });
    // The surviving history: every order before the cut, none of the cut.
    let (before, cut): (i64, i64) = pc
        .query_one(
            "SELECT count(*) FILTER (WHERE body LIKE 'before:%'), count(*) FILTER (WHERE body LIKE 'cut:%') FROM orders",
            &[],
        )
        .map(|r| (r.get(0), r.get(1)))
        .expect("orders on the promoted standby");
    assert_eq!((before, cut), (20, 0), "orders the promoted standby has");
    for i in 0..10 {
        order(&mut pc, broker_id, (&exchange, &key), &format!("after:{i}"));
    }
    for i in 0..10 {
        w.collector.wait_for_body(&format!("after:{i}"), ARRIVAL);
    }
    let took = promoted.elapsed();
    // Anything left over from the old primary's last moments has had its chance.
    std::thread::sleep(Duration::from_secs(1));
    standby.stop_immediate();
    (w.collector.bodies(), took)
}

#[test]
fn with_standby_names_a_failover_publishes_nothing_the_standby_lacks() {
    let (bodies, took) = failover(Some(STANDBY), "failover_gated");
    let phantoms: Vec<&String> = bodies.iter().filter(|b| b.starts_with("cut:")).collect();
    assert!(
        phantoms.is_empty(),
        "messages of commits the promoted standby never had: {phantoms:?}"
    );
    for prefix in ["before:", "after:"] {
        for i in 0..if prefix == "before:" { 20 } else { 10 } {
            let body = format!("{prefix}{i}");
            assert!(bodies.contains(&body), "{body} never arrived");
        }
    }
    eprintln!("promoted standby delivered within {took:?}");
    ResultRow {
        case: "23 primary failover, producer".into(),
        messages: 60,
        committed: 30,
        lost: 0,
        phantom: phantoms.len(),
        duplicates: bodies.len().saturating_sub(30),
        heal: Some(took),
        status: "PASS".into(),
        note: "standby_names set: 30 commits the promoted standby lacks, none published; 20 before and 10 after the promotion delivered".into(),
        ..ResultRow::default()
    }
    .record();
}

/// The trade-off without the setting: the primary published commits its standby never got.
#[test]
fn without_standby_names_a_failover_leaves_phantoms() {
    let (bodies, _) = failover(None, "failover_ungated");
    let phantoms = bodies.iter().filter(|b| b.starts_with("cut:")).count();
    assert_eq!(
        phantoms, 30,
        "without amqp_outbox.standby_names every cut commit was published before the failover"
    );
}

/// A named standby that does not exist holds every message back (none dropped); clearing the
/// setting with a reload lets them all go.
#[test]
fn a_standby_that_is_not_there_holds_messages_until_the_setting_is_cleared() {
    let rabbit = Rabbit::shared();
    let mut w = World::new("failover_nosuch", config(Some("no_such_standby")), &rabbit);
    for i in 0..5 {
        w.publish(&format!("held:{i}"));
    }
    let collector = &w.collector;
    holds_for(Duration::from_secs(3), "nothing goes out", || {
        if collector.is_empty() {
            Ok(())
        } else {
            Err(format!("published: {:?}", collector.bodies()))
        }
    })
    .unwrap();
    assert_eq!(w.rows(), 5, "the held messages stay in the outbox");
    // Both views say why nothing goes out.
    let state: String = w
        .client
        .query_one(
            "SELECT state FROM amqp.worker_status WHERE database = current_database()",
            &[],
        )
        .expect("amqp.worker_status")
        .get(0);
    assert_eq!(state, "waiting for standbys (amqp_outbox.standby_names)");
    let health: Vec<(String, String)> = w
        .client
        .query(
            "SELECT component, status FROM amqp.health() WHERE component LIKE 'standby%'",
            &[],
        )
        .expect("amqp.health()")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        health,
        vec![(
            "standby no_such_standby".to_string(),
            "critical".to_string()
        )]
    );
    w.cluster.set_setting("amqp_outbox.standby_names", "''");
    w.cluster.reload();
    for i in 0..5 {
        w.collector.wait_for_body(&format!("held:{i}"), ARRIVAL);
    }
    Outbox::wait_drained(&mut w.client, ARRIVAL);
    let client = &mut w.client;
    eventually(ARRIVAL, "the worker's state back to running", || {
        let state: String = client
            .query_one(
                "SELECT state FROM amqp.worker_status WHERE database = current_database()",
                &[],
            )
            .map_err(|e| e.to_string())?
            .get(0);
        if state == "running" {
            Ok(())
        } else {
            Err(state)
        }
    });
}

/// The consuming side of a failover: `cut` deliveries handled on the primary while the standby
/// no longer streams, then the primary killed and the standby promoted. Returns the effects the
/// promoted database ends with (body → how many times).
fn consumer_failover(standby_names: Option<&str>, name: &str) -> Vec<(String, i64)> {
    let rabbit = Rabbit::shared();
    let mut w = World::new(name, config(standby_names), &rabbit);
    let queue = rabbit.declare_queue(name);
    w.client
        .batch_execute(
            "CREATE TABLE effects (body text);
             CREATE FUNCTION record_effect(d amqp.delivery) RETURNS void LANGUAGE sql
                 AS $$ INSERT INTO effects VALUES (amqp.body_text(d)) $$;",
        )
        .expect("the handler");
    w.client
        .execute(
            "SELECT amqp.subscribe('fo', $1, $2, 'record_effect(amqp.delivery)'::regprocedure)",
            &[&w.outbox.broker_id, &queue.queue],
        )
        .expect("amqp.subscribe");
    let (mut standby, mut sc) = standby_of(&mut w);
    let effects = |c: &mut Client, prefix: &str| -> i64 {
        c.query_one(
            "SELECT count(*) FROM effects WHERE body LIKE $1 || '%'",
            &[&prefix],
        )
        .map(|r| r.get(0))
        .unwrap_or(-1)
    };
    for i in 0..10 {
        rabbit
            .publish("", &queue.queue, format!("early:{i}").as_bytes())
            .expect("publish");
    }
    eventually(ARRIVAL, "the early deliveries handled", || {
        match effects(&mut w.client, "early:") {
            10 => Ok(()),
            n => Err(format!("{n} handled")),
        }
    });
    eventually(
        ARRIVAL,
        "the standby has the early effects",
        || match effects(&mut sc, "early:") {
            10 => Ok(()),
            n => Err(format!("{n} on the standby")),
        },
    );

    cut_replication(&mut w, &standby, &mut sc);
    for i in 0..10 {
        rabbit
            .publish("", &queue.queue, format!("cut:{i}").as_bytes())
            .expect("publish");
    }
    eventually(
        ARRIVAL,
        "the cut deliveries handled on the primary",
        || match effects(&mut w.client, "cut:") {
            10 => Ok(()),
            n => Err(format!("{n} handled")),
        },
    );
    // Long enough for acknowledgements that are not held to reach the broker.
    std::thread::sleep(Duration::from_millis(500));
    w.cluster.stop(StopMode::Immediate);
    standby.promote().unwrap_or_else(|e| panic!("promote: {e}"));
    let db = w.cluster.config().database.clone();
    let mut pc = eventually(ARRIVAL, "a connection to the promoted standby", || {
        standby.client(&db)
    });
    if standby_names.is_some() {
        eventually(
            ARRIVAL,
            "the cut deliveries handled again on the promoted standby",
            || match effects(&mut pc, "cut:") {
                10 => Ok(()),
                n => Err(format!("{n} handled")),
            },
        );
    } else {
        // What it would have handled comes within seconds: give it the time.
        std::thread::sleep(Duration::from_secs(5));
    }
    let out = pc
        .query(
            "SELECT body, count(*) FROM effects GROUP BY body ORDER BY body",
            &[],
        )
        .expect("effects on the promoted standby")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    standby.stop_immediate();
    out
}

#[test]
fn with_standby_names_a_failover_loses_no_effect_of_an_acknowledged_delivery() {
    let effects = consumer_failover(Some(STANDBY), "failover_consumer_gated");
    let doubled: Vec<&(String, i64)> = effects.iter().filter(|(_, n)| *n != 1).collect();
    assert!(
        doubled.is_empty(),
        "effects applied more than once: {doubled:?}"
    );
    assert_eq!(
        effects.len(),
        20,
        "every delivery's effect is in the promoted database once: {effects:?}"
    );
    ResultRow {
        case: "23 primary failover, consumer".into(),
        messages: 20,
        committed: 20,
        lost: 20 - effects.len(),
        duplicates: doubled.len(),
        status: "PASS".into(),
        note: "standby_names set: 10 deliveries handled on the primary only were handled again on the promoted standby, none twice".into(),
        ..ResultRow::default()
    }
    .record();
}

/// The trade-off without the setting: deliveries acknowledged after a commit the standby never
/// got are gone from the broker, and their effects from the promoted database.
#[test]
fn without_standby_names_a_failover_loses_effects() {
    let effects = consumer_failover(None, "failover_consumer_ungated");
    let cut = effects
        .iter()
        .filter(|(b, _)| b.starts_with("cut:"))
        .count();
    assert_eq!(
        cut, 0,
        "without amqp_outbox.standby_names the effects of the cut deliveries are lost: {effects:?}"
    );
    assert_eq!(effects.len(), 10, "the early effects: {effects:?}");
}
