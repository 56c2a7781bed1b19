//! The rows of `amqp.broker` and of the declaration tables as the host read them, NULLs as
//! NULLs: what [`crate::outbox::Outbox::broker_tables`] returns and
//! [`crate::brokers::assemble`] makes a configuration of.

/// One row of `amqp.broker`, NULLs as NULLs (the defaults are applied in
/// [`crate::brokers::assemble`]).
#[derive(Debug, Default, Clone)]
pub struct HostRow {
    pub broker_id: i32,
    pub host: Option<String>,
    pub port: Option<i32>,
    pub vhost: Option<String>,
    pub username: Option<String>,
    pub password: Option<String>,
    pub proof: Option<String>,
    pub tls: Option<bool>,
    pub tls_ca_file: Option<String>,
    pub tls_cert_file: Option<String>,
    pub tls_key_file: Option<String>,
    pub tls_server_name: Option<String>,
}

/// One row of `amqp.exchange`.
#[derive(Debug, Default, Clone)]
pub struct ExchangeRow {
    pub broker_id: i32,
    pub exchange: Option<String>,
    pub exchange_type: Option<String>,
    pub passive: Option<bool>,
    pub durable: Option<bool>,
    pub auto_delete: Option<bool>,
}

/// One row of `amqp.queue` (its arguments as jsonb's text).
#[derive(Debug, Default, Clone)]
pub struct QueueRow {
    pub broker_id: i32,
    pub queue: Option<String>,
    pub durable: Option<bool>,
    pub auto_delete: Option<bool>,
    pub arguments: Option<String>,
}

/// One row of `amqp.binding` (its arguments as jsonb's text).
#[derive(Debug, Default, Clone)]
pub struct BindingRow {
    pub broker_id: i32,
    pub queue: Option<String>,
    pub exchange: Option<String>,
    pub routing_key: Option<String>,
    pub arguments: Option<String>,
}

/// The four tables, each in the order its statement reads it.
#[derive(Debug, Default, Clone)]
pub struct BrokerTables {
    pub hosts: Vec<HostRow>,
    pub exchanges: Vec<ExchangeRow>,
    pub queues: Vec<QueueRow>,
    pub bindings: Vec<BindingRow>,
}
