//! The supervisor only routes: it keeps one task per configured `broker_id` (see `session`),
//! starts, reconfigures and retires them as the configuration changes, and hands each command to
//! its broker's task.

use crate::batch::Batch;
use crate::bridge::{Command, Event, LogLevel};
use crate::config::BrokerConfig;
use crate::events::EventSink;
use crate::session::{self, BrokerCmd, Shared};
use std::collections::HashMap;
use std::time::Duration;
use tokio::sync::mpsc::{self, error::SendError};
use tokio::task::JoinHandle;

/// Bound on the whole shutdown of every broker task.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(5);

struct Slot {
    config: BrokerConfig,
    tx: mpsc::UnboundedSender<BrokerCmd>,
    task: JoinHandle<Option<()>>,
}

impl Slot {
    fn start(config: BrokerConfig, sink: EventSink, shared: Shared) -> Slot {
        let (tx, task) = session::start(config.clone(), sink, shared);
        Slot { config, tx, task }
    }
}

/// Runs until `Command::Shutdown` (or until the worker drops its handle).
pub(crate) async fn run(mut commands: mpsc::UnboundedReceiver<Command>, sink: EventSink) {
    // One session and one record tracker per AMQP thread (see `ack`).
    let shared = Shared::new();
    let mut brokers: HashMap<i32, Slot> = HashMap::new();
    // Removed brokers still closing; awaited (bounded) at shutdown.
    let mut retiring: Vec<JoinHandle<Option<()>>> = Vec::new();

    while let Some(cmd) = commands.recv().await {
        match cmd {
            Command::Configure(configs) => {
                let mut wanted: HashMap<i32, BrokerConfig> = HashMap::new();
                for c in configs {
                    if wanted.contains_key(&c.broker_id) {
                        sink.send(Event::Log {
                            level: LogLevel::Warning,
                            message: format!(
                                "broker {} is configured twice; using the last entry",
                                c.broker_id
                            ),
                        });
                    }
                    wanted.insert(c.broker_id, c);
                }
                let removed: Vec<i32> = brokers
                    .keys()
                    .filter(|id| !wanted.contains_key(id))
                    .copied()
                    .collect();
                for id in removed {
                    if let Some(slot) = brokers.remove(&id) {
                        let _ = slot.tx.send(BrokerCmd::Shutdown);
                        retiring.push(slot.task);
                    }
                }
                for (id, config) in wanted {
                    match brokers.get_mut(&id) {
                        Some(slot) if !slot.task.is_finished() => {
                            if slot.config != config {
                                slot.config = config.clone();
                                let _ = slot.tx.send(BrokerCmd::Configure(config));
                            }
                        }
                        _ => {
                            brokers.insert(id, Slot::start(config, sink.clone(), shared.clone()));
                        }
                    }
                }
                retiring.retain(|t| !t.is_finished());
            }
            Command::Publish {
                broker_id,
                messages,
                solo,
            } => {
                // Unsent, the batch fails its messages itself as it is dropped.
                let mut batch = Batch::new(broker_id, messages, solo, sink.clone());
                match brokers.get(&broker_id) {
                    Some(slot) => {
                        if let Err(SendError(BrokerCmd::Publish(mut batch))) =
                            slot.tx.send(BrokerCmd::Publish(batch))
                        {
                            batch.unsent_because(format!(
                                "broker {broker_id}: the broker's task has stopped"
                            ));
                        }
                    }
                    None => batch
                        .unsent_because(format!("broker {broker_id}: broker is not configured")),
                }
            }
            Command::Reconnect { broker_id } => {
                if let Some(slot) = brokers.get(&broker_id) {
                    let _ = slot.tx.send(BrokerCmd::Reconnect);
                }
            }
            Command::Shutdown => break,
        }
    }

    for slot in brokers.values() {
        let _ = slot.tx.send(BrokerCmd::Shutdown);
    }
    retiring.extend(brokers.into_values().map(|s| s.task));
    let all = futures_util::future::join_all(retiring);
    let _ = tokio::time::timeout(SHUTDOWN_WAIT, all).await;
}
