//! End-to-end TLS (`amqps`): a private RabbitMQ node with a TLS listener on 127.0.0.1 and
//! certificates this test makes with `openssl` (a CA, a server certificate for "localhost", and
//! an unrelated CA). A broker row with `tls` and the wrong CA leaves messages pending with a
//! clear warning in the server log (no password); fixed to the right CA (and reached by
//! address with `tls_server_name = 'localhost'`), the same messages arrive.
//!
//! Requires the extension installed (`make install`), `rabbitmq-server` and `openssl`.

use std::time::Duration;

use amqp_outbox_e2e::outbox::create_extension;
use amqp_outbox_e2e::{eventually, unique_name, Outbox, PgCluster, PrivateRabbit};
use amqp_outbox_testkit::{openssl_installed, pick_ports, Pki};

const SECRET: &str = "pw-S3cr3t-tls-e2e";

#[test]
fn tls_broker_row_delivers_with_the_right_ca_and_logs_a_clear_error_with_the_wrong_one() {
    assert!(
        openssl_installed(),
        "openssl is not installed (scripts/setup.sh installs it)"
    );
    // Readable by the cluster's user (the worker opens the CA file).
    let pki = Pki::make().unwrap_or_else(|e| panic!("certificates: {e}"));
    let file = |name: &str| pki.path(name);

    let mut node = PrivateRabbit::prepare();
    let tls_port = pick_ports(30000, 32000, 1);
    let conf = node.dir().join("rabbitmq.conf");
    let mut text = std::fs::read_to_string(&conf).unwrap();
    text.push_str(&pki.listener_conf(tls_port, false));
    std::fs::write(&conf, text).unwrap();
    node.boot();

    // Topology and consumer over the node's plaintext port (the test's own client).
    let rabbit = node.rabbit();
    let route = rabbit.declare_route("tls");
    let collector = rabbit.consume_connected(&route);

    let cluster = PgCluster::with_defaults();
    let mut client = cluster.client();
    create_extension(&mut client);
    let port = i32::from(tls_port);
    let broker_id: i32 = client
        .query_one(
            "INSERT INTO amqp.broker (host, port, username, password, tls, tls_ca_file, \
             tls_server_name) VALUES ('127.0.0.1', $1, 'guest', $2, true, $3, 'localhost') \
             RETURNING broker_id",
            &[&port, &SECRET, &file("other_ca.pem")],
        )
        .unwrap()
        .get(0);
    let outbox = Outbox { broker_id };
    let bodies: Vec<String> = (0..5).map(|i| unique_name(&format!("tls{i}"))).collect();
    for b in &bodies {
        outbox.publish(&mut client, &route.exchange, &route.routing_key, b);
    }

    // The wrong CA: a clear warning naming the cause, never the password; nothing delivered.
    let line = eventually(
        Duration::from_secs(30),
        "the worker's warning about the untrusted certificate",
        || {
            cluster
                .log()
                .lines()
                .find(|l| l.contains(&format!("broker {broker_id} unavailable")))
                .map(str::to_string)
                .ok_or_else(|| cluster.log_tail(10))
        },
    );
    eprintln!("server log: {line}");
    assert!(line.contains("unknown issuer"), "{line}");
    assert!(
        !cluster.log().contains("S3cr3t"),
        "password in the server log"
    );
    assert_eq!(Outbox::pending(&mut client).unwrap(), 5);
    assert!(collector.deliveries().is_empty());

    // The right CA (and the password): the same messages arrive, over TLS.
    client
        .execute(
            "UPDATE amqp.broker SET tls_ca_file = $1, password = 'guest' WHERE broker_id = $2",
            &[&file("ca.pem"), &broker_id],
        )
        .unwrap();
    for b in &bodies {
        collector.wait_for_body(b, Duration::from_secs(30));
    }
    Outbox::wait_drained(&mut client, Duration::from_secs(30));
    let connections = node
        .ctl(&["list_connections", "ssl", "client_properties"])
        .unwrap();
    let worker: Vec<&str> = connections
        .lines()
        .filter(|l| l.contains("amqp_outbox"))
        .collect();
    assert!(!worker.is_empty(), "{connections}");
    assert!(
        worker.iter().all(|l| l.trim_start().starts_with("true")),
        "{connections}"
    );
    assert!(
        !cluster.log().contains("S3cr3t"),
        "password in the server log"
    );
}
