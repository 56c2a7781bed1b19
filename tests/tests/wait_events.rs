//! What the extension's processes show in `pg_stat_activity` while they wait: on PostgreSQL 17
//! and later each wait has its own name (custom wait events, `wait_event_type` `Extension`,
//! listed in `pg_wait_events`); before 17 each shows `Extension`, as every extension's wait does.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use amqp_outbox_e2e::{eventually, PgConfig, Rabbit, World};
use postgres::Client;

const SETTLE: Duration = Duration::from_secs(30);

fn server_major(client: &mut Client) -> i32 {
    client
        .query_one(
            "SELECT current_setting('server_version_num')::int / 10000",
            &[],
        )
        .map(|r| r.get(0))
        .unwrap_or_else(|e| panic!("server_version_num: {e}"))
}

/// The wait of each of the extension's processes now: backend_type -> (type, event).
fn waits(client: &mut Client) -> Result<BTreeMap<String, (String, String)>, String> {
    client
        .batch_execute("SELECT pg_catalog.pg_stat_clear_snapshot()")
        .map_err(|e| e.to_string())?;
    Ok(client
        .query(
            "SELECT backend_type, coalesce(wait_event_type, '-'), coalesce(wait_event, '-') \
               FROM pg_stat_activity WHERE backend_type LIKE 'amqp_outbox%'",
            &[],
        )
        .map_err(|e| format!("reading pg_stat_activity: {e}"))?
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2))))
        .collect())
}

#[test]
fn each_process_shows_its_own_wait_event_from_postgresql_17() {
    let rabbit = Rabbit::shared();
    let mut w = World::new("waits", PgConfig::default(), &rabbit);
    w.warm_up();
    // A subscription with two lanes, so that the lanes' wait shows too.
    let q = rabbit.declare_queue("waits-lanes");
    w.client
        .batch_execute(
            "CREATE FUNCTION public.noop(d amqp.delivery) RETURNS void LANGUAGE sql AS ''",
        )
        .unwrap_or_else(|e| panic!("handler: {e}"));
    w.client
        .execute(
            "SELECT amqp.subscribe('waits', $1, $2, 'public.noop(amqp.delivery)', parallelism => 2)",
            &[&w.outbox.broker_id, &q.queue],
        )
        .unwrap_or_else(|e| panic!("amqp.subscribe with lanes: {e}"));
    let major = server_major(&mut w.client);
    let named = major >= 17;
    let expect = |name: &str| {
        (
            "Extension".to_string(),
            if named { name } else { "Extension" }.to_string(),
        )
    };
    let expected: BTreeMap<String, (String, String)> = [
        ("amqp_outbox", expect("AmqpOutboxWorkerMain")),
        ("amqp_outbox lane", expect("AmqpOutboxLaneMain")),
        ("amqp_outbox launcher", expect("AmqpOutboxLauncherMain")),
        ("amqp_outbox monitor", expect("AmqpOutboxMonitorMain")),
        (
            "amqp_outbox subscriptions",
            expect("AmqpOutboxSubscriptionMain"),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    // Idle, each process spends nearly all its time in its wait; a snapshot catches all of
    // them there within a few tries.
    let mut last = BTreeMap::new();
    eventually(
        SETTLE,
        &format!("each process in its wait (PostgreSQL {major}): {expected:?}"),
        || {
            last = waits(&mut w.client)?;
            if last == expected {
                Ok(())
            } else {
                Err(format!("{last:?}"))
            }
        },
    );

    if named {
        // Registered in the cluster's list of wait events, the outbox worker's gap between
        // claims too (it shows only under load).
        let listed: BTreeSet<String> = w
            .client
            .query(
                "SELECT name FROM pg_wait_events WHERE type = 'Extension' AND name LIKE 'AmqpOutbox%'",
                &[],
            )
            .unwrap_or_else(|e| panic!("reading pg_wait_events: {e}"))
            .iter()
            .map(|r| r.get(0))
            .collect();
        let want: BTreeSet<String> = [
            "AmqpOutboxBatchGap",
            "AmqpOutboxLaneMain",
            "AmqpOutboxLauncherMain",
            "AmqpOutboxMonitorMain",
            "AmqpOutboxSubscriptionMain",
            "AmqpOutboxWorkerMain",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(listed, want, "pg_wait_events");
    }

    // A session in amqp.wait_for_standbys(), waiting for a standby that is not there.
    w.cluster
        .set_setting("amqp_outbox.standby_names", "'nowhere'");
    w.cluster.reload();
    let mut waiter = w.cluster.client();
    let waiter_pid: i32 = waiter
        .query_one("SELECT pg_backend_pid()", &[])
        .map(|r| r.get(0))
        .unwrap_or_else(|e| panic!("pg_backend_pid: {e}"));
    eventually(SETTLE, "the reload to reach a new session", || {
        let names: String = waiter
            .query_one("SHOW amqp_outbox.standby_names", &[])
            .map(|r| r.get(0))
            .map_err(|e| e.to_string())?;
        if names == "nowhere" {
            Ok(())
        } else {
            Err(names)
        }
    });
    // A commit of its own, for the standbys to have.
    waiter
        .batch_execute("CREATE TEMP TABLE t (); DROP TABLE t")
        .unwrap_or_else(|e| panic!("a commit: {e}"));
    let waiting = std::thread::spawn(move || -> Result<bool, String> {
        waiter
            .query_one("SELECT amqp.wait_for_standbys('20 seconds')", &[])
            .map(|r| r.get(0))
            .map_err(|e| format!("{e:?}; SQLSTATE {:?}", e.code().map(|c| c.code())))
    });
    let want = expect("AmqpOutboxWaitForStandbys");
    eventually(SETTLE, "the session's wait in pg_stat_activity", || {
        w.client
            .batch_execute("SELECT pg_catalog.pg_stat_clear_snapshot()")
            .map_err(|e| e.to_string())?;
        let row = w
            .client
            .query_one(
                "SELECT coalesce(wait_event_type, '-'), coalesce(wait_event, '-') \
                   FROM pg_stat_activity WHERE pid = $1",
                &[&waiter_pid],
            )
            .map_err(|e| e.to_string())?;
        let now: (String, String) = (row.get(0), row.get(1));
        if now == want {
            Ok(())
        } else {
            Err(format!("{now:?}"))
        }
    });
    w.client
        .query_one("SELECT pg_cancel_backend($1)", &[&waiter_pid])
        .unwrap_or_else(|e| panic!("pg_cancel_backend: {e}"));
    match waiting.join() {
        Ok(Err(e)) if e.contains("Some(\"57014\")") => {}
        other => panic!("amqp.wait_for_standbys() should end cancelled (57014): {other:?}"),
    }
    // Nothing waits for a standby any more.
    w.cluster.set_setting("amqp_outbox.standby_names", "''");
    w.cluster.reload();
}
