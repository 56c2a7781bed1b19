//! The command `amqp-outbox-relay`: arguments, `--help`, one thread per database, the exit
//! status. (In the library so that the end-to-end tests run the very same program.)

use crate::config::{self, Command, Config};
use crate::{connect, database, stop};
use std::process::ExitCode;

fn help() -> String {
    let mut settings = String::new();
    for (name, what) in config::SETTINGS {
        settings.push_str(&format!("  {name:<20} {what}\n"));
    }
    format!(
        "amqp-outbox-relay {version}: delivers amqp_outbox's messages from PostgreSQL without
the extension's library (the plain-SQL install), with publisher confirms and proof of delivery.
Any number may run against one database: one delivers, the others stand by.

Usage: amqp-outbox-relay [OPTIONS]
  -c, --config FILE      TOML file: databases = [\"postgresql://...\"] and [settings]
  -d, --database URL     a database to serve (repeatable; replaces the file's list)
  -s, --set NAME=VALUE   a setting (overrides the file and the environment)
  -v, --verbose          debug lines too
      --check            print the configuration and stop
  -h, --help, -V, --version

Environment: {config_env} (the file), {databases_env} (URLs separated
by spaces), {prefix}<SETTING> (e.g. {prefix}BATCH_SIZE=200).
Times take units: 250ms, 30s, 5min.
Settings (the extension's amqp_outbox.* names and defaults):
{settings}Stops cleanly on SIGTERM or SIGINT. Logs to stderr.",
        version = env!("CARGO_PKG_VERSION"),
        config_env = config::CONFIG_ENV,
        databases_env = config::DATABASES_ENV,
        prefix = config::SETTING_ENV_PREFIX,
    )
}

fn check(config: &Config) -> String {
    let mut text = String::from("databases:\n");
    for url in &config.databases {
        text.push_str(&format!("  {}\n", connect::target(url)));
    }
    text.push_str(&format!("settings: {:?}\n", config.settings));
    text.push_str(&format!(
        "keep production log: {}, takeover every: {:?}",
        config.keep_log, config.takeover_every
    ));
    text
}

/// Writes `text` and a newline to stdout. A reader that went away (`--help | head`) is not an
/// error of ours: what it did not read is dropped (println! would panic).
fn say(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{text}").and_then(|()| out.flush());
}

/// Runs the relay with the process's arguments and environment until SIGTERM or SIGINT.
pub fn main() -> ExitCode {
    ExitCode::from(run())
}

/// [`main`]'s exit status: 0 after a clean stop, 1 when a thread failed, 2 for a configuration
/// error. (What a program embedding the relay passes to `std::process::exit`.)
pub fn run() -> u8 {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let config = match config::parse(&args, &|k| std::env::var(k).ok()) {
        Ok(Command::Help) => {
            say(&help());
            return 0;
        }
        Ok(Command::Version) => {
            say(&format!("amqp-outbox-relay {}", env!("CARGO_PKG_VERSION")));
            return 0;
        }
        Ok(Command::Check(config)) => {
            say(&check(&config));
            return 0;
        }
        Ok(Command::Run(config)) => config,
        Err(e) => {
            eprintln!("amqp-outbox-relay: {e}");
            return 2;
        }
    };
    if let Err(e) = stop::install() {
        eprintln!("amqp-outbox-relay: cannot install the signal handlers: {e}");
        return 1;
    }
    let config: &'static Config = Box::leak(config);
    let threads: Vec<_> = config
        .databases
        .iter()
        .map(|url| {
            std::thread::Builder::new()
                .name("database".into())
                .spawn(move || database::serve(url, config))
        })
        .collect();
    let mut code = 0;
    for t in threads {
        match t {
            Ok(t) => {
                if t.join().is_err() {
                    code = 1;
                }
            }
            Err(e) => {
                eprintln!("amqp-outbox-relay: cannot start a thread: {e}");
                stop::request();
                code = 1;
            }
        }
    }
    code
}
