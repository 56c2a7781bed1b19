//! Support for the fault-injection suite (`tests/faults/`, FAULTS.md): the volume knob, the
//! results table that `make chaos` prints, the worker's peak memory, a loopback TCP proxy that
//! can stall or cut connections, a physical standby of a [`PgCluster`], and a few process tools.
//!
//! Only loopback addresses; only processes and clusters the test started.

use std::ffi::OsStr;
use std::fs;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use postgres::{Client, NoTls};

use crate::pg::{connection_string, login_args, run_pg_program, PgInstall};
use crate::{eventually, pick_ports, running_as_root, tail, PgCluster, Report};

/// `AMQP_OUTBOX_CHAOS_SCALE`: a volume multiplier for the fault suite (1 by default; `make
/// chaos` sets 10: e.g. case 10's backlog becomes 1,000,000 messages).
pub fn scale() -> f64 {
    std::env::var("AMQP_OUTBOX_CHAOS_SCALE")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| *s > 0.0)
        .unwrap_or(1.0)
}

/// `base × scale()`, at least 1.
pub fn scaled(base: u64) -> u64 {
    ((base as f64) * scale()).round().max(1.0) as u64
}

/// The file the fault tests append their result rows to (`make chaos` prints it as a table):
/// `AMQP_OUTBOX_CHAOS_RESULTS`, else `target/chaos/results.tsv` in the workspace.
pub fn results_path() -> PathBuf {
    match std::env::var_os("AMQP_OUTBOX_CHAOS_RESULTS") {
        Some(p) => PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join("target")
            .join("chaos")
            .join("results.tsv"),
    }
}

/// One line of the results table.
#[derive(Clone, Debug, Default)]
pub struct ResultRow {
    /// FAULTS.md case number and a short name, e.g. `2 worker killed`.
    pub case: String,
    /// Messages in the ledger (committed + aborted + unknown).
    pub messages: usize,
    pub committed: usize,
    pub lost: usize,
    pub phantom: usize,
    /// Extra copies beyond the first.
    pub duplicates: usize,
    pub order_violations: usize,
    /// From the end of the fault until every committed message had arrived.
    pub heal: Option<Duration>,
    /// The worker's peak resident set (VmHWM), the largest over every worker process seen.
    pub worker_peak_kb: Option<u64>,
    /// Rows left in `amqp.message` after the final drain (parked on purpose, or not drained).
    pub rows_left: Option<i64>,
    /// PASS, FAIL or SKIPPED.
    pub status: String,
    pub note: String,
}

impl ResultRow {
    pub fn from_report(case: &str, report: &Report) -> ResultRow {
        ResultRow {
            case: case.to_string(),
            messages: report.committed + report.aborted + report.unknown,
            committed: report.committed,
            lost: report.lost.len(),
            phantom: report.phantom.len(),
            duplicates: report.extra_copies(),
            order_violations: report.order_violations.len(),
            status: "PASS".into(),
            ..ResultRow::default()
        }
    }

    /// Appends the row to [`results_path`] and prints it.
    pub fn record(&self) {
        let clean = |s: &str| s.replace(['\t', '\n'], " ");
        let line = format!(
            "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\n",
            clean(&self.case),
            self.messages,
            self.committed,
            self.lost,
            self.phantom,
            self.duplicates,
            self.order_violations,
            self.heal
                .map(|d| format!("{:.1}s", d.as_secs_f64()))
                .unwrap_or_else(|| "-".into()),
            self.worker_peak_kb
                .map(|k| format!("{:.1}MB", k as f64 / 1024.0))
                .unwrap_or_else(|| "-".into()),
            self.rows_left
                .map(|n| n.to_string())
                .unwrap_or_else(|| "-".into()),
            clean(&self.status),
            clean(&self.note),
        );
        eprint!("CHAOS RESULT: {line}");
        let path = results_path();
        if let Some(dir) = path.parent() {
            let _ = fs::create_dir_all(dir);
        }
        if let Ok(mut f) = fs::OpenOptions::new().create(true).append(true).open(&path) {
            let _ = f.write_all(line.as_bytes());
        }
    }
}

/// Prints a loud SKIPPED line and records it in the results table. The caller returns (the
/// test is marked `#[ignore = "reason"]` too, so a plain run lists it as ignored).
pub fn skip_loudly(case: &str, reason: &str) {
    eprintln!("\n*** SKIPPED: FAULTS.md case {case}: {reason} ***\n");
    ResultRow {
        case: case.to_string(),
        status: "SKIPPED".into(),
        note: reason.to_string(),
        ..ResultRow::default()
    }
    .record();
}

/// The first word of a field of `/proc/<pid>/status` (`TracerPid`, `State`, `VmHWM`).
fn proc_status_word(pid: i32, field: &str) -> Option<String> {
    let text = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find(|l| l.starts_with(field) && l[field.len()..].starts_with(':'))
        .and_then(|l| l.split_whitespace().nth(1))
        .map(str::to_string)
}

/// A field of `/proc/<pid>/status` in kB (`VmHWM`, `VmRSS`).
pub fn proc_status_kb(pid: i32, field: &str) -> Option<u64> {
    proc_status_word(pid, field)?.parse().ok()
}

/// Field `n` of `/proc/<pid>/stat` as written (1-based, as proc(5) numbers them: 3 the state,
/// 14 utime, 19 nice), counted after the command name, which may hold spaces and parentheses.
fn proc_stat_word(pid: i32, n: usize) -> Option<String> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, after_name) = stat.rsplit_once(')')?;
    // Field 3 (the state) is the first after the name.
    after_name
        .split_whitespace()
        .nth(n.checked_sub(3)?)
        .map(str::to_string)
}

/// Numeric field `n` of `/proc/<pid>/stat` (see [`proc_stat_word`]).
pub fn proc_stat_field(pid: i32, n: usize) -> Option<i64> {
    proc_stat_word(pid, n)?.parse().ok()
}

/// Runs `during` while the postmaster of `cluster` (a private one) is held, under gdb, just
/// after its server loop blocked signals, then lets it go: what `during` makes happen (a child
/// that exits, a signal) is then seen by a PostgreSQL 15 postmaster only after it chose how
/// long to sleep, as when it was busy at that moment. Up to 15 the loop blocks and unblocks
/// signals around its `select()`; 16 and later wait on a latch and never stop here, so this is
/// an error there, as it is without gdb or without the right to attach to the process.
pub fn with_postmaster_signals_blocked<T>(
    cluster: &PgCluster,
    during: impl FnOnce() -> T,
) -> Result<T, String> {
    let pid_file = fs::read_to_string(cluster.data_dir().join("postmaster.pid"))
        .map_err(|e| format!("postmaster.pid: {e}"))?;
    let postmaster: i32 = pid_file
        .lines()
        .next()
        .and_then(|l| l.trim().parse().ok())
        .ok_or("postmaster.pid without a pid")?;
    let held = cluster.dir().join("postmaster-held");
    let go = cluster.dir().join("postmaster-go");
    let _ = fs::remove_file(&held);
    let _ = fs::remove_file(&go);
    let shell = format!(
        "shell touch {held}; while [ ! -e {go} ]; do sleep 0.01; done",
        held = held.display(),
        go = go.display()
    );
    let mut gdb = Command::new("gdb")
        .args(["-p", &postmaster.to_string(), "-batch", "-nx"])
        .args(["-ex", "handle SIGUSR1 nostop noprint pass"])
        .args(["-ex", "handle SIGCHLD nostop noprint pass"])
        // The first call after select() returned blocks signals; `finish` lets it take effect.
        .args([
            "-ex",
            "break pthread_sigmask",
            "-ex",
            "continue",
            "-ex",
            "finish",
        ])
        .args(["-ex", &shell, "-ex", "delete", "-ex", "detach"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("gdb: {e} (install gdb)"))?;
    // Attached and running again (not in a tracing stop): then a signal wakes its select().
    let attached = || {
        proc_status_word(postmaster, "TracerPid").is_some_and(|t| t != "0")
            && proc_status_word(postmaster, "State").is_some_and(|s| !s.starts_with('t'))
    };
    let until = Instant::now() + Duration::from_secs(20);
    let mut woken_at: Option<Instant> = None;
    while !held.exists() {
        if let Ok(Some(exit)) = gdb.try_wait() {
            let out = gdb
                .wait_with_output()
                .map(|o| tail(&String::from_utf8_lossy(&o.stderr), 5));
            return Err(format!(
                "gdb ended ({exit}) before holding the postmaster: {out:?}"
            ));
        }
        if Instant::now() > until {
            let _ = fs::write(&go, b"");
            let _ = gdb.kill();
            return Err("the postmaster was not held within 20 s (PostgreSQL 16 or later?)".into());
        }
        if attached() && woken_at.is_none_or(|t| t.elapsed() > Duration::from_secs(1)) {
            // SAFETY: a plain kill(2) of the test's own private postmaster; a SIGUSR1 with no
            // request flagged only ends its sleep.
            unsafe { libc::kill(postmaster, libc::SIGUSR1) };
            woken_at = Some(Instant::now());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = during();
    fs::write(&go, b"").map_err(|e| format!("{}: {e}", go.display()))?;
    let status = gdb.wait().map_err(|e| format!("gdb: {e}"))?;
    if !status.success() {
        return Err(format!("gdb ended with {status}"));
    }
    Ok(out)
}

/// The state letter of a process (`/proc/<pid>/stat` field 3: `Z` a zombie), `None` once it is
/// gone.
pub fn proc_state(pid: i32) -> Option<char> {
    proc_stat_word(pid, 3)?.chars().next()
}

/// Watches the worker's memory: every 200 ms it looks the worker up in `pg_stat_activity`
/// (through its own connection, re-opened after a restart of the cluster) and reads its
/// `VmHWM`. Keeps the largest value over every worker process it saw.
pub struct MemWatch {
    stop: Arc<AtomicBool>,
    state: Arc<Mutex<MemState>>,
    handle: Option<JoinHandle<()>>,
}

#[derive(Default, Clone, Debug)]
pub struct MemState {
    pub peak_kb: Option<u64>,
    pub last_rss_kb: Option<u64>,
    pub pids: Vec<i32>,
}

impl MemWatch {
    pub fn start(cluster: &PgCluster) -> MemWatch {
        let conninfo = cluster.connection_string("postgres");
        let stop = Arc::new(AtomicBool::new(false));
        let state = Arc::new(Mutex::new(MemState::default()));
        let handle = {
            let (stop, state) = (stop.clone(), state.clone());
            std::thread::Builder::new()
                .name("chaos-memwatch".into())
                .spawn(move || {
                    let mut client: Option<Client> = None;
                    while !stop.load(Ordering::Relaxed) {
                        if client.as_ref().is_none_or(|c| c.is_closed()) {
                            client = Client::connect(&conninfo, NoTls).ok();
                        }
                        if let Some(c) = client.as_mut() {
                            let pid = c
                                .batch_execute("SELECT pg_catalog.pg_stat_clear_snapshot()")
                                .and_then(|_| {
                                    c.query(
                                        "SELECT pid FROM pg_catalog.pg_stat_activity \
                                         WHERE backend_type = 'amqp_outbox'",
                                        &[],
                                    )
                                });
                            match pid {
                                Ok(rows) => {
                                    for r in rows {
                                        let pid: i32 = r.get(0);
                                        let hwm = proc_status_kb(pid, "VmHWM");
                                        let rss = proc_status_kb(pid, "VmRSS");
                                        let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
                                        if !s.pids.contains(&pid) {
                                            s.pids.push(pid);
                                        }
                                        if let Some(h) = hwm {
                                            s.peak_kb = Some(s.peak_kb.unwrap_or(0).max(h));
                                        }
                                        if rss.is_some() {
                                            s.last_rss_kb = rss;
                                        }
                                    }
                                }
                                Err(_) => client = None,
                            }
                        }
                        std::thread::sleep(Duration::from_millis(200));
                    }
                })
                .expect("spawn the memory watcher")
        };
        MemWatch {
            stop,
            state,
            handle: Some(handle),
        }
    }

    pub fn state(&self) -> MemState {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn peak_kb(&self) -> Option<u64> {
        self.state().peak_kb
    }
}

impl Drop for MemWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// What a [`TcpProxy`] does with traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProxyMode {
    /// Forward both ways.
    Pass = 0,
    /// Hold every byte (connections stay open, nothing moves): a hung network.
    Stall = 1,
    /// Close new connections at once (existing ones are left alone; see [`TcpProxy::cut`]).
    Refuse = 2,
}

struct ProxyShared {
    mode: AtomicU8,
    stop: AtomicBool,
    conns: Mutex<Vec<TcpStream>>,
    accepted: std::sync::atomic::AtomicU64,
}

/// A loopback TCP proxy 127.0.0.1:port → target, on plain threads, that can stall traffic,
/// refuse new connections and cut the open ones.
pub struct TcpProxy {
    port: u16,
    shared: Arc<ProxyShared>,
    handle: Option<JoinHandle<()>>,
}

impl TcpProxy {
    pub fn start(target: SocketAddr) -> TcpProxy {
        assert!(
            target.ip().is_loopback(),
            "the proxy only forwards to loopback"
        );
        let listener = (0..5)
            .find_map(|_| TcpListener::bind(("127.0.0.1", pick_ports(30000, 39000, 1))).ok())
            .expect("bind a port for the TCP proxy");
        let port = listener.local_addr().expect("proxy address").port();
        listener
            .set_nonblocking(true)
            .expect("non-blocking listener");
        let shared = Arc::new(ProxyShared {
            mode: AtomicU8::new(ProxyMode::Pass as u8),
            stop: AtomicBool::new(false),
            conns: Mutex::new(Vec::new()),
            accepted: Default::default(),
        });
        let handle = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("chaos-proxy".into())
                .spawn(move || {
                    while !shared.stop.load(Ordering::Relaxed) {
                        match listener.accept() {
                            Ok((client, _)) => {
                                if shared.mode.load(Ordering::Relaxed) == ProxyMode::Refuse as u8 {
                                    drop(client);
                                    continue;
                                }
                                let _ = client.set_nonblocking(false);
                                let Ok(server) =
                                    TcpStream::connect_timeout(&target, Duration::from_secs(5))
                                else {
                                    continue;
                                };
                                shared.accepted.fetch_add(1, Ordering::Relaxed);
                                let _ = client.set_nodelay(true);
                                let _ = server.set_nodelay(true);
                                {
                                    let mut c =
                                        shared.conns.lock().unwrap_or_else(|e| e.into_inner());
                                    if let (Ok(a), Ok(b)) = (client.try_clone(), server.try_clone())
                                    {
                                        c.push(a);
                                        c.push(b);
                                    }
                                }
                                for (from, to) in [
                                    (client.try_clone(), server.try_clone()),
                                    (server.try_clone(), client.try_clone()),
                                ] {
                                    if let (Ok(from), Ok(to)) = (from, to) {
                                        let shared = shared.clone();
                                        std::thread::spawn(move || pump(from, to, &shared));
                                    }
                                }
                            }
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                                std::thread::sleep(Duration::from_millis(10));
                            }
                            Err(_) => std::thread::sleep(Duration::from_millis(10)),
                        }
                    }
                })
                .expect("spawn the proxy thread")
        };
        TcpProxy {
            port,
            shared,
            handle: Some(handle),
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn set_mode(&self, mode: ProxyMode) {
        self.shared.mode.store(mode as u8, Ordering::Relaxed);
    }

    /// Connections accepted and forwarded so far.
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::Relaxed)
    }

    /// Shuts down every open connection (both directions, both sides).
    pub fn cut(&self) {
        let mut c = self.shared.conns.lock().unwrap_or_else(|e| e.into_inner());
        for s in c.drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream, shared: &ProxyShared) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        // A stalled link holds the bytes it has (the sender's window fills up).
        while shared.mode.load(Ordering::Relaxed) == ProxyMode::Stall as u8
            && !shared.stop.load(Ordering::Relaxed)
        {
            std::thread::sleep(Duration::from_millis(10));
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.cut();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Runs one of PostgreSQL's programs (as `postgres` when root) in `cwd`.
pub fn pg_program<S: AsRef<OsStr>>(
    program: &str,
    args: &[S],
    cwd: &Path,
) -> Result<Output, String> {
    let install = PgInstall::find()?;
    run_pg_program(&install.bindir.join(program), args, cwd)
}

fn ok_or_output(what: &str, out: Output) -> Result<(), String> {
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{what} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// A physical standby of a [`PgCluster`] (`pg_basebackup -R`, streaming from the primary), on
/// its own port and directory. Dropping it stops it (`-m immediate`) and removes the directory.
pub struct Standby {
    dir: Option<tempfile::TempDir>,
    port: u16,
    running: bool,
}

impl Standby {
    /// Base backup of `primary` (running) and start as a hot standby. `settings` are appended to
    /// the standby's `postgresql.auto.conf` (read last, so they override the primary's).
    pub fn create(primary: &PgCluster, settings: &[(&str, &str)]) -> Result<Standby, String> {
        let dir = tempfile::Builder::new()
            .prefix("amqp_outbox_e2e_standby.")
            .tempdir()
            .map_err(|e| format!("cannot create a temporary directory: {e}"))?;
        if running_as_root() {
            let out = Command::new("chown")
                .args(["postgres:postgres"])
                .arg(dir.path())
                .output()
                .map_err(|e| format!("chown: {e}"))?;
            ok_or_output("chown postgres", out)?;
        }
        let data = dir.path().join("data");
        let out = pg_program(
            "pg_basebackup",
            &login_args(
                primary.port(),
                [
                    "-D".as_ref(),
                    data.as_os_str(),
                    "-R".as_ref(),
                    "-X".as_ref(),
                    "stream".as_ref(),
                    "-c".as_ref(),
                    "fast".as_ref(),
                ],
            ),
            dir.path(),
        )?;
        ok_or_output("pg_basebackup", out)?;
        let mut standby = Standby {
            dir: Some(dir),
            port: 0,
            running: false,
        };
        let mut last = String::new();
        for _ in 0..3 {
            standby.port = pick_ports(61000, 65000, 1);
            let mut text = format!(
                "\n# amqp_outbox e2e standby\nport = {}\nunix_socket_directories = '{}'\n",
                standby.port,
                standby.dir().display().to_string().replace('\'', "''")
            );
            for (k, v) in settings {
                text.push_str(&format!("{k} = {v}\n"));
            }
            let auto = standby.data_dir().join("postgresql.auto.conf");
            let mut f = fs::OpenOptions::new()
                .append(true)
                .open(&auto)
                .map_err(|e| format!("open {}: {e}", auto.display()))?;
            f.write_all(text.as_bytes())
                .map_err(|e| format!("write {}: {e}", auto.display()))?;
            match standby.start() {
                Ok(()) => {
                    last.clear();
                    break;
                }
                Err(e) => last = e,
            }
        }
        if last.is_empty() {
            Ok(standby)
        } else {
            Err(last)
        }
    }

    pub fn dir(&self) -> &Path {
        self.dir.as_ref().expect("standby directory").path()
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir().join("data")
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn log(&self) -> String {
        fs::read(self.dir().join("standby.log"))
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    pub fn connection_string(&self, db: &str) -> String {
        connection_string(self.port, db)
    }

    pub fn client(&self, db: &str) -> Result<Client, String> {
        Client::connect(&self.connection_string(db), NoTls)
            .map_err(|e| format!("cannot connect to the standby: {e}"))
    }

    fn pg_ctl(&self, args: &[&str]) -> Result<(), String> {
        let data = self.data_dir();
        let log = self.dir().join("standby.log");
        let mut all = vec![
            "-D",
            data.to_str().ok_or("non-UTF-8 path")?,
            "-l",
            log.to_str().ok_or("non-UTF-8 path")?,
            "-w",
            "-t",
            "60",
        ];
        all.extend_from_slice(args);
        let out = pg_program("pg_ctl", &all, self.dir())?;
        ok_or_output(&format!("pg_ctl {}", args.join(" ")), out)
            .map_err(|e| format!("{e}\n--- standby log ---\n{}", tail(&self.log(), 30)))
    }

    pub fn start(&mut self) -> Result<(), String> {
        self.pg_ctl(&["start"])?;
        self.running = true;
        Ok(())
    }

    /// `pg_ctl promote` (waits until it accepts writes).
    pub fn promote(&self) -> Result<(), String> {
        self.pg_ctl(&["promote"])
    }

    pub fn stop_immediate(&mut self) {
        if self.running {
            let _ = self.pg_ctl(&["-m", "immediate", "stop"]);
            self.running = false;
        }
    }
}

impl Drop for Standby {
    fn drop(&mut self) {
        self.stop_immediate();
        if let Some(dir) = self.dir.take() {
            if std::env::var_os("AMQP_OUTBOX_E2E_KEEP").is_some() {
                eprintln!("keeping the standby in {}", dir.keep().display());
            } else {
                let _ = dir.close();
            }
        }
    }
}

/// Sends `signal` to `pid` (a process this test started, or its worker).
pub use amqp_outbox_testkit::send_signal;

/// Lines of `log` after byte offset `from` that contain every one of `needles`.
pub fn count_log_lines(log: &str, from: usize, needles: &[&str]) -> usize {
    log.get(from..)
        .unwrap_or("")
        .lines()
        .filter(|l| needles.iter().all(|n| l.contains(n)))
        .count()
}

/// Polls `check` for `window` and fails as soon as it returns `Err` (the opposite of
/// [`eventually`]: a condition that must hold throughout an observation period).
pub fn holds_for(
    window: Duration,
    what: &str,
    mut check: impl FnMut() -> Result<(), String>,
) -> Result<(), String> {
    let end = Instant::now() + window;
    loop {
        check().map_err(|e| format!("{what}: {e}"))?;
        if Instant::now() >= end {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits for a psql-like child to have its backend in `state` (e.g. `idle in transaction`),
/// found by `application_name`; returns the backend pid.
pub fn wait_backend_state(
    client: &mut Client,
    application_name: &str,
    state: &str,
    timeout: Duration,
) -> i32 {
    eventually(
        timeout,
        &format!("a backend {application_name} in state {state}"),
        || {
            client
                .batch_execute("SELECT pg_catalog.pg_stat_clear_snapshot()")
                .map_err(|e| e.to_string())?;
            let row = client
                .query_opt(
                    "SELECT pid FROM pg_catalog.pg_stat_activity \
                      WHERE application_name = $1 AND state = $2",
                    &[&application_name, &state],
                )
                .map_err(|e| e.to_string())?;
            row.map(|r| r.get(0)).ok_or_else(|| "not yet".to_string())
        },
    )
}
