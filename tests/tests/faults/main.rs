//! The fault-injection suite: one test per case of FAULTS.md (1 to 26), case 2 also with every
//! process of the product terminated at once, case 10 also after empty statistics.
//!
//! Every test runs its own PostgreSQL cluster and its own RabbitMQ node (never the shared ones),
//! injects its fault on this machine, heals it, drains, and checks with the ledger: lost = 0,
//! phantom = 0, duplicates within the documented bound (`amqp_outbox.max_in_flight` per fault,
//! plus what the test consumer itself gets redelivered when its own connection breaks), every
//! duplicate sharing one `message_id`. Rows left in the outbox after the final drain are
//! reported. Each test appends a row to `target/chaos/results.tsv` (`make chaos` prints it).
//!
//! Fast cases run in `make test`; the slow ones are `#[ignore]` and run with `make chaos`
//! (`--include-ignored`, `AMQP_OUTBOX_CHAOS_SCALE=10` for larger volumes).
//!
//! `harness` holds the rig and the checker; the other modules hold the cases, grouped by the
//! kind of fault. Case 15 (TLS) needs TLS nodes of its own and is tested in `tests/tls.rs` (end
//! to end) and the broker crate's `tests/tls.rs` (untrusted CA, wrong host name, expired
//! certificate, client certificate, no plaintext fallback).

mod harness;

mod bad_input;
mod broker;
mod consuming;
mod crashes;
mod lifecycle;
mod load;
mod monitoring;
mod parking;
mod privileges;
mod rollback;
mod standby;

use amqp_outbox_e2e::chaos::{pg_program, proc_stat_field, proc_state, proc_status_kb, TcpProxy};
use amqp_outbox_e2e::eventually;
use std::time::Duration;

/// Not a FAULTS.md case: the harness's own tools (proxy, memory, results file) work.
#[test]
fn chaos_support_tools_work() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let target = listener.local_addr().unwrap();
    let proxy = TcpProxy::start(target);
    let echo = std::thread::spawn(move || {
        use std::io::{Read, Write};
        let (mut s, _) = listener.accept().unwrap();
        let mut buf = [0u8; 5];
        s.read_exact(&mut buf).unwrap();
        s.write_all(&buf).unwrap();
    });
    {
        use std::io::{Read, Write};
        let mut c = std::net::TcpStream::connect(("127.0.0.1", proxy.port())).unwrap();
        c.write_all(b"hello").unwrap();
        let mut buf = [0u8; 5];
        c.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"hello");
    }
    echo.join().unwrap();
    assert_eq!(proxy.accepted(), 1);
    assert!(proc_status_kb(std::process::id() as i32, "VmHWM").unwrap() > 0);
    // Field 4 is the parent's pid, counted past a name that may hold spaces.
    // SAFETY: getppid has no preconditions.
    let parent = i64::from(unsafe { libc::getppid() });
    assert_eq!(proc_stat_field(std::process::id() as i32, 4), Some(parent));
    // A child that exited is a zombie until it is waited for, then gone.
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    eventually(
        Duration::from_secs(5),
        "a sleeping child",
        || match proc_state(pid) {
            Some('S') => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    child.kill().unwrap();
    eventually(Duration::from_secs(5), "a zombie", || {
        match proc_state(pid) {
            Some('Z') => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    child.wait().unwrap();
    assert_eq!(proc_state(pid), None);
    let _ = pg_program::<&str>;
}
