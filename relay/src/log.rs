//! Log lines to stderr, one per line, naming the database they are about: what a service
//! manager (systemd's journal, a container's log) collects.

use amqp_outbox_engine::telemetry::Level;
use std::io::Write;

/// Where one database's lines go.
#[derive(Clone)]
pub struct Log {
    /// The database as the lines name it (`user@host:port/database`).
    pub target: String,
    pub verbose: bool,
}

impl Log {
    pub fn line(&self, level: Level, text: &str) {
        let label = match level {
            Level::Debug if !self.verbose => return,
            Level::Debug => "DEBUG",
            Level::Log => "LOG",
            Level::Warning => "WARNING",
        };
        // The engine's lines say `amqp_outbox: `; the process is named already.
        let text = text.strip_prefix("amqp_outbox: ").unwrap_or(text);
        // One write per line, so that the threads' lines never interleave; a closed stderr
        // stops nothing.
        let line = format!("{label}: [{}] {text}\n", self.target);
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }

    pub fn log(&self, text: &str) {
        self.line(Level::Log, text);
    }

    pub fn warning(&self, text: &str) {
        self.line(Level::Warning, text);
    }

    pub fn debug(&self, text: &str) {
        self.line(Level::Debug, text);
    }
}
