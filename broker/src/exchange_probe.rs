//! Whether an exchange exists, asked before the first publish to it on a connection. A publish
//! to a missing exchange makes the broker close the publishing channel (404), and with it go
//! the confirms of every good message published around it: those are published again, late
//! and twice. A passive declare on a channel of its own finds the missing exchange instead,
//! and costs only that channel.

use lapin::options::ExchangeDeclareOptions;
use lapin::protocol::AMQPErrorKind;
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ErrorKind, ExchangeKind};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

/// Exchanges remembered per connection; past this the set starts again (a probe is cheap).
const KNOWN_MAX: usize = 10_000;

pub(crate) enum Probe {
    Exists,
    /// The broker says the exchange does not exist (its error, for the message's last_error).
    Missing(lapin::Error),
    /// No answer in time, or another error: publish as usual and let the channel tell.
    Unknown,
}

pub(crate) struct ExchangeProbe {
    conn: Arc<Connection>,
    channel: Option<Channel>,
    /// Exchanges not to ask about again on this connection (found, or not askable).
    known: HashSet<String>,
    timeout: Duration,
}

impl ExchangeProbe {
    pub(crate) fn new(conn: Arc<Connection>, timeout: Duration) -> Self {
        ExchangeProbe {
            conn,
            channel: None,
            known: HashSet::new(),
            timeout,
        }
    }

    pub(crate) async fn check(&mut self, exchange: &str) -> Probe {
        // The default exchange and the predefined amq.* ones always exist.
        if exchange.is_empty() || exchange.starts_with("amq.") || self.known.contains(exchange) {
            return Probe::Exists;
        }
        let channel = match self.channel.take() {
            Some(ch) if ch.status().connected() => ch,
            _ => match tokio::time::timeout(self.timeout, self.conn.create_channel()).await {
                Ok(Ok(ch)) => ch,
                _ => return Probe::Unknown,
            },
        };
        let declare = channel.exchange_declare(
            exchange.into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions {
                passive: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        );
        match tokio::time::timeout(self.timeout, declare).await {
            Ok(Ok(())) => {
                self.remember(exchange);
                self.channel = Some(channel);
                Probe::Exists
            }
            // The broker closed the probe channel; the next probe opens another.
            Ok(Err(e)) if is_not_found(&e) => Probe::Missing(e),
            // Another refusal (a user without the right to ask, say): not asked again on this
            // connection, so that every publish does not cost a channel; the publish tells.
            Ok(Err(_)) => {
                self.remember(exchange);
                Probe::Unknown
            }
            Err(_) => Probe::Unknown,
        }
    }
}

impl ExchangeProbe {
    fn remember(&mut self, exchange: &str) {
        if self.known.len() >= KNOWN_MAX {
            self.known.clear();
        }
        self.known.insert(exchange.to_string());
    }
}

fn is_not_found(e: &lapin::Error) -> bool {
    matches!(e.kind(), ErrorKind::ProtocolError(a)
        if matches!(a.kind(), AMQPErrorKind::Soft(_)) && a.get_id() == 404)
}
