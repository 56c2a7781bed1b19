//! A private RabbitMQ node of one test (the shared node is never reconfigured): its own
//! directory, node name, ports and process group; stopped and removed on drop. Listens on
//! 127.0.0.1 only.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

/// The scripts themselves: Debian's /usr/sbin wrappers switch to the rabbitmq user, who cannot
/// use this test's directory.
pub fn sbin(tool: &str) -> PathBuf {
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

/// Whether `rabbitmq-server` is installed. (Only looked up: running it, even with `--help`,
/// boots a default node, which fails beside the shared one and leaves an `erl_crash.dump`.)
pub fn rabbitmq_installed() -> bool {
    let path = sbin("rabbitmq-server");
    path.is_file()
        || std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).any(|d| d.join("rabbitmq-server").is_file()))
            .unwrap_or(false)
}

/// Ports used from `base`: AMQP, Erlang distribution, 11 CLI ports, and a TLS listener.
const PORTS: u16 = 14;

pub struct Node {
    pub dir: PathBuf,
    pub name: String,
    /// The plaintext AMQP port.
    pub port: u16,
    /// The TLS listener's port (configured only when the node was started with one).
    pub tls_port: u16,
    ctl_min: u16,
    child: Option<Child>,
}

impl Node {
    /// A plain node.
    pub fn start() -> Option<Node> {
        Self::start_with(|_| String::new())
    }

    /// A node whose `rabbitmq.conf` gets the lines `extra(&node)` returns (e.g. a TLS listener
    /// on `node.tls_port` with files in `node.dir`).
    pub fn start_with(extra: impl FnOnce(&Node) -> String) -> Option<Node> {
        // Several nodes may start at once in one test binary: each gets its own start offset.
        static NEXT: AtomicU16 = AtomicU16::new(0);
        let start =
            ((std::process::id() % 250) as u16 + NEXT.fetch_add(37, Ordering::SeqCst)) % 500;
        let base = (0..500u16)
            .map(|i| 41000 + ((start + i) % 500) * 20)
            .find(|b| (0..PORTS).all(|o| TcpListener::bind(("127.0.0.1", b + o)).is_ok()))?;
        let dir = std::env::temp_dir().join(super::unique("node"));
        for sub in ["home", "mnesia", "log"] {
            std::fs::create_dir_all(dir.join(sub)).ok()?;
        }
        let mut node = Node {
            dir,
            name: format!("t{base}@localhost"),
            port: base,
            tls_port: base + PORTS - 1,
            ctl_min: base + 2,
            child: None,
        };
        let conf = format!(
            "loopback_users = none\nlog.console = false\n{}",
            extra(&node)
        );
        std::fs::write(node.dir.join("rabbitmq.conf"), conf).ok()?;
        std::fs::write(node.dir.join("enabled_plugins"), "[].\n").ok()?;
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
                eprintln!(
                    "private node did not start; its output:\n{}",
                    std::fs::read_to_string(node.dir.join("server.out")).unwrap_or_default()
                );
                return None;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        Some(node)
    }

    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    pub fn path(&self) -> &Path {
        &self.dir
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

    pub fn ctl_output(&self, args: &[&str]) -> Option<String> {
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
