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

    /// Adds what `other` has (without repeating what `self` has).
    fn merge(&mut self, other: Decls) {
        fn add<T: PartialEq>(to: &mut Vec<T>, from: Vec<T>) {
            for d in from {
                if !to.contains(&d) {
                    to.push(d);
                }
            }
        }
        add(&mut self.exchanges, other.exchanges);
        add(&mut self.queues, other.queues);
        add(&mut self.bindings, other.bindings);
        if other.ack_queue.is_some() {
            self.ack_queue = other.ack_queue;
        }
    }
}

/// The declarations made on a live connection as configurations change: one batch at a time,
/// in the order the configurations came (a `queue_bind()` committed right after its
/// `queue_declare()` must not overtake it), and what the broker refused, to be tried again.
#[derive(Clone, Default)]
pub(crate) struct Changes(Arc<ChangesInner>);

#[derive(Default)]
struct ChangesInner {
    turn: tokio::sync::Mutex<()>,
    failed: std::sync::Mutex<Decls>,
}

impl Changes {
    /// What was refused since the last call (the caller declares it again later).
    pub(crate) fn take_failed(&self) -> Decls {
        self.0
            .failed
            .lock()
            .map(|mut f| std::mem::take(&mut *f))
            .unwrap_or_default()
    }

    fn failed(&self, decls: Decls) {
        if let Ok(mut f) = self.0.failed.lock() {
            f.merge(decls);
        }
    }
}

/// Declares, in a guarded task bounded by the connect timeout, what `all` has that `declared`
/// has not, on the live connection, after the batches `changes` started before; `declared`
/// becomes `all`, and what the broker refuses goes to `changes` (see [`Changes::take_failed`]).
pub(crate) fn declare_changes(
    conn: &Arc<Connection>,
    cfg: &BrokerConfig,
    declared: &mut Decls,
    sink: &EventSink,
    redactor: &Redactor,
    changes: &Changes,
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
    spawn_guarded(sink.clone(), format!("broker {id}: declarations"), {
        let changes = changes.clone();
        async move {
            let _turn = changes.0.turn.lock().await;
            let work = declare(&conn, &new, id, &task_sink, &redactor);
            match tokio::time::timeout(limit, work).await {
                Ok(failed) => changes.failed(failed),
                Err(_) => {
                    // Not known to be declared: all of it is tried again.
                    changes.failed(new.clone());
                    task_sink.send(Event::Log {
                        level: LogLevel::Warning,
                        message: format!("broker {id}: declaring exchanges and queues timed out"),
                    });
                }
            }
        }
    });
}

/// Declares on a channel of their own, so a failed declaration (which closes its channel) never
/// touches the publishing channel. A failure is a warning; the others are still declared.
/// Returns what the broker refused (or what could not be tried: no channel), which can succeed
/// later (a binding whose queue someone declares after it); not what can never be sent.
pub(crate) async fn declare(
    conn: &Connection,
    decls: &Decls,
    broker_id: i32,
    sink: &EventSink,
    redactor: &Redactor,
) -> Decls {
    let mut failed = Decls::default();
    let warn = |message: String| {
        sink.send(Event::Log {
            level: LogLevel::Warning,
            message: format!("broker {broker_id}: {}", redactor.clean(&message)),
        })
    };
    let mut channel: Option<Channel> = None;
    let channel = &mut channel;
    for d in &decls.exchanges {
        let Some(name) = short_name(&d.name, "exchange", &warn) else {
            continue;
        };
        let options = ExchangeDeclareOptions {
            passive: d.passive,
            durable: d.durable,
            auto_delete: d.auto_delete,
            internal: false,
            nowait: false,
        };
        let kind = exchange_kind(&d.kind);
        let done = on_channel(conn, channel, &warn, |ch| async move {
            ch.exchange_declare(name, kind, options, FieldTable::default())
                .await
        })
        .await;
        if let Some(Err(e)) = done {
            warn(format!(
                "cannot declare exchange \"{}\" ({}): {e}",
                d.name, d.kind
            ));
            failed.exchanges.push(d.clone());
        } else if done.is_none() {
            // No channel: none of it is known to be declared.
            return decls.clone();
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
        let Some(args) = arguments(&d.arguments, &warn, || format!("{what} \"{}\"", d.name)) else {
            continue;
        };
        let options = QueueDeclareOptions {
            passive: false,
            durable: d.durable,
            exclusive: false,
            auto_delete: d.auto_delete,
            nowait: false,
        };
        let done = on_channel(conn, channel, &warn, |ch| async move {
            ch.queue_declare(name, options, args).await
        })
        .await;
        if let Some(Err(e)) = done {
            warn(format!("cannot declare {what} \"{}\": {e}", d.name));
            if what == "queue" {
                failed.queues.push(d.clone());
            } else {
                failed.ack_queue = decls.ack_queue.clone();
            }
        } else if done.is_none() {
            // No channel: none of it is known to be declared.
            return decls.clone();
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
        let Some(args) = arguments(&b.arguments, &warn, || {
            format!(
                "binding of queue \"{}\" to exchange \"{}\"",
                b.queue, b.exchange
            )
        }) else {
            continue;
        };
        let done = on_channel(conn, channel, &warn, |ch| async move {
            ch.queue_bind(queue, exchange, key, QueueBindOptions::default(), args)
                .await
        })
        .await;
        if let Some(Err(e)) = done {
            warn(format!(
                "cannot bind queue \"{}\" to exchange \"{}\" with key \"{}\": {e}",
                b.queue, b.exchange, b.routing_key
            ));
            failed.bindings.push(b.clone());
        } else if done.is_none() {
            // No channel: none of it is known to be declared.
            return decls.clone();
        }
    }
    if let Some(ch) = channel.take() {
        let _ = ch.close(200, "declared".into()).await;
    }
    failed
}

/// Runs one declaration on the declaration channel: `None` when no channel can be opened
/// (nothing more can be declared), else whether the broker took it (its error described). A
/// refusal closes that channel; the next declaration opens another.
async fn on_channel<T, Fut>(
    conn: &Connection,
    channel: &mut Option<Channel>,
    warn: &impl Fn(String),
    op: impl FnOnce(Channel) -> Fut,
) -> Option<Result<(), String>>
where
    Fut: std::future::Future<Output = lapin::Result<T>>,
{
    let ch = usable_channel(conn, channel, warn).await?;
    match op(ch.clone()).await {
        Ok(_) => {
            *channel = Some(ch);
            Some(Ok(()))
        }
        Err(e) => Some(Err(describe_error(&e))),
    }
}

/// The arguments as an AMQP table, or a warning that `what` is not declared.
fn arguments(
    args: &serde_json::Map<String, serde_json::Value>,
    warn: &impl Fn(String),
    what: impl FnOnce() -> String,
) -> Option<FieldTable> {
    match to_field_table(args) {
        Ok(a) => Some(a),
        Err(e) => {
            warn(format!("{} not declared: arguments: {e}", what()));
            None
        }
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
