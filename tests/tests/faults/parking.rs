//! Cases 6 and 7: unroutable and poison messages are parked while the rest flows.

use std::time::Instant;

use amqp_outbox_e2e::chaos::count_log_lines;
use amqp_outbox_e2e::{eventually, MessageKey, PrivateRabbit, Producer};

use super::harness::*;

// ------------------------------------------------------------------------------------------
// 6. unroutable
// ------------------------------------------------------------------------------------------

/// id, attempts, parked, last_error, seconds from created_at to parked_at.
type ParkedRow = (i64, i32, bool, Option<String>, Option<f64>);

#[test]
fn case06_unroutable_is_parked_not_delivered_and_others_flow() {
    let max_attempts = 4;
    let mut rig = Rig::new(
        "6 unroutable",
        base_config()
            .setting("amqp_outbox.max_attempts", max_attempts)
            .setting("amqp_outbox.retry_backoff_min", 200),
    );
    let producers = rig.producers("ur", 2, 600, 10, 0.0);
    let mut ids = Vec::new();
    for i in 0..5u64 {
        let id: i64 = rig
            .client
            .query_one(
                "SELECT amqp.publish_message($1, $2, 'no.such.binding', $3)",
                &[
                    &rig.outbox.broker_id,
                    &rig.route.exchange,
                    &MessageKey::new("u", i).body(),
                ],
            )
            .unwrap()
            .get(0);
        ids.push(id);
    }
    let t0 = Instant::now();
    // Until parked: never deleted (never counted as delivered), attempts grow with backoff.
    let client = &mut rig.client;
    let parked = eventually(ARRIVAL, "the unroutable rows to be parked", || {
        let rows = client
            .query(
                "SELECT id, attempts, parked_at IS NOT NULL, last_error, \
                        extract(epoch FROM parked_at - created_at)::float8 \
                   FROM amqp.message WHERE id = ANY($1) ORDER BY id",
                &[&ids],
            )
            .map_err(|e| e.to_string())?;
        if rows.len() != ids.len() {
            panic!(
                "an unroutable row was deleted (counted as delivered): {} of {} left",
                rows.len(),
                ids.len()
            );
        }
        let all: Vec<ParkedRow> = rows
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
            .collect();
        if all.iter().all(|r| r.2) {
            Ok(all)
        } else {
            Err(format!("{all:?}"))
        }
    });
    eprintln!("parked after {:?}: {parked:?}", t0.elapsed());
    for (id, attempts, _, err, secs) in &parked {
        assert_eq!(
            *attempts, max_attempts,
            "row {id} parked after {attempts} attempts"
        );
        assert!(
            err.as_deref().is_some_and(|e| !e.trim().is_empty()),
            "row {id} parked without an error"
        );
        // Backoff before attempts 2, 3 and 4: at most 200, 400 and 800 ms, jittered down by up
        // to half but never below the 200 ms minimum, so at least 200 + 200 + 400 ms (a row is
        // claimed only once its next_attempt_at has passed).
        assert!(
            secs.unwrap_or(0.0) >= 0.8 - 0.005,
            "row {id} parked after {secs:?} s: no backoff between attempts"
        );
    }
    assert!(
        !rig.collector.bodies().iter().any(|b| b.starts_with("u:")),
        "an unroutable message reached the queue"
    );
    // The other messages kept flowing meanwhile.
    let stats: Vec<_> = producers.into_iter().map(Producer::wait).collect();
    eprintln!("producers: {stats:?}");
    rig.ledger.wait_all_arrived(&rig.collector, ARRIVAL);
    // Make the route exist, release the parked rows: they are delivered after all.
    rig.node
        .rabbit()
        .bind_queue(&rig.route.queue, &rig.route.exchange, "no.such.binding");
    let released: i64 = rig
        .client
        .query_one("SELECT amqp.retry_all($1)", &[&rig.outbox.broker_id])
        .unwrap()
        .get(0);
    assert_eq!(released, 5);
    let heal_at = Instant::now();
    let keys: Vec<MessageKey> = (0..5).map(|i| MessageKey::new("u", i)).collect();
    rig.ledger.committed(&keys);
    rig.finish(
        Some(heal_at),
        0,
        &[],
        &format!(
            "5 unroutable parked after {max_attempts} attempts ({:?}), delivered after bind + retry_all",
            parked[0].3.as_deref().unwrap_or("")
        ),
    );
}

// ------------------------------------------------------------------------------------------
// 7. poison messages
// ------------------------------------------------------------------------------------------

#[test]
fn case07_poison_messages_are_parked_without_a_reconnect_storm() {
    let max_attempts = 3;
    let mut node = PrivateRabbit::prepare();
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(node.dir().join("rabbitmq.conf"))
            .unwrap();
        writeln!(f, "max_message_size = 131072").unwrap();
    }
    node.boot();
    let ctl = |args: &[&str]| node.ctl(args).unwrap_or_else(|e| panic!("{e}"));
    ctl(&["add_user", "limited", "limited-pw"]);
    // `limited` may write to the default exchange (acknowledgement records), the
    // acknowledgement queue and the test's own exchanges (e2e.chaos-…), nothing else.
    ctl(&[
        "set_permissions",
        "-p",
        "/",
        "limited",
        ".*",
        "^(amq\\.default|amqp_outbox\\..*|e2e\\.chaos-.*)$",
        ".*",
    ]);
    let mut endpoint = node.endpoint();
    endpoint.username = "limited".into();
    endpoint.password = "limited-pw".into();
    // An exchange that exists but `limited` may not write to.
    let forbidden = {
        let mut r = node.rabbit().declare_route("noperm");
        r.delete_on_drop = false;
        r.exchange.clone()
    };
    let mut rig = Rig::with_node(
        "7 poison messages",
        base_config()
            .setting("amqp_outbox.max_attempts", max_attempts)
            .setting("amqp_outbox.retry_backoff_min", 200),
        node,
        Some(endpoint),
    );
    let log_from = rig.cluster.log().len();
    let producers = rig.producers("ps", 2, 500, 10, 0.0);
    let b = rig.outbox.broker_id;
    let big = format!("big:0:{}", "x".repeat(200_000));
    let poison: Vec<(&str, String, String)> = vec![
        (
            "404",
            "e2e.chaos-missing.x".to_string(),
            "p404:0".to_string(),
        ),
        ("403", forbidden, "p403:0".to_string()),
        ("size", rig.route.exchange.clone(), big),
    ];
    let mut ids = Vec::new();
    for (what, exchange, body) in &poison {
        let id: i64 = rig
            .client
            .query_one(
                "SELECT amqp.publish_message($1, $2, $3, $4)",
                &[&b, exchange, &rig.route.routing_key, body],
            )
            .unwrap()
            .get(0);
        ids.push((*what, id));
    }
    let t0 = Instant::now();
    // Other messages are delivered on time while the poison is retried.
    let stats: Vec<_> = producers.into_iter().map(Producer::wait).collect();
    eprintln!("producers: {stats:?}");
    rig.ledger.wait_all_arrived(&rig.collector, ARRIVAL);
    let good_after = t0.elapsed();
    let client = &mut rig.client;
    let parked = eventually(ARRIVAL, "every poison message parked", || {
        let mut out = Vec::new();
        for (what, id) in &ids {
            let row = client
                .query_opt(
                    "SELECT attempts, parked_at IS NOT NULL, last_error FROM amqp.message WHERE id = $1",
                    &[id],
                )
                .map_err(|e| e.to_string())?
                .unwrap_or_else(|| panic!("poison message {what} (id {id}) was deleted"));
            let (attempts, parked, err): (i32, bool, Option<String>) =
                (row.get(0), row.get(1), row.get(2));
            if !parked {
                return Err(format!("{what} (id {id}): attempts {attempts}, {err:?}"));
            }
            out.push((*what, *id, attempts, err.unwrap_or_default()));
        }
        Ok(out)
    });
    let parked_after = t0.elapsed();
    for (what, id, attempts, err) in &parked {
        eprintln!("poison {what} (id {id}) parked after {attempts} attempts: {err}");
        assert!(*attempts >= max_attempts, "{what}: parked after {attempts}");
        assert!(!err.trim().is_empty(), "{what}: no error recorded");
    }
    let log = rig.cluster.log();
    let connects = count_log_lines(&log, log_from, &["amqp_outbox: broker", "connected to"]);
    let unavailable = count_log_lines(&log, log_from, &["amqp_outbox: broker", "unavailable"]);
    // Each refused attempt may cost a channel (or a connection); a storm would be hundreds.
    let storm_bound = 3 * (max_attempts as usize) * 3 + 10;
    assert!(
        connects + unavailable <= storm_bound,
        "reconnect storm: {connects} connects, {unavailable} unavailable in the log"
    );
    // Discard them on purpose: they move to amqp.discarded.
    for (_, id, _, _) in &parked {
        rig.client
            .execute("SELECT amqp.discard($1, 'chaos test')", &[id])
            .unwrap();
    }
    let errors: Vec<String> = parked
        .iter()
        .map(|(w, _, a, e)| {
            format!(
                "{w}: {a} attempts, {}",
                e.chars().take(60).collect::<String>()
            )
        })
        .collect();
    rig.finish(
        None,
        // Each refused attempt closes the channel; good messages in flight on it are published
        // again (documented: duplicates bounded by max_in_flight per fault).
        3 * (max_attempts as usize) * MAX_IN_FLIGHT,
        &["p404:", "p403:", "big:"],
        &format!(
            "good messages all in {:.1}s, poison parked after {:.1}s; {connects} connects/{unavailable} unavailable log lines; {}",
            good_after.as_secs_f64(),
            parked_after.as_secs_f64(),
            errors.join(" | ")
        ),
    );
    assert!(
        !rig.collector
            .bodies()
            .iter()
            .any(|b| b.starts_with("p404:") || b.starts_with("p403:") || b.starts_with("big:")),
        "a poison message was delivered"
    );
}
