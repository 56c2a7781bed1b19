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
    owner
        .batch_execute(&format!(
            "BEGIN; {}\nCOMMIT;",
            script_file("amqp_outbox_hosted--0.8.0--0.9.0.sql")
        ))
        .unwrap_or_else(|e| panic!("the update: {e}"));
    let comment: String = owner
        .query_one(
            "SELECT obj_description('amqp'::regnamespace, 'pg_namespace')",
            &[],
        )
        .expect("comment")
        .get(0);
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
    let again = owner.batch_execute(&format!(
        "BEGIN; {}\nCOMMIT;",
        script_file("amqp_outbox_hosted--0.8.0--0.9.0.sql")
    ));
    let e = again.expect_err("a second run");
    assert_eq!(
        e.as_db_error().map(|d| d.code().code().to_string()),
        Some("55000".to_string()),
        "{e}"
    );
}
