//! Connections to PostgreSQL: the relay's defaults on top of the user's connection string, and
//! a name for the logs that shows no password.

use crate::config::PostgresTls;
use postgres::config::{Host, SslMode};
use postgres::{Client, Config, NoTls};
use std::time::Duration;

/// Shown in `pg_stat_activity` unless the connection string names another.
pub const APPLICATION_NAME: &str = "amqp-outbox-relay";

/// A connection that stops answering is given up after this (unless the connection string
/// sets `tcp_user_timeout`): well inside the lease ([`crate::lease::LEASE`]), so a relay cut
/// off from its database stops acting before another can take over.
const TCP_USER_TIMEOUT: Duration = Duration::from_secs(5);

/// Parses `url` (a URL or `key=value` pairs, as libpq takes them, `sslmode` with libpq's
/// meanings: [`crate::tls`]) and connects.
pub fn connect(url: &str, tls: &PostgresTls) -> Result<Client, String> {
    let (url, verify) = crate::tls::verifying_mode(url);
    let url = url.as_str();
    let mut config: Config = url
        .parse()
        .map_err(|e| format!("the connection string of {}: {e}", target(url)))?;
    if config.get_application_name().is_none() {
        config.application_name(APPLICATION_NAME);
    }
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(Duration::from_secs(10));
    }
    if config.get_tcp_user_timeout().is_none() {
        config.tcp_user_timeout(TCP_USER_TIMEOUT);
    }
    config.keepalives_idle(Duration::from_secs(5));
    let connected = if config.get_ssl_mode() == SslMode::Disable {
        config.connect(NoTls)
    } else {
        let host = match config.get_hosts().first() {
            Some(Host::Tcp(h)) => h.clone(),
            _ => "localhost".into(),
        };
        let connector = crate::tls::connector(tls, verify, &host)
            .map_err(|e| format!("TLS to {}: {e}", target(url)))?;
        config.connect(connector)
    };
    connected.map_err(|e| format!("cannot connect to {}: {}", target(url), describe(&e)))
}

/// An error as the logs say it: the server's message and detail (`postgres::Error` alone says
/// only "db error"), or the client's error and its cause.
pub fn describe(e: &postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        let mut text = format!("{}: {} ({})", db.severity(), db.message(), db.code().code());
        if let Some(detail) = db.detail() {
            text.push_str(": ");
            text.push_str(detail);
        }
        return text;
    }
    match std::error::Error::source(e) {
        Some(cause) => format!("{e}: {cause}"),
        None => e.to_string(),
    }
}

/// `user@host:port/database` of a connection string, for the logs (never its password).
pub fn target(url: &str) -> String {
    let Ok(config) = url.parse::<Config>() else {
        return "(a connection string that cannot be parsed)".into();
    };
    let host = match config.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        Some(Host::Unix(p)) => p.display().to_string(),
        None => "localhost".into(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    format!(
        "{}@{host}:{port}/{}",
        config.get_user().unwrap_or("?"),
        config.get_dbname().unwrap_or("?")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_logs_never_show_a_password() {
        let t = target("postgresql://app:secret@db.example.com:6543/orders?sslmode=disable");
        assert_eq!(t, "app@db.example.com:6543/orders");
        let t = target("host=h port=1 user=u password=secret dbname=d");
        assert_eq!(t, "u@h:1/d");
        assert!(!target("postgresql://u:secret@").contains("secret"));
    }
}
