//! The inbox's router: one consumer task per configured subscription (see `consumer`),
//! started, reconfigured and retired as the configuration changes; each command goes to its
//! subscription's task.

use super::bridge::{InboxCommand, InboxEvent, InboxSink, SubscriptionConfig};
use super::consumer::{self, SubCmd};
use crate::bridge::LogLevel;
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Bound on the whole shutdown of every subscription task.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(5);

struct Slot {
    config: SubscriptionConfig,
    tx: mpsc::UnboundedSender<SubCmd>,
    task: JoinHandle<Option<()>>,
}

/// Runs until `InboxCommand::Shutdown` (or until the worker drops its handle).
pub(crate) async fn run(mut commands: mpsc::UnboundedReceiver<InboxCommand>, sink: InboxSink) {
    let mut subs: HashMap<String, Slot> = HashMap::new();
    // Each subscription's channel counter, kept when it is removed: configured again, it goes
    // on counting, so an acknowledgement meant for its old channels never hits a new one.
    let mut epochs: HashMap<String, Arc<AtomicU64>> = HashMap::new();
    // Removed subscriptions still closing; awaited (bounded) at shutdown.
    let mut retiring: Vec<JoinHandle<Option<()>>> = Vec::new();

    while let Some(cmd) = commands.recv().await {
        match cmd {
            InboxCommand::Configure(configs) => {
                let mut wanted: HashMap<String, SubscriptionConfig> = HashMap::new();
                for c in configs {
                    if wanted.contains_key(&c.subscription) {
                        sink.send(InboxEvent::Log {
                            level: LogLevel::Warning,
                            message: format!(
                                "subscription \"{}\" is configured twice; using the last entry",
                                c.subscription
                            ),
                        });
                    }
                    wanted.insert(c.subscription.clone(), c);
                }
                let removed: Vec<String> = subs
                    .keys()
                    .filter(|name| !wanted.contains_key(*name))
                    .cloned()
                    .collect();
                for name in removed {
                    if let Some(slot) = subs.remove(&name) {
                        let _ = slot.tx.send(SubCmd::Stop);
                        retiring.push(slot.task);
                    }
                }
                for (name, config) in wanted {
                    match subs.get_mut(&name) {
                        Some(slot) if !slot.task.is_finished() => {
                            if slot.config != config {
                                slot.config = config.clone();
                                let _ = slot.tx.send(SubCmd::Configure(Box::new(config)));
                            }
                        }
                        _ => {
                            let counter = epochs.entry(name.clone()).or_default().clone();
                            let (tx, task) = consumer::start(config.clone(), counter, sink.clone());
                            subs.insert(name, Slot { config, tx, task });
                        }
                    }
                }
                retiring.retain(|t| !t.is_finished());
            }
            InboxCommand::Ack {
                subscription,
                epoch,
                delivery_tags,
            } => {
                // A removed subscription's deliveries went back to the queue with its
                // connection: nothing to acknowledge.
                if let Some(slot) = subs.get(&subscription) {
                    let _ = slot.tx.send(SubCmd::Ack {
                        epoch,
                        tags: delivery_tags,
                    });
                }
            }
            InboxCommand::Reconnect { subscription } => {
                if let Some(slot) = subs.get(&subscription) {
                    let _ = slot.tx.send(SubCmd::Reconnect);
                }
            }
            InboxCommand::Shutdown => break,
        }
    }

    for slot in subs.values() {
        let _ = slot.tx.send(SubCmd::Stop);
    }
    retiring.extend(subs.into_values().map(|s| s.task));
    let all = futures_util::future::join_all(retiring);
    let _ = tokio::time::timeout(SHUTDOWN_WAIT, all).await;
}
