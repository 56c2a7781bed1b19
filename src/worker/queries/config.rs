//! Reads the configuration the AMQP thread works with: `amqp.broker` and the declarations of
//! `amqp.exchange`, `amqp.queue` and `amqp.binding` (the engine's statements), into the
//! engine's rows; the engine makes the configuration of them ([`brokers::assemble`]).

use crate::worker::host::WorkerTelemetry;
use amqp_outbox_broker::BrokerConfig;
use amqp_outbox_engine::brokers::{self, BindingRow, BrokerTables, ExchangeRow, HostRow, QueueRow};
use amqp_outbox_engine::statements;
use pgrx::spi::{SpiClient, SpiResult};

/// The brokers (hosts grouped by broker_id, in a stable order) and their declarations.
pub fn load_brokers(
    client: &SpiClient<'_>,
    template: &BrokerConfig,
) -> SpiResult<Vec<BrokerConfig>> {
    Ok(brokers::assemble(
        broker_tables(client)?,
        template,
        &WorkerTelemetry,
    ))
}

/// The four tables, as read in this transaction.
pub fn broker_tables(client: &SpiClient<'_>) -> SpiResult<BrokerTables> {
    let mut tables = BrokerTables::default();
    for r in client.select(statements::BROKER_HOSTS_SQL, None, &[])? {
        tables.hosts.push(HostRow {
            broker_id: r.get::<i32>(1)?.unwrap_or_default(),
            host: r.get(2)?,
            port: r.get(3)?,
            vhost: r.get(4)?,
            username: r.get(5)?,
            password: r.get(6)?,
            proof: r.get(7)?,
            tls: r.get(8)?,
            tls_ca_file: r.get(9)?,
            tls_cert_file: r.get(10)?,
            tls_key_file: r.get(11)?,
            tls_server_name: r.get(12)?,
        });
    }
    for r in client.select(statements::EXCHANGES_SQL, None, &[])? {
        tables.exchanges.push(ExchangeRow {
            broker_id: r.get::<i32>(1)?.unwrap_or_default(),
            exchange: r.get(2)?,
            exchange_type: r.get(3)?,
            passive: r.get(4)?,
            durable: r.get(5)?,
            auto_delete: r.get(6)?,
        });
    }
    for r in client.select(statements::QUEUES_SQL, None, &[])? {
        tables.queues.push(QueueRow {
            broker_id: r.get::<i32>(1)?.unwrap_or_default(),
            queue: r.get(2)?,
            durable: r.get(3)?,
            auto_delete: r.get(4)?,
            arguments: r.get(5)?,
        });
    }
    for r in client.select(statements::BINDINGS_SQL, None, &[])? {
        tables.bindings.push(BindingRow {
            broker_id: r.get::<i32>(1)?.unwrap_or_default(),
            queue: r.get(2)?,
            exchange: r.get(3)?,
            routing_key: r.get(4)?,
            arguments: r.get(5)?,
        });
    }
    Ok(tables)
}
