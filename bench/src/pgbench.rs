//! pgbench runs: the same ~100-byte row through `amqp.publish()`, a plain INSERT into a table
//! with the same columns but the stored message_id (`public.plain`, `LIKE amqp.message
//! INCLUDING ALL` without `message_id`: making the id is counted against publish()), and PgQ's
//! `pgq.insert_event()`.

use std::process::{Child, Command, Stdio};

use crate::env::Env;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum System {
    /// `amqp.publish()` with the worker on and publishing.
    Publish,
    /// `amqp.publish()` with `amqp_outbox.enabled = off`.
    PublishOff,
    Insert,
    Pgq,
    /// `amqp.publish_message()`, worker on: the baseline of the next two.
    PublishMessage,
    /// `amqp.publish_message(..., deliver_after => '1 hour')`: nothing is delivered meanwhile.
    PublishLater,
    /// `amqp.publish_message(..., idempotency_key => <a new random key, a bound parameter>)`,
    /// worker on.
    PublishKeyed,
}

impl System {
    pub fn label(self) -> &'static str {
        match self {
            System::Publish => "amqp.publish (worker on)",
            System::PublishOff => "amqp.publish (worker off)",
            System::Insert => "plain INSERT",
            System::Pgq => "pgq.insert_event",
            System::PublishMessage => "amqp.publish_message (worker on)",
            System::PublishLater => "amqp.publish_message with deliver_after",
            System::PublishKeyed => "amqp.publish_message with idempotency_key",
        }
    }

    pub fn key(self) -> &'static str {
        match self {
            System::Publish => "publish_on",
            System::PublishOff => "publish_off",
            System::Insert => "insert",
            System::Pgq => "pgq",
            System::PublishMessage => "publish_message",
            System::PublishLater => "publish_later",
            System::PublishKeyed => "publish_keyed",
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Load {
    pub clients: u32,
    pub per_txn: u32,
    pub size: usize,
    pub secs: u32,
}

#[derive(Clone, Debug, Default)]
pub struct Outcome {
    /// Transactions per second.
    pub tps: f64,
    /// Messages (rows) per second: tps × per_txn.
    pub rows_per_sec: f64,
    pub latency_ms: f64,
}

/// The pgbench script of one transaction.
pub fn script(env: &Env, system: System, load: &Load, body: &str) -> String {
    let exchange = &env.routes.publish.exchange;
    let b = env.broker_id;
    let stmt = match system {
        System::Publish | System::PublishOff => {
            format!("SELECT amqp.publish({b}, '{exchange}', '', '{body}');")
        }
        System::Insert => format!(
            "INSERT INTO public.plain (broker_id, exchange, routing_key, body) \
             VALUES ({b}, '{exchange}', '', convert_to('{body}', 'UTF8'));"
        ),
        System::Pgq => format!("SELECT pgq.insert_event('bench', 'msg', '{body}');"),
        System::PublishMessage => {
            format!("SELECT amqp.publish_message({b}, '{exchange}', '', '{body}');")
        }
        System::PublishLater => format!(
            "SELECT amqp.publish_message({b}, '{exchange}', '', '{body}', \
             deliver_after => '1 hour');"
        ),
        // The key comes from the client as a bound parameter, as an application's does (a key
        // made by the statement itself would charge its making to the publish).
        System::PublishKeyed => format!(
            "\\set key random(1, 9223372036854775806)\n\
             SELECT amqp.publish_message({b}, '{exchange}', '', '{body}', \
             idempotency_key => :key::text);"
        ),
    };
    if load.per_txn == 1 {
        format!("{stmt}\n")
    } else {
        let mut s = String::from("BEGIN;\n");
        for _ in 0..load.per_txn {
            s.push_str(&stmt);
            s.push('\n');
        }
        s.push_str("COMMIT;\n");
        s
    }
}

/// Starts pgbench in the background (the caller may profile a backend meanwhile).
pub fn spawn(env: &Env, system: System, load: &Load, body: &str) -> Result<Child, String> {
    spawn_on(env, env.cluster.port(), system, load, body)
}

/// Starts pgbench against the bench's database on the server at `port` (the bench's cluster,
/// or another with the same database and broker, e.g. the relay's).
pub fn spawn_on(
    env: &Env,
    port: u16,
    system: System,
    load: &Load,
    body: &str,
) -> Result<Child, String> {
    let file = env.write_file(
        &format!(
            "pgbench-{}-{}c-{}pt-{}b.sql",
            system.key(),
            load.clients,
            load.per_txn,
            load.size
        ),
        &script(env, system, load, body),
    )?;
    let port = port.to_string();
    let clients = load.clients.to_string();
    let jobs = load.clients.min(4).to_string();
    let secs = load.secs.to_string();
    Command::new(env.bindir.join("pgbench"))
        .args([
            "-n",
            "-M",
            "prepared",
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-U",
            "postgres",
            "-c",
            &clients,
            "-j",
            &jobs,
            "-T",
            &secs,
            "-f",
        ])
        .arg(&file)
        .arg(crate::env::DATABASE)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run pgbench: {e}"))
}

pub fn wait(child: Child, load: &Load) -> Result<Outcome, String> {
    let out = child
        .wait_with_output()
        .map_err(|e| format!("pgbench: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "pgbench failed ({}): {}{}",
            out.status,
            stdout,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let num_after = |prefix: &str| -> Option<f64> {
        stdout
            .lines()
            .find(|l| l.starts_with(prefix))?
            .trim_start_matches(prefix)
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    let tps = num_after("tps = ").ok_or_else(|| format!("no tps in pgbench output: {stdout}"))?;
    Ok(Outcome {
        tps,
        rows_per_sec: tps * f64::from(load.per_txn),
        latency_ms: num_after("latency average = ").unwrap_or(f64::NAN),
    })
}

pub fn run(env: &Env, system: System, load: &Load, body: &str) -> Result<Outcome, String> {
    let child = spawn(env, system, load, body)?;
    wait(child, load)
}

/// [`run`] against the server at `port`.
pub fn run_on(
    env: &Env,
    port: u16,
    system: System,
    load: &Load,
    body: &str,
) -> Result<Outcome, String> {
    let child = spawn_on(env, port, system, load, body)?;
    wait(child, load)
}
