//! A private PostgreSQL cluster per test: own port, own data directory, own log.
//!
//! Binaries come from `pg_config --bindir` (the `PG_CONFIG` environment variable names another
//! `pg_config`). As root, `initdb` and `pg_ctl` refuse to run, so they run as the `postgres` user
//! (`runuser -u postgres --`) in a temporary directory that user owns.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use postgres::{Client, NoTls};

use crate::{eventually, pick_ports, running_as_root, tail};

/// The database the worker serves in every test cluster (`amqp_outbox.database`).
pub const DEFAULT_DATABASE: &str = "e2e";

/// How a cluster is configured before it starts.
#[derive(Clone, Debug)]
pub struct PgConfig {
    /// `shared_preload_libraries = 'amqp_outbox'` (and the extension's settings). Off only to
    /// test the harness itself without the extension installed.
    pub preload: bool,
    /// The database created after the first start, and `amqp_outbox.database`.
    pub database: String,
    /// `amqp_outbox.naptime` in milliseconds.
    pub naptime_ms: u64,
    /// Further `postgresql.conf` lines, `name = value` (the value as written in the file).
    pub settings: Vec<(String, String)>,
    /// The PostgreSQL whose programs run the cluster; `None`: the one `$PG_CONFIG` names
    /// ([`PgInstall::find`]).
    pub install: Option<PgInstall>,
}

impl Default for PgConfig {
    fn default() -> Self {
        PgConfig {
            preload: true,
            database: DEFAULT_DATABASE.to_string(),
            naptime_ms: 200,
            settings: Vec::new(),
            install: None,
        }
    }
}

impl PgConfig {
    pub fn new() -> Self {
        Self::default()
    }

    /// No `shared_preload_libraries`, no `amqp_outbox.*` settings.
    pub fn without_preload(mut self) -> Self {
        self.preload = false;
        self
    }

    /// Adds `name = value` to `postgresql.conf`; `value` is written as given, so quote strings:
    /// `.setting("amqp_outbox.max_attempts", "3")`, `.setting("work_mem", "'8MB'")`.
    pub fn setting(mut self, name: &str, value: impl ToString) -> Self {
        self.settings.push((name.to_string(), value.to_string()));
        self
    }

    pub fn naptime_ms(mut self, ms: u64) -> Self {
        self.naptime_ms = ms;
        self
    }

    /// Runs the cluster with this PostgreSQL instead of the one `$PG_CONFIG` names.
    pub fn install(mut self, install: PgInstall) -> Self {
        self.install = Some(install);
        self
    }
}

/// `pg_ctl stop -m …`
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopMode {
    Smart,
    Fast,
    Immediate,
}

impl StopMode {
    fn as_arg(self) -> &'static str {
        match self {
            StopMode::Smart => "smart",
            StopMode::Fast => "fast",
            StopMode::Immediate => "immediate",
        }
    }
}

/// Where PostgreSQL is installed, from `pg_config`.
#[derive(Clone, Debug)]
pub struct PgInstall {
    pub bindir: PathBuf,
    pub pkglibdir: PathBuf,
    /// The extension's directory (`--sharedir`/extension).
    pub extension_dir: PathBuf,
    /// The major version (15, 16, …).
    pub major: u32,
}

impl PgInstall {
    /// Runs `$PG_CONFIG` (default `pg_config`) for `--bindir` and `--pkglibdir`.
    pub fn find() -> Result<PgInstall, String> {
        let pg_config = std::env::var("PG_CONFIG").unwrap_or_else(|_| "pg_config".to_string());
        PgInstall::from_pg_config(Path::new(&pg_config))
    }

    /// The PostgreSQL that this `pg_config` describes.
    pub fn from_pg_config(pg_config: &Path) -> Result<PgInstall, String> {
        let shown = pg_config.display();
        let ask = |flag: &str| -> Result<String, String> {
            let out = Command::new(pg_config)
                .arg(flag)
                .output()
                .map_err(|e| format!("cannot run `{shown} {flag}`: {e}"))?;
            if !out.status.success() {
                return Err(format!(
                    "`{shown} {flag}` failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        };
        // "PostgreSQL 18.6" (or "PostgreSQL 15.14 (Debian 15.14-0+deb12u1)", "PostgreSQL 19devel")
        let version = ask("--version")?;
        let major = version
            .strip_prefix("PostgreSQL ")
            .map(|v| {
                v.chars()
                    .take_while(char::is_ascii_digit)
                    .collect::<String>()
            })
            .and_then(|m| m.parse().ok())
            .ok_or_else(|| format!("`{shown} --version` printed {version:?}"))?;
        Ok(PgInstall {
            bindir: PathBuf::from(ask("--bindir")?),
            pkglibdir: PathBuf::from(ask("--pkglibdir")?),
            extension_dir: PathBuf::from(ask("--sharedir")?).join("extension"),
            major,
        })
    }

    /// The extension's `default_version`, from the control file installed here.
    pub fn extension_version(&self) -> Result<String, String> {
        let control = self.extension_dir.join("amqp_outbox.control");
        let text = fs::read_to_string(&control)
            .map_err(|e| format!("cannot read {}: {e}", control.display()))?;
        text.lines()
            .filter_map(|l| l.trim().strip_prefix("default_version"))
            .filter_map(|rest| rest.split('\'').nth(1))
            .map(str::to_string)
            .next()
            .ok_or_else(|| format!("no default_version in {}", control.display()))
    }

    /// Fails with a clear message when `amqp_outbox.so` is not installed.
    pub fn check_extension_installed(&self) -> Result<(), String> {
        let so = self.pkglibdir.join("amqp_outbox.so");
        if so.exists() {
            Ok(())
        } else {
            Err(format!(
                "{} is missing: install the extension into this PostgreSQL before the end-to-end \
                 tests (`make install`, or `cargo pgrx install --release --pg-config \
                 \"$(pg_config --bindir)/pg_config\"` in the repository root)",
                so.display()
            ))
        }
    }
}

/// A private PostgreSQL cluster. Dropping it stops the server (`-m immediate`) and removes its
/// directory.
pub struct PgCluster {
    config: PgConfig,
    install: PgInstall,
    dir: Option<tempfile::TempDir>,
    port: u16,
    running: bool,
    /// Acknowledgement queue names read before each stop: a cluster stopped by its test is
    /// not running at the drop, when they are deleted.
    ack_queues: Vec<String>,
}

impl PgCluster {
    /// `initdb`, configure, start, create the database. Panics with the reason (and the server
    /// log) when any step fails.
    pub fn new(config: PgConfig) -> PgCluster {
        match PgCluster::try_new(config) {
            Ok(c) => c,
            Err(e) => panic!("cannot set up a PostgreSQL cluster: {e}"),
        }
    }

    /// A cluster with the default configuration (extension preloaded).
    pub fn with_defaults() -> PgCluster {
        PgCluster::new(PgConfig::default())
    }

    pub fn try_new(config: PgConfig) -> Result<PgCluster, String> {
        let mut cluster = PgCluster::empty(config)?;
        cluster.initdb()?;
        cluster.start_on_free_port()?;
        let mut admin = cluster.try_client_db("postgres")?;
        admin
            .batch_execute(&format!(
                "CREATE DATABASE \"{}\"",
                cluster.config.database.replace('"', "\"\"")
            ))
            .map_err(|e| format!("CREATE DATABASE {}: {e}", cluster.config.database))?;
        Ok(cluster)
    }

    /// A base backup of `source` (`pg_basebackup`, WAL streamed), not started: once started
    /// (`start()`), it is `source` as it was when the backup ended, as a point-in-time recovery
    /// to that moment gives. Same system identifier, databases and tables; its own port,
    /// directory and `config`'s settings.
    pub fn from_base_backup(source: &PgCluster, config: PgConfig) -> PgCluster {
        match PgCluster::try_from_base_backup(source, config) {
            Ok(c) => c,
            Err(e) => panic!("cannot make a cluster from a base backup: {e}"),
        }
    }

    fn try_from_base_backup(source: &PgCluster, config: PgConfig) -> Result<PgCluster, String> {
        let mut cluster = PgCluster::empty(config)?;
        let data = cluster.data_dir();
        let args = login_args(
            source.port,
            [
                "-D".as_ref(),
                data.as_os_str(),
                "-X".as_ref(),
                "stream".as_ref(),
                "--no-sync".as_ref(),
            ],
        );
        cluster.pg_tool_ok("pg_basebackup", &args, "pg_basebackup")?;
        cluster.port = pick_ports(61000, 65000, 1);
        cluster.write_config()?;
        Ok(cluster)
    }

    /// `pg_upgrade` of this cluster to the PostgreSQL `config` names (a later major): stops
    /// this server (fast) if it runs, makes a new cluster with that version's `initdb` in a
    /// directory of its own, configured from `config` (its own port; the extension preloaded
    /// unless `config` says otherwise; the database is this cluster's), carries everything over
    /// with `pg_upgrade` (copy mode) and starts the new server. This cluster stays, stopped
    /// (copy mode leaves it usable). Returns the new cluster and what `pg_upgrade` printed; when
    /// it fails, the error has its output and the tails of its logs.
    pub fn upgrade(&mut self, config: PgConfig) -> Result<(PgCluster, String), String> {
        if self.running {
            self.try_stop(StopMode::Fast)?;
        }
        let mut config = config;
        config.database = self.config.database.clone();
        let mut new = PgCluster::empty(config)?;
        if new.install.major <= self.install.major {
            return Err(format!(
                "pg_upgrade goes to a later major: this cluster is PostgreSQL {}, the new one {}",
                self.install.major, new.install.major
            ));
        }
        new.initdb()?;
        new.port = pick_ports(61000, 65000, 1);
        new.write_config()?;
        let (old_data, new_data) = (self.data_dir(), new.data_dir());
        let (old_port, new_port) = (self.port.to_string(), new.port.to_string());
        let args: Vec<&OsStr> = vec![
            "--old-bindir".as_ref(),
            self.install.bindir.as_os_str(),
            "--new-bindir".as_ref(),
            new.install.bindir.as_os_str(),
            "--old-datadir".as_ref(),
            old_data.as_os_str(),
            "--new-datadir".as_ref(),
            new_data.as_os_str(),
            "--old-port".as_ref(),
            old_port.as_ref(),
            "--new-port".as_ref(),
            new_port.as_ref(),
            "--username".as_ref(),
            "postgres".as_ref(),
            // Both servers listen only on a socket in the new cluster's directory.
            "--socketdir".as_ref(),
            new.dir().as_os_str(),
            "--no-sync".as_ref(),
        ];
        let out = new.pg_tool("pg_upgrade", &args)?;
        let printed = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            return Err(format!(
                "{}\n--- pg_upgrade's logs ---\n{}",
                failure("pg_upgrade", &out),
                pg_upgrade_logs(&new_data)
            ));
        }
        new.try_start()?;
        Ok((new, printed))
    }

    /// A cluster value with its own directory (owned by `postgres` when we are root), not
    /// initialised or started yet.
    fn empty(config: PgConfig) -> Result<PgCluster, String> {
        let install = match &config.install {
            Some(install) => install.clone(),
            None => PgInstall::find()?,
        };
        if config.preload {
            install.check_extension_installed()?;
        }
        let dir = tempfile::Builder::new()
            .prefix("amqp_outbox_e2e_pg.")
            .tempdir()
            .map_err(|e| format!("cannot create a temporary directory: {e}"))?;
        if running_as_root() {
            let (uid, gid) = postgres_user_ids()?;
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid))
                .map_err(|e| format!("cannot chown {} to postgres: {e}", dir.path().display()))?;
        }
        Ok(PgCluster {
            config,
            install,
            dir: Some(dir),
            port: 0,
            running: false,
            ack_queues: Vec::new(),
        })
    }

    /// Writes the configuration and starts the server; a port can be taken between our check
    /// and the server's bind, so a few are tried. Ports are picked above Linux's ephemeral
    /// range (32768-60999 by default), where outgoing connections do not take them.
    fn start_on_free_port(&mut self) -> Result<(), String> {
        let mut last = String::new();
        for _ in 0..3 {
            self.port = pick_ports(61000, 65000, 1);
            self.write_config()?;
            match self.try_start() {
                Ok(()) => return Ok(()),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Runs one of PostgreSQL's programs (`pg_dump`, `pg_restore`, `psql`, …) in the cluster's
    /// directory, as `postgres` when we are root, and fails with its output unless it succeeds.
    /// Connection options are the caller's (see [`PgCluster::run_client`]).
    pub fn run_tool<S: AsRef<OsStr>>(&self, program: &str, args: &[S]) -> Result<String, String> {
        let args: Vec<&OsStr> = args.iter().map(|a| a.as_ref()).collect();
        let out = self.pg_tool_ok(program, &args, &format!("{program} {args:?}"))?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// [`PgCluster::run_tool`] for a client program, logged in to this cluster as `postgres`.
    pub fn run_client(&self, program: &str, args: &[&str]) -> Result<String, String> {
        self.run_tool(program, &login_args(self.port, args))
    }

    pub fn config(&self) -> &PgConfig {
        &self.config
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The temporary directory: the data directory, the log and the unix socket live here.
    pub fn dir(&self) -> &Path {
        self.dir.as_ref().expect("cluster directory").path()
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir().join("data")
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir().join("postgresql.log")
    }

    /// Everything the server wrote to its log so far (for asserting, e.g., that no password was
    /// ever logged).
    pub fn log(&self) -> String {
        fs::read(self.log_path())
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// The last `n` lines of the log, for failure messages.
    pub fn log_tail(&self, n: usize) -> String {
        tail(&self.log(), n)
    }

    /// Waits until the log contains `text` (a line the server writes after what the test saw,
    /// such as the worker's report of a committed change); panics with the log's tail.
    pub fn wait_for_log(&self, text: &str, timeout: Duration) {
        eventually(timeout, &format!("{text:?} in the server log"), || {
            if self.log().contains(text) {
                Ok(())
            } else {
                Err(self.log_tail(20))
            }
        });
    }

    pub fn is_running(&self) -> bool {
        self.running
    }

    /// A libpq connection string for `db` (TCP to 127.0.0.1, user postgres, trust auth).
    pub fn connection_string(&self, db: &str) -> String {
        connection_string(self.port, db)
    }

    /// A new connection to the test database.
    pub fn client(&self) -> Client {
        self.client_db(&self.config.database)
    }

    pub fn client_db(&self, db: &str) -> Client {
        match self.try_client_db(db) {
            Ok(c) => c,
            Err(e) => panic!("{e}\n--- server log ---\n{}", self.log_tail(30)),
        }
    }

    pub fn try_client(&self) -> Result<Client, String> {
        self.try_client_db(&self.config.database)
    }

    pub fn try_client_db(&self, db: &str) -> Result<Client, String> {
        Client::connect(&self.connection_string(db), NoTls)
            .map_err(|e| format!("cannot connect to database {db} on port {}: {e}", self.port))
    }

    /// Starts a stopped server.
    pub fn start(&mut self) {
        if let Err(e) = self.try_start() {
            panic!("{e}");
        }
    }

    pub fn try_start(&mut self) -> Result<(), String> {
        let log = self.log_path();
        let out = self.pg_ctl_waiting("start", ["-l".as_ref(), log.as_os_str()])?;
        if !out.status.success() {
            return Err(format!(
                "{}\n--- server log ---\n{}",
                failure("pg_ctl start", &out),
                self.log_tail(30)
            ));
        }
        self.running = true;
        Ok(())
    }

    /// `pg_ctl stop -m mode`, waiting until the server is down.
    pub fn stop(&mut self, mode: StopMode) {
        if let Err(e) = self.try_stop(mode) {
            panic!("{e}");
        }
    }

    pub fn try_stop(&mut self, mode: StopMode) -> Result<(), String> {
        if self.running {
            self.remember_ack_queues();
        }
        let out = self.pg_ctl_waiting("stop", ["-m".as_ref(), mode.as_arg().as_ref()])?;
        if !out.status.success() {
            return Err(failure(&format!("pg_ctl stop -m {}", mode.as_arg()), &out));
        }
        self.running = false;
        Ok(())
    }

    /// Fast stop, then start (for a changed `shared_preload_libraries` or a new `.so`).
    pub fn restart(&mut self) {
        if self.running {
            self.stop(StopMode::Fast);
        }
        self.start();
    }

    /// `pg_ctl reload` (SIGHUP): picks up changed `sighup` settings.
    pub fn reload(&self) {
        let data = self.data_dir();
        let out = self
            .pg_tool(
                "pg_ctl",
                &["-D".as_ref(), data.as_os_str(), "reload".as_ref()],
            )
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            out.status.success(),
            "pg_ctl reload failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Sets (or replaces) `name = value` in the cluster's configuration file. Takes effect at the
    /// next [`reload`](Self::reload) or [`restart`](Self::restart).
    pub fn set_setting(&mut self, name: &str, value: impl ToString) {
        self.config.settings.retain(|(n, _)| n != name);
        self.config
            .settings
            .push((name.to_string(), value.to_string()));
        self.write_config().unwrap_or_else(|e| panic!("{e}"));
    }

    /// The pid of the `amqp_outbox` background worker, if it is in `pg_stat_activity` now.
    pub fn worker_pid(&self, client: &mut Client) -> Result<Option<i32>, String> {
        client
            .batch_execute("SELECT pg_catalog.pg_stat_clear_snapshot()")
            .map_err(|e| format!("pg_stat_clear_snapshot: {e}"))?;
        let rows = client
            .query(
                "SELECT pid FROM pg_catalog.pg_stat_activity WHERE backend_type = 'amqp_outbox'",
                &[],
            )
            .map_err(|e| format!("querying pg_stat_activity: {e}"))?;
        match rows.len() {
            0 => Ok(None),
            1 => Ok(Some(rows[0].get(0))),
            n => Err(format!(
                "{n} backends with backend_type 'amqp_outbox' (one per cluster expected)"
            )),
        }
    }

    /// Waits until the worker is in `pg_stat_activity`, and returns its pid.
    pub fn wait_for_worker(&self, client: &mut Client, timeout: Duration) -> i32 {
        eventually(
            timeout,
            "the amqp_outbox worker in pg_stat_activity (backend_type 'amqp_outbox')",
            || match self.worker_pid(client)? {
                Some(pid) => Ok(pid),
                None => Err(format!(
                    "no such backend; server log tail:\n{}",
                    self.log_tail(10)
                )),
            },
        )
    }

    fn initdb(&self) -> Result<(), String> {
        let data = self.data_dir();
        let mut args: Vec<&OsStr> = [
            "-D".as_ref(),
            data.as_os_str(),
            "-U".as_ref(),
            "postgres".as_ref(),
            "--auth=trust".as_ref(),
            "-E".as_ref(),
            "UTF8".as_ref(),
            "--locale=C".as_ref(),
            "--no-sync".as_ref(),
        ]
        .to_vec();
        // PostgreSQL 18's initdb turns data checksums on by default; earlier ones leave them
        // off. Off on every version, so that a cluster of one can be pg_upgraded to another
        // (pg_upgrade requires the same setting on both sides).
        if self.install.major >= 18 {
            args.push("--no-data-checksums".as_ref());
        }
        self.pg_tool_ok("initdb", &args, "initdb")?;
        // Include our own file, rewritten whenever the settings change.
        let conf = data.join("postgresql.conf");
        let mut f = fs::OpenOptions::new()
            .append(true)
            .open(&conf)
            .map_err(|e| format!("cannot open {}: {e}", conf.display()))?;
        writeln!(f, "\ninclude 'e2e.conf'")
            .map_err(|e| format!("cannot write {}: {e}", conf.display()))?;
        Ok(())
    }

    fn write_config(&self) -> Result<(), String> {
        let mut text = String::new();
        let dir = self.dir().display().to_string().replace('\'', "''");
        text.push_str(&format!(
            "listen_addresses = '127.0.0.1'\n\
             port = {}\n\
             unix_socket_directories = '{dir}'\n\
             max_connections = 60\n\
             fsync = off\n\
             full_page_writes = off\n\
             shared_buffers = '64MB'\n\
             log_line_prefix = '%m [%p] %b '\n\
             log_min_messages = info\n",
            self.port
        ));
        if self.config.preload {
            text.push_str(&format!(
                "shared_preload_libraries = 'amqp_outbox'\n\
                 amqp_outbox.database = '{}'\n\
                 amqp_outbox.naptime = {}\n",
                self.config.database.replace('\'', "''"),
                self.config.naptime_ms
            ));
        }
        for (name, value) in &self.config.settings {
            text.push_str(&format!("{name} = {value}\n"));
        }
        let path = self.data_dir().join("e2e.conf");
        fs::write(&path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        if running_as_root() {
            let (uid, gid) = postgres_user_ids()?;
            std::os::unix::fs::chown(&path, Some(uid), Some(gid))
                .map_err(|e| format!("cannot chown {}: {e}", path.display()))?;
        }
        Ok(())
    }

    /// Writes `bytes` into the data directory as `name`, owned by the server's user with
    /// `mode` (a TLS key the server must accept: 0600); returns its path.
    pub fn write_data_file(&self, name: &str, bytes: &[u8], mode: u32) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = self.data_dir().join(name);
        fs::write(&path, bytes).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
        fs::set_permissions(&path, fs::Permissions::from_mode(mode))
            .unwrap_or_else(|e| panic!("cannot chmod {}: {e}", path.display()));
        if running_as_root() {
            let (uid, gid) = postgres_user_ids().unwrap_or_else(|e| panic!("{e}"));
            std::os::unix::fs::chown(&path, Some(uid), Some(gid))
                .unwrap_or_else(|e| panic!("cannot chown {}: {e}", path.display()));
        }
        path
    }

    /// Runs one of PostgreSQL's programs in the cluster's directory.
    fn pg_tool<S: AsRef<OsStr>>(&self, program: &str, args: &[S]) -> Result<Output, String> {
        run_pg_program(&self.install.bindir.join(program), args, self.dir())
    }

    /// [`PgCluster::pg_tool`] that also fails, with the program's output, unless it succeeds;
    /// `what` names the call in that message.
    fn pg_tool_ok<S: AsRef<OsStr>>(
        &self,
        program: &str,
        args: &[S],
        what: &str,
    ) -> Result<Output, String> {
        let out = self.pg_tool(program, args)?;
        if out.status.success() {
            Ok(out)
        } else {
            Err(failure(what, &out))
        }
    }

    /// `pg_ctl -D <data> <options> -w -t 60 <action>`: waits up to a minute for the server to
    /// come up or go down. The caller judges the exit status.
    fn pg_ctl_waiting(&self, action: &str, options: [&OsStr; 2]) -> Result<Output, String> {
        let data = self.data_dir();
        let mut args = vec![OsStr::new("-D"), data.as_os_str()];
        args.extend(options);
        args.extend(["-w", "-t", "60", action].map(OsStr::new));
        self.pg_tool("pg_ctl", &args)
    }
}

impl PgCluster {
    /// Adds the names [`PgCluster::ack_queue_names`] gives now to those remembered.
    fn remember_ack_queues(&mut self) {
        for name in self.ack_queue_names() {
            if !self.ack_queues.contains(&name) {
                self.ack_queues.push(name);
            }
        }
    }

    /// The names the acknowledgement queues of this cluster's databases would have.
    fn ack_queue_names(&self) -> Vec<String> {
        // Every database a worker or a relay may have served (with the extension or the
        // plain-SQL install): deleting a queue nobody declared is harmless.
        let Ok(mut client) = self.try_client_db(&self.config.database) else {
            return Vec::new();
        };
        client
            .query(
                "SELECT 'amqp_outbox.ack.' || to_hex(s.system_identifier) || '.' || \
                        to_hex(d.oid::bigint) \
                   FROM pg_catalog.pg_control_system() s, pg_catalog.pg_database d \
                  WHERE d.datallowconn AND NOT d.datistemplate",
                &[],
            )
            .map(|rows| rows.iter().map(|r| r.get(0)).collect())
            .unwrap_or_default()
    }
}

/// Deletes a test cluster's acknowledgement queues from the shared RabbitMQ, where its worker
/// or a relay declared them (durable): test clusters must not leave queues behind. Best
/// effort; called after the cluster stopped, so no worker declares one again (a relay still
/// running is the test's to stop first).
fn delete_shared_ack_queues(names: &[String]) {
    if names.is_empty() {
        return;
    }
    if let Ok(rabbit) = crate::rabbit::Rabbit::connect(crate::rabbit::AmqpEndpoint::shared()) {
        for name in names {
            let _ = rabbit.delete_queue(name);
        }
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        if self.running {
            let _ = self.try_stop(StopMode::Immediate);
        }
        delete_shared_ack_queues(&self.ack_queues);
        if let Some(dir) = self.dir.take() {
            if std::env::var_os("AMQP_OUTBOX_E2E_KEEP").is_some() {
                let kept = dir.keep();
                eprintln!("keeping PostgreSQL test cluster in {}", kept.display());
            } else {
                let _ = dir.close();
            }
        }
    }
}

/// The error for a PostgreSQL program that exited unsuccessfully: `what`, its status and output.
fn failure(what: &str, out: &Output) -> String {
    format!(
        "{what} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// What `pg_upgrade` left in the new cluster's data directory (`pg_upgrade_output.d/<time>/`):
/// of each log, its error lines and its last lines; the lists of what a failed check found.
fn pg_upgrade_logs(new_data: &Path) -> String {
    let mut files = Vec::new();
    let mut dirs = vec![new_data.join("pg_upgrade_output.d")];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                files.push(path);
            }
        }
    }
    files.sort();
    let mut out = String::new();
    // Not the dumps (binary custom-format archives, and the globals' SQL).
    for f in files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "log" || e == "txt"))
    {
        let text = fs::read(f)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        let errors: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("error") || l.contains("ERROR") || l.contains("FATAL"))
            .filter(|l| !l.starts_with("command:"))
            .collect();
        out.push_str(&format!(
            "== {} ==\n{}{}\n",
            f.display(),
            errors.iter().map(|l| format!("{l}\n")).collect::<String>(),
            tail(&text, 10)
        ));
    }
    if out.is_empty() {
        out.push_str("(none)");
    }
    out
}

/// uid and gid of the `postgres` user (looked up once: `getpwnam` is not thread-safe).
fn postgres_user_ids() -> Result<(u32, u32), String> {
    static IDS: std::sync::OnceLock<Result<(u32, u32), String>> = std::sync::OnceLock::new();
    IDS.get_or_init(|| {
        let name = std::ffi::CString::new("postgres").expect("no NUL");
        // SAFETY: getpwnam gets a valid C string; OnceLock runs this once, so no other
        // getpw* call of ours overwrites the record before it is read.
        unsafe {
            let pw = libc::getpwnam(name.as_ptr());
            if pw.is_null() {
                return Err(
                    "running as root, but there is no `postgres` user to run initdb \
                            and pg_ctl as"
                        .to_string(),
                );
            }
            Ok(((*pw).pw_uid, (*pw).pw_gid))
        }
    })
    .clone()
}

/// The options that log a PostgreSQL client program in to the cluster on `port` as `postgres`,
/// followed by `rest`.
pub fn login_args<S: AsRef<OsStr>>(port: u16, rest: impl IntoIterator<Item = S>) -> Vec<OsString> {
    let port = port.to_string();
    let login = ["-h", "127.0.0.1", "-p", &port, "-U", "postgres"].map(OsString::from);
    login
        .into_iter()
        .chain(rest.into_iter().map(|a| a.as_ref().to_os_string()))
        .collect()
}

/// A libpq connection string for database `db` of the cluster on `port`.
pub fn connection_string(port: u16, db: &str) -> String {
    format!(
        "host=127.0.0.1 port={port} user=postgres dbname={db} connect_timeout=10 \
         application_name=amqp_outbox_e2e"
    )
}

/// The libraries' directory (`pg_config --libdir`) of the PostgreSQL whose program is `bin`,
/// asked once per installation; `None` when that installation has no `pg_config`.
fn libdir_of(bin: &Path) -> Option<PathBuf> {
    static KNOWN: std::sync::OnceLock<std::sync::Mutex<HashMap<PathBuf, Option<PathBuf>>>> =
        std::sync::OnceLock::new();
    let bindir = bin.parent()?.to_path_buf();
    let mut known = KNOWN
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    known
        .entry(bindir.clone())
        .or_insert_with(|| {
            let out = Command::new(bindir.join("pg_config"))
                .arg("--libdir")
                .output()
                .ok()
                .filter(|o| o.status.success())?;
            Some(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
        })
        .clone()
}

/// Runs PostgreSQL's program `bin` in `cwd`, as `postgres` when we are root (initdb and the
/// server refuse to run as root), with its installation's libraries first on
/// `LD_LIBRARY_PATH`: a private install (16-18 from scripts/pg_versions.sh) was built for
/// another prefix, and its programs would otherwise load the system's older libpq (then 18's
/// walreceiver refuses the `sslnegotiation` option its `pg_basebackup -R` writes). A server
/// started by `pg_ctl` keeps that environment.
pub fn run_pg_program<S: AsRef<OsStr>>(
    bin: &Path,
    args: &[S],
    cwd: &Path,
) -> Result<Output, String> {
    let library_path = libdir_of(bin).map(|dir| {
        let mut path = dir.into_os_string();
        if let Some(rest) = std::env::var_os("LD_LIBRARY_PATH").filter(|r| !r.is_empty()) {
            path.push(":");
            path.push(rest);
        }
        path
    });
    let mut cmd = if running_as_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]);
        if let Some(path) = &library_path {
            let mut assignment = OsString::from("LD_LIBRARY_PATH=");
            assignment.push(path);
            c.arg("env").arg(assignment);
        }
        c.arg(bin);
        c
    } else {
        let mut c = Command::new(bin);
        if let Some(path) = &library_path {
            c.env("LD_LIBRARY_PATH", path);
        }
        c
    };
    cmd.args(args)
        .current_dir(cwd)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", bin.display()))
}

/// Waits until the backend `pid` waits for a lock on `relation` (a name `regclass` accepts).
pub fn wait_for_lock_wait(client: &mut Client, pid: i32, relation: &str, timeout: Duration) {
    eventually(
        timeout,
        &format!("backend {pid} to wait for a lock on {relation}"),
        || {
            let waiting: bool = client
                .query_one(
                    "SELECT EXISTS (SELECT FROM pg_locks WHERE pid = $1 AND NOT granted \
                       AND relation = $2::text::regclass)",
                    &[&pid, &relation],
                )
                .map_err(|e| e.to_string())?
                .get(0);
            if waiting {
                Ok(())
            } else {
                Err("not waiting".into())
            }
        },
    );
}

/// Waits until the backend `pid` waits for a heavyweight lock of any kind (a row, a
/// transaction id, a relation).
pub fn wait_for_any_lock_wait(client: &mut Client, pid: i32, timeout: Duration) {
    eventually(
        timeout,
        &format!("backend {pid} to wait for a lock"),
        || {
            let waiting: bool = client
                .query_one(
                    "SELECT coalesce(wait_event_type = 'Lock', false) FROM pg_stat_activity \
                  WHERE pid = $1",
                    &[&pid],
                )
                .map_err(|e| e.to_string())?
                .get(0);
            if waiting {
                Ok(())
            } else {
                Err("not waiting".into())
            }
        },
    );
}
