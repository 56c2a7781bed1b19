//! Opening and closing one connection to one host: the URI (built field by field, so no
//! string ever holds the password), TLS when configured, the connect timeout.

use super::redact::Redactor;
use super::tls;
use crate::config::{BrokerConfig, Endpoint};
use lapin::uri::{AMQPAuthority, AMQPQueryString, AMQPUri, AMQPUserInfo};
use lapin::{Connection, ConnectionProperties};
use std::time::Duration;

/// Bound on a clean close (channel.close / connection.close) before the socket is just dropped.
pub(crate) const CLOSE_WAIT: Duration = Duration::from_secs(2);

pub(crate) fn uri_for(ep: &Endpoint, cfg: &BrokerConfig) -> AMQPUri {
    // Built field by field: no URI string holding the password is ever formatted.
    AMQPUri {
        scheme: tls::scheme_of(ep),
        authority: AMQPAuthority {
            userinfo: AMQPUserInfo {
                username: ep.username.clone(),
                password: ep.password.clone(),
            },
            host: ep.host.clone(),
            port: ep.port,
        },
        vhost: ep.vhost.clone(),
        query: AMQPQueryString {
            heartbeat: Some(cfg.heartbeat_secs),
            connection_timeout: u64::try_from(cfg.connect_timeout.as_millis())
                .ok()
                .filter(|ms| *ms > 0),
            ..AMQPQueryString::default()
        },
    }
}

/// Opens a connection to one host (TLS when configured), named for RabbitMQ's connection list,
/// within the connect timeout (built here, inside the runtime). Errors carry no password.
/// `sanitize`: for a consumer, whose deliveries may carry short strings lapin cannot read (see
/// `sanitize.rs`).
pub(crate) async fn open_connection(
    ep: &Endpoint,
    cfg: &BrokerConfig,
    role: &str,
    sanitize: bool,
) -> Result<Connection, String> {
    let props = ConnectionProperties::default().with_connection_name(
        format!(
            "amqp_outbox {role} {} (pid {})",
            cfg.broker_id,
            std::process::id()
        )
        .into(),
    );
    let limit = cfg.connect_timeout;
    match tokio::time::timeout(limit, tls::connect(ep, uri_for(ep, cfg), props, sanitize)).await {
        Err(_) => Err(format!("connection timed out after {limit:?}")),
        Ok(Err(e)) => Err(Redactor::new(std::slice::from_ref(ep)).clean_secrets(&e)),
        Ok(Ok(c)) => Ok(c),
    }
}

/// A clean close when the broker answers, bounded when it does not.
pub(crate) async fn close_connection(conn: &Connection) {
    if conn.status().connected() {
        let _ = tokio::time::timeout(CLOSE_WAIT, conn.close(200, "OK".into())).await;
    }
}

/// The frame size to fit content headers into: the negotiated one (0 would mean "no limit",
/// which RabbitMQ never negotiates; taken as the protocol's largest frame).
pub(crate) fn frame_limit(negotiated: u32) -> usize {
    if negotiated == 0 {
        u32::MAX as usize
    } else {
        negotiated as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::fixtures::{broker_config, endpoint};

    #[test]
    fn endpoint_debug_has_no_password() {
        let e = endpoint("h", "hunter2");
        assert!(!format!("{e:?}").contains("hunter2"));
        let uri = uri_for(&e, &broker_config(vec![e.clone()]));
        assert_eq!(uri.scheme, lapin::uri::AMQPScheme::AMQP);
        assert_eq!(uri.query.heartbeat, Some(7));
        assert_eq!(uri.query.connection_timeout, Some(3000));
        assert_eq!(uri.vhost, "/");
    }
}
