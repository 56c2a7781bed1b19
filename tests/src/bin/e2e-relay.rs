//! The relay's command, built with the tests under a name of its own (cargo keeps it current
//! for them: `CARGO_BIN_EXE_e2e-relay`): the same program as relay/src/main.rs.

fn main() -> std::process::ExitCode {
    amqp_outbox_relay::cli::main()
}
