//! Hostile input beside good traffic: rows and declarations that no publish path accepts but a
//! direct INSERT or an admin's UPDATE can write. Each poison is parked (or its declaration left
//! out) with the reason, the worker keeps its process and its connection, and the good messages
//! published around it all arrive, once each.

use std::time::Duration;

use amqp_outbox_e2e::{eventually, Outbox, PgConfig, Rabbit, World};

const ARRIVAL: Duration = Duration::from_secs(60);

/// The worker's pid and the broker's channel number (a new channel or connection changes it).
fn worker_and_channel(w: &mut World) -> (Option<i32>, Option<i64>) {
    let pid = w.status().worker_pid;
    let channel: Option<i64> = w
        .client
        .query_one(
            "SELECT channel::bigint FROM amqp.broker_status WHERE broker_id = $1",
            &[&w.outbox.broker_id],
        )
        .map(|r| r.get(0))
        .unwrap_or(None);
    (pid, channel)
}

/// Publishes `n` good messages named `prefix-i`.
fn publish_good(w: &mut World, prefix: &str, n: usize) {
    for i in 0..n {
        w.publish(&format!("{prefix}-{i}"));
    }
}

/// A test's first good traffic: publishes `n` good messages named `prefix-i` and waits until
/// they arrived (the collector held none before).
fn first_good(w: &mut World, prefix: &str, n: usize) {
    publish_good(w, prefix, n);
    w.collector.wait_for_count(n, ARRIVAL);
}

/// Inserts a row directly (as the documented direct INSERT path allows) with these headers;
/// returns its id.
fn insert_with_headers(w: &mut World, body: &str, headers: &str) -> i64 {
    let (ex, rk) = (w.route.exchange.clone(), w.route.routing_key.clone());
    w.client
        .query_one(
            &format!(
                "INSERT INTO amqp.message (broker_id, exchange, routing_key, body, headers) \
                 VALUES ($1, $2, $3, convert_to($4, 'UTF8'), {headers}) RETURNING id"
            ),
            &[&w.outbox.broker_id, &ex, &rk, &body],
        )
        .unwrap_or_else(|e| panic!("direct INSERT with headers {headers}: {e}"))
        .get(0)
}

fn wait_parked(w: &mut World, id: i64, reason: &str) -> String {
    eventually(
        ARRIVAL,
        &format!("message {id} parked for {reason}"),
        || match Outbox::message_status(&mut w.client, id)? {
            Some(s) if s.state == "parked" => {
                let error = s.last_error.unwrap_or_default();
                if error.contains(reason) {
                    Ok(error)
                } else {
                    Err(format!("parked, but last_error is {error:?}"))
                }
            }
            other => Err(format!("{other:?}")),
        },
    )
}

fn assert_each_arrived_once(w: &World, prefix: &str, n: usize) {
    let counts = w.collector.body_counts();
    for i in 0..n {
        let body = format!("{prefix}-{i}");
        assert_eq!(counts.get(&body), Some(&1), "{body}: {counts:?}");
    }
}

#[test]
fn headers_the_worker_cannot_send_are_parked_at_once_beside_good_traffic() {
    let rabbit = Rabbit::shared();
    let mut w = World::new("hostile_headers", PgConfig::default(), &rabbit);
    first_good(&mut w, "warmup", 5);
    let (pid, channel) = worker_and_channel(&mut w);

    publish_good(&mut w, "before", 50);
    let poison = [
        (
            "1e400",
            insert_with_headers(&mut w, "p-1e400", "'{\"f\": 1e400}'"),
            "number out of range",
        ),
        (
            "400 digits",
            insert_with_headers(
                &mut w,
                "p-digits",
                &format!("'{{\"n\": 1{}}}'", "0".repeat(400)),
            ),
            "number out of range",
        ),
        (
            "1e-400",
            insert_with_headers(&mut w, "p-tiny", "'{\"t\": 1e-400}'"),
            "too small for a double",
        ),
        (
            "23 digits",
            insert_with_headers(&mut w, "p-wide", "'{\"w\": 12345678901234567890123}'"),
            "beyond 64 bits",
        ),
        (
            "200-deep",
            insert_with_headers(
                &mut w,
                "p-deep",
                &format!("'{{\"d\": {}{}}}'", "[".repeat(200), "]".repeat(200)),
            ),
            "recursion limit",
        ),
        (
            "256-byte name",
            insert_with_headers(
                &mut w,
                "p-name",
                &format!("jsonb_build_object('{}', 1)", "n".repeat(256)),
            ),
            "255 bytes",
        ),
        (
            "200 KB header",
            insert_with_headers(
                &mut w,
                "p-frame",
                "jsonb_build_object('big', repeat('x', 200000))",
            ),
            "frame size",
        ),
    ];
    // An admin's UPDATE can put the same into a row that was fine (in the publishing
    // transaction here, so that the worker cannot have sent the row before).
    let (ex, rk) = (w.route.exchange.clone(), w.route.routing_key.clone());
    let updated: i64 = {
        let mut tx = w
            .client
            .transaction()
            .unwrap_or_else(|e| panic!("BEGIN: {e}"));
        let id: i64 = tx
            .query_one(
                "SELECT amqp.publish_message($1, $2, $3, 'p-updated')",
                &[&w.outbox.broker_id, &ex, &rk],
            )
            .map(|r| r.get(0))
            .unwrap_or_else(|e| panic!("publish_message: {e}"));
        tx.execute(
            "UPDATE amqp.message SET headers = '{\"f\": 1e400}' WHERE id = $1",
            &[&id],
        )
        .unwrap_or_else(|e| panic!("UPDATE headers: {e}"));
        tx.commit().unwrap_or_else(|e| panic!("COMMIT: {e}"));
        id
    };
    publish_good(&mut w, "after", 50);

    for (what, id, reason) in &poison {
        let error = wait_parked(&mut w, *id, reason);
        eprintln!("{what}: parked: {error}");
        let attempts: i32 = w
            .client
            .query_one("SELECT attempts FROM amqp.message WHERE id = $1", &[id])
            .map(|r| r.get(0))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(attempts, 1, "{what}: parked at the first attempt");
    }
    wait_parked(&mut w, updated, "number out of range");
    w.collector.wait_for_count(5 + 100, ARRIVAL);
    w.settle();
    assert_each_arrived_once(&w, "before", 50);
    assert_each_arrived_once(&w, "after", 50);
    assert!(
        !w.collector.bodies().iter().any(|b| b.starts_with("p-")),
        "a poisoned message was delivered"
    );
    assert_eq!(
        worker_and_channel(&mut w),
        (pid, channel),
        "the worker restarted or its channel was replaced"
    );

    // Parked poison can be discarded like any parked message.
    for (_, id, _) in &poison {
        let done: bool = w
            .client
            .query_one("SELECT amqp.discard($1, 'poison')", &[id])
            .map(|r| r.get(0))
            .unwrap_or_else(|e| panic!("amqp.discard({id}): {e}"));
        assert!(done);
    }
}

#[test]
fn a_declaration_the_worker_cannot_send_is_left_out_and_publishing_goes_on() {
    let rabbit = Rabbit::shared();
    let mut w = World::new("hostile_decl", PgConfig::default(), &rabbit);
    first_good(&mut w, "warmup", 3);
    let pid = w.status().worker_pid;
    let broker_id = w.outbox.broker_id;
    let bad = amqp_outbox_e2e::unique_name("bad_args");
    let good = amqp_outbox_e2e::unique_name("good_args");
    w.client
        .execute(
            "INSERT INTO amqp.queue (broker_id, queue, arguments) \
             VALUES ($1, $2, '{\"x-max-length\": 1e400}'), ($1, $3, '{\"x-max-length\": 10}')",
            &[&broker_id, &bad, &good],
        )
        .unwrap_or_else(|e| panic!("INSERT INTO amqp.queue: {e}"));
    publish_good(&mut w, "after", 20);
    w.collector.wait_for_count(3 + 20, ARRIVAL);
    assert_each_arrived_once(&w, "after", 20);
    eventually(ARRIVAL, "the good queue declared", || {
        match rabbit.queue_counts(&good)? {
            Some(_) => Ok(()),
            None => Err("not declared yet".into()),
        }
    });
    let log = w.cluster.log();
    assert!(
        log.contains(&format!("queue \"{bad}\" is not declared")),
        "no warning about the left-out declaration"
    );
    assert_eq!(rabbit.queue_counts(&bad).ok().flatten().map(|_| ()), None);
    assert_eq!(w.status().worker_pid, pid, "the worker restarted");
    let _ = rabbit.delete_queue(&good);
}

/// Without `shared_preload_libraries` no worker would publish: `publish()` refuses with 55000
/// and a hint, and the session goes on (it used to end with FATAL when the library defined its
/// server-start setting too late).
#[test]
fn without_preloading_publish_refuses_with_55000_and_the_session_lives() {
    let cluster = amqp_outbox_e2e::PgCluster::new(PgConfig::default().without_preload());
    let mut client = cluster.client();
    amqp_outbox_e2e::outbox::create_extension(&mut client);
    client
        .batch_execute("INSERT INTO amqp.broker (host) VALUES ('127.0.0.1')")
        .unwrap_or_else(|e| panic!("INSERT INTO amqp.broker: {e}"));
    let err = client
        .query_one("SELECT amqp.publish(1, 'ex', 'rk', 'x')", &[])
        .expect_err("publish without preloading must fail");
    let db = err
        .as_db_error()
        .unwrap_or_else(|| panic!("not a server error: {err}"));
    assert_eq!(db.code().code(), "55000", "{db:?}");
    assert!(
        db.hint().unwrap_or("").contains("shared_preload_libraries"),
        "{db:?}"
    );
    let one: i32 = client
        .query_one("SELECT 1", &[])
        .map(|r| r.get(0))
        .unwrap_or_else(|e| panic!("the session did not survive: {e}"));
    assert_eq!(one, 1);
    let rows: i64 = client
        .query_one("SELECT count(*) FROM amqp.message", &[])
        .map(|r| r.get(0))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(rows, 0);
}

/// A connection to `db` that collects the WARNING notices the server sends.
fn client_with_notices(
    cluster: &amqp_outbox_e2e::PgCluster,
    db: &str,
) -> (
    postgres::Client,
    std::sync::Arc<std::sync::Mutex<Vec<String>>>,
) {
    use std::str::FromStr;
    let notices = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = notices.clone();
    let client = postgres::Config::from_str(&cluster.connection_string(db))
        .unwrap_or_else(|e| panic!("{e}"))
        .notice_callback(move |n| {
            if let Ok(mut v) = sink.lock() {
                v.push(format!("{}: {}", n.severity(), n.message()));
            }
        })
        .connect(postgres::NoTls)
        .unwrap_or_else(|e| panic!("connecting to {db}: {e}"));
    (client, notices)
}

/// A database `amqp_outbox.database` leaves out says so: a WARNING at CREATE EXTENSION, one at
/// the session's first publish, and its `worker_status` row.
#[test]
fn a_database_the_worker_does_not_serve_says_so() {
    let cluster = amqp_outbox_e2e::PgCluster::new(PgConfig::default());
    cluster
        .client()
        .batch_execute("CREATE DATABASE elsewhere")
        .unwrap_or_else(|e| panic!("CREATE DATABASE: {e}"));
    let (mut client, notices) = client_with_notices(&cluster, "elsewhere");
    amqp_outbox_e2e::outbox::create_extension(&mut client);
    client
        .batch_execute("INSERT INTO amqp.broker (host) VALUES ('127.0.0.1')")
        .unwrap_or_else(|e| panic!("{e}"));
    for _ in 0..3 {
        client
            .batch_execute("SELECT amqp.publish(1, 'ex', 'rk', 'waits')")
            .unwrap_or_else(|e| panic!("publish: {e}"));
    }
    let seen = notices.lock().map(|v| v.clone()).unwrap_or_default();
    let warnings: Vec<&String> = seen
        .iter()
        .filter(|n| {
            n.contains("no worker serves database \"elsewhere\" (amqp_outbox.database = 'e2e')")
        })
        .collect();
    assert_eq!(
        warnings.len(),
        2,
        "one at CREATE EXTENSION, one at the first publish: {seen:#?}"
    );
    let row = client
        .query_one(
            "SELECT database, state FROM amqp.worker_status WHERE database = current_database()",
            &[],
        )
        .unwrap_or_else(|e| panic!("amqp.worker_status: {e}"));
    assert_eq!(
        row.get::<_, Option<String>>(0).as_deref(),
        Some("elsewhere")
    );
    assert_eq!(
        row.get::<_, String>(1),
        "not served: excluded by amqp_outbox.database"
    );

    // The served database says nothing, and its workers run (or are on their way).
    let (mut served, notices) = client_with_notices(&cluster, "e2e");
    amqp_outbox_e2e::outbox::create_extension(&mut served);
    let state: String = served
        .query_one(
            "SELECT state FROM amqp.worker_status WHERE database = current_database()",
            &[],
        )
        .map(|r| r.get(0))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(state == "running" || state == "starting", "{state}");
    let seen = notices.lock().map(|v| v.clone()).unwrap_or_default();
    assert!(
        seen.iter().all(|n| !n.contains("serves database")),
        "{seen:#?}"
    );
}

/// A database in another encoding than UTF-8 is refused at CREATE EXTENSION with 0A000 and a
/// hint, and nothing is created (text arguments used to fail later with XX000).
#[test]
fn a_database_not_in_utf8_is_refused_at_create_extension() {
    let cluster = amqp_outbox_e2e::PgCluster::new(PgConfig::default());
    cluster
        .client()
        .batch_execute(
            "CREATE DATABASE latin ENCODING 'LATIN1' TEMPLATE template0 LC_COLLATE 'C' LC_CTYPE 'C'",
        )
        .unwrap_or_else(|e| panic!("CREATE DATABASE latin: {e}"));
    let mut client = cluster.client_db("latin");
    let err = client
        .batch_execute("CREATE EXTENSION amqp_outbox")
        .expect_err("CREATE EXTENSION in a LATIN1 database must fail");
    let db = err
        .as_db_error()
        .unwrap_or_else(|| panic!("not a server error: {err}"));
    assert_eq!(db.code().code(), "0A000", "{db:?}");
    assert!(db.message().contains("LATIN1"), "{db:?}");
    assert!(db.hint().unwrap_or("").contains("UTF8"), "{db:?}");
    let schemas: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_namespace WHERE nspname = 'amqp'",
            &[],
        )
        .map(|r| r.get(0))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(schemas, 0, "nothing is left behind");
}

/// Publishes `n` messages in one transaction: every 30th to an exchange that does not exist
/// (`poison-<i>`), the others to the route (`<prefix>-<i>`). Returns how many were good.
fn publish_mixed(w: &mut World, prefix: &str, n: i32, missing: Option<&str>) -> usize {
    let (ex, rk) = (w.route.exchange.clone(), w.route.routing_key.clone());
    let missing = missing.unwrap_or("");
    w.client
        .execute(
            "SELECT CASE WHEN $5 <> '' AND g % 30 = 0
                         THEN amqp.publish($1, $5, $3, 'poison-' || g)
                         ELSE amqp.publish($1, $2, $3, $4 || '-' || g) END
               FROM generate_series(1, $6::int) g",
            &[&w.outbox.broker_id, &ex, &rk, &prefix, &missing, &n],
        )
        .unwrap_or_else(|e| panic!("publishing {n}: {e}"));
    if missing.is_empty() {
        n as usize
    } else {
        (n - n / 30) as usize
    }
}

/// Messages to a missing exchange among good ones: the good ones are not slowed down (within
/// twice their time alone; sub-second runs are compared with a 2 s floor, below which a
/// shared 2-core machine's noise decides) and none of them is published twice.
#[test]
fn refused_messages_neither_slow_down_nor_duplicate_good_ones() {
    let rabbit = Rabbit::shared();
    let mut w = World::new("hostile_missing", PgConfig::default(), &rabbit);
    let missing = amqp_outbox_e2e::unique_name("missing_x");

    let started = std::time::Instant::now();
    let alone = publish_mixed(&mut w, "alone", 2900, None);
    w.collector.wait_for_count(alone, ARRIVAL);
    let alone_took = started.elapsed();

    let before = w.collector.len();
    let started = std::time::Instant::now();
    let good = publish_mixed(&mut w, "mixed", 3000, Some(&missing));
    eventually(ARRIVAL, "the good messages among poison", || {
        let counts = w.collector.body_counts();
        let arrived = counts.keys().filter(|b| b.starts_with("mixed-")).count();
        if arrived == good {
            Ok(())
        } else {
            Err(format!("{arrived} of {good}"))
        }
    });
    let mixed_took = started.elapsed();
    eprintln!(
        "2,900 good alone: {alone_took:?}; 2,900 good among 100 refused: {mixed_took:?}; \
         deliveries since: {}",
        w.collector.len() - before
    );
    let counts = w.collector.body_counts();
    let twice: Vec<(&String, &usize)> = counts
        .iter()
        .filter(|(b, n)| b.starts_with("mixed-") && **n > 1)
        .collect();
    assert!(
        twice.is_empty(),
        "good messages published twice: {}",
        twice.len()
    );
    assert!(
        !counts.keys().any(|b| b.starts_with("poison-")),
        "a message to a missing exchange arrived"
    );
    let floor = Duration::from_secs(2);
    assert!(
        mixed_took <= 2 * alone_took.max(floor),
        "good messages took {mixed_took:?} among refused ones, {alone_took:?} alone"
    );
    // The refused ones are waiting for a retry with the broker's reason, not lost.
    let refused =
        Outbox::refused_with_404(&mut w.client, &missing).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(refused, 100);
}

/// `amqp_outbox.max_pending` counts the backlog the broker has yet to take; messages it refused
/// (waiting for their retry) do not turn publishers away.
#[test]
fn refused_messages_do_not_count_against_max_pending() {
    let rabbit = Rabbit::shared();
    let mut w = World::new(
        "hostile_max_pending",
        PgConfig::default()
            .setting("amqp_outbox.max_pending", 50)
            .setting("amqp_outbox.retry_backoff_min", "'30s'")
            .setting("amqp_outbox.retry_backoff_max", "'60s'"),
        &rabbit,
    );
    let missing = amqp_outbox_e2e::unique_name("missing_x");
    w.client
        .execute(
            "SELECT count(amqp.publish($1, $2, 'rk', 'poison-' || g)) FROM generate_series(1, 100) g",
            &[&w.outbox.broker_id, &missing],
        )
        .unwrap_or_else(|e| panic!("publishing the poison: {e}"));
    eventually(ARRIVAL, "all 100 refused once and waiting", || {
        let (refused, pending): (i64, Option<i64>) = w
            .client
            .query_one(
                "SELECT (SELECT count(*) FROM amqp.message WHERE attempts > 0),
                        (SELECT pending FROM amqp.broker_status WHERE broker_id = $1)",
                &[&w.outbox.broker_id],
            )
            .map(|r| (r.get(0), r.get(1)))
            .map_err(|e| e.to_string())?;
        if refused == 100 && pending == Some(0) {
            Ok(())
        } else {
            Err(format!(
                "{refused} refused, broker_status.pending {pending:?}"
            ))
        }
    });
    first_good(&mut w, "good", 20);
    assert_each_arrived_once(&w, "good", 20);
}

/// Inserts a row directly that comes due in `secs` seconds; returns its id.
fn insert_due_in(w: &mut World, exchange: &str, body: &str, headers: &str, secs: f64) -> i64 {
    let rk = w.route.routing_key.clone();
    w.client
        .query_one(
            "INSERT INTO amqp.message (broker_id, exchange, routing_key, body, headers, next_attempt_at) \
             VALUES ($1, $2, $3, convert_to($4, 'UTF8'), $5::text::jsonb, \
                     now() + $6 * interval '1 second') RETURNING id",
            &[&w.outbox.broker_id, &exchange, &rk, &body, &headers, &secs],
        )
        .unwrap_or_else(|e| panic!("INSERT {body}: {e}"))
        .get(0)
}

/// A session that keeps rows locked (an admin's open transaction, a long `amqp.discard()` run)
/// holds back nothing but those rows: the worker records what it can, delivers everything
/// else, and finishes the locked rows once they are free. Each locked row stands for one thing
/// the worker writes: a refusal to record, a poison row to park, a delivered row to delete.
#[test]
fn rows_a_session_keeps_locked_hold_back_nothing_else() {
    let rabbit = Rabbit::shared();
    let mut w = World::new(
        "hostile_locked",
        PgConfig::default()
            .setting("amqp_outbox.retry_backoff_min", 100)
            .setting("amqp_outbox.retry_backoff_max", 1000),
        &rabbit,
    );
    first_good(&mut w, "warm", 5);
    let missing = amqp_outbox_e2e::unique_name("locked_missing_x");
    let route = w.route.exchange.clone();
    let refused = insert_due_in(&mut w, &missing, "locked-refused", "{}", 1.0);
    let poison = insert_due_in(&mut w, &route, "locked-poison", r#"{"f": 1e400}"#, 1.0);
    let delivered = insert_due_in(&mut w, &route, "locked-delivered", "{}", 1.0);
    let ids = vec![refused, poison, delivered];
    let mut admin = w.cluster.client();
    admin.batch_execute("BEGIN").unwrap();
    let locked = admin
        .query(
            "SELECT id FROM amqp.message WHERE id = ANY ($1) FOR UPDATE",
            &[&ids],
        )
        .unwrap()
        .len();
    assert_eq!(locked, 3, "the three rows locked before they came due");

    // Due now: the next wake-up takes them with this message.
    std::thread::sleep(Duration::from_millis(1500));
    publish_good(&mut w, "wake", 1);
    w.collector.wait_for_body("locked-delivered", ARRIVAL);
    w.collector.wait_for_body("wake-0", ARRIVAL);
    // The worker now has a refusal to record, a row to park and one to delete, all locked.
    let before = w.collector.len();
    publish_good(&mut w, "beside", 50);
    eventually(ARRIVAL, "good messages beside the locked rows", || {
        let counts = w.collector.body_counts();
        let n = (0..50)
            .filter(|i| counts.contains_key(&format!("beside-{i}")))
            .count();
        if n == 50 {
            Ok(())
        } else {
            Err(format!("{n} of 50 arrived while three rows are locked"))
        }
    });
    let (pid, _) = worker_and_channel(&mut w);
    let still: i64 = w
        .client
        .query_one(
            "SELECT count(*) FROM amqp.message WHERE id = ANY ($1) AND attempts = 0 AND parked_at IS NULL",
            &[&ids],
        )
        .unwrap()
        .get(0);
    assert_eq!(still, 3, "the locked rows were left as they were");

    admin.batch_execute("COMMIT").unwrap();
    // Free again: the refusal is recorded with the broker's reason, the poison parked, the
    // delivered row deleted without being published again.
    eventually(
        ARRIVAL,
        "the refused row's attempt recorded",
        || match Outbox::message_status(&mut w.client, refused)? {
            Some(s) if s.attempts >= 1 && s.last_error.as_deref().unwrap_or("").contains("404") => {
                Ok(())
            }
            other => Err(format!("{other:?}")),
        },
    );
    wait_parked(&mut w, poison, "cannot be sent");
    eventually(
        ARRIVAL,
        "the delivered row deleted",
        || match Outbox::message_status(&mut w.client, delivered)? {
            None => Ok(()),
            Some(s) => Err(format!("{s:?}")),
        },
    );
    w.client
        .execute("DELETE FROM amqp.message WHERE id = $1", &[&refused])
        .unwrap();
    w.settle();
    let counts = w.collector.body_counts();
    assert_eq!(
        counts.get("locked-delivered"),
        Some(&1),
        "the locked delivered row went out once: {counts:?}"
    );
    assert!(!counts.contains_key("locked-poison") && !counts.contains_key("locked-refused"));
    assert_each_arrived_once(&w, "beside", 50);
    assert!(w.collector.len() >= before + 50);
    assert_eq!(worker_and_channel(&mut w).0, pid, "the worker restarted");
}
