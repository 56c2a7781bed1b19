//! Case 16: a standby publishes nothing until promoted.

use std::time::{Duration, Instant};

use amqp_outbox_e2e::chaos::{holds_for, proc_status_kb, Standby};
use amqp_outbox_e2e::{eventually, StopMode};

use super::harness::*;

// ------------------------------------------------------------------------------------------
// 16. standby
// ------------------------------------------------------------------------------------------

#[test]
fn case16_standby_publishes_nothing_until_promoted() {
    // The primary holds its messages (enabled = off), so its standby has rows to (not) publish.
    let mut rig = Rig::new(
        "16 standby",
        base_config().setting("amqp_outbox.enabled", "off"),
    );
    let (route, conninfo) = rig.publish_target();
    bulk_publish(
        conninfo.clone(),
        route.clone(),
        "sb".into(),
        0,
        200,
        100,
        rig.ledger.clone(),
    );
    let standby = Standby::create(
        &rig.cluster,
        &[("amqp_outbox.enabled", "on"), ("hot_standby", "on")],
    )
    .unwrap_or_else(|e| panic!("cannot create the standby: {e}"));
    // More messages after the base backup: streamed to the standby.
    bulk_publish(
        conninfo,
        route,
        "sb".into(),
        200,
        300,
        50,
        rig.ledger.clone(),
    );
    let mut sc = eventually(ARRIVAL, "the standby to accept connections", || {
        standby.client(&rig.cluster.config().database)
    });
    eventually(ARRIVAL, "the standby to replay every message row", || {
        let row = sc
            .query_one(
                "SELECT pg_is_in_recovery(), (SELECT count(*) FROM amqp.message)",
                &[],
            )
            .map_err(|e| e.to_string())?;
        let (rec, n): (bool, i64) = (row.get(0), row.get(1));
        if rec && n == 300 {
            Ok(())
        } else {
            Err(format!("in recovery {rec}, {n} rows"))
        }
    });
    rig.cluster.stop(StopMode::Fast);
    // The standby: no worker, no publish.
    let collector = &rig.collector;
    holds_for(Duration::from_secs(5), "the standby does nothing", || {
        let _ = sc.batch_execute("SELECT pg_stat_clear_snapshot()");
        let n: i64 = sc
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'amqp_outbox'",
                &[],
            )
            .map_err(|e| e.to_string())?
            .get(0);
        if n > 0 {
            return Err("an amqp_outbox worker runs on the standby".into());
        }
        if !collector.is_empty() {
            return Err(format!(
                "{} messages published from the standby",
                collector.len()
            ));
        }
        Ok(())
    })
    .unwrap();
    standby.promote().unwrap();
    let heal_at = Instant::now();
    rig.client = eventually(ARRIVAL, "a connection to the promoted standby", || {
        standby.client(&rig.cluster.config().database)
    });
    let client = &mut rig.client;
    let pid = eventually(WORKER_UP, "the worker on the promoted standby", || {
        let _ = client.batch_execute("SELECT pg_stat_clear_snapshot()");
        client
            .query_opt(
                "SELECT pid FROM pg_stat_activity WHERE backend_type = 'amqp_outbox'",
                &[],
            )
            .map_err(|e| e.to_string())?
            .map(|r| r.get::<_, i32>(0))
            .ok_or_else(|| "no worker yet".to_string())
    });
    let hwm = proc_status_kb(pid, "VmHWM");
    rig.finish(
        Some(heal_at),
        0,
        &[],
        &format!("standby: no worker and nothing published for 5s; after promotion worker {pid} (VmHWM {hwm:?} kB) published all"),
    );
    drop(standby);
}
