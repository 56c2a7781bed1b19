//! `amqp-outbox-relay`: publishes what the plain-SQL install's `amqp.publish()` wrote, with the
//! proof of delivery of the extension's background worker, for PostgreSQL that cannot load the
//! extension's library.

fn main() -> std::process::ExitCode {
    amqp_outbox_relay::cli::main()
}
