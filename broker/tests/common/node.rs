//! A private RabbitMQ node of one test (the shared node is never reconfigured): the shared
//! `amqp_outbox_testkit` node process (its own directory, node name, ports and process group;
//! stopped and removed on drop), with a TLS listener's port reserved. Listens on 127.0.0.1
//! only.

use std::time::Duration;

use amqp_outbox_testkit::{NodeOptions, RabbitNode};

// Every test binary compiles `common`; only those with a private node use this.
#[allow(unused_imports)]
pub use amqp_outbox_testkit::rabbitmq_installed;

pub struct Node {
    /// The plaintext AMQP port.
    pub port: u16,
    /// The TLS listener's port (configured only when the node was started with one).
    pub tls_port: u16,
    node: RabbitNode,
}

impl Node {
    /// A plain node.
    pub fn start() -> Option<Node> {
        Self::start_with(|_| String::new())
    }

    /// A node whose `rabbitmq.conf` gets the lines `extra(&node)` returns (e.g. a TLS listener
    /// on `node.tls_port`).
    pub fn start_with(extra: impl FnOnce(&Node) -> String) -> Option<Node> {
        let prepared = RabbitNode::prepare(NodeOptions {
            extra_ports: 1,
            ..NodeOptions::new("t", std::env::temp_dir().join(super::unique("node")))
        });
        let mut node = match prepared {
            Ok(node) => Node {
                port: node.port(),
                tls_port: node.extra_port(0),
                node,
            },
            Err(e) => {
                eprintln!("cannot prepare a private node: {e}");
                return None;
            }
        };
        let booted = node
            .node
            .append_conf(&extra(&node))
            .and_then(|()| node.node.boot(Duration::from_secs(90)));
        if let Err(e) = booted {
            eprintln!("private node did not start: {e}");
            return None;
        }
        Some(node)
    }

    /// `rabbitmqctl -q …`'s standard output, or None when it fails.
    pub fn ctl_output(&self, args: &[&str]) -> Option<String> {
        let args: Vec<&str> = ["-q"].iter().chain(args).copied().collect();
        self.node
            .cli_output("rabbitmqctl", &args)
            .ok()
            .map(|(out, _)| out)
    }

    pub fn ctl(&self, args: &[&str]) -> bool {
        self.ctl_output(args).is_some()
    }

    /// guest@127.0.0.1 on the plaintext port.
    pub fn endpoint(&self) -> amqp_outbox_broker::Endpoint {
        let mut e = super::local_endpoint();
        e.port = self.port;
        e
    }
}
