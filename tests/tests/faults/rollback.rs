//! Case 1: rolled-back transactions publish nothing.

use amqp_outbox_e2e::chaos::wait_backend_state;
use amqp_outbox_e2e::pg::PgInstall;
use amqp_outbox_e2e::{eventually, MessageKey};
use postgres::Client;

use super::harness::*;

// ------------------------------------------------------------------------------------------
// 1. rollback matrix
// ------------------------------------------------------------------------------------------

#[test]
fn case01_rollback_matrix_delivers_no_aborted_message() {
    let mut rig = Rig::new(
        "1 rollback matrix",
        base_config().setting("max_prepared_transactions", 5),
    );
    let (b, ex, rk) = (
        rig.outbox.broker_id,
        rig.route.exchange.clone(),
        rig.route.routing_key.clone(),
    );
    let ledger = rig.ledger.clone();
    let k = |n: u64| MessageKey::new("m", n);
    let publish = |c: &mut Client, key: &MessageKey| {
        c.execute(
            "SELECT amqp.publish($1, $2, $3, $4)",
            &[&b, &ex, &rk, &key.body()],
        )
        .unwrap_or_else(|e| panic!("publish {key}: {e}"));
    };
    // A background stream with 30 % rollbacks.
    let producers = rig.producers("rb", 2, 300, 2, 0.3);
    let c = &mut rig.client;

    // Plain ROLLBACK.
    c.batch_execute("BEGIN").unwrap();
    publish(c, &k(0));
    c.batch_execute("ROLLBACK").unwrap();
    ledger.aborted([&k(0)]);

    // SAVEPOINT; publish; ROLLBACK TO; COMMIT: the outer transaction's messages survive.
    c.batch_execute("BEGIN").unwrap();
    publish(c, &k(1));
    c.batch_execute("SAVEPOINT s").unwrap();
    publish(c, &k(2));
    publish(c, &k(3));
    c.batch_execute("ROLLBACK TO SAVEPOINT s").unwrap();
    publish(c, &k(4));
    c.batch_execute("COMMIT").unwrap();
    ledger.committed([&k(1), &k(4)]);
    ledger.aborted([&k(2), &k(3)]);

    // Nested savepoints: the released inner one goes with the outer one.
    c.batch_execute("BEGIN; SAVEPOINT a").unwrap();
    publish(c, &k(5));
    c.batch_execute("SAVEPOINT b").unwrap();
    publish(c, &k(6));
    c.batch_execute("RELEASE SAVEPOINT b; ROLLBACK TO SAVEPOINT a")
        .unwrap();
    publish(c, &k(7));
    c.batch_execute("COMMIT").unwrap();
    ledger.aborted([&k(5), &k(6)]);
    ledger.committed([&k(7)]);

    // PL/pgSQL EXCEPTION block around a publish.
    c.batch_execute(&format!(
        "DO $$ BEGIN
           BEGIN
             PERFORM amqp.publish({b}, '{ex}', '{rk}', 'm:8');
             RAISE EXCEPTION 'undo';
           EXCEPTION WHEN raise_exception THEN NULL;
           END;
           PERFORM amqp.publish({b}, '{ex}', '{rk}', 'm:9');
         END $$"
    ))
    .unwrap();
    ledger.aborted([&k(8)]);
    ledger.committed([&k(9)]);

    // An error after the publish.
    c.batch_execute("BEGIN").unwrap();
    publish(c, &k(10));
    assert!(c.batch_execute("SELECT 1/0").is_err());
    c.batch_execute("ROLLBACK").unwrap();
    ledger.aborted([&k(10)]);

    // statement_timeout after the publish.
    c.batch_execute("BEGIN; SET LOCAL statement_timeout = '100ms'")
        .unwrap();
    publish(c, &k(11));
    let e = c.batch_execute("SELECT pg_sleep(10)").unwrap_err();
    assert_eq!(sqlstate(&e), "57014", "statement_timeout: {e}");
    c.batch_execute("ROLLBACK").unwrap();
    ledger.aborted([&k(11)]);

    // Two-phase commit: ROLLBACK PREPARED never delivers, COMMIT PREPARED (no commit wake in
    // the publishing session) does.
    c.batch_execute("BEGIN").unwrap();
    publish(c, &k(12));
    c.batch_execute("PREPARE TRANSACTION 'chaos_rb'").unwrap();
    c.batch_execute("ROLLBACK PREPARED 'chaos_rb'").unwrap();
    ledger.aborted([&k(12)]);
    c.batch_execute("BEGIN").unwrap();
    publish(c, &k(13));
    c.batch_execute("PREPARE TRANSACTION 'chaos_cp'").unwrap();
    c.batch_execute("COMMIT PREPARED 'chaos_cp'").unwrap();
    ledger.committed([&k(13)]);

    // pg_terminate_backend of the caller mid-transaction.
    let mut victim = rig.cluster.client();
    let victim_pid: i32 = victim
        .query_one("SELECT pg_backend_pid()", &[])
        .unwrap()
        .get(0);
    victim.batch_execute("BEGIN").unwrap();
    publish(&mut victim, &k(14));
    let c = &mut rig.client;
    let killed: bool = c
        .query_one("SELECT pg_terminate_backend($1, 30000)", &[&victim_pid])
        .unwrap()
        .get(0);
    assert!(killed);
    assert!(
        victim.batch_execute("COMMIT").is_err(),
        "COMMIT on a terminated session must fail"
    );
    ledger.aborted([&k(14)]);

    // The client process killed (SIGKILL) mid-transaction: psql with an open transaction.
    let install = PgInstall::find().unwrap();
    let app = format!("chaos_killed_{}", std::process::id());
    let mut psql = std::process::Command::new(install.bindir.join("psql"))
        .args([
            "-X",
            "-q",
            "-h",
            "127.0.0.1",
            "-p",
            &rig.cluster.port().to_string(),
            "-U",
            "postgres",
            "-d",
            &rig.cluster.config().database,
        ])
        .env("PGAPPNAME", &app)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn psql");
    {
        use std::io::Write;
        let stdin = psql.stdin.as_mut().unwrap();
        writeln!(
            stdin,
            "BEGIN;\nSELECT amqp.publish({b}, '{ex}', '{rk}', 'm:15');"
        )
        .unwrap();
        stdin.flush().unwrap();
    }
    let backend = wait_backend_state(c, &app, "idle in transaction", ARRIVAL);
    psql.kill().expect("SIGKILL psql");
    let _ = psql.wait();
    ledger.aborted([&k(15)]);
    eventually(ARRIVAL, "the killed client's backend to end", || {
        c.batch_execute("SELECT pg_stat_clear_snapshot()")
            .map_err(|e| e.to_string())?;
        let n: i64 = c
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = $1",
                &[&backend],
            )
            .map_err(|e| e.to_string())?
            .get(0);
        if n == 0 {
            Ok(())
        } else {
            Err("still there".into())
        }
    });

    join_all(producers);
    let report = rig.finish(
        None,
        0,
        &[],
        "savepoint/exception/error/timeout/2PC/terminate/SIGKILL client",
    );
    assert!(report.aborted >= 12, "{report}");
}
