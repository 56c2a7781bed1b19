//! The queue depth of a subscription ("lag"): a passive `queue.declare` every few seconds on a
//! channel of its own on the consumer's connection (a refused declare closes only that
//! channel), reported as [`InboxEvent::QueueDepth`]. Failures are skipped silently: the
//! consumer itself reports what is wrong with the connection or the queue.

use super::bridge::{InboxEvent, InboxSink};
use lapin::options::QueueDeclareOptions;
use lapin::types::{FieldTable, ShortString};
use lapin::{Channel, Connection};
use std::sync::Arc;
use std::time::Duration;

/// How often the depth is reported (the first time at once).
pub(crate) const DEPTH_INTERVAL: Duration = Duration::from_secs(3);
/// Bound on opening the channel or on one declare.
const DEPTH_WAIT: Duration = Duration::from_secs(5);

/// Reports the depth of `queue` until the task is aborted (with its connection's use).
pub(crate) async fn watch(
    conn: Arc<Connection>,
    queue: ShortString,
    subscription: String,
    sink: InboxSink,
) {
    let mut channel: Option<Channel> = None;
    let mut tick = tokio::time::interval(DEPTH_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if !channel.as_ref().is_some_and(|c| c.status().connected()) {
            channel = match tokio::time::timeout(DEPTH_WAIT, conn.create_channel()).await {
                Ok(Ok(c)) => Some(c),
                _ => None,
            };
        }
        let Some(ch) = &channel else { continue };
        let declared = tokio::time::timeout(
            DEPTH_WAIT,
            ch.queue_declare(
                queue.clone(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            ),
        )
        .await;
        if let Ok(Ok(q)) = declared {
            sink.send(InboxEvent::QueueDepth {
                subscription: subscription.clone(),
                ready: q.message_count(),
                consumers: q.consumer_count(),
            });
        }
    }
}
