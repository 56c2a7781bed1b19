//! The documentation's examples and reference, checked against the product
//! (docs/contributing.md, "Runnable examples" and "The documentation checks").
//!
//! - `readme_tour_and_consuming_examples_run`: the SQL blocks of README.md's tour and of
//!   docs/consuming.md that carry `<!-- run: DB -->` run, in order, with psql on a private
//!   cluster (each file on a fresh one) against the shared RabbitMQ; `wait: TEXT` blocks are
//!   run again until their output contains TEXT (the message arrived, was handled, traced).
//!   Every ```sql block must carry `run:` or `norun:`.
//! - `reference_matches_the_installed_catalog`: `scripts/docs_check.py catalog` against a
//!   private cluster that preloads the installed library: every function, view, table, type
//!   and setting of the extension has its entry in docs/reference.md, and every entry exists.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use amqp_outbox_e2e::{eventually, AmqpEndpoint, Outbox, PgCluster, PgConfig, Rabbit};
use amqp_outbox_testkit::amqp_admin::AmqpAdmin;

/// What the documented examples declare on the broker (deleted before and after).
const EXAMPLE_QUEUES: &[&str] = &["billing.orders"];
const EXAMPLE_EXCHANGES: &[&str] = &["orders"];
const WAIT: Duration = Duration::from_secs(30);

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate lives in the repository")
        .to_path_buf()
}

#[derive(Debug)]
struct Block {
    file: String,
    line: usize,
    database: String,
    wait: Option<String>,
    sql: String,
}

/// The marked SQL blocks of a Markdown file, in order; an error names each unmarked block.
fn sql_blocks(rel: &str) -> Result<Vec<Block>, String> {
    let text = std::fs::read_to_string(repo_root().join(rel)).map_err(|e| format!("{rel}: {e}"))?;
    let mut blocks = Vec::new();
    let mut problems = Vec::new();
    let mut mark: Option<(String, usize)> = None;
    let mut lines = text.lines().enumerate();
    while let Some((i, line)) = lines.next() {
        let t = line.trim();
        if let Some(inner) = t.strip_prefix("<!--").and_then(|r| r.strip_suffix("-->")) {
            let inner = inner.trim();
            if inner.starts_with("run:") || inner.starts_with("norun:") {
                mark = Some((inner.to_string(), i + 1));
                continue;
            }
        }
        if t.starts_with("```") {
            let lang = t.trim_start_matches('`').trim();
            let mut body = String::new();
            for (_, l) in lines.by_ref() {
                if l.trim_start().starts_with("```") {
                    break;
                }
                body.push_str(l);
                body.push('\n');
            }
            let taken = mark.take();
            if lang != "sql" {
                continue;
            }
            match taken {
                None => problems.push(format!(
                    "{rel}:{}: a ```sql block without <!-- run: DB --> or <!-- norun: why -->",
                    i + 1
                )),
                Some((m, _)) if m.starts_with("norun:") => {}
                Some((m, at)) => {
                    let spec = m.trim_start_matches("run:").trim();
                    let (db, wait) = match spec.split_once(',') {
                        Some((db, rest)) => {
                            let rest = rest.trim();
                            let w = rest.strip_prefix("wait:").ok_or_else(|| {
                                format!("{rel}:{at}: unknown option {rest:?} (only wait: TEXT)")
                            })?;
                            (db.trim(), Some(w.trim().replace("\\n", "\n")))
                        }
                        None => (spec, None),
                    };
                    if db.is_empty() || !db.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                        problems.push(format!("{rel}:{at}: bad database name {db:?}"));
                        continue;
                    }
                    blocks.push(Block {
                        file: rel.to_string(),
                        line: i + 1,
                        database: db.to_string(),
                        wait,
                        sql: body,
                    });
                }
            }
            continue;
        }
        if !t.is_empty() {
            // A mark applies to the block right after it (blank lines allowed).
            mark = None;
        }
    }
    if problems.is_empty() {
        Ok(blocks)
    } else {
        Err(problems.join("\n"))
    }
}

fn clean_broker(rabbit: &Rabbit, endpoint: &AmqpEndpoint, extra_queues: &[String]) {
    for q in EXAMPLE_QUEUES {
        let _ = rabbit.delete_queue(q);
    }
    for q in extra_queues {
        let _ = rabbit.delete_queue(q);
    }
    if let Ok(admin) = AmqpAdmin::connect(&endpoint.uri()) {
        for e in EXAMPLE_EXCHANGES {
            let _ = admin.delete_exchange(e);
        }
    }
}

/// Runs one file's marked blocks on a fresh cluster; returns the acknowledgement queues its
/// databases declared (to delete once the cluster is gone).
fn run_file(rel: &str, endpoint: &AmqpEndpoint) -> Vec<String> {
    let blocks = sql_blocks(rel).unwrap_or_else(|e| panic!("{e}"));
    assert!(!blocks.is_empty(), "{rel} has no block marked to run");
    let cluster = PgCluster::new(PgConfig::default().setting("amqp_outbox.database", "'*'"));
    let mut created = BTreeSet::new();
    let mut ack_queues = BTreeSet::new();
    for (n, b) in blocks.iter().enumerate() {
        if created.insert(b.database.clone()) {
            cluster
                .client_db("postgres")
                .batch_execute(&format!("CREATE DATABASE {}", b.database))
                .unwrap_or_else(|e| panic!("CREATE DATABASE {}: {e}", b.database));
        }
        let path = cluster.dir().join(format!("docs-block-{n}.sql"));
        std::fs::write(&path, &b.sql).expect("write the block");
        let path = path.to_string_lossy().into_owned();
        let run = || {
            cluster.run_client(
                "psql",
                &[
                    "-X",
                    "-q",
                    "-A",
                    "-t",
                    "-v",
                    "ON_ERROR_STOP=1",
                    "-d",
                    &b.database,
                    "-f",
                    &path,
                ],
            )
        };
        let where_ = format!("{}:{} (database {})", b.file, b.line, b.database);
        match &b.wait {
            None => {
                run().unwrap_or_else(|e| {
                    panic!(
                        "{where_} failed: {e}\n--- server log ---\n{}",
                        cluster.log_tail(30)
                    )
                });
            }
            Some(text) => {
                eventually(WAIT, &format!("{where_} to print {text:?}"), || {
                    let out = run()?;
                    if out.contains(text.as_str()) {
                        Ok(())
                    } else {
                        Err(format!("it printed {out:?}"))
                    }
                });
            }
        }
        // The examples name the broker 127.0.0.1:5672; a test run against another port moves
        // the broker rows there (the worker picks the change up at commit).
        let mut client = cluster.client_db(&b.database);
        let has_ext = client
            .query_one(
                "SELECT count(*) FROM pg_extension WHERE extname = 'amqp_outbox'",
                &[],
            )
            .map(|r| r.get::<_, i64>(0) == 1)
            .unwrap_or(false);
        if has_ext {
            ack_queues.insert(Outbox::ack_queue_name(&mut client));
            if endpoint.port != 5672 {
                client
                    .execute(
                        "UPDATE amqp.broker SET port = $1 WHERE port = 5672",
                        &[&i32::from(endpoint.port)],
                    )
                    .expect("move the broker rows to the test's port");
            }
        }
    }
    drop(cluster);
    ack_queues.into_iter().collect()
}

#[test]
fn readme_tour_and_consuming_examples_run() {
    let start = Instant::now();
    let endpoint = AmqpEndpoint::shared();
    let rabbit = Rabbit::shared();
    for rel in ["README.md", "docs/consuming.md"] {
        clean_broker(&rabbit, &endpoint, &[]);
        let acks = run_file(rel, &endpoint);
        clean_broker(&rabbit, &endpoint, &acks);
        eprintln!("{rel}: its examples ran ({:.1?} so far)", start.elapsed());
    }
}

#[test]
fn every_sql_block_is_marked() {
    for rel in ["README.md", "docs/consuming.md"] {
        sql_blocks(rel).unwrap_or_else(|e| panic!("{e}"));
    }
}

#[test]
fn reference_matches_the_installed_catalog() {
    let cluster = PgCluster::new(PgConfig::default());
    let script = repo_root().join("scripts/docs_check.py");
    let port = cluster.port().to_string();
    let out = Command::new("python3")
        .arg(&script)
        .args(["catalog", "-h", "127.0.0.1", "-p", &port, "-U", "postgres"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run python3 {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "docs/reference.md does not match the installed extension:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
