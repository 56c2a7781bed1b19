//! What the delivery tells the operator: counters (the extension keeps them in shared memory,
//! for `amqp.outbox_status`) and log lines (the server log). The host decides where they go, so
//! the delivery never calls PostgreSQL to say something.

/// The delivery's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    /// Messages handed to the AMQP thread (suspects published alone are not counted again).
    Published,
    /// Messages the broker confirmed.
    Confirmed,
    /// Messages whose acknowledgement came back through the acknowledgement queue.
    Acknowledged,
    /// Publishes the broker refused, or that could never be sent.
    Failed,
    /// Messages parked.
    Parked,
    /// Messages published again because a later one of their channel was acknowledged first.
    ResentGap,
    /// Messages published again because no proof came within `resend_after`.
    ResentTimeout,
}

/// How much a log line matters (PostgreSQL's DEBUG1, LOG and WARNING).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Debug,
    Log,
    Warning,
}

/// Where the delivery's counters and log lines go.
pub trait Telemetry {
    /// Adds `n` to `counter`.
    fn count(&self, counter: Counter, n: u64);
    /// Writes one line to the log (the text is complete, `amqp_outbox: ` prefix included).
    fn log(&self, level: Level, text: &str);
}
