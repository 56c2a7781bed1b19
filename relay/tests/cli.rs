//! The command line's output when its reader is gone: `amqp-outbox-relay --help | head -1`
//! must not end in a panic and a backtrace.

use std::process::{Command, Stdio};

#[test]
fn help_version_and_check_to_a_closed_pipe_exit_cleanly() {
    for args in [
        &["--help"][..],
        &["--version"][..],
        &["--check", "--database", "postgresql://relay@db.example/app"][..],
    ] {
        // The reading end is closed before the relay starts: its first write fails (EPIPE).
        let (reader, writer) = std::io::pipe().expect("a pipe");
        drop(reader);
        let out = Command::new(env!("CARGO_BIN_EXE_amqp-outbox-relay"))
            .args(args)
            .stdout(writer)
            .stderr(Stdio::piped())
            .output()
            .expect("run the relay");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {:?}, {stderr}", out.status);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}
