//! How the AMQP side reports: every event goes through one [`EventSink`], and every task is
//! spawned guarded, so a panic becomes an event instead of vanishing.

use crate::bridge::Event;
use crate::wake;
use futures_util::future::FutureExt;
use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::mpsc;

/// Where the AMQP side puts events: a std channel, then one wake-up byte if none is pending.
#[derive(Clone)]
pub(crate) struct EventSink {
    events: mpsc::Sender<Event>,
    wake: wake::WakeSender,
}

impl EventSink {
    pub(crate) fn new(events: mpsc::Sender<Event>, wake: wake::WakeSender) -> Self {
        EventSink { events, wake }
    }

    pub(crate) fn send(&self, event: Event) {
        // An error means the worker dropped its handle: nobody is listening any more.
        if self.events.send(event).is_ok() {
            self.wake.wake();
        }
    }
}

/// Spawns `task` on the current runtime. A panic in a task would otherwise vanish into its
/// JoinHandle, leaving messages unreported: it becomes a fatal event instead, so the worker
/// restarts and republishes. `what` names the task in that event.
pub(crate) fn spawn_guarded(
    sink: EventSink,
    what: String,
    task: impl Future<Output = ()> + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        if let Err(panic) = AssertUnwindSafe(task).catch_unwind().await {
            sink.send(Event::Fatal(format!(
                "{what} panicked: {}",
                panic_message(&*panic)
            )));
        }
    })
}

pub(crate) fn panic_message(panic: &(dyn Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".to_string()
    }
}
