//! How the AMQP side reports: every event goes through one [`EventSink`], and every task is
//! spawned guarded, so a panic becomes an event instead of vanishing.

use crate::bridge::Event;
use crate::wake;
use futures_util::future::FutureExt;
use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::mpsc;

/// An event type of a bridge: what a guarded task's panic becomes.
pub(crate) trait FatalEvent: Send + 'static {
    fn fatal(text: String) -> Self;

    /// Whether the loop may take this event up to [`wake::SOON`] later (see [`wake`]).
    fn can_wait(&self) -> bool {
        false
    }
}

impl FatalEvent for Event {
    fn fatal(text: String) -> Self {
        Event::Fatal(text)
    }

    /// Proofs of delivery: the loop deletes proven rows in batches 20 ms after the first, and
    /// frees their room in flight at its next step.
    fn can_wait(&self) -> bool {
        matches!(self, Event::Confirmed { .. } | Event::Acked { .. })
    }
}

/// Where the AMQP side puts events: a std channel, then one wake-up byte if none is pending.
/// Generic over the bridge's event type (the outbox's [`Event`] by default, the inbox's own).
pub(crate) struct EventSink<E = Event> {
    events: mpsc::Sender<E>,
    wake: wake::WakeSender,
}

// Not derived: a derive would require `E: Clone`, and the sender clones without it.
impl<E> Clone for EventSink<E> {
    fn clone(&self) -> Self {
        EventSink {
            events: self.events.clone(),
            wake: self.wake.clone(),
        }
    }
}

impl<E: FatalEvent> EventSink<E> {
    pub(crate) fn new(events: mpsc::Sender<E>, wake: wake::WakeSender) -> Self {
        EventSink { events, wake }
    }

    /// For unit tests: a sink and the receiving end of its events (and of its wake-ups, kept
    /// open so sending never fails).
    #[cfg(test)]
    pub(crate) fn for_test() -> (Self, mpsc::Receiver<E>, wake::WakeReceiver) {
        let (wake_rx, wake_tx) = wake::pair().expect("a wake-up socket pair");
        let (tx, rx) = mpsc::channel();
        (EventSink::new(tx, wake_tx), rx, wake_rx)
    }

    pub(crate) fn send(&self, event: E) {
        let can_wait = event.can_wait();
        // An error means the worker dropped its handle: nobody is listening any more.
        if self.events.send(event).is_ok() {
            if can_wait {
                self.wake.wake_soon();
            } else {
                self.wake.wake();
            }
        }
    }
}

/// Spawns `task` on the current runtime; every task of the AMQP side starts here. A panic in a
/// task would otherwise vanish into its JoinHandle, leaving messages unreported: it becomes a
/// fatal event instead, so the worker restarts and republishes. `what` names the task in that
/// event. The handle yields the task's output, or `None` after such a panic.
pub(crate) fn spawn_guarded<E: FatalEvent, T: Send + 'static>(
    sink: EventSink<E>,
    what: String,
    task: impl Future<Output = T> + Send + 'static,
) -> tokio::task::JoinHandle<Option<T>> {
    tokio::spawn(async move {
        match AssertUnwindSafe(task).catch_unwind().await {
            Ok(out) => Some(out),
            Err(panic) => {
                sink.send(E::fatal(format!(
                    "{what} panicked: {}",
                    panic_message(&*panic)
                )));
                None
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panicking_task_becomes_a_fatal_event_and_none() {
        let (sink, rx, _wake) = EventSink::<Event>::for_test();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let (fine, failed) = rt.block_on(async {
            let fine = spawn_guarded(sink.clone(), "fine".into(), async { 7 });
            let failed = spawn_guarded(sink.clone(), "doomed task".into(), async {
                if true {
                    panic!("boom");
                }
                7
            });
            (fine.await.unwrap(), failed.await.unwrap())
        });
        assert_eq!((fine, failed), (Some(7), None));
        let events: Vec<Event> = rx.try_iter().collect();
        assert!(
            matches!(&events[..], [Event::Fatal(m)] if m == "doomed task panicked: boom"),
            "{events:?}"
        );
    }
}
