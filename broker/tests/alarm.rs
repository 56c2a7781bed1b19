//! A resource alarm on a private RabbitMQ node of this test (the shared node's limits are never
//! touched): publishing pauses without being taken for a hang, the acknowledgement listener's
//! connection is not blocked, and everything drains once the alarm clears.

mod common;

use amqp_outbox_broker::{Command, Endpoint, Event, LogLevel};
use common::*;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// The scripts themselves: Debian's /usr/sbin wrappers switch to the rabbitmq user, who cannot
/// use this test's directory.
fn sbin(tool: &str) -> PathBuf {
    let dir = std::env::var_os("RABBITMQ_SBIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/lib/rabbitmq/bin"));
    let path = dir.join(tool);
    if path.exists() {
        path
    } else {
        PathBuf::from(tool)
    }
}

/// A node in its own directory and process group; stopped and removed on drop.
struct Node {
    dir: PathBuf,
    name: String,
    port: u16,
    ctl_min: u16,
    child: Option<Child>,
}

impl Node {
    fn start() -> Option<Node> {
        // AMQP, Erlang distribution and 11 CLI ports, consecutive and free.
        let start = (std::process::id() % 500) as u16;
        let base = (0..500u16)
            .map(|i| 41000 + ((start + i) % 500) * 20)
            .find(|b| (0..13).all(|o| TcpListener::bind(("127.0.0.1", b + o)).is_ok()))?;
        let dir = std::env::temp_dir().join(unique("alarm_node"));
        for sub in ["home", "mnesia", "log"] {
            std::fs::create_dir_all(dir.join(sub)).ok()?;
        }
        std::fs::write(
            dir.join("rabbitmq.conf"),
            "loopback_users = none\nlog.console = false\n",
        )
        .ok()?;
        std::fs::write(dir.join("enabled_plugins"), "[].\n").ok()?;
        let mut node = Node {
            dir,
            name: format!("t{base}@localhost"),
            port: base,
            ctl_min: base + 2,
            child: None,
        };
        let mut cmd = std::process::Command::new(sbin("rabbitmq-server"));
        node.env(&mut cmd);
        {
            use std::os::unix::process::CommandExt;
            cmd.process_group(0);
        }
        let out = std::fs::File::create(node.dir.join("server.out")).ok()?;
        let err = out.try_clone().ok()?;
        node.child = Some(
            cmd.stdin(Stdio::null())
                .stdout(out)
                .stderr(err)
                .spawn()
                .ok()?,
        );
        let deadline = Instant::now() + Duration::from_secs(90);
        while !node.ctl(&["await_startup", "--timeout", "10"]) {
            if Instant::now() > deadline {
                eprintln!("private node did not start");
                return None;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        Some(node)
    }

    fn env(&self, cmd: &mut std::process::Command) {
        let d = &self.dir;
        cmd.env("HOME", d.join("home"))
            .env("RABBITMQ_NODENAME", &self.name)
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_DIST_PORT", (self.port + 1).to_string())
            .env("RABBITMQ_CTL_DIST_PORT_MIN", self.ctl_min.to_string())
            .env(
                "RABBITMQ_CTL_DIST_PORT_MAX",
                (self.ctl_min + 10).to_string(),
            )
            .env("RABBITMQ_MNESIA_BASE", d.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", d.join("log"))
            .env("RABBITMQ_CONFIG_FILE", d.join("rabbitmq.conf"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d.join("enabled_plugins"))
            .env("RABBITMQ_PID_FILE", d.join("rabbitmq.pid"))
            .current_dir(d);
    }

    fn ctl_output(&self, args: &[&str]) -> Option<String> {
        let mut cmd = std::process::Command::new(sbin("rabbitmqctl"));
        self.env(&mut cmd);
        let out = cmd
            .arg("-q")
            .arg("-n")
            .arg(&self.name)
            .args(args)
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn ctl(&self, args: &[&str]) -> bool {
        self.ctl_output(args).is_some()
    }

    fn endpoint(&self) -> Endpoint {
        let mut e = local_endpoint();
        e.port = self.port;
        e
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.ctl(&["stop"]);
        if let Some(mut child) = self.child.take() {
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(100));
            }
            if matches!(child.try_wait(), Ok(None)) {
                // Its own process group: this kills only the node we started.
                unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
                let _ = child.wait();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn connection_states(node: &Node) -> Vec<(String, String)> {
    node.ctl_output(&["list_connections", "client_properties", "state"])
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let name = if l.contains("ack listener") {
                "listener"
            } else if l.contains("amqp_outbox broker") {
                "publisher"
            } else {
                return None;
            };
            let state = l.rsplit('\t').next()?.trim().to_string();
            Some((name.to_string(), state))
        })
        .collect()
}

#[test]
fn resource_alarm_pauses_publishing_without_a_hang_and_everything_drains_after() {
    if std::process::Command::new(sbin("rabbitmq-server"))
        .arg("--help")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_err()
    {
        eprintln!("rabbitmq-server is not installed here: skipped");
        return;
    }
    let Some(node) = Node::start() else {
        panic!("cannot start a private RabbitMQ node");
    };
    let ack_q = unique("alarm_acks");
    let target = unique("alarm_target");
    let mut cfg = ack_config(1, vec![node.endpoint()], vec![], &ack_q, false);
    // Short, so the alarm below lasts several confirm timeouts.
    cfg.confirm_timeout = Duration::from_secs(2);
    cfg.queues = vec![amqp_outbox_broker::QueueDecl {
        name: target.clone(),
        durable: false,
        auto_delete: false,
        arguments: serde_json::Map::new(),
    }];
    let mut bridge = Bridge::new();
    bridge.send(Command::Configure(vec![cfg]));
    bridge.wait_connected(1, 0);

    let (mut confirmed, mut acked) = (0usize, 0usize);

    bridge.publish(
        1,
        (1..=10).map(|i| message(i, "", &target)).collect(),
        false,
    );
    bridge.wait_for(Duration::from_secs(20), |e| {
        tally(e, &mut confirmed, &mut acked);
        (confirmed == 10 && acked == 10).then_some(())
    });

    assert!(
        node.ctl(&["set_disk_free_limit", "100000GB"]),
        "cannot set the alarm"
    );
    let restore = scopeguard(&node);
    bridge.publish(
        1,
        (11..=30).map(|i| message(i, "", &target)).collect(),
        false,
    );
    bridge.wait_for(Duration::from_secs(20), |e| {
        tally(e, &mut confirmed, &mut acked);
        matches!(e, Event::Log { level: LogLevel::Info, message }
            if message.contains("publishing paused: broker resource alarm"))
        .then_some(())
    });
    // Several confirm timeouts pass: no hang is declared, nothing fails or disconnects.
    let until = Instant::now() + Duration::from_secs(7);
    while Instant::now() < until {
        for e in bridge.poll(Duration::from_millis(200)) {
            tally(&e, &mut confirmed, &mut acked);
            bridge.seen.push(e);
        }
    }
    assert!(confirmed < 30, "confirms came through a resource alarm");
    // The listener only consumes: the broker does not block it ("blocking" means it would be
    // blocked if it published; deliveries keep flowing).
    let states = connection_states(&node);
    assert!(
        states
            .iter()
            .any(|(n, s)| n == "listener" && (s == "running" || s == "blocking")),
        "{states:?}"
    );
    assert!(
        states
            .iter()
            .any(|(n, s)| n == "publisher" && s.starts_with("block")),
        "{states:?}"
    );
    drop(restore);
    bridge.wait_for(Duration::from_secs(30), |e| {
        tally(e, &mut confirmed, &mut acked);
        (confirmed == 30 && acked == 30).then_some(())
    });
    assert!(bridge
        .seen
        .iter()
        .any(|e| matches!(e, Event::Log { message, .. }
        if message.contains("publishing resumed"))));
    drop(bridge);
    drop(node);
}

fn tally(e: &Event, confirmed: &mut usize, acked: &mut usize) {
    match e {
        Event::Confirmed { ids, .. } => *confirmed += ids.len(),
        Event::Acked { ids, .. } => *acked += ids.len(),
        Event::Failed { id, error, .. } => panic!("{id} failed: {error}"),
        Event::Disconnected { error, .. } => panic!("disconnected: {error}"),
        Event::Lost { ids, .. } => panic!("lost: {ids:?}"),
        _ => {}
    }
}

/// Restores the disk limit when dropped (also when the test panics).
struct Restore<'a>(&'a Node);

fn scopeguard(node: &Node) -> Restore<'_> {
    Restore(node)
}

impl Drop for Restore<'_> {
    fn drop(&mut self) {
        let _ = self.0.ctl(&["set_disk_free_limit", "50MB"]);
    }
}
