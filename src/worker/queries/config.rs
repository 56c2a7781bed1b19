//! Reads the configuration the AMQP thread works with: `amqp.broker` (hosts grouped by
//! broker_id) and the declarations of `amqp.exchange`, `amqp.queue` and `amqp.binding`.

use amqp_outbox_broker::{
    BindingDecl, BrokerConfig, Endpoint, ExchangeDecl, ProofMode, QueueDecl, TlsOptions,
};
use pgrx::prelude::*;
use pgrx::spi::{SpiClient, SpiResult};
use std::collections::BTreeMap;

/// The brokers (hosts grouped by broker_id, in a stable order) and their declarations.
pub fn load_brokers(
    client: &SpiClient<'_>,
    template: &BrokerConfig,
) -> SpiResult<Vec<BrokerConfig>> {
    let mut brokers: BTreeMap<i32, BrokerConfig> = BTreeMap::new();
    let hosts = client.select(
        "SELECT broker_id, host, port, vhost, username, password, proof, \
                tls, tls_ca_file, tls_cert_file, tls_key_file, tls_server_name \
           FROM amqp.broker ORDER BY broker_id, host, port",
        None,
        &[],
    )?;
    for r in hosts {
        let broker_id = r.get::<i32>(1)?.unwrap_or_default();
        let port = r.get::<i32>(3)?.unwrap_or(5672);
        let endpoint = Endpoint {
            host: r.get::<String>(2)?.unwrap_or_default(),
            port: u16::try_from(port).unwrap_or(5672),
            vhost: r.get::<String>(4)?.unwrap_or_else(|| "/".into()),
            username: r.get::<String>(5)?.unwrap_or_else(|| "guest".into()),
            password: r.get::<String>(6)?.unwrap_or_else(|| "guest".into()),
            tls: if r.get::<bool>(8)?.unwrap_or(false) {
                Some(TlsOptions {
                    ca_file: r.get::<String>(9)?,
                    cert_file: r.get::<String>(10)?,
                    key_file: r.get::<String>(11)?,
                    server_name: r.get::<String>(12)?,
                })
            } else {
                None
            },
        };
        // The first host row of a broker decides its proof mode.
        let proof = match r.get::<String>(7)?.as_deref() {
            Some("confirm") => ProofMode::Confirm,
            _ => ProofMode::AckQueue,
        };
        brokers
            .entry(broker_id)
            .or_insert_with(|| BrokerConfig {
                broker_id,
                proof,
                ..template.clone()
            })
            .hosts
            .push(endpoint);
    }
    let exchanges = client.select(
        "SELECT broker_id, exchange, exchange_type, passive, durable, auto_delete \
           FROM amqp.exchange ORDER BY broker_id, exchange",
        None,
        &[],
    )?;
    for r in exchanges {
        let broker_id = r.get::<i32>(1)?.unwrap_or_default();
        if let Some(b) = brokers.get_mut(&broker_id) {
            b.exchanges.push(ExchangeDecl {
                name: r.get::<String>(2)?.unwrap_or_default(),
                kind: r.get::<String>(3)?.unwrap_or_else(|| "direct".into()),
                passive: r.get::<bool>(4)?.unwrap_or(false),
                durable: r.get::<bool>(5)?.unwrap_or(true),
                auto_delete: r.get::<bool>(6)?.unwrap_or(false),
            });
        }
    }
    let queues = client.select(
        "SELECT broker_id, queue, durable, auto_delete, arguments::text FROM amqp.queue \
          ORDER BY broker_id, queue",
        None,
        &[],
    )?;
    for r in queues {
        let broker_id = r.get::<i32>(1)?.unwrap_or_default();
        let name = r.get::<String>(2)?.unwrap_or_default();
        let Some(arguments) = declaration_arguments(r.get::<String>(5)?, "queue", &name) else {
            continue;
        };
        if let Some(b) = brokers.get_mut(&broker_id) {
            b.queues.push(QueueDecl {
                name,
                durable: r.get::<bool>(3)?.unwrap_or(true),
                auto_delete: r.get::<bool>(4)?.unwrap_or(false),
                arguments,
            });
        }
    }
    let bindings = client.select(
        "SELECT broker_id, queue, exchange, routing_key, arguments::text FROM amqp.binding \
          ORDER BY broker_id, queue, exchange, routing_key",
        None,
        &[],
    )?;
    for r in bindings {
        let broker_id = r.get::<i32>(1)?.unwrap_or_default();
        let queue = r.get::<String>(2)?.unwrap_or_default();
        let Some(arguments) =
            declaration_arguments(r.get::<String>(5)?, "binding of queue", &queue)
        else {
            continue;
        };
        if let Some(b) = brokers.get_mut(&broker_id) {
            b.bindings.push(BindingDecl {
                queue,
                exchange: r.get::<String>(3)?.unwrap_or_default(),
                routing_key: r.get::<String>(4)?.unwrap_or_default(),
                arguments,
            });
        }
    }
    Ok(brokers.into_values().collect())
}

/// A declaration's arguments, or `None` (with a warning) when they cannot be sent: a number
/// out of range, nesting deeper than the parser allows. Such a declaration is left out; the
/// others, and publishing, go on.
fn declaration_arguments(
    text: Option<String>,
    what: &str,
    name: &str,
) -> Option<serde_json::Map<String, serde_json::Value>> {
    match crate::headers::json_object(text.as_deref()) {
        Ok(map) => Some(map),
        Err(why) => {
            warning!("amqp_outbox: {what} {name:?} is not declared: its arguments {why}");
            None
        }
    }
}
