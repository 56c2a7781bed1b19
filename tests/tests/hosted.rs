//! The plain-SQL install for hosted PostgreSQL (sql/hosted/), on a private cluster that does not
//! load the library: installed by a role that is not a superuser, it tells a relay what the
//! extension tells its worker through shared memory, as a `NOTIFY amqp_outbox` sent at commit
//! and never on rollback, and reports the relay that holds the database's advisory lock in
//! `amqp.worker_status`.

use std::time::Duration;

use amqp_outbox_e2e::eventually;
use amqp_outbox_e2e::hosted::{installed, DB};
use postgres::fallible_iterator::FallibleIterator;
use postgres::Client;

/// The notifications on `amqp_outbox` that arrive within `wait`, as payloads.
fn notifications(listener: &mut Client, wait: Duration) -> Vec<String> {
    let mut seen = Vec::new();
    let mut n = listener.notifications();
    let mut it = n.timeout_iter(wait);
    while let Ok(Some(note)) = it.next() {
        if note.channel() == "amqp_outbox" {
            seen.push(note.payload().to_string());
        }
    }
    seen
}

#[test]
fn commits_notify_the_relay_and_rollbacks_do_not() {
    let cluster = installed();
    let mut listener = cluster.client_db(DB);
    listener
        .batch_execute("LISTEN amqp_outbox")
        .expect("LISTEN");
    let mut c = cluster.client_db(DB);
    c.batch_execute("INSERT INTO amqp.broker (broker_id, host) VALUES (1, '127.0.0.1')")
        .expect("broker");
    assert_eq!(
        notifications(&mut listener, Duration::from_millis(500)),
        ["reload"],
        "a configuration change"
    );

    // Published and rolled back (whole transaction, savepoint): nothing.
    c.batch_execute(
        "BEGIN; SELECT amqp.publish(1, 'ex', 'rk', 'undone'); ROLLBACK; \
         BEGIN; SAVEPOINT s; SELECT amqp.publish(1, 'ex', 'rk', 'undone'); \
         ROLLBACK TO SAVEPOINT s; COMMIT;",
    )
    .expect("rolled back publishes");
    assert!(
        notifications(&mut listener, Duration::from_millis(500)).is_empty(),
        "a rollback wakes nobody"
    );
    // Three publishes in one transaction: one wake-up, after the commit.
    c.batch_execute("BEGIN").expect("BEGIN");
    for i in 0..3 {
        c.query_one(
            "SELECT amqp.publish(1, 'ex', 'rk', $1)",
            &[&format!("m{i}")],
        )
        .expect("publish");
    }
    assert!(
        notifications(&mut listener, Duration::from_millis(300)).is_empty(),
        "nothing before the commit"
    );
    c.batch_execute("COMMIT").expect("COMMIT");
    assert_eq!(
        notifications(&mut listener, Duration::from_millis(500)),
        [""]
    );
    let rows: i64 = c
        .query_one("SELECT count(*) FROM amqp.message", &[])
        .expect("count")
        .get(0);
    assert_eq!(rows, 3, "the committed messages wait in the outbox");

    // A delayed message, a declaration, a parked message retried, a disconnect request.
    c.query_one(
        "SELECT amqp.publish_message(1, 'ex', 'rk', 'later', deliver_after => '1 hour')",
        &[],
    )
    .expect("delayed publish");
    assert_eq!(
        notifications(&mut listener, Duration::from_millis(500)),
        ["scheduled"]
    );
    c.query_one(
        "SELECT amqp.exchange_declare(1, 'ex', 'topic', false, true)",
        &[],
    )
    .expect("exchange_declare");
    c.query_one(
        "SELECT amqp.queue_declare(1, 'q', arguments => '{\"x-queue-type\": \"quorum\"}')",
        &[],
    )
    .expect("queue_declare");
    let mut got = notifications(&mut listener, Duration::from_millis(500));
    got.sort();
    assert_eq!(got, ["reload", "reload"]);
    c.batch_execute(
        "UPDATE amqp.message SET parked_at = now(), last_error = 'refused' \
          WHERE id = (SELECT min(id) FROM amqp.message)",
    )
    .expect("park one");
    let parked: i64 = c
        .query_one(
            "SELECT min(id) FROM amqp.message WHERE parked_at IS NOT NULL",
            &[],
        )
        .expect("parked")
        .get(0);
    c.query_one("SELECT amqp.retry($1)", &[&parked])
        .expect("retry");
    c.query_one("SELECT amqp.disconnect(1)", &[])
        .expect("disconnect");
    let mut got = notifications(&mut listener, Duration::from_millis(500));
    got.sort();
    assert_eq!(got, ["", "disconnect:1"]);
}

#[test]
fn worker_status_reports_the_relay_that_holds_the_database() {
    let cluster = installed();
    let mut c = cluster.client_db(DB);
    let state = |c: &mut Client| -> (String, Option<i32>) {
        let r = c
            .query_one(
                "SELECT state, worker_pid FROM amqp.worker_status WHERE database = current_database()",
                &[],
            )
            .expect("worker_status");
        (r.get(0), r.get(1))
    };
    assert_eq!(state(&mut c), ("no relay".to_string(), None));
    let mut relay = cluster.client_db(DB);
    let pid: i32 = relay
        .query_one(
            "SELECT pg_backend_pid() FROM (SELECT pg_advisory_lock(1634562416, 1)) l",
            &[],
        )
        .expect("the relay's lock")
        .get(0);
    relay
        .batch_execute("INSERT INTO amqp._relay_counters (published, confirmed) VALUES (7, 6)")
        .expect("the relay's report");
    assert_eq!(state(&mut c), ("running".to_string(), Some(pid)));
    let published: i64 = c
        .query_one(
            "SELECT published FROM amqp.worker_status WHERE database = current_database()",
            &[],
        )
        .expect("counters")
        .get(0);
    assert_eq!(published, 7);
    drop(relay);
    // The lock goes when the relay's backend has exited.
    eventually(
        Duration::from_secs(10),
        "the relay's lock to go",
        || match state(&mut c) {
            (s, None) if s == "no relay" => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
}

/// Whether `c` may take the advisory lock (1634562416, `n`) alone now (and gives it back).
fn alone(c: &mut Client, n: i32) -> bool {
    let got: bool = c
        .query_one("SELECT pg_try_advisory_lock(1634562416, $1)", &[&n])
        .expect("try lock")
        .get(0);
    if got {
        c.execute("SELECT pg_advisory_unlock(1634562416, $1)", &[&n])
            .expect("unlock");
    }
    got
}

#[test]
fn publishers_notify_only_while_the_relay_sleeps_and_hold_the_barrier_until_they_end() {
    let cluster = installed();
    let mut listener = cluster.client_db(DB);
    listener
        .batch_execute("LISTEN amqp_outbox")
        .expect("LISTEN");
    let mut c = cluster.client_db(DB);
    c.batch_execute("INSERT INTO amqp.broker (broker_id, host) VALUES (1, '127.0.0.1')")
        .expect("broker");
    notifications(&mut listener, Duration::from_millis(300));
    let mut relay = cluster.client_db(DB);

    // Asleep (the lock (…, 2) free): a commit notifies.
    c.query_one("SELECT amqp.publish(1, 'ex', 'rk', 'asleep')", &[])
        .expect("publish");
    assert_eq!(
        notifications(&mut listener, Duration::from_millis(500)),
        [""]
    );

    // Awake: no NOTIFY, so publishing commits are not serialized by it.
    relay
        .execute("SELECT pg_advisory_lock(1634562416, 2)", &[])
        .expect("awake");
    c.query_one("SELECT amqp.publish(1, 'ex', 'rk', 'awake')", &[])
        .expect("publish");
    assert!(
        notifications(&mut listener, Duration::from_millis(500)).is_empty(),
        "notified while the relay was awake"
    );

    // A publishing transaction holds the barrier (…, 3) until it ends, so the relay cannot go
    // to sleep past it.
    assert!(alone(&mut relay, 3));
    c.batch_execute("BEGIN").expect("BEGIN");
    c.query_one("SELECT amqp.publish(1, 'ex', 'rk', 'open')", &[])
        .expect("publish");
    assert!(!alone(&mut relay, 3), "the barrier was not held");
    relay
        .execute("SELECT pg_advisory_unlock(1634562416, 2)", &[])
        .expect("asleep");
    c.batch_execute("COMMIT").expect("COMMIT");
    assert!(
        alone(&mut relay, 3),
        "the barrier was kept after the commit"
    );
    // It saw the relay awake: no notification (the relay claims after the barrier).
    assert!(notifications(&mut listener, Duration::from_millis(300)).is_empty());

    // A savepoint rolled back takes its wake-up with it; the next publish asks again.
    c.batch_execute(
        "BEGIN; SAVEPOINT s; SELECT amqp.publish(1, 'ex', 'rk', 'undone'); \
         ROLLBACK TO SAVEPOINT s; SELECT amqp.publish(1, 'ex', 'rk', 'kept'); COMMIT;",
    )
    .expect("savepoint");
    assert_eq!(
        notifications(&mut listener, Duration::from_millis(500)),
        [""]
    );
}

/// Runs the committed update script `name` in one transaction.
fn run_update(c: &mut Client, name: &str) -> Result<(), postgres::Error> {
    use amqp_outbox_e2e::hosted::script_file;
    c.batch_execute(&format!("BEGIN; {}\nCOMMIT;", script_file(name)))
}

/// The installed version, as the schema's comment says it.
fn schema_comment(c: &mut Client) -> String {
    c.query_one(
        "SELECT obj_description('amqp'::regnamespace, 'pg_namespace')",
        &[],
    )
    .expect("comment")
    .get(0)
}

/// A second run of the update script `name` is refused (55000).
fn assert_refused_twice(c: &mut Client, name: &str) {
    let e = run_update(c, name).expect_err("a second run");
    c.batch_execute("ROLLBACK").expect("ROLLBACK");
    assert_eq!(
        e.as_db_error().map(|d| d.code().code().to_string()),
        Some("55000".to_string()),
        "{e}"
    );
}

#[test]
fn the_update_from_0_8_0_keeps_every_message_and_installs_the_doorbell() {
    use amqp_outbox_e2e::hosted::{installed_from, owner_client, script_file};
    let cluster = installed_from(&script_file("amqp_outbox_hosted--0.8.0.sql"));
    let mut owner = owner_client(&cluster);
    owner
        .batch_execute("INSERT INTO amqp.broker (broker_id, host) VALUES (1, '127.0.0.1')")
        .expect("broker");
    let mut before = Vec::new();
    for i in 0..20 {
        let id: i64 = owner
            .query_one(
                "SELECT amqp.publish_message(1, 'ex', 'rk', $1)",
                &[&format!("before-{i}")],
            )
            .expect("publish with 0.8.0")
            .get(0);
        before.push(id);
    }
    let ids_before: Vec<(i64, String)> = owner
        .query("SELECT id, message_id FROM amqp.message ORDER BY id", &[])
        .expect("messages")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    run_update(&mut owner, "amqp_outbox_hosted--0.8.0--0.9.0.sql")
        .unwrap_or_else(|e| panic!("the update: {e}"));
    let comment = schema_comment(&mut owner);
    assert!(comment.starts_with("amqp_outbox 0.9.0"), "{comment}");
    let ids_after: Vec<(i64, String)> = owner
        .query("SELECT id, message_id FROM amqp.message ORDER BY id", &[])
        .expect("messages")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(ids_before, ids_after, "every message kept with its id");
    // Publishing goes on, with the doorbell: awake, no notification.
    let mut listener = cluster.client_db(DB);
    listener
        .batch_execute("LISTEN amqp_outbox")
        .expect("LISTEN");
    let mut relay = cluster.client_db(DB);
    relay
        .execute("SELECT pg_advisory_lock(1634562416, 2)", &[])
        .expect("awake");
    let after: i64 = owner
        .query_one("SELECT amqp.publish_message(1, 'ex', 'rk', 'after')", &[])
        .expect("publish with 0.9.0")
        .get(0);
    assert!(after > *before.last().expect("published"));
    assert!(notifications(&mut listener, Duration::from_millis(300)).is_empty());
    // The update refuses to run twice.
    assert_refused_twice(&mut owner, "amqp_outbox_hosted--0.8.0--0.9.0.sql");
}

/// Every function of the install: signature, definition (with its settings) and grants.
fn function_definitions(c: &mut Client) -> Vec<(String, String, Option<String>)> {
    c.query(
        "SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid), p.proacl::text \
           FROM pg_proc p WHERE p.pronamespace = 'amqp'::regnamespace AND p.prokind <> 'a' \
          ORDER BY 1",
        &[],
    )
    .expect("functions")
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2)))
    .collect()
}

/// Every view of the install: name, definition and grants.
fn view_definitions(c: &mut Client) -> Vec<(String, String, Option<String>)> {
    c.query(
        "SELECT c.oid::regclass::text, pg_get_viewdef(c.oid), c.relacl::text \
           FROM pg_class c WHERE c.relnamespace = 'amqp'::regnamespace AND c.relkind = 'v' \
          ORDER BY 1",
        &[],
    )
    .expect("views")
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2)))
    .collect()
}

/// Every constraint of the install's tables: table, name and definition.
fn constraint_definitions(c: &mut Client) -> Vec<(String, String, String)> {
    c.query(
        "SELECT conrelid::regclass::text, conname::text, pg_get_constraintdef(oid) \
           FROM pg_constraint WHERE connamespace = 'amqp'::regnamespace ORDER BY 1, 2",
        &[],
    )
    .expect("constraints")
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2)))
    .collect()
}

#[test]
fn the_updates_from_0_9_0_keep_every_message_and_end_as_a_fresh_install() {
    use amqp_outbox_e2e::hosted::{installed_from, owner_client, script, script_file};
    let cluster = installed_from(&script_file("amqp_outbox_hosted--0.9.0.sql"));
    let mut owner = owner_client(&cluster);
    owner
        .batch_execute("INSERT INTO amqp.broker (broker_id, host) VALUES (1, '127.0.0.1')")
        .expect("broker");
    for i in 0..20 {
        owner
            .query_one(
                "SELECT amqp.publish_message(1, 'ex', 'rk', $1, business_type => 'order', \
                 idempotency_key => $1)",
                &[&format!("before-{i}")],
            )
            .expect("publish with 0.9.0");
    }
    owner
        .query_one(
            "SELECT amqp.publish_message(1, 'ex', 'rk', 'later', deliver_after => '1 hour')",
            &[],
        )
        .expect("a delayed message");
    let rows = |c: &mut Client| -> Vec<String> {
        c.query(
            "SELECT m::text FROM amqp.message m UNION ALL \
             SELECT s::text FROM amqp.scheduled_message s UNION ALL \
             SELECT k::text FROM amqp.idempotency_key k ORDER BY 1",
            &[],
        )
        .expect("rows")
        .iter()
        .map(|r| r.get(0))
        .collect()
    };
    // Each update keeps every row as it was and ends at its version.
    let update = |owner: &mut Client, from: &str, to: &str| {
        let before = rows(owner);
        run_update(owner, &format!("amqp_outbox_hosted--{from}--{to}.sql"))
            .unwrap_or_else(|e| panic!("the update to {to}: {e}"));
        assert_eq!(rows(owner), before, "every row kept as it was");
        let comment = schema_comment(owner);
        assert!(
            comment.starts_with(&format!("amqp_outbox {to}")),
            "{comment}"
        );
    };
    assert_eq!(rows(&mut owner).len(), 41);
    update(&mut owner, "0.9.0", "0.10.0");
    owner
        .query_one("SELECT amqp.publish(1, 'ex', 'rk', 'with 0.10.0')", &[])
        .expect("publish with 0.10.0");
    update(&mut owner, "0.10.0", "0.11.0");
    update(&mut owner, "0.11.0", "0.12.0");
    update(&mut owner, "0.12.0", "0.13.0");
    // The functions (their settings and grants), the views and the constraints are a fresh
    // install's.
    let fresh_cluster = installed_from(&script());
    let mut fresh = owner_client(&fresh_cluster);
    assert_eq!(
        function_definitions(&mut owner),
        function_definitions(&mut fresh)
    );
    assert_eq!(
        constraint_definitions(&mut owner),
        constraint_definitions(&mut fresh)
    );
    assert_eq!(view_definitions(&mut owner), view_definitions(&mut fresh));
    // A key published before the update is still known; a new one publishes.
    let again: i64 = owner
        .query_one(
            "SELECT amqp.publish_message(1, 'ex', 'rk', 'x', idempotency_key => 'before-3')",
            &[],
        )
        .expect("a known key")
        .get(0);
    let known: i64 = owner
        .query_one(
            "SELECT id FROM amqp.idempotency_key WHERE key = 'before-3'",
            &[],
        )
        .expect("the key")
        .get(0);
    assert_eq!(again, known);
    owner
        .query_one("SELECT amqp.publish(1, 'ex', 'rk', 'after')", &[])
        .expect("publish with 0.13.0");
    // A row the table's rules refuse is refused as before, naming the rule.
    let e = owner
        .query_one("SELECT amqp.publish(1, 'ex', 'rk', 'x', 3)", &[])
        .expect_err("delivery_mode 3");
    assert_eq!(
        e.as_db_error().map(|d| d.code().code()),
        Some("22023"),
        "{e}"
    );
    let e = owner
        .execute(
            "UPDATE amqp.message SET routing_key = repeat('k', 256)",
            &[],
        )
        .expect_err("a routing key of 256 bytes");
    let db = e.as_db_error().expect("a database error");
    assert_eq!(
        (db.code().code(), db.constraint()),
        ("23514", Some("message_routing_key_length")),
        "{e}"
    );
    // Each update refuses to run twice.
    assert_refused_twice(&mut owner, "amqp_outbox_hosted--0.9.0--0.10.0.sql");
    assert_refused_twice(&mut owner, "amqp_outbox_hosted--0.10.0--0.11.0.sql");
    assert_refused_twice(&mut owner, "amqp_outbox_hosted--0.11.0--0.12.0.sql");
    assert_refused_twice(&mut owner, "amqp_outbox_hosted--0.12.0--0.13.0.sql");
}

/// One call of `amqp.<function>` with `args` (as text, cast in SQL) and `settings` set for the
/// transaction: the row it wrote (without its id, message id and times), what it left in the
/// session's settings, or the error it raised. Rolled back.
fn publish_outcome(
    c: &mut Client,
    function: &str,
    args: &[Option<String>; 14],
    settings: &[(&str, String)],
    read_only: bool,
) -> String {
    c.batch_execute("BEGIN").expect("BEGIN");
    for (name, value) in settings {
        c.execute("SELECT set_config($1, $2, true)", &[name, value])
            .expect("setting");
    }
    if read_only {
        c.batch_execute("SET TRANSACTION READ ONLY")
            .expect("read only");
    }
    let call = format!(
        "SELECT amqp.{function}($1::text::integer, $2, $3, decode($4, 'hex'), $5::text::jsonb, \
         $6::text::integer, $7, $8, $9, $10, $11, $12, $13::text::interval, $14)"
    );
    let params: Vec<&(dyn postgres::types::ToSql + Sync)> = args
        .iter()
        .map(|a| a as &(dyn postgres::types::ToSql + Sync))
        .collect();
    let out = match c.query_one(call.as_str(), &params) {
        Ok(row) => {
            let id: i64 = row.get(0);
            let written: String = c
                .query_one(
                    "SELECT coalesce((SELECT row(m.producer_pid = pg_backend_pid(), m.broker_id, \
                       m.exchange, m.routing_key, m.body, m.delivery_mode, m.content_type, \
                       m.reply_to, m.correlation_id, m.headers, m.business_type, m.business_key, \
                       m.traceparent, m.system_id, m.host_id, m.message_id <> '')::text \
                       FROM amqp.message m WHERE m.id = $1), \
                     (SELECT 'later ' || row(s.broker_id, s.exchange, s.body, s.headers, \
                       s.deliver_at > now())::text FROM amqp.scheduled_message s WHERE s.id = $1), \
                     'no row') \
                     || ' last ' || replace(current_setting('amqp_outbox.last_message_id', true), \
                                            $1::text, 'id') \
                     || ' wake ' || coalesce(current_setting('amqp_outbox.wake_asked', true), '-')",
                    &[&id],
                )
                .expect("the row written")
                .get(0);
            written
        }
        Err(e) => match e.as_db_error() {
            Some(db) => format!("error {} {}", db.code().code(), db.message()),
            None => panic!("{function}: {e}"),
        },
    };
    c.batch_execute("ROLLBACK").expect("ROLLBACK");
    out
}

/// `amqp._publish` answers the common case with one test and one INSERT and leaves everything
/// else to `amqp._publish_checked`: for arguments and settings on each side of every limit, both
/// write the same row, leave the same session values, or raise the same error.
#[test]
fn the_one_test_publish_answers_as_the_checked_one_at_every_limit() {
    use amqp_outbox_e2e::hosted::owner_client;
    let cluster = installed();
    let mut c = owner_client(&cluster);
    c.batch_execute("INSERT INTO amqp.broker (broker_id, host) VALUES (1, '127.0.0.1')")
        .expect("broker");
    let s = |v: &str| Some(v.to_string());
    let base: [Option<String>; 14] = [
        s("1"),
        s("ex"),
        s("rk"),
        s("00"),
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
    ];
    let x = |n: usize| Some("x".repeat(n));
    let trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let long_name = format!("{{\"{}\": 1}}", "k".repeat(300));
    // (argument index, value) changes of the base call.
    let mut cases: Vec<Vec<(usize, Option<String>)>> = vec![vec![]];
    for (i, values) in [
        (0, vec![None, s("2"), s("-1")]),
        (
            1,
            vec![
                None,
                s(""),
                x(255),
                x(256),
                s(&"é".repeat(128)),
                s(&"é".repeat(127)),
            ],
        ),
        (2, vec![None, x(255), x(256)]),
        (3, vec![None, s(""), s(&"ab".repeat(600))]),
        (
            4,
            vec![
                s("{}"),
                s("{\"a\": 1, \"b\": [true, null, \"s\"]}"),
                s("[1]"),
                s("\"s\""),
                s("null"),
                s(&long_name),
                s("{\"n\": 123456789012345678901234567890}"),
                s("{\"n\": 1e-400}"),
            ],
        ),
        (5, vec![s("0"), s("1"), s("2"), s("3")]),
        (6, vec![s(""), x(255), x(256)]),
        (7, vec![x(255), x(256)]),
        (8, vec![x(255), x(256)]),
        (9, vec![s(""), s("order"), x(255), x(256)]),
        (10, vec![s(""), s("42"), x(1000), x(1001)]),
        (
            11,
            vec![s(trace), s("01-bad"), s(&trace.replace("00-0a", "ff-0a"))],
        ),
        (12, vec![s("0"), s("1 hour"), s("-1 second"), s("infinity")]),
        (13, vec![s(""), s("key"), x(1000), x(1001)]),
    ] {
        for v in values {
            cases.push(vec![(i, v)]);
        }
    }
    // Tags together, as applications pass them.
    cases.push(vec![
        (4, s("{\"tenant\": \"acme\"}")),
        (9, s("order")),
        (10, s("7")),
    ]);
    let settings: Vec<Vec<(&str, String)>> = vec![
        vec![],
        vec![("amqp_outbox.max_message_size", "1".into())],
        vec![("amqp_outbox.max_message_size", "1kB".into())],
        vec![("amqp_outbox.max_message_size", "1 parsec".into())],
        vec![("amqp_outbox.traceparent", trace.into())],
        vec![("amqp_outbox.traceparent", "bad".into())],
        vec![("amqp_outbox.system_id", "s".repeat(255))],
        vec![("amqp_outbox.system_id", "s".repeat(256))],
        vec![("amqp_outbox.host_id", "h".repeat(256))],
        vec![("amqp_outbox.idempotency_window", "1 parsec".into())],
    ];
    let mut compared = 0;
    for (k, setting) in settings.iter().enumerate() {
        for (n, case) in cases.iter().enumerate() {
            // Every case without settings; with a setting, the base call and the keyed one.
            if k > 0 && !(case.is_empty() || case.iter().any(|(i, _)| *i == 13)) {
                continue;
            }
            for read_only in [false, true] {
                if read_only && n > 2 {
                    continue;
                }
                let mut args = base.clone();
                for (i, v) in case {
                    args[*i] = v.clone();
                }
                let fast = publish_outcome(&mut c, "_publish", &args, setting, read_only);
                let checked =
                    publish_outcome(&mut c, "_publish_checked", &args, setting, read_only);
                assert_eq!(
                    fast, checked,
                    "arguments {args:?}, settings {setting:?}, read only {read_only}"
                );
                compared += 1;
            }
        }
    }
    // The common case really is the one-test path: it writes the same row without calling
    // amqp._publish_checked (made to fail here, in a transaction rolled back).
    c.batch_execute(
        "BEGIN; ALTER FUNCTION amqp._publish_checked(integer, text, text, bytea, jsonb, integer, \
         text, text, text, text, text, text, interval, text) RENAME TO _publish_checked_gone",
    )
    .expect("rename");
    c.query_one(
        "SELECT amqp.publish_message(1, 'ex', 'rk', 'body', '{\"a\": 1}', \
         business_type => 'order', business_key => '1')",
        &[],
    )
    .expect("the common case without amqp._publish_checked");
    c.batch_execute("ROLLBACK").expect("ROLLBACK");
    assert!(compared > 80, "{compared} cases compared");
}
