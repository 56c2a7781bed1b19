//! A private RabbitMQ node for tests that stop, restart or break the broker. The shared broker
//! (5672) is never touched. The node process itself (own directory, `HOME` and cookie, node
//! name `t<port>@localhost`, ports, process group) is `amqp_outbox_testkit`'s [`RabbitNode`];
//! this adds AMQP clients and the `rabbitmqctl` commands the tests use.

use std::path::Path;
use std::time::Duration;

use amqp_outbox_testkit::{NodeOptions, RabbitNode};

use crate::rabbit::{AmqpEndpoint, Rabbit};
use crate::try_eventually;

/// A RabbitMQ node of our own on 127.0.0.1. Dropping it stops the node and removes its files
/// (kept with `AMQP_OUTBOX_E2E_KEEP=1`).
pub struct PrivateRabbit {
    node: RabbitNode,
}

const STARTUP_TIMEOUT: Duration = Duration::from_secs(90);

impl PrivateRabbit {
    /// Prepares a node (ports, directories, config) and starts it; returns once it accepts
    /// AMQP connections.
    pub fn start() -> PrivateRabbit {
        let mut r = PrivateRabbit::prepare();
        r.boot();
        r
    }

    /// Prepares a node without starting it: its port is known (e.g. to point a broker row at
    /// it) but nothing listens there until [`boot`](Self::boot).
    pub fn prepare() -> PrivateRabbit {
        PrivateRabbit::try_prepare()
            .unwrap_or_else(|e| panic!("cannot prepare a RabbitMQ node: {e}"))
    }

    pub fn try_prepare() -> Result<PrivateRabbit, String> {
        // The node owns (and on drop removes) the directory.
        let dir = tempfile::Builder::new()
            .prefix("amqp_outbox_e2e_rabbit.")
            .tempdir()
            .map_err(|e| format!("cannot create a temporary directory: {e}"))?
            .keep();
        let node = RabbitNode::prepare(NodeOptions {
            keep_dir: std::env::var_os("AMQP_OUTBOX_E2E_KEEP").is_some(),
            ..NodeOptions::new("t", dir)
        })?;
        Ok(PrivateRabbit { node })
    }

    pub fn port(&self) -> u16 {
        self.node.port()
    }

    pub fn node(&self) -> &str {
        self.node.name()
    }

    pub fn dir(&self) -> &Path {
        self.node.dir()
    }

    /// 127.0.0.1:port, guest/guest (allowed from anywhere by `loopback_users = none`).
    pub fn endpoint(&self) -> AmqpEndpoint {
        AmqpEndpoint::local(self.port())
    }

    /// A client connection for declaring topology.
    pub fn rabbit(&self) -> Rabbit {
        Rabbit::connect(self.endpoint()).unwrap_or_else(|e| panic!("{e}"))
    }

    /// True when an AMQP client can connect and log in now.
    pub fn accepts_connections(&self) -> bool {
        Rabbit::connect(self.endpoint()).is_ok()
    }

    /// The node's log file (for failure messages).
    pub fn log(&self) -> String {
        self.node.log()
    }

    /// Starts the node (again) and waits until it accepts AMQP connections.
    pub fn boot(&mut self) {
        if let Err(e) = self.try_boot() {
            panic!("cannot start RabbitMQ node {}: {e}", self.node());
        }
    }

    pub fn try_boot(&mut self) -> Result<(), String> {
        self.node.boot(STARTUP_TIMEOUT)?;
        self.await_amqp()
            .map_err(|e| format!("node up but AMQP port {} not usable: {e}", self.port()))
    }

    /// The listener comes up with the app; waits until a client can log in.
    fn await_amqp(&self) -> Result<(), String> {
        try_eventually(Duration::from_secs(30), || {
            Rabbit::connect(self.endpoint()).map(drop)
        })
    }

    /// Runs `rabbitmqctl -n NODE args…`; returns its output, or an error with its output.
    pub fn ctl(&self, args: &[&str]) -> Result<String, String> {
        self.node.ctl(args)
    }

    /// Runs `rabbitmq-diagnostics -n NODE args…` (e.g. `alarms`).
    pub fn diagnostics(&self, args: &[&str]) -> Result<String, String> {
        self.node.cli("rabbitmq-diagnostics", args)
    }

    /// The node's AMQP connections: (Erlang pid, client properties as rabbitmqctl prints them;
    /// they include the `connection_name` a client gave). RabbitMQ 3.10's `list_connections`
    /// has no `user_provided_name` column.
    pub fn connections(&self) -> Result<Vec<(String, String)>, String> {
        let out = self.ctl(&[
            "list_connections",
            "pid",
            "client_properties",
            "--quiet",
            "--no-table-headers",
        ])?;
        Ok(out
            .lines()
            .filter(|l| l.trim_start().starts_with('<'))
            .map(|l| {
                let (pid, name) = l.split_once('\t').unwrap_or((l, ""));
                (pid.trim().to_string(), name.trim().to_string())
            })
            .collect())
    }

    /// `rabbitmqctl close_connection PID REASON`.
    pub fn close_connection(&self, pid: &str, reason: &str) -> Result<(), String> {
        self.ctl(&["close_connection", pid, reason]).map(drop)
    }

    /// `rabbitmqctl set_disk_free_limit LIMIT`: `100000GB` raises the disk alarm (every
    /// publishing connection is blocked), `50MB` (the default) clears it.
    pub fn set_disk_free_limit(&self, limit: &str) {
        self.ctl_or_panic(&["set_disk_free_limit", limit]);
    }

    /// True when `rabbitmq-diagnostics alarms` reports a resource alarm on the node.
    pub fn has_alarm(&self) -> Result<bool, String> {
        let out = self.diagnostics(&["alarms"])?;
        Ok(!out.contains("no alarms") && (out.contains("disk") || out.contains("memory")))
    }

    fn ctl_or_panic(&self, args: &[&str]) {
        if let Err(e) = self.ctl(args) {
            panic!("{e}");
        }
    }

    /// `rabbitmqctl stop_app`: the broker application stops (connections closed, port closed),
    /// the Erlang node stays up.
    pub fn stop_app(&self) {
        self.ctl_or_panic(&["stop_app"]);
    }

    /// `rabbitmqctl start_app`, then waits until a client can connect.
    pub fn start_app(&self) {
        self.ctl_or_panic(&["start_app"]);
        if let Err(e) = self.await_amqp() {
            panic!("after start_app, AMQP port {} not usable: {e}", self.port());
        }
    }

    /// `rabbitmqctl close_all_connections REASON`.
    pub fn close_all_connections(&self, reason: &str) {
        self.ctl_or_panic(&["close_all_connections", reason]);
    }

    /// The pid of the node's `beam.smp` (for `kill -STOP` / `-CONT` / `-9`).
    pub fn beam_pid(&self) -> Option<i32> {
        self.node.beam_pid()
    }

    /// Sends `signal` to the node's `beam.smp`.
    pub fn signal(&self, signal: i32) -> Result<(), String> {
        self.node.signal(signal)
    }

    /// Stops the whole node (`rabbitmqctl stop`) and waits for its processes to end and its
    /// port to be free. Its data (durable exchanges, queues, persistent messages) stays for the
    /// next [`boot`](Self::boot).
    pub fn stop(&mut self) {
        self.node.stop(Duration::from_secs(30));
    }

    pub fn is_started(&self) -> bool {
        self.node.is_running()
    }
}
