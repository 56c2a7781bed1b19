//! TLS (`amqps`) against private RabbitMQ nodes with TLS listeners, and certificates this test
//! makes with `openssl`: a CA, a server certificate for "localhost" signed by it, an expired
//! one, a second unrelated CA, and a client certificate. The shared node is never touched.
//!
//! Cases: the right CA connects and messages are confirmed (publisher and acknowledgement
//! listener both over TLS); an untrusted CA, a name mismatch and an expired certificate fail
//! with a Disconnected naming the cause, retried with backoff; a TLS host pointed at a
//! plaintext port fails and never falls back to plaintext; a node that requires a client
//! certificate refuses a client without one and accepts one with it; missing files are clear
//! errors. No error carries the password.

mod common;

use amqp_outbox_broker::{BrokerConfig, Command, Endpoint, Event, LogLevel, TlsOptions};
use amqp_outbox_testkit::{openssl_installed, Pki};
use common::node::{rabbitmq_installed, Node};
use common::*;
use std::collections::HashMap;
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SECRET: &str = "pw-S3cr3t-%/@-tls";

/// The broker's TLS options for the test's certificates.
trait TlsFiles {
    /// Trusting `ca` (one of the PKI's files).
    fn tls(&self, ca: &str) -> TlsOptions;
    /// `t` plus the PKI's client certificate.
    fn with_client_cert(&self, t: TlsOptions) -> TlsOptions;
}

impl TlsFiles for Pki {
    fn tls(&self, ca: &str) -> TlsOptions {
        TlsOptions {
            ca_file: Some(self.path(ca)),
            ..TlsOptions::default()
        }
    }

    fn with_client_cert(&self, mut t: TlsOptions) -> TlsOptions {
        t.cert_file = Some(self.path("client.pem"));
        t.key_file = Some(self.path("client.key"));
        t
    }
}

fn make_pki() -> Pki {
    Pki::make().unwrap_or_else(|e| panic!("certificates: {e}"))
}

fn endpoint(host: &str, port: u16, password: &str, tls: Option<TlsOptions>) -> Endpoint {
    Endpoint {
        host: host.into(),
        port,
        vhost: "/".into(),
        username: "guest".into(),
        password: password.into(),
        tls,
    }
}

/// The first Connected (Ok: host) or Disconnected (Err: error) of each broker in `ids`.
fn outcomes(bridge: &mut Bridge, ids: &[i32]) -> HashMap<i32, Result<String, String>> {
    let mut out: HashMap<i32, Result<String, String>> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while ids.iter().any(|id| !out.contains_key(id)) {
        assert!(
            Instant::now() < deadline,
            "no outcome for some of {ids:?}: {out:#?}; events: {:#?}",
            bridge.seen
        );
        for e in bridge.poll(Duration::from_millis(200)) {
            match &e {
                Event::Connected {
                    broker_id, host, ..
                } => {
                    out.entry(*broker_id).or_insert(Ok(host.clone()));
                }
                Event::Disconnected { broker_id, error } => {
                    out.entry(*broker_id).or_insert(Err(error.clone()));
                }
                _ => {}
            }
            bridge.seen.push(e);
        }
    }
    out
}

fn failed(out: &HashMap<i32, Result<String, String>>, id: i32) -> String {
    match &out[&id] {
        Ok(host) => panic!("broker {id} connected to {host}; it should have failed"),
        Err(e) => {
            assert!(!e.contains("S3cr3t"), "password in the error: {e}");
            e.clone()
        }
    }
}

fn connected(out: &HashMap<i32, Result<String, String>>, id: i32) {
    if let Err(e) = &out[&id] {
        panic!("broker {id} did not connect: {e}");
    }
}

/// Publishes `n` messages to `queue` (declared by the broker side) and waits for their confirms
/// (and, in `AckQueue` mode, their acknowledgement records).
fn publish_and_settle(bridge: &mut Bridge, cfg: &BrokerConfig, queue: &str, first_id: i64) {
    let ids: Vec<i64> = (first_id..first_id + 5).collect();
    let messages = ids.iter().map(|i| message(*i, "", queue)).collect();
    bridge.publish(cfg.broker_id, messages, false);
    let mut confirmed = Vec::new();
    let mut acked = Vec::new();
    let want_acks = cfg.proof == amqp_outbox_broker::ProofMode::AckQueue;
    bridge.wait_for(Duration::from_secs(20), |e| {
        match e {
            Event::Confirmed { broker_id, ids, .. } if *broker_id == cfg.broker_id => {
                confirmed.extend(ids.iter().copied())
            }
            Event::Acked { broker_id, ids, .. } if *broker_id == cfg.broker_id => {
                acked.extend(ids.iter().copied())
            }
            Event::Failed {
                broker_id,
                id,
                error,
                ..
            } if *broker_id == cfg.broker_id => {
                panic!("message {id} failed: {error}")
            }
            _ => {}
        }
        let done = ids.iter().all(|i| confirmed.contains(i))
            && (!want_acks || ids.iter().all(|i| acked.contains(i)));
        done.then_some(())
    });
}

fn with_queue(mut cfg: BrokerConfig, queue: &str) -> BrokerConfig {
    cfg.queues = vec![amqp_outbox_broker::QueueDecl {
        name: queue.into(),
        durable: false,
        auto_delete: false,
        arguments: serde_json::Map::new(),
    }];
    cfg
}

/// The node's client connections of `broker_id` with their `ssl` flag.
fn node_connections(node: &Node, broker_id: i32) -> Vec<String> {
    let tag = format!("amqp_outbox broker {broker_id} (");
    node.ctl_output(&["list_connections", "ssl", "client_properties"])
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(&tag))
        .map(|l| l.split('\t').next().unwrap_or("").trim().to_string())
        .collect()
}

/// Test certificates and a private node with a TLS listener (asking for a client certificate
/// when `client_cert`); None, said on stderr, where rabbitmq-server or openssl is missing.
fn tls_node(client_cert: bool) -> Option<(Pki, Node)> {
    if !rabbitmq_installed() || !openssl_installed() {
        eprintln!("rabbitmq-server or openssl is not installed here: skipped");
        return None;
    }
    let pki = make_pki();
    let node = Node::start_with(|n| pki.listener_conf(n.tls_port, client_cert))
        .expect("cannot start a private RabbitMQ node");
    Some((pki, node))
}

#[test]
fn verifies_the_ca_and_the_name_and_never_falls_back_to_plaintext() {
    let Some((pki, node)) = tls_node(false) else {
        return;
    };
    let (plain, tls) = (node.port, node.tls_port);
    let q1 = unique("tls_q1");
    let q2 = unique("tls_q2");
    let acks = unique("tls_acks");

    let right = pki.tls("ca.pem");
    let mut override_name = right.clone();
    override_name.server_name = Some("localhost".into());
    let mut wrong_name = right.clone();
    wrong_name.server_name = Some("wrong.example".into());
    let missing_ca = TlsOptions {
        ca_file: Some(pki.path("no-such-ca.pem")),
        ..TlsOptions::default()
    };

    let ep = endpoint;
    let cfgs = vec![
        // 1: the right CA, by the certificate's name: connects, messages confirmed.
        with_queue(
            config(
                1,
                vec![ep("localhost", tls, "guest", Some(right.clone()))],
                vec![],
            ),
            &q1,
        ),
        // 2: by address with the name overridden, a client certificate the node verifies, and
        // the acknowledgement listener (its own connection) over TLS too.
        with_queue(
            ack_config(
                2,
                vec![ep(
                    "127.0.0.1",
                    tls,
                    "guest",
                    Some(pki.with_client_cert(override_name)),
                )],
                vec![],
                &acks,
                false,
            ),
            &q2,
        ),
        // 3: a CA that did not sign the server's certificate.
        config(
            3,
            vec![ep("localhost", tls, SECRET, Some(pki.tls("other_ca.pem")))],
            vec![],
        ),
        // 4: by address, the certificate is only for "localhost".
        config(
            4,
            vec![ep("127.0.0.1", tls, SECRET, Some(right.clone()))],
            vec![],
        ),
        // 5: an expected name the certificate does not carry.
        config(
            5,
            vec![ep("localhost", tls, SECRET, Some(wrong_name))],
            vec![],
        ),
        // 6: TLS configured, pointed at the plaintext port (where guest/guest would work).
        config(
            6,
            vec![ep("127.0.0.1", plain, "guest", Some(right.clone()))],
            vec![],
        ),
        // 7: a CA file that does not exist.
        config(
            7,
            vec![ep("localhost", tls, SECRET, Some(missing_ca))],
            vec![],
        ),
        // 8: plaintext pointed at the TLS port.
        config(8, vec![ep("127.0.0.1", tls, SECRET, None)], vec![]),
    ];
    let mut bridge = Bridge::new();
    bridge.send(Command::Configure(cfgs.clone()));
    let out = outcomes(&mut bridge, &[1, 2, 3, 4, 5, 6, 7, 8]);

    connected(&out, 1);
    connected(&out, 2);
    let e3 = failed(&out, 3);
    assert!(
        e3.contains("unknown issuer") && e3.contains("certificate"),
        "{e3}"
    );
    let e4 = failed(&out, 4);
    assert!(
        e4.contains("name mismatch") && e4.contains("\"127.0.0.1\""),
        "{e4}"
    );
    let e5 = failed(&out, 5);
    assert!(
        e5.contains("name mismatch") && e5.contains("wrong.example"),
        "{e5}"
    );
    let e6 = failed(&out, 6);
    assert!(e6.contains("TLS"), "{e6}");
    let e7 = failed(&out, 7);
    assert!(
        e7.contains("cannot read CA file") && e7.contains("no-such-ca.pem"),
        "{e7}"
    );
    failed(&out, 8);
    for e in [&e3, &e4, &e5, &e6, &e7] {
        eprintln!("Disconnected: {e}");
    }

    publish_and_settle(&mut bridge, &cfgs[0], &q1, 1);
    publish_and_settle(&mut bridge, &cfgs[1], &q2, 100);

    // The node sees the working connections as TLS ones.
    assert_eq!(node_connections(&node, 1), vec!["true"]);
    assert_eq!(node_connections(&node, 2), vec!["true"]);

    // Failures are retried with the usual backoff (reported again as debug lines, with the
    // cause), and the TLS host on the plaintext port never connects in plaintext.
    let mut retried: Vec<i32> = Vec::new();
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        for e in bridge.poll(Duration::from_millis(200)) {
            match &e {
                Event::Log {
                    level: LogLevel::Debug,
                    message,
                } => {
                    assert!(!message.contains("S3cr3t"), "{message}");
                    for id in [3, 4, 5, 6, 7] {
                        if message.starts_with(&format!("broker {id}: cannot connect"))
                            && !retried.contains(&id)
                        {
                            retried.push(id);
                        }
                    }
                }
                Event::Connected { broker_id, .. } => {
                    assert!(![3, 4, 5, 6, 7, 8].contains(broker_id), "{e:?}")
                }
                _ => {}
            }
            bridge.seen.push(e);
        }
    }
    retried.sort();
    assert_eq!(retried, vec![3, 4, 5, 6, 7], "{:#?}", bridge.seen);
    assert!(node_connections(&node, 6).is_empty());
}

#[test]
fn a_required_client_certificate_is_sent_when_configured() {
    let Some((pki, node)) = tls_node(true) else {
        return;
    };
    let q = unique("tls_client_q");
    let with_cert = pki.with_client_cert(pki.tls("ca.pem"));
    let mut missing_key = with_cert.clone();
    missing_key.key_file = Some(pki.path("no-such-client.key"));
    let cfgs = vec![
        with_queue(
            config(
                1,
                vec![endpoint(
                    "localhost",
                    node.tls_port,
                    "guest",
                    Some(with_cert),
                )],
                vec![],
            ),
            &q,
        ),
        config(
            2,
            vec![endpoint(
                "localhost",
                node.tls_port,
                SECRET,
                Some(pki.tls("ca.pem")),
            )],
            vec![],
        ),
        config(
            3,
            vec![endpoint(
                "localhost",
                node.tls_port,
                SECRET,
                Some(missing_key),
            )],
            vec![],
        ),
    ];
    let mut bridge = Bridge::new();
    bridge.send(Command::Configure(cfgs.clone()));
    let out = outcomes(&mut bridge, &[1, 2, 3]);
    connected(&out, 1);
    let e2 = failed(&out, 2);
    eprintln!("Disconnected: {e2}");
    assert!(
        e2.contains("TLS") && e2.contains("client certificate"),
        "{e2}"
    );
    let e3 = failed(&out, 3);
    assert!(e3.contains("cannot read client key file"), "{e3}");
    publish_and_settle(&mut bridge, &cfgs[0], &q, 1);
    assert_eq!(node_connections(&node, 1), vec!["true"]);
}

/// A TLS server (rustls, in this process) presenting an expired certificate signed by the
/// trusted CA: the handshake is all that matters here.
struct ExpiredServer {
    port: u16,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ExpiredServer {
    fn start(pki: &Pki) -> ExpiredServer {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let certs: Vec<CertificateDer<'static>> =
            CertificateDer::pem_file_iter(pki.path("expired.pem"))
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap();
        let key = PrivateKeyDer::from_pem_file(pki.path("expired.key")).unwrap();
        let config = Arc::new(
            rustls::ServerConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .unwrap(),
        );
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = std::thread::spawn(move || {
            while !stop2.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((mut sock, _)) => {
                        let _ = sock.set_nonblocking(false);
                        let _ = sock.set_read_timeout(Some(Duration::from_secs(2)));
                        let Ok(mut conn) = rustls::ServerConnection::new(config.clone()) else {
                            continue;
                        };
                        while conn.is_handshaking() {
                            if conn.complete_io(&mut sock).is_err() {
                                break;
                            }
                        }
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
        });
        ExpiredServer {
            port,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for ExpiredServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[test]
fn an_expired_server_certificate_is_refused() {
    if !openssl_installed() {
        eprintln!("openssl is not installed here: skipped");
        return;
    }
    let pki = make_pki();
    let server = ExpiredServer::start(&pki);
    let mut bridge = Bridge::new();
    bridge.send(Command::Configure(vec![config(
        1,
        vec![endpoint(
            "localhost",
            server.port,
            SECRET,
            Some(pki.tls("ca.pem")),
        )],
        vec![],
    )]));
    let out = outcomes(&mut bridge, &[1]);
    let e = failed(&out, 1);
    eprintln!("Disconnected: {e}");
    assert!(e.contains("expired"), "{e}");
    drop(bridge);
}
