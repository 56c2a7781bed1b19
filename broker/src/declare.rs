//! Exchanges, queues, bindings and the acknowledgement queue, declared on every (re)connection
//! and again, on the live connection, for what a new configuration adds.

use crate::ack;
use crate::amqp_values::{to_field_table, truncate};
use crate::bridge::{Event, LogLevel};
use crate::config::{AckQueueConfig, BindingDecl, BrokerConfig, ExchangeDecl, QueueDecl};
use crate::connection::{describe_error, Redactor};
use crate::events::{spawn_guarded, EventSink};
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{Channel, Connection, ExchangeKind};
use std::sync::Arc;

/// Everything declared on (re)connection, in this order: exchanges, queues, bindings, then the
/// acknowledgement queue (`AckQueue` mode).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Decls {
    exchanges: Vec<ExchangeDecl>,
    queues: Vec<QueueDecl>,
    bindings: Vec<BindingDecl>,
    ack_queue: Option<AckQueueConfig>,
}

impl Decls {
    pub(crate) fn of(cfg: &BrokerConfig) -> Self {
        Decls {
            exchanges: cfg.exchanges.clone(),
            queues: cfg.queues.clone(),
            bindings: cfg.bindings.clone(),
            ack_queue: ack::queue_in_use(cfg).cloned(),
        }
    }

    /// What `self` has that `done` has not.
    pub(crate) fn minus(&self, done: &Decls) -> Decls {
        fn new<T: Clone + PartialEq>(all: &[T], done: &[T]) -> Vec<T> {
            all.iter().filter(|d| !done.contains(d)).cloned().collect()
        }
        Decls {
            exchanges: new(&self.exchanges, &done.exchanges),
            queues: new(&self.queues, &done.queues),
            bindings: new(&self.bindings, &done.bindings),
            ack_queue: self
                .ack_queue
                .clone()
                .filter(|q| done.ack_queue.as_ref() != Some(q)),
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.exchanges.is_empty()
            && self.queues.is_empty()
            && self.bindings.is_empty()
            && self.ack_queue.is_none()
    }
}

/// Declares, in a guarded task bounded by the connect timeout, what `all` has that `declared`
/// has not, on the live connection; `declared` becomes `all`.
pub(crate) fn declare_changes(
    conn: &Arc<Connection>,
    cfg: &BrokerConfig,
    declared: &mut Decls,
    sink: &EventSink,
    redactor: &Redactor,
) {
    let all = Decls::of(cfg);
    let new = all.minus(declared);
    *declared = all;
    if new.is_empty() {
        return;
    }
    let conn = conn.clone();
    let (id, limit, redactor, task_sink) = (
        cfg.broker_id,
        cfg.connect_timeout,
        redactor.clone(),
        sink.clone(),
    );
    spawn_guarded(
        sink.clone(),
        format!("broker {id}: declarations"),
        async move {
            let work = declare(&conn, &new, id, &task_sink, &redactor);
            if tokio::time::timeout(limit, work).await.is_err() {
                task_sink.send(Event::Log {
                    level: LogLevel::Warning,
                    message: format!("broker {id}: declaring exchanges and queues timed out"),
                });
            }
        },
    );
}

/// Declares on a channel of their own, so a failed declaration (which closes its channel) never
/// touches the publishing channel. A failure is a warning; the others are still declared.
pub(crate) async fn declare(
    conn: &Connection,
    decls: &Decls,
    broker_id: i32,
    sink: &EventSink,
    redactor: &Redactor,
) {
    let warn = |message: String| {
        sink.send(Event::Log {
            level: LogLevel::Warning,
            message: format!("broker {broker_id}: {}", redactor.clean(&message)),
        })
    };
    let mut channel: Option<Channel> = None;
    for d in &decls.exchanges {
        let Some(name) = short_name(&d.name, "exchange", &warn) else {
            continue;
        };
        let Some(ch) = usable_channel(conn, &mut channel, &warn).await else {
            return;
        };
        let options = ExchangeDeclareOptions {
            passive: d.passive,
            durable: d.durable,
            auto_delete: d.auto_delete,
            internal: false,
            nowait: false,
        };
        match ch
            .exchange_declare(name, exchange_kind(&d.kind), options, FieldTable::default())
            .await
        {
            Ok(()) => channel = Some(ch),
            // The broker closed that channel; the next declaration opens another.
            Err(e) => warn(format!(
                "cannot declare exchange \"{}\" ({}): {}",
                d.name,
                d.kind,
                describe_error(&e)
            )),
        }
    }
    let ack_queue = decls.ack_queue.as_ref().map(|q| QueueDecl {
        name: q.name.clone(),
        durable: true,
        auto_delete: false,
        arguments: ack::ack_queue_arguments(q),
    });
    for (d, what) in decls
        .queues
        .iter()
        .map(|d| (d, "queue"))
        .chain(ack_queue.iter().map(|d| (d, "acknowledgement queue")))
    {
        let Some(name) = short_name(&d.name, what, &warn) else {
            continue;
        };
        let args = match to_field_table(&d.arguments) {
            Ok(a) => a,
            Err(e) => {
                warn(format!(
                    "{what} \"{}\" not declared: arguments: {e}",
                    d.name
                ));
                continue;
            }
        };
        let Some(ch) = usable_channel(conn, &mut channel, &warn).await else {
            return;
        };
        let options = QueueDeclareOptions {
            passive: false,
            durable: d.durable,
            exclusive: false,
            auto_delete: d.auto_delete,
            nowait: false,
        };
        match ch.queue_declare(name, options, args).await {
            Ok(_) => channel = Some(ch),
            Err(e) => warn(format!(
                "cannot declare {what} \"{}\": {}",
                d.name,
                describe_error(&e)
            )),
        }
    }
    for b in &decls.bindings {
        let (Some(queue), Some(exchange), Some(key)) = (
            short_name(&b.queue, "binding queue", &warn),
            short_name(&b.exchange, "binding exchange", &warn),
            short_name(&b.routing_key, "binding routing key", &warn),
        ) else {
            continue;
        };
        let args = match to_field_table(&b.arguments) {
            Ok(a) => a,
            Err(e) => {
                warn(format!(
                    "binding of queue \"{}\" to exchange \"{}\" not declared: arguments: {e}",
                    b.queue, b.exchange
                ));
                continue;
            }
        };
        let Some(ch) = usable_channel(conn, &mut channel, &warn).await else {
            return;
        };
        match ch
            .queue_bind(queue, exchange, key, QueueBindOptions::default(), args)
            .await
        {
            Ok(()) => channel = Some(ch),
            Err(e) => warn(format!(
                "cannot bind queue \"{}\" to exchange \"{}\" with key \"{}\": {}",
                b.queue,
                b.exchange,
                b.routing_key,
                describe_error(&e)
            )),
        }
    }
    if let Some(ch) = channel {
        let _ = ch.close(200, "declared".into()).await;
    }
}

/// The name as a ShortString, or a warning when it is longer than 255 bytes.
fn short_name(name: &str, what: &str, warn: &impl Fn(String)) -> Option<ShortString> {
    match ShortString::try_new(name) {
        Ok(s) => Some(s),
        Err(_) => {
            warn(format!(
                "{what} name longer than 255 bytes, not declared: {}...",
                truncate(name, 40)
            ));
            None
        }
    }
}

/// The declaration channel: the open one, or a new one after a failed declaration closed it.
/// None (after a warning) when no channel can be opened.
async fn usable_channel(
    conn: &Connection,
    channel: &mut Option<Channel>,
    warn: &impl Fn(String),
) -> Option<Channel> {
    match channel.take() {
        Some(ch) if ch.status().connected() => Some(ch),
        _ => match conn.create_channel().await {
            Ok(ch) => Some(ch),
            Err(e) => {
                warn(format!(
                    "cannot open a channel to declare exchanges and queues: {}",
                    describe_error(&e)
                ));
                None
            }
        },
    }
}

fn exchange_kind(kind: &str) -> ExchangeKind {
    match kind {
        "direct" => ExchangeKind::Direct,
        "fanout" => ExchangeKind::Fanout,
        "topic" => ExchangeKind::Topic,
        "headers" => ExchangeKind::Headers,
        other => ExchangeKind::Custom(other.to_string()),
    }
}
