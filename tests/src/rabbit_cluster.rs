//! A RabbitMQ cluster of private nodes on this machine, for the high-availability tests
//! (`tests/ha.rs`): node failover, quorum queue leader loss, a majority down. The shared broker
//! (5672) is never touched.
//!
//! Each node is an `amqp_outbox_testkit` [`RabbitNode`] (own node name `ha<port>@localhost`,
//! directory, ports, process group), but all nodes share ONE `HOME`, so they and our
//! `rabbitmqctl` calls share one `.erlang.cookie`, which is what lets them form a cluster.
//! Node 1 boots alone; every other node boots, then `stop_app`, `join_cluster <node 1>`,
//! `start_app`.
//!
//! Faults: [`kill`](RabbitCluster::kill) (SIGKILL of the node's `beam.smp` and its process
//! group: the abrupt death of a machine, no goodbye to clients or peers) and
//! [`boot`](RabbitCluster::boot) (the node restarts from its data directory and rejoins).
//! Dropping the cluster kills every node's process group and removes the directories.
//!
//! [`Collector::start_failover`](crate::Collector::start_failover) over
//! [`endpoints`](RabbitCluster::endpoints) is a consumer that fails over between the nodes.

use std::fs;
use std::path::Path;
use std::time::Duration;

use amqp_outbox_testkit::{NodeOptions, RabbitNode};

use crate::rabbit::{AmqpEndpoint, Rabbit};
use crate::try_eventually;

const STARTUP_TIMEOUT: Duration = Duration::from_secs(180);

/// One node of a [`RabbitCluster`].
pub struct ClusterNode(RabbitNode);

impl ClusterNode {
    /// `ha<port>@localhost`.
    pub fn name(&self) -> &str {
        self.0.name()
    }

    /// Its AMQP port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.0.port()
    }

    /// 127.0.0.1:port, guest/guest.
    pub fn endpoint(&self) -> AmqpEndpoint {
        AmqpEndpoint::local(self.port())
    }

    /// True while the node's process runs (started by us and not killed).
    pub fn is_running(&self) -> bool {
        self.0.is_running()
    }

    /// The node's log file (for failure messages).
    pub fn log(&self) -> String {
        self.0.log()
    }

    /// The pid of the node's `beam.smp`.
    pub fn beam_pid(&self) -> Option<i32> {
        self.0.beam_pid()
    }
}

/// Several private RabbitMQ nodes clustered together. Dropping it kills every node and removes
/// the files (kept with `AMQP_OUTBOX_E2E_KEEP=1`).
pub struct RabbitCluster {
    dir: Option<tempfile::TempDir>,
    nodes: Vec<ClusterNode>,
}

impl RabbitCluster {
    /// Starts `n` nodes and clusters them; returns once every node accepts AMQP connections and
    /// reports all `n` nodes running.
    pub fn start(n: usize) -> RabbitCluster {
        RabbitCluster::try_start(n)
            .unwrap_or_else(|e| panic!("cannot start a RabbitMQ cluster: {e}"))
    }

    pub fn try_start(n: usize) -> Result<RabbitCluster, String> {
        assert!(n >= 1, "a cluster needs at least one node");
        let dir = tempfile::Builder::new()
            .prefix("amqp_outbox_e2e_ha.")
            .tempdir()
            .map_err(|e| format!("cannot create a temporary directory: {e}"))?;
        let home = dir.path().join("home");
        fs::create_dir_all(&home).map_err(|e| format!("cannot create {}: {e}", home.display()))?;
        // One cookie for every node and every CLI call, written before any node starts (a node
        // that finds none would create its own, racing with the others).
        let cookie: String = (0..20)
            .map(|_| char::from(b'A' + rand::random::<u8>() % 26))
            .collect();
        let cookie_path = home.join(".erlang.cookie");
        fs::write(&cookie_path, &cookie).map_err(|e| format!("cannot write the cookie: {e}"))?;
        {
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(&cookie_path, fs::Permissions::from_mode(0o400))
                .map_err(|e| format!("cannot chmod the cookie: {e}"))?;
        }
        let keep_dir = std::env::var_os("AMQP_OUTBOX_E2E_KEEP").is_some();
        let mut nodes = Vec::with_capacity(n);
        for i in 0..n {
            let node = RabbitNode::prepare(NodeOptions {
                home: Some(home.clone()),
                conf: "cluster_partition_handling = ignore\n".into(),
                // Three nodes share two cores with other tests: schedulers that sleep instead
                // of spinning when idle.
                env: vec![(
                    "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
                    "+sbwt none +sbwtdcpu none +sbwtdio none".into(),
                )],
                keep_dir,
                ..NodeOptions::new("ha", dir.path().join(format!("node{}", i + 1)))
            })?;
            nodes.push(ClusterNode(node));
        }
        let mut cluster = RabbitCluster {
            dir: Some(dir),
            nodes,
        };
        // Boot every node at once (they are independent until they join), then wait for each.
        for i in 0..n {
            cluster.nodes[i].0.spawn()?;
        }
        for i in 0..n {
            cluster.await_up(i)?;
        }
        let first = cluster.nodes[0].name().to_string();
        for i in 1..n {
            cluster.ctl(i, &["stop_app"])?;
            cluster.ctl(i, &["join_cluster", &first])?;
            cluster.ctl(i, &["start_app"])?;
            cluster.await_amqp(i)?;
        }
        let all: Vec<usize> = (0..n).collect();
        try_eventually(STARTUP_TIMEOUT, || cluster.check_running_nodes(0, &all))
            .map_err(|e| format!("the nodes did not form one cluster: {e}"))?;
        Ok(cluster)
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    pub fn node(&self, i: usize) -> &ClusterNode {
        &self.nodes[i]
    }

    pub fn nodes(&self) -> &[ClusterNode] {
        &self.nodes
    }

    pub fn dir(&self) -> &Path {
        self.dir.as_ref().expect("cluster directory").path()
    }

    /// Every node's endpoint, in node order.
    pub fn endpoints(&self) -> Vec<AmqpEndpoint> {
        self.nodes.iter().map(ClusterNode::endpoint).collect()
    }

    /// The node listening on this AMQP port.
    pub fn index_of_port(&self, port: u16) -> Option<usize> {
        self.nodes.iter().position(|n| n.port() == port)
    }

    /// The node with this Erlang node name.
    pub fn index_of_name(&self, name: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.name() == name)
    }

    /// The nodes whose process runs.
    pub fn running(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| self.nodes[i].is_running())
            .collect()
    }

    /// A client connection to node `i`, for declaring topology.
    pub fn rabbit(&self, i: usize) -> Rabbit {
        Rabbit::connect(self.nodes[i].endpoint()).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Waits until node `i` has booted (`await_startup`) and accepts AMQP connections.
    fn await_up(&mut self, i: usize) -> Result<(), String> {
        self.nodes[i].0.await_startup(STARTUP_TIMEOUT)?;
        self.await_amqp(i)
    }

    fn await_amqp(&self, i: usize) -> Result<(), String> {
        let n = &self.nodes[i];
        try_eventually(Duration::from_secs(60), || {
            Rabbit::connect(n.endpoint()).map(drop)
        })
        .map_err(|e| format!("{} up but AMQP port {} not usable: {e}", n.name(), n.port()))
    }

    /// SIGKILL of node `i`'s `beam.smp`, then of its whole process group; waits until the
    /// processes are gone and the AMQP port is free. A machine dying: no connection is closed
    /// politely, the peers see the distribution link drop.
    pub fn kill(&mut self, i: usize) {
        self.kill_many(&[i]);
    }

    /// [`kill`](Self::kill) of several nodes at (nearly) the same instant: every beam gets its
    /// SIGKILL before any is waited for.
    pub fn kill_many(&mut self, which: &[usize]) {
        for &i in which {
            self.nodes[i].0.send_kill();
        }
        for &i in which {
            self.nodes[i].0.reap();
        }
    }

    /// Starts node `i` again (from its data: it rejoins the cluster) and waits until it accepts
    /// AMQP connections and sees every running node.
    pub fn boot(&mut self, i: usize) {
        self.boot_many(&[i]);
    }

    /// [`boot`](Self::boot) of several nodes at once.
    pub fn boot_many(&mut self, which: &[usize]) {
        if let Err(e) = self.try_boot_many(which) {
            panic!("cannot restart RabbitMQ nodes {which:?}: {e}");
        }
    }

    pub fn try_boot_many(&mut self, which: &[usize]) -> Result<(), String> {
        self.start_nodes(which)?;
        self.await_nodes(which)
    }

    /// Starts the processes of `which` and returns at once (with [`await_nodes`](Self::await_nodes)
    /// to wait for them), so a test can watch what happens while they boot.
    pub fn start_nodes(&mut self, which: &[usize]) -> Result<(), String> {
        for &i in which {
            self.nodes[i].0.spawn()?;
        }
        Ok(())
    }

    /// Waits until every node of `which` (started by [`start_nodes`](Self::start_nodes)) has
    /// booted, accepts AMQP connections and sees every running node.
    pub fn await_nodes(&mut self, which: &[usize]) -> Result<(), String> {
        for &i in which {
            self.await_up(i)?;
        }
        let running = self.running();
        for &i in which {
            try_eventually(STARTUP_TIMEOUT, || self.check_running_nodes(i, &running))
                .map_err(|e| format!("{} did not rejoin: {e}", self.nodes[i].name()))?;
        }
        Ok(())
    }

    /// True when node `i`'s AMQP port accepts a TCP connection now (cheap; no login).
    pub fn port_open(&self, i: usize) -> bool {
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], self.nodes[i].port()));
        std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
    }

    /// Ok when node `at` reports exactly the nodes `expected` as running cluster members.
    fn check_running_nodes(&self, at: usize, expected: &[usize]) -> Result<(), String> {
        let seen = self.running_nodes(at)?;
        let want: Vec<&str> = expected.iter().map(|&i| self.nodes[i].name()).collect();
        if want.iter().all(|w| seen.iter().any(|s| s == w)) && seen.len() == want.len() {
            Ok(())
        } else {
            Err(format!(
                "{} sees running {seen:?}, want {want:?}",
                self.nodes[at].name()
            ))
        }
    }

    /// The cluster's running nodes as node `at` sees them (`cluster_status`).
    pub fn running_nodes(&self, at: usize) -> Result<Vec<String>, String> {
        let out = self.ctl(at, &["cluster_status", "--formatter", "json"])?;
        let json_start = out.find('{').ok_or_else(|| format!("no JSON in {out:?}"))?;
        let v: serde_json::Value = serde_json::from_str(&out[json_start..])
            .map_err(|e| format!("cluster_status JSON: {e}: {out}"))?;
        Ok(v["running_nodes"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|n| n.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default())
    }

    /// Runs `rabbitmqctl -n <node i> args…` (with node i's CLI port range).
    pub fn ctl(&self, i: usize, args: &[&str]) -> Result<String, String> {
        self.cli(i, "rabbitmqctl", args)
    }

    /// Runs `rabbitmq-queues -n <node i> args…`.
    pub fn queues_cli(&self, i: usize, args: &[&str]) -> Result<String, String> {
        self.cli(i, "rabbitmq-queues", args)
    }

    fn cli(&self, i: usize, program: &str, args: &[&str]) -> Result<String, String> {
        self.nodes[i].0.cli(program, args)
    }

    /// The quorum queue's leader and the members the cluster reports online, asked of the
    /// first running node that answers (`rabbitmqctl list_queues name leader online`).
    pub fn quorum_queue_state(&self, queue: &str) -> Result<QuorumState, String> {
        let mut last = String::from("no node running");
        for i in self.running() {
            match self.ctl(
                i,
                &[
                    "list_queues",
                    "name",
                    "leader",
                    "online",
                    "--quiet",
                    "--formatter",
                    "json",
                ],
            ) {
                Ok(out) => return self.parse_queue_state(queue, &out),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    fn parse_queue_state(&self, queue: &str, out: &str) -> Result<QuorumState, String> {
        let start = out.find('[').ok_or_else(|| format!("no JSON in {out:?}"))?;
        let v: serde_json::Value = serde_json::from_str(&out[start..])
            .map_err(|e| format!("list_queues JSON: {e}: {out}"))?;
        let row = v
            .as_array()
            .and_then(|a| a.iter().find(|r| r["name"] == queue))
            .ok_or_else(|| format!("queue {queue} not listed: {out}"))?;
        let leader = row["leader"].as_str().and_then(|l| self.index_of_name(l));
        let online = row["online"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|n| n.as_str().and_then(|n| self.index_of_name(n)))
                    .collect()
            })
            .unwrap_or_default();
        Ok(QuorumState { leader, online })
    }

    /// Waits until the quorum queue has a leader and `members` members online.
    pub fn wait_quorum_queue(&self, queue: &str, members: usize, timeout: Duration) -> QuorumState {
        crate::eventually(
            timeout,
            &format!("quorum queue {queue} with a leader and {members} members online"),
            || {
                let st = self.quorum_queue_state(queue)?;
                if st.leader.is_some() && st.online.len() >= members {
                    Ok(st)
                } else {
                    Err(format!("{st:?}"))
                }
            },
        )
    }
}

/// A quorum queue's Raft state as `list_queues` reports it: node indexes of the cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuorumState {
    pub leader: Option<usize>,
    pub online: Vec<usize>,
}

impl Drop for RabbitCluster {
    fn drop(&mut self) {
        let all: Vec<usize> = (0..self.nodes.len()).collect();
        self.kill_many(&all);
        // The nodes' directories first (or the note that they are kept), then the shared HOME.
        self.nodes.clear();
        if let Some(dir) = self.dir.take() {
            if std::env::var_os("AMQP_OUTBOX_E2E_KEEP").is_some() {
                eprintln!("keeping RabbitMQ cluster files in {}", dir.keep().display());
            } else {
                let _ = dir.close();
            }
        }
    }
}
