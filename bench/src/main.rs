//! `make bench`: amqp_outbox's benchmark suite.
//!
//! Starts a private PostgreSQL cluster with the library preloaded, uses the local RabbitMQ at
//! 127.0.0.1:5672 (guest/guest; never restarted or reconfigured), runs every measurement several
//! times interleaved with its baseline, prints a table of medians and ratios and writes
//! `bench/results/latest.json` (and `latest.md`).
//!
//! Environment: `BENCH_QUICK=1` (default) or `0` for the full sizes; `BENCH_ONLY=publish,drain,
//! latency,scale,growth,consume,capacity,monitor,standby,lanes,later,relay,profile` to run a subset;
//! `BENCH_SCALE_N` messages per large backlog and `BENCH_SCALE_REPS` backlogs in the scale phase;
//! `BENCH_CONSUME_N` messages per consume run; `BENCH_LANES_N` messages per lanes run; `BENCH_CAPACITY_ROUNDS`, `BENCH_CAPACITY_REPS`,
//! `BENCH_CAPACITY_SECS` for the capacity search; `BENCH_MONITOR_OPEN`, `BENCH_MONITOR_RATE`,
//! `BENCH_MONITOR_FLOW`, `BENCH_MONITOR_SECS`, `BENCH_MONITOR_REPS`, `BENCH_MONITOR_PENDING`,
//! `BENCH_MONITOR_CALLS` for the monitor phase; `BENCH_PROFILE=0` to skip perf;
//! `BENCH_SETTINGS="amqp_outbox.batch_interval=0,…"` adds settings to the cluster's.
//! `--charts <results.json>` prints the charts of an earlier run and exits.

mod capacity;
mod charts;
mod consume;
mod env;
mod lanes;
mod later;
mod monitor;
mod pgbench;
mod phases;
mod raw;
mod relay;
mod report;
mod standby;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use env::Env;
use report::Figure;

/// Sizes and repetitions of one run.
#[derive(Clone, Debug)]
pub struct Opts {
    pub quick: bool,
    /// pgbench seconds per run.
    pub secs: u32,
    /// Repetitions of the publish-cost matrix.
    pub reps: usize,
    /// Repetitions of the cost-growth runs.
    pub growth_reps: usize,
    pub drain_n: u64,
    pub drain_reps: usize,
    pub lat_secs_low: f64,
    pub lat_secs_high: f64,
    pub lat_reps: usize,
    pub scale_n: u64,
    /// Large backlogs drained in the scale phase, each between two reference drains.
    pub scale_reps: usize,
    /// (body size, backlog) for the size-growth drains.
    pub size_drains: Vec<(usize, u64)>,
    /// Messages per run of the consume phase, and its repetitions.
    pub consume_n: u64,
    pub consume_reps: usize,
    /// Messages per run of the lanes phase (a quarter of it with 10 ms handlers).
    pub lanes_n: u64,
    /// Rounds of the capacity search per repetition, repetitions, and seconds per window.
    pub capacity_rounds: usize,
    pub capacity_reps: usize,
    pub capacity_secs: u64,
    /// Monitor phase: open monitored messages seeded, new monitored messages per second, the
    /// unrelated subscription's messages per second, seconds per measured window, repetitions.
    pub monitor_open: u64,
    pub monitor_rate: f64,
    pub monitor_flow: f64,
    pub monitor_secs: u64,
    pub monitor_reps: usize,
    /// Pending outbox rows for the timing of `amqp.health()`, and calls timed.
    pub health_pending: u64,
    pub health_calls: usize,
    pub profile: bool,
    pub only: Option<Vec<String>>,
}

impl Opts {
    fn from_env() -> Opts {
        let quick = std::env::var("BENCH_QUICK")
            .map(|v| v != "0")
            .unwrap_or(true);
        let num = |name: &str, default: u64| -> u64 {
            std::env::var(name)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(default)
        };
        let mut o = if quick {
            Opts {
                quick,
                secs: 3,
                reps: 3,
                growth_reps: 2,
                drain_n: 50_000,
                drain_reps: 2,
                lat_secs_low: 5.0,
                lat_secs_high: 3.0,
                lat_reps: 2,
                scale_n: 200_000,
                scale_reps: 2,
                size_drains: vec![(4096, 20_000), (65536, 2_000)],
                consume_n: 20_000,
                consume_reps: 3,
                lanes_n: 2_000,
                capacity_rounds: 7,
                capacity_reps: 2,
                capacity_secs: 4,
                monitor_open: 100_000,
                monitor_rate: 500.0,
                monitor_flow: 200.0,
                monitor_secs: 30,
                monitor_reps: 2,
                health_pending: 1_000_000,
                health_calls: 20,
                profile: true,
                only: None,
            }
        } else {
            Opts {
                quick,
                secs: 10,
                reps: 5,
                growth_reps: 3,
                drain_n: 200_000,
                drain_reps: 3,
                lat_secs_low: 15.0,
                lat_secs_high: 10.0,
                lat_reps: 3,
                scale_n: 1_000_000,
                scale_reps: 2,
                size_drains: vec![(4096, 50_000), (65536, 5_000)],
                consume_n: 100_000,
                consume_reps: 5,
                lanes_n: 10_000,
                capacity_rounds: 8,
                capacity_reps: 3,
                capacity_secs: 10,
                monitor_open: 100_000,
                monitor_rate: 500.0,
                monitor_flow: 200.0,
                monitor_secs: 60,
                monitor_reps: 3,
                health_pending: 1_000_000,
                health_calls: 20,
                profile: true,
                only: None,
            }
        };
        o.secs = num("BENCH_PGBENCH_SECS", u64::from(o.secs)) as u32;
        o.reps = num("BENCH_REPS", o.reps as u64) as usize;
        o.drain_n = num("BENCH_DRAIN_N", o.drain_n);
        o.scale_n = num("BENCH_SCALE_N", o.scale_n);
        o.scale_reps = num("BENCH_SCALE_REPS", o.scale_reps as u64).max(1) as usize;
        o.consume_n = num("BENCH_CONSUME_N", o.consume_n);
        o.lanes_n = num("BENCH_LANES_N", o.lanes_n).max(8);
        o.capacity_rounds = num("BENCH_CAPACITY_ROUNDS", o.capacity_rounds as u64) as usize;
        o.capacity_reps = num("BENCH_CAPACITY_REPS", o.capacity_reps as u64).max(1) as usize;
        o.capacity_secs = num("BENCH_CAPACITY_SECS", o.capacity_secs).max(1);
        o.monitor_open = num("BENCH_MONITOR_OPEN", o.monitor_open);
        o.monitor_rate = num("BENCH_MONITOR_RATE", o.monitor_rate as u64).max(1) as f64;
        o.monitor_flow = num("BENCH_MONITOR_FLOW", o.monitor_flow as u64).max(1) as f64;
        o.monitor_secs = num("BENCH_MONITOR_SECS", o.monitor_secs).max(5);
        o.monitor_reps = num("BENCH_MONITOR_REPS", o.monitor_reps as u64).max(1) as usize;
        o.health_pending = num("BENCH_MONITOR_PENDING", o.health_pending);
        o.health_calls = num("BENCH_MONITOR_CALLS", o.health_calls as u64).max(1) as usize;
        o.profile = std::env::var("BENCH_PROFILE")
            .map(|v| v != "0")
            .unwrap_or(true);
        o.only = std::env::var("BENCH_ONLY")
            .ok()
            .filter(|s| !s.trim().is_empty())
            .map(|s| s.split(',').map(|x| x.trim().to_string()).collect());
        o
    }

    pub fn runs(&self, phase: &str) -> bool {
        self.only
            .as_ref()
            .is_none_or(|o| o.iter().any(|p| p == phase))
    }
}

/// Everything a run found, beyond the figures: per-run details, profiles, errors.
#[derive(Default)]
pub struct Run {
    pub figures: Vec<Figure>,
    pub details: BTreeMap<String, Value>,
    pub errors: Vec<String>,
    pub notes: Vec<String>,
    /// One line per phase that has a headline, printed above the table.
    pub summary: Vec<String>,
    /// Medians shared between phases (e.g. the raw publisher's rate).
    pub shared: BTreeMap<String, f64>,
}

impl Run {
    pub fn fig(&mut self, f: Figure) {
        self.figures.push(f);
    }

    pub fn detail(&mut self, key: &str, v: Value) {
        self.details.insert(key.to_string(), v);
    }

    pub fn error(&mut self, phase: &str, e: String) {
        eprintln!("bench: {phase}: ERROR: {e}");
        self.errors.push(format!("{phase}: {e}"));
    }
}

pub fn log(msg: impl AsRef<str>) {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let t = START.get_or_init(Instant::now).elapsed().as_secs_f64();
    eprintln!("[{t:7.1}s] {}", msg.as_ref());
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn command_line(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// `--charts <file>`: the charts of a results file.
fn print_charts(path: &str) -> ! {
    let figures = std::fs::read_to_string(path)
        .map_err(|e| e.to_string())
        .and_then(|t| serde_json::from_str::<Value>(&t).map_err(|e| e.to_string()))
        .map(|doc| doc["figures"].as_array().cloned().unwrap_or_default());
    match figures {
        Ok(f) => {
            print!("{}", charts::charts(&f));
            std::process::exit(0)
        }
        Err(e) => {
            eprintln!("cannot read {path}: {e}");
            std::process::exit(2)
        }
    }
}

fn main() {
    // Started again as the relay by section 13.
    relay::run_as_relay();
    let args: Vec<String> = std::env::args().collect();
    if let [_, flag, path] = args.as_slice() {
        if flag == "--charts" {
            print_charts(path);
        }
    }
    let opts = Opts::from_env();
    let started = Instant::now();
    log(format!(
        "amqp_outbox bench ({} mode): {opts:?}",
        if opts.quick { "quick" } else { "full" }
    ));
    let results_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("results");
    let stamp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let out_dir = results_dir.join(format!("run-{stamp}"));
    if let Err(e) = std::fs::create_dir_all(&out_dir) {
        eprintln!("cannot create {}: {e}", out_dir.display());
        std::process::exit(2);
    }
    let load_start = loadavg();
    let mut env = match Env::start(out_dir.clone()) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("bench: cannot set up: {e}");
            std::process::exit(2);
        }
    };
    log(format!(
        "cluster on port {}, RabbitMQ {}:{}",
        env.cluster.port(),
        env.amqp_host,
        env.amqp_port
    ));
    let mut run = Run::default();

    type Phase = fn(&mut Env, &Opts, &mut Run) -> Result<(), String>;
    let all: [(&str, Phase); 13] = [
        ("publish", phases::publish_cost),
        ("drain", phases::drain),
        ("latency", phases::latency),
        ("scale", phases::scale),
        ("growth", phases::growth),
        ("consume", consume::consume),
        ("capacity", capacity::capacity),
        ("monitor", monitor::monitor),
        ("standby", standby::standby),
        ("lanes", lanes::lanes),
        ("later", later::later),
        ("relay", relay::relay),
        ("profile", phases::profile),
    ];
    let mut timings = BTreeMap::new();
    for (name, phase) in all {
        if !opts.runs(name) || (name == "profile" && !opts.profile) {
            continue;
        }
        let t = Instant::now();
        log(format!("== phase {name} (load average {})", loadavg()));
        if let Err(e) = phase(&mut env, &opts, &mut run) {
            run.error(name, e);
            // Leave a clean state for the next phase.
            let _ = env.clear_outbox();
            let _ = env.set_enabled(true);
            let _ = env.set_proof("ack_queue");
        }
        timings.insert(name.to_string(), t.elapsed().as_secs_f64());
        log(format!(
            "== phase {name} done in {:.0}s",
            t.elapsed().as_secs_f64()
        ));
    }
    let load_end = loadavg();
    env.cleanup_broker();

    let table = report::table(&run.figures);
    let elapsed = started.elapsed().as_secs_f64();
    let git = command_line(
        "git",
        &[
            "-C",
            env!("CARGO_MANIFEST_DIR"),
            "rev-parse",
            "--short",
            "HEAD",
        ],
    );
    let dirty = !command_line(
        "git",
        &[
            "-C",
            env!("CARGO_MANIFEST_DIR"),
            "status",
            "--porcelain",
            "--",
            "../src",
        ],
    )
    .is_empty();
    let meta = json!({
        "mode": if opts.quick { "quick" } else { "full" },
        "command": if opts.quick { "make bench" } else { "make bench-full" },
        "git_commit": git,
        "synchronous_commit": env::sync_commit(),
        "src_modified_in_worktree": dirty,
        "started_unix": stamp,
        "elapsed_secs": elapsed,
        "phase_secs": timings,
        "nproc": command_line("nproc", &[]),
        "loadavg_start": load_start,
        "loadavg_end": load_end,
        "postgres": command_line(&env.bindir.join("postgres").display().to_string(), &["--version"]),
        "pgbench_secs": opts.secs,
        "reps": opts.reps,
        "growth_reps": opts.growth_reps,
        "drain_n": opts.drain_n,
        "drain_reps": opts.drain_reps,
        "latency_reps": opts.lat_reps,
        "scale_n": opts.scale_n,
        "scale_reps": opts.scale_reps,
        "size_drains": opts.size_drains,
        "consume_n": opts.consume_n,
        "consume_reps": opts.consume_reps,
        "capacity_rounds": opts.capacity_rounds,
        "capacity_reps": opts.capacity_reps,
        "capacity_secs": opts.capacity_secs,
        "monitor_open": opts.monitor_open,
        "monitor_rate": opts.monitor_rate,
        "monitor_flow": opts.monitor_flow,
        "monitor_secs": opts.monitor_secs,
        "monitor_reps": opts.monitor_reps,
        "health_pending": opts.health_pending,
        "health_calls": opts.health_calls,
        "summary": run.summary,
        "notes": run.notes,
    });
    let doc = json!({
        "meta": meta,
        "figures": run.figures.iter().map(Figure::to_json).collect::<Vec<_>>(),
        "details": run.details,
        "errors": run.errors,
    });
    let json_text = serde_json::to_string_pretty(&doc).unwrap_or_default();
    let summary: String = if run.summary.is_empty() {
        String::new()
    } else {
        let lines: Vec<String> = run.summary.iter().map(|l| format!("- {l}\n")).collect();
        format!("Summary:\n\n{}\n", lines.concat())
    };
    let mut md = format!(
        "## amqp_outbox benchmark — {} mode ({}), {:.0} s, git {}{}\n\n\
         Load average at start {load_start}, at end {load_end} (2 shared cores: read ratios, \
         not absolute numbers); synchronous_commit = {}. Medians of interleaved repetitions; ratio = median of the \
         per-repetition ratios against the baseline measured in the same run.\n\n{summary}{table}",
        if opts.quick { "quick" } else { "full" },
        if opts.quick { "make bench" } else { "make bench-full" },
        elapsed,
        git,
        if dirty { " (src/ modified in the work tree)" } else { "" },
        env::sync_commit()
    );
    let figures_json: Vec<Value> = run.figures.iter().map(Figure::to_json).collect();
    let pictures = charts::charts(&figures_json);
    if !pictures.is_empty() {
        md.push_str(&format!("\n{pictures}"));
    }
    if !run.notes.is_empty() {
        md.push_str("\nNotes:\n");
        for n in &run.notes {
            md.push_str(&format!("- {n}\n"));
        }
    }
    if let Some(Value::String(p)) = run.details.get("profile_summary") {
        md.push_str(&format!("\nProfile (perf, self time):\n\n```\n{p}```\n"));
    }
    if !run.errors.is_empty() {
        md.push_str("\nErrors:\n");
        for e in &run.errors {
            md.push_str(&format!("- {e}\n"));
        }
    }
    for (name, text) in [("results.json", &json_text), ("results.md", &md)] {
        let _ = std::fs::write(out_dir.join(name), text);
    }
    let _ = std::fs::write(results_dir.join("latest.json"), &json_text);
    let _ = std::fs::write(results_dir.join("latest.md"), &md);
    println!("\n{md}");
    println!(
        "JSON: {}\nmarkdown: {}\nrun directory: {}",
        results_dir.join("latest.json").display(),
        results_dir.join("latest.md").display(),
        out_dir.display()
    );
    // Stop the cluster before exiting (Drop stops it with -m immediate).
    drop(env);
    if !run.errors.is_empty() {
        std::process::exit(1);
    }
}
