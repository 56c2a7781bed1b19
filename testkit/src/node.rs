//! A private RabbitMQ node process for tests; the shared broker (5672) is never touched.
//!
//! Every piece of state points into the node's own directory: `HOME` (so the node and our CLI
//! calls share one `.erlang.cookie`; cluster nodes share one `HOME`), the node name
//! `<prefix><port>@localhost`, its AMQP port, its Erlang distribution port
//! (`RABBITMQ_DIST_PORT`: the default, AMQP port + 20000, would collide or overflow), the port
//! range of the CLI's own Erlang node (`RABBITMQ_CTL_DIST_PORT_MIN/MAX`: the default
//! 35672–35682 is shared with every other node's CLI), mnesia, logs, config
//! (`loopback_users = none`), enabled plugins (`[].`: no management listener) and pid file.
//! The server runs in its own process group, so killing it kills nothing else.

use std::fs;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::{pick_ports, port_is_free, tail, try_eventually};

/// AMQP, Erlang distribution, and 11 for the CLI (`CTL_DIST_PORT_MIN..=MAX`).
const NODE_PORTS: u16 = 13;

/// How a [`RabbitNode`] is set up; [`NodeOptions::new`] gives the plain node.
pub struct NodeOptions {
    /// The node is named `<name_prefix><AMQP port>@localhost`.
    pub name_prefix: &'static str,
    /// The node's directory: created, and removed on drop unless `keep_dir`.
    pub dir: PathBuf,
    /// `HOME`, holding the Erlang cookie, when nodes share one (a cluster); else `<dir>/home`.
    pub home: Option<PathBuf>,
    /// Lines appended to `rabbitmq.conf`.
    pub conf: String,
    /// Ports reserved after the node's own (e.g. for a TLS listener): [`RabbitNode::extra_port`].
    pub extra_ports: u16,
    /// More environment, for the server and the CLI alike.
    pub env: Vec<(&'static str, String)>,
    /// Leave the directory (logs, data) behind on drop.
    pub keep_dir: bool,
}

impl NodeOptions {
    pub fn new(name_prefix: &'static str, dir: PathBuf) -> NodeOptions {
        NodeOptions {
            name_prefix,
            dir,
            home: None,
            conf: String::new(),
            extra_ports: 0,
            env: Vec::new(),
            keep_dir: false,
        }
    }
}

/// A RabbitMQ node of our own on 127.0.0.1. Dropping it stops the node (SIGKILL of its process
/// group if a polite stop takes too long) and removes its directory.
pub struct RabbitNode {
    name: String,
    port: u16,
    extra_ports: u16,
    dir: PathBuf,
    home: PathBuf,
    env: Vec<(&'static str, String)>,
    keep_dir: bool,
    sbin: PathBuf,
    child: Option<Child>,
}

impl RabbitNode {
    /// Picks the ports, creates the directories and writes the config; starts nothing, so the
    /// port is known (to point a client at it) before anything listens there.
    pub fn prepare(opts: NodeOptions) -> Result<RabbitNode, String> {
        // Below Linux's ephemeral range (32768-60999 by default): a port found free there can be
        // taken by any outgoing connection before the node binds it (a CI run failed so).
        let port = pick_ports(20000, 32000, NODE_PORTS + opts.extra_ports);
        let mut node = RabbitNode {
            name: format!("{}{port}@localhost", opts.name_prefix),
            port,
            extra_ports: opts.extra_ports,
            home: opts.home.unwrap_or_else(|| opts.dir.join("home")),
            dir: opts.dir,
            env: opts.env,
            keep_dir: opts.keep_dir,
            sbin: PathBuf::new(),
            child: None,
        };
        // From here on, an error drops `node`, which removes the directory.
        node.sbin = find_sbin()?;
        for d in [
            node.home.clone(),
            node.dir.join("mnesia"),
            node.dir.join("log"),
        ] {
            fs::create_dir_all(&d).map_err(|e| format!("cannot create {}: {e}", d.display()))?;
        }
        let conf = "loopback_users = none\nlog.console = false\nlog.file.level = info\n";
        fs::write(node.dir.join("rabbitmq.conf"), conf)
            .map_err(|e| format!("cannot write rabbitmq.conf: {e}"))?;
        node.append_conf(&opts.conf)?;
        fs::write(node.dir.join("enabled_plugins"), "[].\n")
            .map_err(|e| format!("cannot write enabled_plugins: {e}"))?;
        Ok(node)
    }

    /// Adds lines to `rabbitmq.conf` (read when the node next boots).
    pub fn append_conf(&self, lines: &str) -> Result<(), String> {
        fs::OpenOptions::new()
            .append(true)
            .open(self.dir.join("rabbitmq.conf"))
            .and_then(|mut f| f.write_all(lines.as_bytes()))
            .map_err(|e| format!("cannot write rabbitmq.conf: {e}"))
    }

    /// `<prefix><port>@localhost`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The AMQP port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The `i`th of the ports reserved by [`NodeOptions::extra_ports`].
    pub fn extra_port(&self, i: u16) -> u16 {
        assert!(
            i < self.extra_ports,
            "only {} extra ports",
            self.extra_ports
        );
        self.port + NODE_PORTS + i
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// True while the server process runs (spawned and not stopped or killed).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// The node's log file (for failure messages).
    pub fn log(&self) -> String {
        read_lossy(&self.dir.join("log").join(format!("{}.log", self.name)))
    }

    /// What `rabbitmq-server` printed (startup failures end up here, not in the log).
    pub fn server_output(&self) -> String {
        read_lossy(&self.dir.join("server.out"))
    }

    /// The pid of the node's `beam.smp` (for `kill -STOP` / `-CONT` / `-9`).
    pub fn beam_pid(&self) -> Option<i32> {
        fs::read_to_string(self.dir.join("rabbitmq.pid"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
    }

    fn env(&self, cmd: &mut Command) {
        let d = &self.dir;
        cmd.env("HOME", &self.home)
            .env("RABBITMQ_NODENAME", &self.name)
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_DIST_PORT", (self.port + 1).to_string())
            .env("RABBITMQ_CTL_DIST_PORT_MIN", (self.port + 2).to_string())
            .env("RABBITMQ_CTL_DIST_PORT_MAX", (self.port + 12).to_string())
            .env("RABBITMQ_MNESIA_BASE", d.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", d.join("log"))
            .env("RABBITMQ_CONFIG_FILE", d.join("rabbitmq.conf"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d.join("enabled_plugins"))
            .env("RABBITMQ_PID_FILE", d.join("rabbitmq.pid"))
            .current_dir(d);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
    }

    /// Starts `rabbitmq-server` in its own process group, output to `server.out`, and returns
    /// at once ([`await_startup`](Self::await_startup) waits for it).
    pub fn spawn(&mut self) -> Result<(), String> {
        if self.child.is_some() {
            return Err(format!("{} already started", self.name));
        }
        // A stale pid file would name a dead (or reused) pid.
        let _ = fs::remove_file(self.dir.join("rabbitmq.pid"));
        let out = fs::File::create(self.dir.join("server.out"))
            .map_err(|e| format!("cannot create server.out: {e}"))?;
        let err = out.try_clone().map_err(|e| e.to_string())?;
        let mut cmd = Command::new(self.sbin.join("rabbitmq-server"));
        self.env(&mut cmd);
        let child = cmd
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("cannot run rabbitmq-server: {e}"))?;
        self.child = Some(child);
        Ok(())
    }

    /// Waits at most `timeout` until the spawned node has booted (`rabbitmqctl await_startup`).
    /// If the server exits first, or is killed when the time runs out, the error ends with its
    /// output.
    pub fn await_startup(&mut self, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        // `await_startup` fails at once until the node has registered with epmd: repeat it.
        let r = try_eventually(timeout, || {
            if let Some(status) = self.child_exited() {
                return Ok(Err(format!("rabbitmq-server exited ({status})")));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let left = left.as_secs().max(1).to_string();
            self.ctl(&["await_startup", "--timeout", &left]).map(Ok)
        });
        let e = match r {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) => e,
            Err(e) => {
                self.send_kill();
                format!("not up after {timeout:?}: {e}")
            }
        };
        if let Some(mut child) = self.child.take() {
            let _ = child.wait();
        }
        Err(format!(
            "{}: {e}\n{}",
            self.name,
            tail(&self.server_output(), 20)
        ))
    }

    /// [`spawn`](Self::spawn), then [`await_startup`](Self::await_startup).
    pub fn boot(&mut self, timeout: Duration) -> Result<(), String> {
        self.spawn()?;
        self.await_startup(timeout)
    }

    fn child_exited(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Runs `program -n NODE args…` (`rabbitmqctl`, `rabbitmq-diagnostics`, `rabbitmq-queues`)
    /// with the node's environment; its (stdout, stderr), or an error with the output's end.
    pub fn cli_output(&self, program: &str, args: &[&str]) -> Result<(String, String), String> {
        let mut cmd = Command::new(self.sbin.join(program));
        self.env(&mut cmd);
        let out = cmd
            .arg("-n")
            .arg(&self.name)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run {program}: {e}"))?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        if out.status.success() {
            Ok((stdout, stderr))
        } else {
            Err(format!(
                "{program} -n {} {} failed ({}): {}",
                self.name,
                args.join(" "),
                out.status,
                tail(&(stdout + &stderr), 8)
            ))
        }
    }

    /// [`cli_output`](Self::cli_output) with stdout and stderr in one string.
    pub fn cli(&self, program: &str, args: &[&str]) -> Result<String, String> {
        self.cli_output(program, args).map(|(out, err)| out + &err)
    }

    /// `rabbitmqctl -n NODE args…`.
    pub fn ctl(&self, args: &[&str]) -> Result<String, String> {
        self.cli("rabbitmqctl", args)
    }

    /// Sends `signal` to the node's `beam.smp`.
    pub fn signal(&self, signal: i32) -> Result<(), String> {
        send_signal(self.beam_pid().ok_or("no pid file")?, signal)
    }

    /// SIGKILL of the `beam.smp` and of the whole process group, without waiting (a machine
    /// dying: no goodbye to clients or peers). [`reap`](Self::reap) waits, so that several
    /// nodes can die at nearly the same instant.
    pub fn send_kill(&mut self) {
        let Some(child) = &self.child else {
            return;
        };
        if let Some(beam) = self.beam_pid().filter(|&p| p > 1) {
            // SAFETY: kill(2) has no memory-safety preconditions; the pid is our node's beam.
            unsafe {
                libc::kill(beam, libc::SIGKILL);
            }
        }
        kill_group(child.id());
    }

    /// Waits for the killed server to end, then (at most 20 s) for its AMQP port to be free,
    /// so that it can boot again.
    pub fn reap(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.wait();
            self.await_port_free();
        }
    }

    /// [`send_kill`](Self::send_kill), then [`reap`](Self::reap).
    pub fn kill(&mut self) {
        self.send_kill();
        self.reap();
    }

    /// `rabbitmqctl stop`, then waits at most `timeout` for the server to end and SIGKILLs the
    /// process group (what outlived it, or all of it), then waits for the port to be free. The
    /// data (durable exchanges, queues, persistent messages) stays for the next boot.
    pub fn stop(&mut self, timeout: Duration) {
        if self.halt(timeout) {
            self.await_port_free();
        }
    }

    /// [`stop`](Self::stop) without the wait for the port; false when nothing ran.
    fn halt(&mut self, timeout: Duration) -> bool {
        let Some(mut child) = self.child.take() else {
            return false;
        };
        let _ = self.ctl(&["stop"]);
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(50));
        }
        kill_group(child.id());
        let _ = child.wait();
        true
    }

    fn await_port_free(&self) {
        let port = self.port;
        let _ = try_eventually(Duration::from_secs(20), || {
            port_is_free(port)
                .then_some(())
                .ok_or_else(|| format!("port {port} still bound"))
        });
    }
}

impl Drop for RabbitNode {
    fn drop(&mut self) {
        // A polite stop takes about a second; a node that does not answer gets SIGKILL.
        self.halt(Duration::from_secs(20));
        if self.keep_dir {
            eprintln!("keeping RabbitMQ node files in {}", self.dir.display());
        } else {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// Sends `signal` to `pid` (a process this test started).
pub fn send_signal(pid: i32, signal: i32) -> Result<(), String> {
    // SAFETY: kill(2) has no memory-safety preconditions.
    if unsafe { libc::kill(pid, signal) } == 0 {
        Ok(())
    } else {
        Err(format!(
            "kill({pid}, {signal}): {}",
            std::io::Error::last_os_error()
        ))
    }
}

/// SIGKILL to the process group led by `pid` (the node's own group).
fn kill_group(pid: u32) {
    if let Ok(pid) = i32::try_from(pid) {
        if pid > 1 {
            // SAFETY: killpg(2) has no memory-safety preconditions; the group is the node's.
            unsafe {
                libc::killpg(pid, libc::SIGKILL);
            }
        }
    }
}

/// The directory of RabbitMQ's own scripts: `$RABBITMQ_SBIN`, else the first of the usual
/// places (then `$PATH`) that has `rabbitmq-server`. On Debian that is /usr/lib/rabbitmq/bin:
/// the wrappers in /usr/sbin switch to the `rabbitmq` user, which loses our environment and
/// cannot use the test's directory.
pub fn find_sbin() -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os("RABBITMQ_SBIN") {
        return Ok(PathBuf::from(dir));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    ["/usr/lib/rabbitmq/bin", "/usr/local/sbin", "/usr/sbin"]
        .into_iter()
        .map(PathBuf::from)
        .chain(std::env::split_paths(&path))
        .find(|d| d.join("rabbitmq-server").is_file())
        .ok_or_else(|| {
            "rabbitmq-server not found (set RABBITMQ_SBIN to the directory of its scripts)".into()
        })
}

/// Whether `rabbitmq-server` is installed. Only looked up: running it, even with `--help`,
/// boots a default node, which fails beside the shared one and leaves an `erl_crash.dump`.
pub fn rabbitmq_installed() -> bool {
    find_sbin().is_ok_and(|d| d.join("rabbitmq-server").is_file())
}

fn read_lossy(path: &Path) -> String {
    fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}
