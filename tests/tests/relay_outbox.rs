//! The relay's `ClientOutbox` (relay/src/client_outbox.rs): the engine's statements over a
//! client connection, on a private cluster without the library where a role that is not a
//! superuser ran the plain-SQL install (sql/hosted/). Each method against the rows it must
//! read or write, with other sessions holding rows where that matters.

use std::time::Duration;

use amqp_outbox_broker::backoff::Backoff;
use amqp_outbox_e2e::hosted::{installed, owner_client, DB};
use amqp_outbox_e2e::PgCluster;
use amqp_outbox_engine::flight::Proof;
use amqp_outbox_engine::message::uuid7_unix_ms;
use amqp_outbox_engine::outbox::{Outbox, RetryDelays};
use amqp_outbox_engine::row::Row;
use amqp_outbox_relay::client_outbox::{ClientOutbox, Session};
use postgres::{Client, IsolationLevel, Transaction};

/// A cluster without the library, the script run by a role with CREATE on the database and
/// CREATEROLE (what a hosted service's administrator has), brokers 1 and 2, and the relay's
/// connection (as that role) with its session.
struct Fixture {
    cluster: PgCluster,
    relay: Client,
    session: Session,
}

impl Fixture {
    fn new() -> Fixture {
        let cluster = installed();
        let mut owner = owner_client(&cluster);
        owner
            .batch_execute(
                "INSERT INTO amqp.broker (broker_id, host) VALUES (1, '127.0.0.1'), (2, '127.0.0.1')",
            )
            .expect("brokers");
        let mut relay = owner_client(&cluster);
        let session = Session::new(&mut relay).expect("the relay's session");
        Fixture {
            cluster,
            relay,
            session,
        }
    }

    /// Another session (a publisher, an admin holding rows).
    fn other(&self) -> Client {
        self.cluster.client_db(DB)
    }

    /// A transaction of the relay's connection and the outbox over it, as a claim runs it
    /// (REPEATABLE READ) or as the settling does (READ COMMITTED).
    fn with<R>(
        &mut self,
        level: IsolationLevel,
        f: impl FnOnce(&mut ClientOutbox<'_, Transaction<'_>>) -> R,
    ) -> R {
        let mut tx = self
            .relay
            .build_transaction()
            .isolation_level(level)
            .start()
            .expect("BEGIN");
        let r = f(&mut ClientOutbox::new(&mut tx, &mut self.session));
        tx.commit().expect("COMMIT");
        r
    }

    fn claiming<R>(&mut self, f: impl FnOnce(&mut ClientOutbox<'_, Transaction<'_>>) -> R) -> R {
        self.with(IsolationLevel::RepeatableRead, f)
    }

    fn settling<R>(&mut self, f: impl FnOnce(&mut ClientOutbox<'_, Transaction<'_>>) -> R) -> R {
        self.with(IsolationLevel::ReadCommitted, f)
    }
}

/// Publishes `body` to broker `broker` with routing key `rk`; returns its id.
fn publish(c: &mut Client, broker: i32, rk: &str, body: &str) -> i64 {
    c.query_one(
        "SELECT amqp.publish_message($1, 'ex', $2, $3)",
        &[&broker, &rk, &body],
    )
    .expect("publish_message")
    .get(0)
}

fn ids(rows: &[Row]) -> Vec<i64> {
    rows.iter().map(|r| r.id).collect()
}

fn sorted(mut v: Vec<i64>) -> Vec<i64> {
    v.sort_unstable();
    v
}

/// A row's delivery state: attempts, last_error, parked, seconds until next_attempt_at.
fn state(c: &mut Client, id: i64) -> (i32, Option<String>, bool, Option<f64>) {
    let r = c
        .query_one(
            "SELECT attempts, last_error, parked_at IS NOT NULL, \
                    extract(epoch FROM next_attempt_at - clock_timestamp())::float8 \
               FROM amqp.message WHERE id = $1",
            &[&id],
        )
        .expect("the row");
    (r.get(0), r.get(1), r.get(2), r.get(3))
}

/// Holds these rows locked (FOR UPDATE) in an open transaction of `c` until it is dropped.
fn hold<'c>(c: &'c mut Client, ids: &[i64]) -> Transaction<'c> {
    let mut tx = c.transaction().expect("BEGIN");
    let locked = tx
        .query(
            "SELECT id FROM amqp.message WHERE id = ANY ($1) FOR UPDATE",
            &[&ids],
        )
        .expect("lock the rows");
    assert_eq!(locked.len(), ids.len(), "every row to hold exists");
    tx
}

#[test]
fn claim_reads_due_rows_in_id_order_with_every_field() {
    let mut f = Fixture::new();
    let mut p = f.other();
    p.batch_execute("SET amqp_outbox.system_id = 'sys-a'")
        .expect("SET");
    let m1: i64 = p
        .query_one(
            "SELECT amqp.publish_message(1, 'ex', 'rk1', 'one', \
                 headers => '{\"h\": \"v\", \"n\": 1}', delivery_mode => 1, \
                 content_type => 'text/plain', reply_to => 'rq', correlation_id => 'c1', \
                 business_type => 'order.created', business_key => 'k1', \
                 traceparent => '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01')",
            &[],
        )
        .expect("publish_message")
        .get(0);
    p.batch_execute("RESET amqp_outbox.system_id")
        .expect("RESET");
    p.query_one("SELECT amqp.publish(1, 'ex', 'rk2', 'two')", &[])
        .expect("publish");
    let m2: i64 = p
        .query_one("SELECT max(id) FROM amqp.message", &[])
        .expect("max")
        .get(0);
    let m3 = publish(&mut p, 2, "rk3", "three");
    let m4 = publish(&mut p, 1, "rk4", "four");
    let parked = publish(&mut p, 1, "rk5", "parked");
    let later = publish(&mut p, 1, "rk6", "later");
    p.execute(
        "UPDATE amqp.message SET parked_at = now() WHERE id = $1",
        &[&parked],
    )
    .expect("park by hand");
    p.execute(
        "UPDATE amqp.message SET next_attempt_at = now() + interval '1 hour' WHERE id = $1",
        &[&later],
    )
    .expect("retry later");
    assert!(m1 < m2 && m2 < m3 && m3 < m4 && m4 < parked && parked < later);

    let rows = f.claiming(|o| o.claim(&[1], 100, &[], usize::MAX, 0).expect("claim"));
    assert_eq!(
        ids(&rows),
        [m1, m2, m4],
        "broker 1's due rows, in id order: not broker 2's, not the parked or not-yet-due one"
    );

    // Every field of the first row, against the table.
    let expect = p
        .query_one(
            "SELECT message_id, producer_pid, \
                    (extract(epoch FROM producer_started_at) * 1000000)::int8, \
                    (extract(epoch FROM created_at) * 1000000)::int8 \
               FROM amqp.message WHERE id = $1",
            &[&m1],
        )
        .expect("m1");
    let r = &rows[0];
    assert_eq!(r.broker_id, 1);
    assert_eq!(r.exchange, "ex");
    assert_eq!(r.routing_key, "rk1");
    assert_eq!(r.body, b"one");
    assert_eq!(r.delivery_mode, 1);
    assert_eq!(r.content_type.as_deref(), Some("text/plain"));
    assert_eq!(r.reply_to.as_deref(), Some("rq"));
    assert_eq!(r.correlation_id.as_deref(), Some("c1"));
    let headers: serde_json::Value =
        serde_json::from_str(r.headers.as_deref().expect("headers as text")).expect("JSON");
    assert_eq!(headers, serde_json::json!({"h": "v", "n": 1}));
    assert_eq!(r.message_id, expect.get::<_, String>(0));
    assert_eq!(r.producer_pid, expect.get::<_, i32>(1));
    assert_eq!(r.producer_started_at, expect.get::<_, i64>(2));
    assert_eq!(r.created_at, expect.get::<_, i64>(3));
    let now_micros = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_micros() as i64;
    assert!(
        (now_micros - r.created_at).abs() < 600_000_000,
        "created_at in Unix microseconds: {}",
        r.created_at
    );
    assert_eq!(r.attempts, 0);
    assert_eq!(r.tags.business_type.as_deref(), Some("order.created"));
    assert_eq!(r.tags.business_key.as_deref(), Some("k1"));
    assert_eq!(
        r.tags.traceparent.as_deref(),
        Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    );
    assert_eq!(r.tags.system_id.as_deref(), Some("sys-a"));
    assert_eq!(r.tags.host_id, None);
    // A plain publish: the defaults.
    let r = &rows[1];
    assert_eq!(
        (r.routing_key.as_str(), r.body.as_slice()),
        ("rk2", &b"two"[..])
    );
    assert_eq!(r.delivery_mode, 2);
    assert_eq!(
        (
            &r.content_type,
            &r.headers,
            &r.tags.business_type,
            &r.tags.system_id
        ),
        (&None, &None, &None, &None)
    );

    f.claiming(|o| {
        let claim = |o: &mut ClientOutbox<'_, Transaction<'_>>,
                     brokers: &[i32],
                     limit: usize,
                     skip: &[i64],
                     bytes: usize,
                     after: i64| {
            ids(&o.claim(brokers, limit, skip, bytes, after).expect("claim"))
        };
        assert_eq!(claim(o, &[1, 2], 100, &[], usize::MAX, 0), [m1, m2, m3, m4]);
        assert_eq!(claim(o, &[2], 100, &[], usize::MAX, 0), [m3]);
        assert_eq!(claim(o, &[1], 100, &[m2], usize::MAX, 0), [m1, m4], "skip");
        assert_eq!(claim(o, &[1], 2, &[], usize::MAX, 0), [m1, m2], "limit");
        assert_eq!(
            claim(o, &[1], 2, &[m1], usize::MAX, 0),
            [m2, m4],
            "the limit counts only rows not skipped"
        );
        assert_eq!(claim(o, &[1], 100, &[], usize::MAX, m1), [m2, m4], "after");
        // Bodies of 3, 3 and 4 bytes: a row is taken while the bytes before it are under the
        // budget; the first always.
        assert_eq!(claim(o, &[1], 100, &[], 1, 0), [m1], "the first row always");
        assert_eq!(claim(o, &[1], 100, &[], 3, 0), [m1]);
        assert_eq!(claim(o, &[1], 100, &[], 4, 0), [m1, m2]);
        assert_eq!(claim(o, &[1], 100, &[], 7, 0), [m1, m2, m4]);
        assert_eq!(claim(o, &[3], 100, &[], usize::MAX, 0), Vec::<i64>::new());

        let suspects = o
            .claim_ids(&[later, parked, m4, m1, 999_999])
            .expect("claim_ids");
        assert_eq!(
            ids(&suspects),
            [m1, m4, later],
            "in id order, not parked, not gone (due or not)"
        );
        assert_eq!(suspects[0].body, b"one");
        assert_eq!(suspects[0].tags.system_id.as_deref(), Some("sys-a"));
    });
}

#[test]
fn probe_reads_the_snapshot_and_a_next_xid_above_every_running_publisher() {
    let mut f = Fixture::new();
    let first = f.claiming(|o| o.probe().expect("probe"));
    let first = first.expect("a probe on a fresh install");
    assert_eq!(first.last_value, 0, "no id drawn yet");

    let mut p = f.other();
    let done = publish(&mut p, 1, "rk", "committed");
    // A publisher left open, holding the newest transaction id: the floor must not pass over
    // its row, so the next transaction id must be above its id (a later snapshot's xmax, one
    // past the highest *completed* id, would not be).
    let mut open = f.other();
    open.batch_execute("BEGIN").expect("BEGIN");
    let pending = publish(&mut open, 1, "rk", "pending");
    let open_xid: i64 = open
        .query_one("SELECT pg_current_xact_id()::text::int8", &[])
        .expect("xid")
        .get(0);

    let (probe, claimed) = f.claiming(|o| {
        let probe = o.probe().expect("probe").expect("a probe");
        let claimed = ids(&o.claim(&[1], 100, &[], usize::MAX, 0).expect("claim"));
        (probe, claimed)
    });
    assert!(probe.xmin <= probe.xmax, "{probe:?}");
    assert!(
        probe.running.windows(2).all(|w| w[0] < w[1]),
        "running sorted: {probe:?}"
    );
    assert!(
        probe
            .running
            .iter()
            .all(|x| *x >= probe.xmin && *x < probe.xmax),
        "{probe:?}"
    );
    assert_eq!(probe.last_value, pending, "the id the open publisher drew");
    assert!(
        probe.next_xid > open_xid as u64,
        "next_xid {} above the open publisher's {open_xid}",
        probe.next_xid
    );
    assert!(probe.next_xid >= probe.xmax, "{probe:?}");
    assert!(
        probe.xmax <= open_xid as u64 || probe.running.contains(&(open_xid as u64)),
        "the open publisher is not seen ended: {probe:?}"
    );
    assert_eq!(claimed, [done], "the claim sees the probe's snapshot");

    // The next transaction id is this transaction's own, taken after the probe.
    let mut tx = f
        .relay
        .build_transaction()
        .isolation_level(IsolationLevel::RepeatableRead)
        .start()
        .expect("BEGIN");
    let probe = ClientOutbox::new(&mut tx, &mut f.session)
        .probe()
        .expect("probe")
        .expect("a probe");
    let own: i64 = tx
        .query_one("SELECT pg_current_xact_id_if_assigned()::text::int8", &[])
        .expect("own xid")
        .get(0);
    assert_eq!(probe.next_xid, own as u64);
    tx.commit().expect("COMMIT");
    open.batch_execute("COMMIT").expect("COMMIT");

    // READ COMMITTED: the claim would not read in the probe's snapshot.
    let rc = f.settling(|o| o.probe().expect("probe"));
    assert_eq!(rc, None, "no floor under READ COMMITTED");
    // A transaction that took an id before the probe: that id may be below others'.
    let mut tx = f
        .relay
        .build_transaction()
        .isolation_level(IsolationLevel::RepeatableRead)
        .start()
        .expect("BEGIN");
    tx.query_one("SELECT pg_current_xact_id()", &[])
        .expect("xid");
    let probe = ClientOutbox::new(&mut tx, &mut f.session)
        .probe()
        .expect("probe");
    assert_eq!(probe, None, "no floor with an id taken before the probe");
    tx.commit().expect("COMMIT");

    // A sequence that caches values hands them out of order: no floor, until it no longer does.
    let mut owner = owner_client(&f.cluster);
    owner
        .batch_execute("ALTER TABLE amqp.message ALTER COLUMN id SET CACHE 10")
        .expect("cache 10");
    assert_eq!(f.claiming(|o| o.probe().expect("probe")), None, "cache 10");
    owner
        .batch_execute("ALTER TABLE amqp.message ALTER COLUMN id SET CACHE 1")
        .expect("cache 1");
    let again = f.claiming(|o| o.probe().expect("probe"));
    assert_eq!(again.map(|p| p.last_value), Some(pending));
}

#[test]
fn delete_delivered_writes_the_production_log_and_the_statistics() {
    let mut f = Fixture::new();
    let mut p = f.other();
    p.batch_execute(
        "INSERT INTO amqp.monitor_rule (business_type, consumers) VALUES ('watched', '{billing}')",
    )
    .expect("monitor rule");
    let watched: i64 = p
        .query_one(
            "SELECT amqp.publish_message(1, 'ex', 'rk', 'kept body', business_type => 'watched')",
            &[],
        )
        .expect("publish")
        .get(0);
    let plain = publish(&mut p, 1, "plain", "not kept");
    let unlogged = publish(&mut p, 1, "unlogged", "x");
    let stays = publish(&mut p, 1, "stays", "y");
    let proof = |c: &mut Client, id: i64, published: i64, confirmed: Option<i64>| {
        let message_id: String = c
            .query_one("SELECT message_id FROM amqp.message WHERE id = $1", &[&id])
            .expect("message_id")
            .get(0);
        Proof {
            id,
            message_at: uuid7_unix_ms(&message_id).expect("a UUIDv7") * 1000,
            published,
            confirmed,
            acknowledged: None,
        }
    };
    let t = 1_700_000_000_123_456_i64;
    let proofs = vec![
        proof(&mut p, watched, t, Some(t + 1_000)),
        proof(&mut p, plain, t + 2_000, None),
        Proof {
            id: 999_999,
            ..proof(&mut p, plain, t, None)
        },
    ];
    let unlogged_proof = proof(&mut p, unlogged, t, Some(t));

    let (deleted, origin) = f.settling(|o| {
        let origin = o.origin();
        let origin = (origin.system_id.to_owned(), origin.host_id.to_owned());
        (o.delete_delivered(&proofs, true).expect("delete"), origin)
    });
    assert_eq!(deleted, 2, "the rows that existed");
    assert_eq!(
        origin,
        (DB.to_owned(), amqp_outbox_broker::identity::host_name())
    );
    let left: Vec<i64> = p
        .query("SELECT id FROM amqp.message ORDER BY id", &[])
        .expect("rows")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(left, [unlogged, stays]);

    let logged = p
        .query(
            "SELECT seq, business_type, system_id, host_id, \
                    (extract(epoch FROM published_at) * 1000000)::int8, \
                    (extract(epoch FROM confirmed_at) * 1000000)::int8, \
                    acknowledged_at IS NULL, body, expected, check_at IS NOT NULL, \
                    (extract(epoch FROM message_at) * 1000000)::int8 \
               FROM amqp.produced ORDER BY seq",
            &[],
        )
        .expect("production log");
    assert_eq!(logged.len(), 2, "one record per deleted row");
    let w = &logged[0];
    assert_eq!(w.get::<_, i64>(0), watched);
    assert_eq!(w.get::<_, String>(1), "watched");
    assert_eq!(
        w.get::<_, String>(2),
        DB,
        "the default system tag: the database"
    );
    assert_eq!(
        w.get::<_, String>(3),
        amqp_outbox_broker::identity::host_name()
    );
    assert_eq!(w.get::<_, i64>(4), t);
    assert_eq!(w.get::<_, Option<i64>>(5), Some(t + 1_000));
    assert!(w.get::<_, bool>(6));
    assert_eq!(
        w.get::<_, Option<Vec<u8>>>(7).as_deref(),
        Some(&b"kept body"[..]),
        "a monitored message keeps its body"
    );
    assert_eq!(
        w.get::<_, Option<Vec<String>>>(8),
        Some(vec!["billing".to_owned()])
    );
    assert!(w.get::<_, bool>(9), "the monitor's first look");
    assert_eq!(w.get::<_, i64>(10), proofs[0].message_at);
    let n = &logged[1];
    assert_eq!(n.get::<_, i64>(0), plain);
    assert_eq!(n.get::<_, String>(1), "plain", "the routing key stands in");
    assert_eq!(n.get::<_, Option<i64>>(5), None);
    assert_eq!(n.get::<_, Option<Vec<u8>>>(7), None, "not monitored");
    assert!(!n.get::<_, bool>(9));

    let stat = |c: &mut Client, kind: &str| -> Option<(i64, bool)> {
        c.query_opt(
            "SELECT delivered, day = (to_timestamp($2 / 1e6::float8) AT TIME ZONE 'UTC')::date \
               FROM amqp._daily_stat WHERE business_type = $1 AND part = 0",
            &[&kind, &(proofs[0].message_at as f64)],
        )
        .expect("statistics")
        .map(|r| (r.get(0), r.get(1)))
    };
    assert_eq!(stat(&mut p, "watched"), Some((1, true)));
    assert_eq!(stat(&mut p, "plain"), Some((1, true)));

    // Without the log: deleted and counted, not recorded.
    let deleted = f.settling(|o| {
        o.delete_delivered(&[unlogged_proof], false)
            .expect("delete")
    });
    assert_eq!(deleted, 1);
    let recorded: i64 = p
        .query_one(
            "SELECT count(*) FROM amqp.produced WHERE seq = $1",
            &[&unlogged],
        )
        .expect("count")
        .get(0);
    assert_eq!(recorded, 0);
    assert_eq!(stat(&mut p, "unlogged"), Some((1, true)));
    assert_eq!(stat(&mut p, "stays"), None);
}

#[test]
fn failures_resends_and_parks_count_attempts_and_leave_locked_rows_alone() {
    let mut f = Fixture::new();
    let mut p = f.other();
    let failing = publish(&mut p, 1, "rk", "a");
    let locked = publish(&mut p, 1, "rk", "b");
    let resent = publish(&mut p, 1, "rk", "c");
    let last_try = publish(&mut p, 1, "rk", "d");
    let unsendable = publish(&mut p, 1, "rk", "e");
    p.execute(
        "UPDATE amqp.message SET attempts = 1 WHERE id = $1",
        &[&last_try],
    )
    .expect("one attempt made");
    p.execute(
        "UPDATE amqp.message SET next_attempt_at = now() + interval '1 hour' WHERE id = $1",
        &[&resent],
    )
    .expect("a retry scheduled");
    let delays = RetryDelays::new(&Backoff::new(
        Duration::from_secs(10),
        Duration::from_secs(60),
    ));

    let r = f.settling(|o| {
        o.record_failure(failing, "refused: 1", 3, &delays)
            .expect("record_failure")
    });
    let r = r.expect("recorded");
    assert_eq!((r.attempts, r.parked), (1, false));
    assert_eq!(r.retry_in, Duration::from_secs(10), "the first delay: min");
    let (attempts, error, parked, due_in) = state(&mut p, failing);
    assert_eq!(
        (attempts, error.as_deref(), parked),
        (1, Some("refused: 1"), false)
    );
    let due_in = due_in.expect("next_attempt_at");
    assert!((8.0..=10.5).contains(&due_in), "due in {due_in} s");
    let claimed = f.claiming(|o| ids(&o.claim(&[1], 100, &[], usize::MAX, 0).expect("claim")));
    assert!(!claimed.contains(&failing), "not due: {claimed:?}");

    let second = f.settling(|o| {
        o.record_failure(failing, "refused: 2", 3, &delays)
            .expect("record_failure")
    });
    let second = second.expect("recorded");
    assert_eq!((second.attempts, second.parked), (2, false));
    let (_, _, _, due_in) = state(&mut p, failing);
    assert!(
        due_in.expect("next_attempt_at") > 8.0,
        "the second delay: at least min"
    );
    let third = f.settling(|o| {
        o.record_failure(failing, "refused: 3", 3, &delays)
            .expect("record_failure")
    });
    let third = third.expect("recorded");
    assert_eq!((third.attempts, third.parked), (3, true), "max_attempts");
    assert!(state(&mut p, failing).2, "parked");
    let none = f.settling(|o| {
        (
            o.record_failure(failing, "again", 3, &delays)
                .expect("record_failure")
                .is_none(),
            o.record_failure(999_999, "gone", 3, &delays)
                .expect("record_failure")
                .is_none(),
        )
    });
    assert_eq!(none, (true, true), "parked, gone: nothing recorded");

    // Another session holds a row: nothing waits, nothing is written to it.
    let mut admin = f.other();
    let held = hold(&mut admin, &[locked]);
    let (failure, resend_parked, parked_now) = f.settling(|o| {
        o.set_lock_timeout("5s").expect("a bound on waits, in case");
        (
            o.record_failure(locked, "refused", 3, &delays)
                .expect("record_failure")
                .is_none(),
            o.record_resend(&[resent, last_try, locked, 999_999], "gap", 2)
                .expect("record_resend"),
            o.park(locked, "never").expect("park"),
        )
    });
    drop(held);
    assert!(failure, "a locked row: None");
    assert_eq!(resend_parked, [last_try], "parked at max_attempts");
    assert!(!parked_now, "a locked row is not parked");
    assert_eq!(state(&mut p, locked), (0, None, false, None), "left alone");
    let (attempts, error, parked, due) = state(&mut p, resent);
    assert_eq!(
        (attempts, error.as_deref(), parked, due),
        (1, Some("gap"), false, None),
        "counted, due at once"
    );
    assert_eq!(state(&mut p, last_try).0, 2);
    assert!(state(&mut p, last_try).2);

    let (first, again, gone) = f.settling(|o| {
        (
            o.park(unsendable, "no route").expect("park"),
            o.park(unsendable, "no route").expect("park"),
            o.park(999_999, "gone").expect("park"),
        )
    });
    assert_eq!((first, again, gone), (true, false, false));
    let (attempts, error, parked, _) = state(&mut p, unsendable);
    assert_eq!(
        (attempts, error.as_deref(), parked),
        (1, Some("no route"), true)
    );
}

#[test]
fn lock_free_existing_and_the_delete_around_a_held_row() {
    let mut f = Fixture::new();
    let mut p = f.other();
    let free = publish(&mut p, 1, "rk", "free");
    let locked = publish(&mut p, 1, "rk", "locked");
    let gone = publish(&mut p, 1, "rk", "gone");
    p.execute("DELETE FROM amqp.message WHERE id = $1", &[&gone])
        .expect("delete");
    let mut admin = f.other();
    let held = hold(&mut admin, &[locked]);

    let mut tx = f.relay.transaction().expect("BEGIN");
    let mut o = ClientOutbox::new(&mut tx, &mut f.session);
    let all = [free, locked, gone];
    assert_eq!(sorted(o.lock_free(&all).expect("lock_free")), [free]);
    assert_eq!(sorted(o.existing(&all).expect("existing")), [free, locked]);
    // `free` is now this transaction's.
    let taken = p
        .query(
            "SELECT id FROM amqp.message WHERE id = $1 FOR UPDATE SKIP LOCKED",
            &[&free],
        )
        .expect("try the lock");
    assert!(taken.is_empty(), "lock_free locked the row");
    tx.rollback().expect("ROLLBACK");

    // The engine's DELETE of delivered rows: it waits DELETE_LOCK_WAIT in a subtransaction,
    // whose lock timeout is caught; then deletes the free row and reports the held one.
    let proof = |id: i64| Proof {
        id,
        message_at: 0,
        published: 0,
        confirmed: None,
        acknowledged: None,
    };
    let waiting = f.settling(|o| {
        amqp_outbox_engine::settle::delete_delivered(
            o,
            vec![proof(free), proof(locked)],
            false,
            false,
        )
        .expect("delete_delivered")
    });
    assert_eq!(
        waiting.iter().map(|p| p.id).collect::<Vec<_>>(),
        [locked],
        "the held row waits"
    );
    drop(held);
    let left: Vec<i64> = p
        .query("SELECT id FROM amqp.message ORDER BY id", &[])
        .expect("rows")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(left, [locked]);
}

#[test]
fn subtransactions_undo_only_their_own_work_and_the_transaction_goes_on() {
    let mut f = Fixture::new();
    let mut p = f.other();
    let m: Vec<i64> = (0..5)
        .map(|i| publish(&mut p, 1, "rk", &format!("m{i}")))
        .collect();
    let parked = |c: &mut Client| -> Vec<i64> {
        c.query(
            "SELECT id FROM amqp.message WHERE parked_at IS NOT NULL ORDER BY id",
            &[],
        )
        .expect("parked")
        .iter()
        .map(|r| r.get(0))
        .collect()
    };

    let mut tx = f.relay.transaction().expect("BEGIN");
    let mut o = ClientOutbox::new(&mut tx, &mut f.session);
    // A failing statement: caught with its SQLSTATE, what ran before it inside undone.
    let failed = o.subtransaction(|o| {
        assert!(o.park(m[0], "undone").expect("park"));
        o.set_lock_timeout("not a duration")
    });
    let caught = failed.expect_err("an ERROR is caught");
    assert_eq!(caught.sqlstate, "22023", "{caught:?}");
    assert!(caught.message.contains("lock_timeout"), "{caught:?}");
    // The transaction goes on, without the park.
    let rows = o.claim_ids(&[m[0]]).expect("the transaction goes on");
    assert_eq!(ids(&rows), [m[0]], "the park inside was rolled back");

    // Work that ends well is kept; nested levels undo only their own.
    let kept = o.subtransaction(|o| o.park(m[1], "kept"));
    assert!(matches!(kept, Ok(Ok(true))));
    let outer = o.subtransaction(|o| {
        assert!(o.park(m[2], "outer, kept").expect("park"));
        let inner = o.subtransaction(|o| {
            assert!(o.park(m[3], "inner, undone").expect("park"));
            o.set_lock_timeout("nonsense")
        });
        assert!(inner.is_err(), "the inner ERROR is caught");
        o.claim_ids(&[m[3]]).map(|r| ids(&r))
    });
    assert_eq!(
        outer
            .expect("the outer level ends well")
            .expect("claim_ids"),
        [m[3]],
        "the inner park was undone inside the outer level"
    );
    let both = o.subtransaction(|o| {
        let inner = o.subtransaction(|o| o.park(m[4], "inner, released"));
        assert!(matches!(inner, Ok(Ok(true))));
        o.set_lock_timeout("nonsense")
    });
    assert!(both.is_err(), "the outer ERROR is caught");
    // A lock timeout set in a subtransaction that failed is gone with it.
    let undone_timeout = o.subtransaction(|o| {
        o.set_lock_timeout("1234ms")?;
        o.set_lock_timeout("nonsense")
    });
    assert!(undone_timeout.is_err());
    let timeout: String = tx.query_one("SHOW lock_timeout", &[]).expect("SHOW").get(0);
    assert_eq!(
        timeout, "10s",
        "rolled back with its subtransaction: the session's own (its delivery settings)"
    );
    tx.commit().expect("COMMIT");

    assert_eq!(
        parked(&mut p),
        [m[1], m[2]],
        "kept: the released levels; undone: the failed ones, with what they had released"
    );
}
