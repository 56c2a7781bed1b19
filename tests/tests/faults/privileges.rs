//! Case 14: privileges, secrets and a search_path hijack.

use amqp_outbox_e2e::chaos::count_log_lines;
use amqp_outbox_e2e::{eventually, unique_name, MessageKey};

use super::harness::*;

// ------------------------------------------------------------------------------------------
// 14. privileges and secrets
// ------------------------------------------------------------------------------------------

#[test]
fn case14_privileges_secrets_and_search_path_hijack() {
    let mut rig = Rig::new("14 privileges and secrets", base_config());
    let b = rig.outbox.broker_id;
    let (ex, rk) = (rig.route.exchange.clone(), rig.route.routing_key.clone());
    let mut notes = Vec::new();

    // A broker login with a secret password.
    let secret = unique_name("Sec").replace('.', "-");
    rig.node.ctl(&["add_user", "e2euser", &secret]).unwrap();
    rig.node
        .ctl(&["set_permissions", "-p", "/", "e2euser", ".*", ".*", ".*"])
        .unwrap();
    rig.client
        .execute(
            "UPDATE amqp.broker SET username = 'e2euser', password = $2 WHERE broker_id = $1",
            &[&b, &secret],
        )
        .unwrap();
    rig.publish_key(&MessageKey::new("s", 0));
    rig.collector.wait_for_body("s:0", ARRIVAL);
    // An error path that names the login (a vhost that does not exist), then back.
    let from = rig.cluster.log().len();
    rig.client
        .execute(
            "UPDATE amqp.broker SET vhost = 'nope' WHERE broker_id = $1",
            &[&b],
        )
        .unwrap();
    rig.publish_key(&MessageKey::new("s", 1));
    let cluster = &rig.cluster;
    eventually(ARRIVAL, "the vhost error in the log", || {
        if count_log_lines(&cluster.log(), from, &["unavailable"]) > 0 {
            Ok(())
        } else {
            Err(cluster.log_tail(3))
        }
    });
    rig.client
        .execute(
            "UPDATE amqp.broker SET vhost = '/' WHERE broker_id = $1",
            &[&b],
        )
        .unwrap();
    rig.collector.wait_for_body("s:1", ARRIVAL);

    // A role without grants.
    rig.client
        .batch_execute("CREATE ROLE nogrants LOGIN; CREATE ROLE monitor LOGIN IN ROLE pg_monitor")
        .unwrap();
    let as_role = |role: &str| {
        postgres::Client::connect(
            &rig.cluster
                .connection_string(&rig.cluster.config().database)
                .replace("user=postgres", &format!("user={role}")),
            postgres::NoTls,
        )
        .unwrap()
    };
    let mut nog = as_role("nogrants");
    let mut denied = Vec::new();
    let mut allowed = Vec::new();
    for sql in [
        "SELECT * FROM amqp.broker",
        "SELECT password FROM amqp.broker",
        "SELECT * FROM amqp.message",
        "SELECT * FROM amqp.discarded",
        "UPDATE amqp.broker SET host = 'evil'",
        "DELETE FROM amqp.message",
    ] {
        match nog.batch_execute(sql) {
            Err(e) if sqlstate(&e) == "42501" => denied.push(sql),
            Err(e) => panic!("{sql} as nogrants: {e} (want 42501)"),
            Ok(()) => allowed.push(sql),
        }
    }
    assert!(
        allowed.is_empty(),
        "a role without grants could run: {allowed:?}"
    );
    // Reported, not asserted (roles and privileges are being implemented).
    let publish = nog
        .batch_execute(&format!(
            "SELECT amqp.publish({b}, '{ex}', '{rk}', 'nogrants:0')"
        ))
        .map_err(|e| sqlstate(&e));
    let views = nog
        .batch_execute("SELECT * FROM amqp.broker_status")
        .map_err(|e| sqlstate(&e));
    let setting = nog
        .query_one("SHOW amqp_outbox.database", &[])
        .map(|r| r.get::<_, String>(0))
        .map_err(|e| sqlstate(&e));
    notes.push(format!(
        "nogrants: {} statements denied (42501); publish {:?}, broker_status {:?}, SHOW setting {:?}",
        denied.len(),
        publish,
        views,
        setting
    ));
    let mut mon = as_role("monitor");
    let status: Vec<String> = mon
        .query("SELECT row_to_json(s)::text FROM amqp.broker_status s", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(
        !status.iter().any(|s| s.contains(&secret)),
        "broker_status shows the password to pg_monitor: {status:?}"
    );
    assert!(
        mon.batch_execute("SELECT password FROM amqp.broker")
            .is_err(),
        "pg_monitor can read broker passwords"
    );

    // search_path hijack: public functions and an operator shadowing built-ins, first on the
    // search_path of the publishing session and of the database (the worker's).
    rig.client
        .batch_execute(
            "CREATE TABLE public.hijack_log (fn text, at timestamptz DEFAULT pg_catalog.clock_timestamp());
             GRANT INSERT ON public.hijack_log TO PUBLIC;
             CREATE FUNCTION public.now() RETURNS timestamptz LANGUAGE plpgsql AS
               $$BEGIN INSERT INTO public.hijack_log(fn) VALUES ('now'); RETURN '1999-01-01'; END$$;
             CREATE FUNCTION public.pg_backend_pid() RETURNS int LANGUAGE plpgsql AS
               $$BEGIN INSERT INTO public.hijack_log(fn) VALUES ('pg_backend_pid'); RETURN -1; END$$;
             CREATE FUNCTION public.octet_length(text) RETURNS int LANGUAGE plpgsql AS
               $$BEGIN INSERT INTO public.hijack_log(fn) VALUES ('octet_length(text)'); RETURN 0; END$$;
             CREATE FUNCTION public.octet_length(bytea) RETURNS int LANGUAGE plpgsql AS
               $$BEGIN INSERT INTO public.hijack_log(fn) VALUES ('octet_length(bytea)'); RETURN 0; END$$;
             CREATE FUNCTION public.jsonb_typeof(jsonb) RETURNS text LANGUAGE plpgsql AS
               $$BEGIN INSERT INTO public.hijack_log(fn) VALUES ('jsonb_typeof'); RETURN 'object'; END$$;
             CREATE FUNCTION public.nextval(regclass) RETURNS bigint LANGUAGE plpgsql AS
               $$BEGIN INSERT INTO public.hijack_log(fn) VALUES ('nextval'); RETURN pg_catalog.nextval($1); END$$;
             CREATE FUNCTION public.to_hex(bigint) RETURNS text LANGUAGE plpgsql AS
               $$BEGIN INSERT INTO public.hijack_log(fn) VALUES ('to_hex'); RETURN pg_catalog.to_hex($1); END$$;
             CREATE FUNCTION public.hijack_int4eq(int, int) RETURNS bool LANGUAGE plpgsql AS
               $$BEGIN INSERT INTO public.hijack_log(fn) VALUES ('=(int,int)'); RETURN $1 OPERATOR(pg_catalog.=) $2; END$$;
             CREATE OPERATOR public.= (LEFTARG = int, RIGHTARG = int, FUNCTION = public.hijack_int4eq);
             CREATE FUNCTION public.hijack_int8eq(bigint, bigint) RETURNS bool LANGUAGE plpgsql AS
               $$BEGIN INSERT INTO public.hijack_log(fn) VALUES ('=(bigint,bigint)'); RETURN $1 OPERATOR(pg_catalog.=) $2; END$$;
             CREATE OPERATOR public.= (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = public.hijack_int8eq);",
        )
        .unwrap();
    let db = rig.cluster.config().database.clone();
    rig.client
        .batch_execute(&format!(
            "ALTER DATABASE \"{db}\" SET search_path = public, pg_catalog"
        ))
        .unwrap();
    // A new worker picks the database's search_path up.
    let old = rig.worker_pid().unwrap();
    rig.client
        .execute("SELECT pg_terminate_backend($1)", &[&old])
        .unwrap();
    let cluster = &rig.cluster;
    let client = &mut rig.client;
    eventually(WORKER_UP, "a new worker", || {
        match cluster.worker_pid(client)? {
            Some(p) if p != old => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    let mut hijacked = rig.cluster.client();
    hijacked
        .batch_execute("SET search_path = public, pg_catalog")
        .unwrap();
    let real_pid: i32 = hijacked
        .query_one("SELECT pg_catalog.pg_backend_pid()", &[])
        .unwrap()
        .get(0);
    for i in 0..20u64 {
        let key = MessageKey::new("hj", i);
        hijacked
            .execute(
                "SELECT amqp.publish_message($1, $2, $3, $4, '{\"h\": 1}')",
                &[&b, &ex, &rk, &key.body()],
            )
            .unwrap_or_else(|e| panic!("publish with a hijacked search_path: {e}"));
        rig.ledger.committed([&key]);
    }
    let d = rig.collector.wait_for_body("hj:19", ARRIVAL);
    let pid_header = d.header("x-amqp-outbox-producer-pid").and_then(|v| {
        v.as_i64()
            .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
    });
    let hits: Vec<String> = rig
        .client
        .query("SELECT DISTINCT fn FROM public.hijack_log ORDER BY 1", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    notes.push(format!(
        "search_path hijack (session + database): hijacked built-ins called: {hits:?}"
    ));
    // The worker was restarted once (duplicates bounded by the in-flight window).
    let report = rig.finish(None, MAX_IN_FLIGHT, &["nogrants:"], &notes.join("; "));
    let log = rig.cluster.log();
    assert!(
        !log.contains(&secret),
        "the broker password is in the server log:\n{}",
        log.lines()
            .filter(|l| l.contains(&secret))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(
        pid_header,
        Some(i64::from(real_pid)),
        "producer pid header hijacked"
    );
    assert!(
        hits.is_empty(),
        "a search_path hijack reached the extension: {hits:?}"
    );
    assert!(report.committed >= 22);
}
