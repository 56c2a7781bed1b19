//! A private RabbitMQ node for tests that stop, restart or break the broker. The shared broker
//! (5672) is never touched.
//!
//! Every piece of state points into a temporary directory the test owns: `HOME` (so the node
//! and our `rabbitmqctl` share their own `.erlang.cookie`), the node name `t<port>@localhost`,
//! its AMQP port, its Erlang distribution port (`RABBITMQ_DIST_PORT`: the default, AMQP port +
//! 20000, would collide or overflow), the port range of the `rabbitmqctl` CLI node
//! (`RABBITMQ_CTL_DIST_PORT_MIN/MAX`, default 35672–35682, shared with every other node's CLI),
//! mnesia, logs, config (`loopback_users = none`), enabled plugins (`[].`: no management
//! listener) and pid file. The node runs in its own process group.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::rabbit::{AmqpEndpoint, Rabbit};
use crate::{pick_ports, tail, try_eventually};

/// A RabbitMQ node of our own on 127.0.0.1. Dropping it stops the node and removes its files.
pub struct PrivateRabbit {
    dir: Option<tempfile::TempDir>,
    port: u16,
    dist_port: u16,
    ctl_port_min: u16,
    node: String,
    child: Option<Child>,
    sbin: PathBuf,
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
        // AMQP port, Erlang distribution port, and 11 ports for the CLI: 13 consecutive ports.
        let base = pick_ports(40000, 54900, 13);
        let dir = tempfile::Builder::new()
            .prefix("amqp_outbox_e2e_rabbit.")
            .tempdir()
            .map_err(|e| format!("cannot create a temporary directory: {e}"))?;
        let d = dir.path();
        for sub in ["home", "mnesia", "log"] {
            fs::create_dir_all(d.join(sub))
                .map_err(|e| format!("cannot create {}: {e}", d.join(sub).display()))?;
        }
        fs::write(
            d.join("rabbitmq.conf"),
            "loopback_users = none\n\
             log.console = false\n\
             log.file.level = info\n",
        )
        .map_err(|e| format!("cannot write rabbitmq.conf: {e}"))?;
        fs::write(d.join("enabled_plugins"), "[].\n")
            .map_err(|e| format!("cannot write enabled_plugins: {e}"))?;
        Ok(PrivateRabbit {
            dir: Some(dir),
            port: base,
            dist_port: base + 1,
            ctl_port_min: base + 2,
            node: format!("t{base}@localhost"),
            child: None,
            sbin: find_sbin()?,
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn node(&self) -> &str {
        &self.node
    }

    pub fn dir(&self) -> &Path {
        self.dir.as_ref().expect("node directory").path()
    }

    /// 127.0.0.1:port, guest/guest (allowed from anywhere by `loopback_users = none`).
    pub fn endpoint(&self) -> AmqpEndpoint {
        AmqpEndpoint::local(self.port)
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
        let path = self.dir().join("log").join(format!("{}.log", self.node));
        fs::read(&path)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    fn env(&self, cmd: &mut Command) {
        let d = self.dir();
        cmd.env("HOME", d.join("home"))
            .env("RABBITMQ_NODENAME", &self.node)
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_CTL_DIST_PORT_MIN", self.ctl_port_min.to_string())
            .env(
                "RABBITMQ_CTL_DIST_PORT_MAX",
                (self.ctl_port_min + 10).to_string(),
            )
            .env("RABBITMQ_MNESIA_BASE", d.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", d.join("log"))
            .env("RABBITMQ_CONFIG_FILE", d.join("rabbitmq.conf"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d.join("enabled_plugins"))
            .env("RABBITMQ_PID_FILE", d.join("rabbitmq.pid"))
            .current_dir(d);
    }

    /// Starts the node (again) and waits until it accepts AMQP connections.
    pub fn boot(&mut self) {
        if let Err(e) = self.try_boot() {
            panic!("cannot start RabbitMQ node {}: {e}", self.node);
        }
    }

    pub fn try_boot(&mut self) -> Result<(), String> {
        if self.child.is_some() {
            return Err("already started".into());
        }
        let d = self.dir().to_path_buf();
        let out = fs::File::create(d.join("server.out")).map_err(|e| e.to_string())?;
        let err = out.try_clone().map_err(|e| e.to_string())?;
        let mut cmd = Command::new(self.sbin.join("rabbitmq-server"));
        self.env(&mut cmd);
        {
            use std::os::unix::process::CommandExt;
            cmd.process_group(0);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("cannot run rabbitmq-server: {e}"))?;
        self.child = Some(child);
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        // `await_startup` fails at once until the node has registered with epmd: repeat it.
        let r = try_eventually(STARTUP_TIMEOUT, || {
            if let Some(status) = self.child_exited() {
                return Ok(Err(format!(
                    "rabbitmq-server exited ({status}): {}",
                    tail(&self.server_output(), 20)
                )));
            }
            let left = deadline
                .saturating_duration_since(Instant::now())
                .as_secs()
                .max(1);
            self.ctl(&["await_startup", "--timeout", &left.to_string()])
                .map(Ok)
        });
        match r {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                self.child = None;
                return Err(e);
            }
            Err(e) => {
                self.kill();
                return Err(format!(
                    "not up after {STARTUP_TIMEOUT:?}: {e}\n{}",
                    tail(&self.server_output(), 20)
                ));
            }
        }
        // The listener comes up with the app; make sure a client can log in.
        try_eventually(Duration::from_secs(30), || {
            Rabbit::connect(self.endpoint()).map(drop)
        })
        .map_err(|e| format!("node up but AMQP port {} not usable: {e}", self.port))
    }

    fn server_output(&self) -> String {
        fs::read(self.dir().join("server.out"))
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    fn child_exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Runs `rabbitmqctl -n NODE args…`; returns its output, or an error with its output.
    pub fn ctl(&self, args: &[&str]) -> Result<String, String> {
        self.cli("rabbitmqctl", args)
    }

    /// Runs `rabbitmq-diagnostics -n NODE args…` (e.g. `alarms`).
    pub fn diagnostics(&self, args: &[&str]) -> Result<String, String> {
        self.cli("rabbitmq-diagnostics", args)
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

    fn cli(&self, program: &str, args: &[&str]) -> Result<String, String> {
        let mut cmd = Command::new(self.sbin.join(program));
        self.env(&mut cmd);
        let out = cmd
            .arg("-n")
            .arg(&self.node)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run {program}: {e}"))?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if out.status.success() {
            Ok(text)
        } else {
            Err(format!(
                "{program} {} failed ({}): {}",
                args.join(" "),
                out.status,
                tail(&text, 8)
            ))
        }
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
        if let Err(e) = try_eventually(Duration::from_secs(30), || {
            Rabbit::connect(self.endpoint()).map(drop)
        }) {
            panic!("after start_app, AMQP port {} not usable: {e}", self.port);
        }
    }

    /// `rabbitmqctl close_all_connections REASON`.
    pub fn close_all_connections(&self, reason: &str) {
        self.ctl_or_panic(&["close_all_connections", reason]);
    }

    /// The pid of the node's `beam.smp` (for `kill -STOP` / `-CONT` / `-9`).
    pub fn beam_pid(&self) -> Option<i32> {
        fs::read_to_string(self.dir().join("rabbitmq.pid"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
    }

    /// Sends `signal` to the node's `beam.smp`.
    pub fn signal(&self, signal: i32) -> Result<(), String> {
        let pid = self.beam_pid().ok_or("no pid file")?;
        // SAFETY: kill(2) with a pid we started.
        if unsafe { libc::kill(pid, signal) } == 0 {
            Ok(())
        } else {
            Err(format!(
                "kill({pid}, {signal}): {}",
                std::io::Error::last_os_error()
            ))
        }
    }

    /// Stops the whole node (`rabbitmqctl stop`) and waits for its processes to end. Its data
    /// (durable exchanges, queues, persistent messages) stays for the next [`boot`](Self::boot).
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let stopped = self.ctl(&["stop"]);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match child.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                _ => {
                    kill_group(child.id());
                    let _ = child.wait();
                    break;
                }
            }
        }
        // The node may have left the pid file's process behind if `stop` failed.
        if stopped.is_err() {
            kill_group(child.id());
        }
        // Wait until its port is free again, so a restart can bind it.
        let port = self.port;
        let _ = try_eventually(Duration::from_secs(10), || {
            if crate::port_is_free(port) {
                Ok(())
            } else {
                Err("port still bound".into())
            }
        });
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            kill_group(child.id());
            let _ = child.wait();
        }
    }

    pub fn is_started(&self) -> bool {
        self.child.is_some()
    }
}

impl Drop for PrivateRabbit {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // A polite stop is quick (about a second); fall back to SIGKILL of the group.
            let _ = self.ctl(&["stop"]);
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            kill_group(child.id());
            let _ = child.wait();
        }
        if let Some(dir) = self.dir.take() {
            if std::env::var_os("AMQP_OUTBOX_E2E_KEEP").is_some() {
                eprintln!("keeping RabbitMQ node files in {}", dir.keep().display());
            } else {
                let _ = dir.close();
            }
        }
    }
}

/// SIGKILL to the process group led by `pid` (the node runs in its own group).
fn kill_group(pid: u32) {
    if let Ok(pid) = i32::try_from(pid) {
        if pid > 1 {
            // SAFETY: killpg(2) on the group we created for the node.
            unsafe {
                libc::killpg(pid, libc::SIGKILL);
            }
        }
    }
}

/// The directory with RabbitMQ's own scripts (`/usr/lib/rabbitmq/bin` on Debian: the wrappers
/// in /usr/sbin switch to the `rabbitmq` user, which would lose our environment), or
/// `$RABBITMQ_SBIN`.
fn find_sbin() -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os("RABBITMQ_SBIN") {
        return Ok(PathBuf::from(dir));
    }
    for dir in ["/usr/lib/rabbitmq/bin", "/usr/local/sbin", "/usr/sbin"] {
        if Path::new(dir).join("rabbitmq-server").exists() {
            return Ok(PathBuf::from(dir));
        }
    }
    Err("rabbitmq-server not found (set RABBITMQ_SBIN to the directory of its scripts)".into())
}
