//! Test support shared by the end-to-end tests (`tests/`), the broker crate's integration
//! tests and the benchmark: a private RabbitMQ node process ([`RabbitNode`]), an AMQP admin
//! client ([`amqp_admin::AmqpAdmin`]), TLS test certificates ([`Pki`]), free ports, bounded
//! polling. Beyond std it needs only libc, lapin and tokio (and the `openssl` command), so
//! every user can take it without the others' dependencies.

pub mod amqp_admin;
mod node;
mod pki;

pub use node::{find_sbin, rabbitmq_installed, send_signal, NodeOptions, RabbitNode};
pub use pki::{openssl_installed, Pki};

use std::collections::HashSet;
use std::net::TcpListener;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Polls `check` until it returns `Ok`, and returns that value; after `timeout`, the last
/// error `check` gave. The polling interval starts at 20 ms and grows to 250 ms.
pub fn try_eventually<T>(
    timeout: Duration,
    mut check: impl FnMut() -> Result<T, String>,
) -> Result<T, String> {
    let deadline = Instant::now() + timeout;
    let mut interval = Duration::from_millis(20);
    loop {
        match check() {
            Ok(v) => return Ok(v),
            Err(e) => {
                if Instant::now() >= deadline {
                    return Err(e);
                }
            }
        }
        std::thread::sleep(interval.min(deadline.saturating_duration_since(Instant::now())));
        interval = (interval * 2).min(Duration::from_millis(250));
    }
}

/// True when nothing listens on 127.0.0.1:`port` (we could bind it ourselves).
pub fn port_is_free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// A port in `lo..hi` that is free now and was not handed out before by this process;
/// `span` consecutive ports starting at the result must all be free. Remembering what was
/// handed out keeps nodes started at once in one test binary apart (none has bound its ports
/// yet); the random start keeps other processes' choices apart.
pub fn pick_ports(lo: u16, hi: u16, span: u16) -> u16 {
    static TAKEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
    let mut guard = TAKEN.lock().unwrap_or_else(|e| e.into_inner());
    let taken = guard.get_or_insert_with(HashSet::new);
    for _ in 0..1000 {
        let base = lo + (random_u16() % (hi - lo - span));
        let all_free = (base..base + span).all(|p| !taken.contains(&p) && port_is_free(p));
        if all_free {
            taken.extend(base..base + span);
            return base;
        }
    }
    panic!("no {span} free consecutive ports found in {lo}..{hi}");
}

/// A random number without a `rand` dependency: std's hasher keys are random per process and
/// change with every `RandomState`.
fn random_u16() -> u16 {
    use std::hash::BuildHasher;
    (std::collections::hash_map::RandomState::new().hash_one(0u8) >> 24) as u16
}

/// The last `n` lines of `text`, for failure messages.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
