//! The benchmark's environment: a private PostgreSQL cluster with the library preloaded, the
//! shared RabbitMQ on 127.0.0.1:5672 (only queues and exchanges named `amqp_outbox_bench.*` are
//! declared, purged and deleted; the broker itself is never restarted or reconfigured), and
//! helpers to switch the worker on and off, build backlogs and watch the outbox.

use std::fs;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use amqp_outbox_e2e::{PgCluster, PgConfig};
use amqp_outbox_testkit::amqp_admin::AmqpAdmin;
use lapin::types::{AMQPValue, FieldTable};
use lapin::ExchangeKind;
use postgres::Client;

/// The database the worker serves.
pub const DATABASE: &str = "bench";
/// Every AMQP object the benchmark declares starts with this.
pub const PREFIX: &str = "amqp_outbox_bench";

/// A fanout exchange bound to one queue (`<exchange>.q`).
#[derive(Clone, Debug)]
pub struct Route {
    pub exchange: String,
    pub queue: String,
    pub quorum: bool,
}

impl Route {
    pub(crate) fn new(name: &str, quorum: bool) -> Route {
        let exchange = format!("{PREFIX}.{name}");
        Route {
            queue: format!("{exchange}.q"),
            exchange,
            quorum,
        }
    }
}

/// The routes the phases publish to.
pub struct Routes {
    /// Publish-cost runs (pgbench with the worker on).
    pub publish: Route,
    /// Drain runs, classic durable queue.
    pub classic: Route,
    /// Drain runs, quorum queue.
    pub quorum: Route,
    /// Latency runs (a consumer is attached).
    pub latency: Route,
    /// The standby section's latency runs (a consumer of its own).
    pub standby: Route,
}

pub struct Env {
    pub cluster: PgCluster,
    pub admin: Client,
    /// Declares, purges and counts the benchmark's queues.
    pub amqp: AmqpAdmin,
    pub broker_id: i32,
    pub bindir: PathBuf,
    pub routes: Routes,
    pub amqp_host: String,
    pub amqp_port: u16,
    /// Where this run writes its files (scripts, profiles, results).
    pub out_dir: PathBuf,
    enabled: bool,
    /// `amqp_outbox.reconcile_window` is not 0 (the default: 15 days).
    production_log: bool,
}

/// A payload of `size` bytes of random lowercase hex (pglz cannot compress it much, so large
/// bodies are stored as they would be with real data).
pub fn payload(size: usize) -> String {
    let mut s = String::with_capacity(size + 16);
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15 ^ size as u64;
    while s.len() < size {
        // xorshift64*
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let v = x.wrapping_mul(0x2545_F491_4F6C_DD1D);
        s.push_str(&format!("{v:016x}"));
    }
    s.truncate(size);
    s
}

impl Env {
    pub fn start(out_dir: PathBuf) -> Result<Env, String> {
        let config = PgConfig {
            database: DATABASE.to_string(),
            naptime_ms: 1000,
            ..PgConfig::default()
        }
        // fsync on (the harness turns it off for tests) and, by default, synchronous_commit
        // on: PostgreSQL's defaults, what applications run with. Each commit then waits for
        // its WAL flush, which on a shared machine costs 0.1 to 5 ms depending on what the
        // neighbours write; BENCH_SYNC_COMMIT=off takes the disk out of CPU comparisons.
        .setting("fsync", "on")
        .setting("full_page_writes", "on")
        .setting("synchronous_commit", sync_commit())
        .setting("shared_buffers", "'256MB'")
        .setting("max_wal_size", "'2GB'")
        .setting("max_connections", "120")
        // The lanes phase runs 8 lanes beside the database's three workers.
        .setting("max_worker_processes", "20")
        .setting("log_min_messages", "warning")
        .setting("amqp_outbox.enabled", "on");
        let config = extra_settings()?
            .into_iter()
            .fold(config, |c, (name, value)| c.setting(&name, value));
        let cluster = PgCluster::try_new(config)?;
        let mut admin = cluster.try_client()?;
        let bindir = pg_bindir()?;

        let amqp_port: u16 = std::env::var("AMQP_OUTBOX_E2E_AMQP_PORT")
            .ok()
            .and_then(|p| p.parse().ok())
            .unwrap_or(5672);
        let amqp_host = "127.0.0.1".to_string();
        admin
            .batch_execute(
                "CREATE EXTENSION amqp_outbox;
                 -- PgQ (the publish-cost baseline; `make bench` installs it): without it the
                 -- phases that do not compare against it still run.
                 DO $$ BEGIN
                   IF EXISTS (SELECT FROM pg_available_extensions WHERE name = 'pgq') THEN
                     CREATE EXTENSION pgq;
                     PERFORM pgq.create_queue('bench');
                   ELSE
                     RAISE WARNING 'PgQ is not installed: the phases comparing against it will fail';
                   END IF;
                 END $$;
                 CREATE TABLE public.plain (LIKE amqp.message INCLUDING ALL);
                 -- The baseline row has no message_id: making it is counted against publish().
                 ALTER TABLE public.plain DROP COLUMN message_id;",
            )
            .map_err(|e| {
                let why = e.as_db_error().map_or_else(|| e.to_string(), |d| d.to_string());
                format!("setting up the bench database: {why}")
            })?;
        // Only now: before CREATE EXTENSION the database has at most a probe, which looks and
        // exits at once.
        cluster.wait_for_worker(&mut admin, Duration::from_secs(30));
        let port = i32::from(amqp_port);
        let broker_id: i32 = admin
            .query_one(
                "INSERT INTO amqp.broker (host, port) VALUES ($1, $2) RETURNING broker_id",
                &[&amqp_host, &port],
            )
            .map_err(|e| format!("INSERT INTO amqp.broker: {e}"))?
            .get(0);

        let amqp = AmqpAdmin::connect(&amqp_uri(&amqp_host, amqp_port))
            .map_err(|e| format!("RabbitMQ: {e}"))?;
        let routes = Routes {
            publish: Route::new("publish", false),
            classic: Route::new("classic", false),
            quorum: Route::new("quorum", true),
            latency: Route::new("latency", false),
            standby: Route::new("standby", false),
        };
        let env = Env {
            cluster,
            admin,
            amqp,
            broker_id,
            bindir,
            routes,
            amqp_host,
            amqp_port,
            out_dir,
            enabled: true,
            production_log: true,
        };
        for r in env.all_routes() {
            env.declare(&r)?;
        }
        Ok(env)
    }

    pub fn all_routes(&self) -> Vec<Route> {
        vec![
            self.routes.publish.clone(),
            self.routes.classic.clone(),
            self.routes.quorum.clone(),
            self.routes.latency.clone(),
            self.routes.standby.clone(),
        ]
    }

    pub fn amqp_uri(&self) -> String {
        amqp_uri(&self.amqp_host, self.amqp_port)
    }

    pub(crate) fn declare(&self, r: &Route) -> Result<(), String> {
        // A leftover of an interrupted run may have other arguments: start afresh.
        let _ = self.amqp.delete_queue(&r.queue);
        self.amqp
            .declare_exchange(&r.exchange, ExchangeKind::Fanout, true)?;
        let mut args = FieldTable::default();
        if r.quorum {
            args.insert(
                "x-queue-type".into(),
                AMQPValue::LongString("quorum".into()),
            );
        }
        self.amqp.declare_queue(&r.queue, true, args)?;
        self.amqp
            .bind_queue(&r.queue, &r.exchange, "", FieldTable::default())
    }

    /// Deletes the benchmark's queues and exchanges.
    pub fn cleanup_broker(&self) {
        let routes = self.all_routes();
        let queues: Vec<String> = routes.iter().map(|r| r.queue.clone()).collect();
        let exchanges: Vec<String> = routes.iter().map(|r| r.exchange.clone()).collect();
        self.amqp
            .delete_all(&queues, &exchanges, Duration::from_secs(30));
    }

    pub fn purge(&self, queue: &str) -> Result<(), String> {
        self.amqp.purge_queue(queue)
    }

    /// Ready messages in `queue`.
    pub fn queue_len(&self, queue: &str) -> Result<u64, String> {
        self.amqp.queue_len(queue).map(u64::from)
    }

    /// Waits (bounded) until `queue` holds at least `n` messages; returns what it holds.
    pub fn wait_queue_len(&self, queue: &str, n: u64, timeout: Duration) -> Result<u64, String> {
        let deadline = Instant::now() + timeout;
        loop {
            let len = self.queue_len(queue)?;
            if len >= n || Instant::now() >= deadline {
                return Ok(len);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `amqp_outbox.enabled` through the cluster's configuration file and a reload (custom
    /// settings cannot be set with ALTER SYSTEM before the library is loaded).
    pub fn set_enabled(&mut self, on: bool) -> Result<(), String> {
        if self.enabled == on {
            return Ok(());
        }
        self.cluster
            .set_setting("amqp_outbox.enabled", if on { "on" } else { "off" });
        self.admin
            .batch_execute("SELECT pg_catalog.pg_reload_conf()")
            .map_err(|e| format!("pg_reload_conf: {e}"))?;
        self.enabled = on;
        if on {
            let _ = self.admin.batch_execute("SELECT amqp.wake()");
        } else {
            // Let the worker see the new setting before the caller relies on it.
            std::thread::sleep(Duration::from_millis(500));
        }
        Ok(())
    }

    /// The production log on (`amqp_outbox.reconcile_window` at its default) or off (`0`), through
    /// the configuration file and a reload.
    pub fn set_production_log(&mut self, on: bool) -> Result<(), String> {
        if self.production_log == on {
            return Ok(());
        }
        self.cluster.set_setting(
            "amqp_outbox.reconcile_window",
            if on { "'15d'" } else { "0" },
        );
        self.admin
            .batch_execute("SELECT pg_catalog.pg_reload_conf()")
            .map_err(|e| format!("pg_reload_conf: {e}"))?;
        self.production_log = on;
        // Let the worker see the new setting before the caller relies on it.
        std::thread::sleep(Duration::from_millis(500));
        Ok(())
    }

    pub fn set_proof(&mut self, proof: &str) -> Result<(), String> {
        self.admin
            .execute(
                "UPDATE amqp.broker SET proof = $1 WHERE broker_id = $2 AND proof <> $1",
                &[&proof, &self.broker_id],
            )
            .map(|_| ())
            .map_err(|e| format!("UPDATE amqp.broker SET proof = {proof}: {e}"))
    }

    pub fn sql(&mut self, sql: &str) -> Result<(), String> {
        self.admin
            .batch_execute(sql)
            .map_err(|e| format!("{sql}: {e}"))
    }

    pub fn outbox_rows(&mut self) -> Result<i64, String> {
        self.admin
            .query_one("SELECT count(*) FROM amqp.message", &[])
            .map(|r| r.get(0))
            .map_err(|e| format!("count amqp.message: {e}"))
    }

    /// True when `amqp.message` has a row (an index probe, cheap enough to poll).
    pub fn outbox_nonempty(client: &mut Client) -> Result<bool, String> {
        client
            .query_opt("SELECT id FROM amqp.message ORDER BY id LIMIT 1", &[])
            .map(|r| r.is_some())
            .map_err(|e| format!("probing amqp.message: {e}"))
    }

    /// Polls every 50 ms until `amqp.message` is empty; returns when it first was, or an error
    /// after `timeout`.
    pub fn wait_outbox_empty(&mut self, timeout: Duration) -> Result<Instant, String> {
        let deadline = Instant::now() + timeout;
        loop {
            if !Env::outbox_nonempty(&mut self.admin)? {
                return Ok(Instant::now());
            }
            if Instant::now() >= deadline {
                let n = self.outbox_rows()?;
                return Err(format!(
                    "amqp.message not empty after {timeout:?}: {n} rows"
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Makes `amqp.message` empty with the worker off (a leftover of a run that was cut short).
    pub fn clear_outbox(&mut self) -> Result<(), String> {
        self.set_enabled(false)?;
        self.sql("TRUNCATE amqp.message")
    }

    /// Builds a backlog of `n` committed messages of `body` to `exchange`, in transactions of
    /// 50,000 rows through `amqp.publish()`.
    pub fn build_backlog(&mut self, exchange: &str, body: &str, n: u64) -> Result<(), String> {
        let chunk: u64 = 50_000;
        let mut left = n;
        let stmt = self
            .admin
            .prepare(
                "SELECT count(amqp.publish($1, $2, '', $3)) FROM generate_series(1, $4::int) g",
            )
            .map_err(|e| format!("prepare backlog statement: {e}"))?;
        while left > 0 {
            let k = left.min(chunk) as i32;
            self.admin
                .query_one(&stmt, &[&self.broker_id, &exchange, &body, &k])
                .map_err(|e| format!("building the backlog: {e}"))?;
            left -= k as u64;
        }
        Ok(())
    }

    pub fn worker_pid(&mut self) -> Result<Option<i32>, String> {
        self.cluster.worker_pid(&mut self.admin)
    }

    /// The pid of this database's process of `backend_type` (`amqp_outbox monitor`,
    /// `amqp_outbox subscriptions`), if it runs.
    pub fn backend_pid(&mut self, backend_type: &str) -> Result<Option<i32>, String> {
        self.admin
            .query_opt(
                "SELECT pid FROM pg_stat_activity
                  WHERE backend_type = $1 AND datname = current_database()",
                &[&backend_type],
            )
            .map(|r| r.map(|r| r.get(0)))
            .map_err(|e| format!("pg_stat_activity: {e}"))
    }

    /// `amqp.worker_status.confirmed`.
    pub fn confirmed(&mut self) -> Result<i64, String> {
        self.admin
            .query_one(
                "SELECT confirmed FROM amqp.worker_status WHERE database = current_database()",
                &[],
            )
            .map(|r| r.get(0))
            .map_err(|e| format!("amqp.worker_status: {e}"))
    }

    /// (total, heap, indexes) bytes of `amqp.message`.
    pub fn outbox_size(&mut self) -> Result<(i64, i64, i64), String> {
        let r = self
            .admin
            .query_one(
                "SELECT pg_total_relation_size('amqp.message'), pg_relation_size('amqp.message'),
                        pg_indexes_size('amqp.message')",
                &[],
            )
            .map_err(|e| format!("size of amqp.message: {e}"))?;
        Ok((r.get(0), r.get(1), r.get(2)))
    }

    pub fn write_file(&self, name: &str, text: &str) -> Result<PathBuf, String> {
        let p = self.out_dir.join(name);
        fs::write(&p, text).map_err(|e| format!("cannot write {}: {e}", p.display()))?;
        Ok(p)
    }
}

/// The shared broker as guest; a long heartbeat, so a loaded run does not lose its connections.
fn amqp_uri(host: &str, port: u16) -> String {
    format!("amqp://guest:guest@{host}:{port}/%2f?heartbeat=30")
}

/// `synchronous_commit` of the cluster: `BENCH_SYNC_COMMIT` (default `on`, PostgreSQL's).
pub fn sync_commit() -> String {
    match std::env::var("BENCH_SYNC_COMMIT").as_deref() {
        Ok("off") | Ok("0") => "off".to_string(),
        _ => "on".to_string(),
    }
}

fn pg_bindir() -> Result<PathBuf, String> {
    let pg_config = std::env::var("PG_CONFIG").unwrap_or_else(|_| "pg_config".to_string());
    let out = Command::new(&pg_config)
        .arg("--bindir")
        .output()
        .map_err(|e| format!("cannot run {pg_config}: {e}"))?;
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// From /proc/<pid>/status: (VmRSS, VmHWM) in KiB.
pub fn proc_mem_kib(pid: i32) -> Option<(u64, u64)> {
    proc_mem_detail_kib(pid).map(|[rss, hwm, ..]| (rss, hwm))
}

/// From /proc/<pid>/status: (VmRSS, VmHWM, RssAnon, RssShmem) in KiB. VmRSS counts the pages
/// of PostgreSQL's shared buffers the process touched (RssShmem); RssAnon is its own memory.
pub fn proc_mem_detail_kib(pid: i32) -> Option<[u64; 4]> {
    let s = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> Option<u64> {
        s.lines()
            .find(|l| l.starts_with(name))?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    };
    Some([
        field("VmRSS:")?,
        field("VmHWM:")?,
        field("RssAnon:")?,
        field("RssShmem:")?,
    ])
}

/// Calls a sampling function on its state every 100 ms in a thread (once at the start, once
/// more when told to stop) until [`Sampler::finish`], which returns the state.
pub struct Sampler<T> {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    handle: Option<std::thread::JoinHandle<T>>,
}

impl<T: Default + Send + 'static> Sampler<T> {
    fn start(mut sample: impl FnMut(&mut T) + Send + 'static) -> Sampler<T> {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s2 = stop.clone();
        let handle = std::thread::spawn(move || {
            let mut state = T::default();
            loop {
                sample(&mut state);
                if s2.load(std::sync::atomic::Ordering::Relaxed) {
                    return state;
                }
                std::thread::sleep(SAMPLE_EVERY);
            }
        });
        Sampler {
            stop,
            handle: Some(handle),
        }
    }

    pub fn finish(mut self) -> T {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.handle
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default()
    }
}

const SAMPLE_EVERY: Duration = Duration::from_millis(100);

impl Sampler<[u64; 4]> {
    /// Peaks of a process's memory in KiB: [VmRSS, VmHWM, RssAnon, RssShmem].
    pub fn memory(pid: i32) -> Sampler<[u64; 4]> {
        Sampler::start(move |peak: &mut [u64; 4]| {
            if let Some(m) = proc_mem_detail_kib(pid) {
                for i in 0..4 {
                    peak[i] = peak[i].max(m[i]);
                }
            }
        })
    }
}

/// How long a VACUUM (autovacuum's or anyone's) of `amqp.message` was seen running, and how
/// many different ones. On two cores a vacuum landing in a drain takes CPU from it, and whether
/// one lands depends on autovacuum's clock, not on the backlog.
#[derive(Clone, Copy, Debug, Default)]
pub struct VacuumSeen {
    /// Seconds during which a vacuum of the table was seen running (sampling resolution).
    pub secs: f64,
    /// Distinct vacuums seen (by the pid running them).
    pub runs: u32,
    last_pid: Option<i32>,
}

impl Sampler<VacuumSeen> {
    /// Samples `pg_stat_progress_vacuum` on a connection of its own.
    pub fn vacuum(env: &Env) -> Result<Sampler<VacuumSeen>, String> {
        let mut client = env.cluster.try_client()?;
        Ok(Sampler::start(move |seen: &mut VacuumSeen| {
            let pid: Option<i32> = client
                .query_opt(
                    "SELECT pid FROM pg_stat_progress_vacuum
                      WHERE relid = 'amqp.message'::regclass LIMIT 1",
                    &[],
                )
                .ok()
                .flatten()
                .map(|r| r.get(0));
            if let Some(p) = pid {
                seen.secs += SAMPLE_EVERY.as_secs_f64();
                if seen.last_pid != Some(p) {
                    seen.runs += 1;
                }
            }
            seen.last_pid = pid;
        }))
    }
}

/// Resets VmHWM of `pid` (needs permission on /proc/<pid>/clear_refs: root or the owner).
pub fn reset_hwm(pid: i32) -> bool {
    fs::write(format!("/proc/{pid}/clear_refs"), "5").is_ok()
}

/// The process listening on 127.0.0.1:`port` (the RabbitMQ node), found with `ss`.
pub fn listener_pid(port: u16) -> Option<i32> {
    let out = std::process::Command::new("ss")
        .args(["-Hltnp", &format!("sport = :{port}")])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let at = text.find("pid=")? + 4;
    text[at..]
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

/// CPU seconds (user + system) `pid` has used so far.
pub fn proc_cpu_secs(pid: i32) -> Option<f64> {
    stat_cpu_secs(&format!("/proc/{pid}/stat"))
}

/// CPU seconds (user + system) one thread `tid` of this process has used so far.
pub fn thread_cpu_secs(tid: i32) -> Option<f64> {
    stat_cpu_secs(&format!("/proc/self/task/{tid}/stat"))
}

/// This thread's id (for [`thread_cpu_secs`]).
pub fn gettid() -> i32 {
    // SAFETY: gettid has no preconditions and cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) as i32 }
}

/// The ids of this process's threads whose name is `name` (`/proc/self/task/*/comm`).
pub fn threads_named(name: &str) -> Vec<i32> {
    let Ok(dir) = fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    dir.filter_map(|e| {
        let e = e.ok()?;
        let tid: i32 = e.file_name().to_str()?.parse().ok()?;
        let comm = fs::read_to_string(e.path().join("comm")).ok()?;
        (comm.trim_end() == name).then_some(tid)
    })
    .collect()
}

/// The RabbitMQ node's pid: the listener on `port`, else the oldest `beam.smp` (`pgrep`).
pub fn broker_pid(port: u16) -> Option<i32> {
    listener_pid(port).or_else(|| {
        let out = Command::new("pgrep")
            .args(["-o", "-f", "beam.smp"])
            .output()
            .ok()?;
        String::from_utf8_lossy(&out.stdout).trim().parse().ok()
    })
}

/// CPU seconds (user + system) of a whole PostgreSQL cluster so far: its postmaster, every
/// process it runs now, and those that ended and were reaped (their time is in the postmaster's
/// children's counts), so the backends of clients that disconnected still count.
pub fn cluster_cpu_secs(data_dir: &std::path::Path) -> Option<f64> {
    let pid_file = fs::read_to_string(data_dir.join("postmaster.pid")).ok()?;
    let postmaster: i32 = pid_file.lines().next()?.trim().parse().ok()?;
    let mut total = stat_cpu(&format!("/proc/{postmaster}/stat"), WITH_CHILDREN)?;
    for e in fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(s) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some(f) = stat_fields(&s) else {
            continue;
        };
        if f.get(PPID).and_then(|p| p.parse::<i32>().ok()) == Some(postmaster) {
            total += ticks_secs(&f, WITH_CHILDREN).unwrap_or(0.0);
        }
    }
    Some(total)
}

/// CPU seconds (user + system) of this process's children that ended and were reaped (pgbench).
pub fn reaped_children_cpu_secs() -> Option<f64> {
    stat_cpu("/proc/self/stat", CHILDREN)
}

/// Fields of a `/proc/<pid>/stat` line (0-based after the command, which is in parentheses
/// and may contain spaces): the parent's pid, then utime, stime, cutime, cstime in clock ticks.
const PPID: usize = 1;
const OWN: std::ops::Range<usize> = 11..13;
const CHILDREN: std::ops::Range<usize> = 13..15;
const WITH_CHILDREN: std::ops::Range<usize> = 11..15;

/// The fields after the command of a `/proc/.../stat` text.
fn stat_fields(s: &str) -> Option<Vec<&str>> {
    Some(s[s.rfind(')')? + 2..].split_whitespace().collect())
}

/// The sum of `fields` (clock ticks), in seconds.
fn ticks_secs(f: &[&str], fields: std::ops::Range<usize>) -> Option<f64> {
    let mut ticks = 0.0;
    for i in fields {
        ticks += f.get(i)?.parse::<f64>().ok()?;
    }
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Some(ticks / hz)
}

/// The CPU seconds `fields` of a `/proc/.../stat` file say.
fn stat_cpu(path: &str, fields: std::ops::Range<usize>) -> Option<f64> {
    let s = fs::read_to_string(path).ok()?;
    ticks_secs(&stat_fields(&s)?, fields)
}

fn stat_cpu_secs(path: &str) -> Option<f64> {
    stat_cpu(path, OWN)
}

/// `BENCH_SETTINGS="name=value,name=value"`: settings added to the cluster's configuration
/// after the bench's own (to measure another `amqp_outbox.batch_interval`, say). A value is
/// written as given: quote strings the way postgresql.conf wants them.
fn extra_settings() -> Result<Vec<(String, String)>, String> {
    let Ok(list) = std::env::var("BENCH_SETTINGS") else {
        return Ok(Vec::new());
    };
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|item| match item.split_once('=') {
            Some((name, value)) if !name.trim().is_empty() => {
                Ok((name.trim().to_string(), value.trim().to_string()))
            }
            _ => Err(format!("BENCH_SETTINGS: {item:?} is not name=value")),
        })
        .collect()
}
