//! Its own test binary (so no other test's lapin connection shares the process): every thread
//! the AMQP side starts, lapin's io loops included, has SIGTERM and SIGHUP blocked, so they
//! always reach PostgreSQL's main thread.

mod common;

use amqp_outbox_broker::Command;
use common::*;

/// (thread name, blocked-signal mask) of every thread of this process.
fn threads() -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc/self/task").unwrap() {
        let path = entry.unwrap().path();
        let Ok(status) = std::fs::read_to_string(path.join("status")) else {
            continue; // the thread ended meanwhile
        };
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| v.trim().to_string())
                .unwrap()
        };
        let mask = u64::from_str_radix(&field("SigBlk:"), 16).unwrap();
        out.push((field("Name:"), mask));
    }
    out
}

fn blocked(mask: u64, sig: i32) -> bool {
    mask & (1u64 << (sig - 1)) != 0
}

#[test]
fn amqp_threads_block_signals_and_the_caller_does_not() {
    let mut bridge = Bridge::new();
    bridge.send(Command::Configure(vec![config(
        1,
        vec![local_endpoint()],
        vec![],
    )]));
    bridge.wait_connected(1, 0);

    let all = threads();
    let amqp: Vec<_> = all
        .iter()
        .filter(|(n, _)| n.starts_with("amqp_outbox") || n.starts_with("lapin"))
        .collect();
    assert!(
        amqp.iter().any(|(n, _)| n.starts_with("amqp_outbox-amq")),
        "{all:?}"
    );
    assert!(
        amqp.iter().any(|(n, _)| n.starts_with("lapin-io")),
        "{all:?}"
    );
    for (name, mask) in &amqp {
        assert!(blocked(*mask, libc::SIGTERM), "{name}: {mask:x}");
        assert!(blocked(*mask, libc::SIGHUP), "{name}: {mask:x}");
        assert!(blocked(*mask, libc::SIGINT), "{name}: {mask:x}");
    }
    // The spawning thread got its own mask back.
    // SAFETY: sigset_t is plain data, valid when zeroed.
    let mut mine: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: a null new mask only reads the current one into `mine`.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, std::ptr::null(), &mut mine) };
    // SAFETY: `mine` was filled by pthread_sigmask.
    assert_eq!(unsafe { libc::sigismember(&mine, libc::SIGTERM) }, 0);
}
