//! The inbox's AMQP thread (its frame, as the outbox's: signals blocked, a current-thread
//! runtime, panics reported) running the router, and the subscription worker's end of its
//! bridge.

use super::bridge::{InboxCommand, InboxEvent};
use super::router;
use crate::events::EventSink;
use crate::{runtime_thread, wake};
use std::io;
use std::os::fd::RawFd;
use std::sync::mpsc;
use std::time::Duration;

/// Shown as `amqp_outbox-inb` (thread names are cut to 15 bytes).
const THREAD_NAME: &str = "amqp_outbox-inbox";

/// Starts the inbox's AMQP thread and returns the subscription worker's end of the bridge.
pub fn spawn() -> io::Result<InboxHandle> {
    let (wake_rx, wake_tx) = wake::pair()?;
    let (cmd_tx, cmd_rx) = tokio::sync::mpsc::unbounded_channel::<InboxCommand>();
    let (ev_tx, ev_rx) = mpsc::channel::<InboxEvent>();
    let sink = EventSink::new(ev_tx, wake_tx);
    let thread = runtime_thread::spawn(THREAD_NAME, sink, move |sink| router::run(cmd_rx, sink))?;
    Ok(InboxHandle {
        commands: cmd_tx,
        events: ev_rx,
        wake: wake_rx,
        thread: Some(thread),
    })
}

/// The subscription worker's end of the bridge.
pub struct InboxHandle {
    commands: tokio::sync::mpsc::UnboundedSender<InboxCommand>,
    events: mpsc::Receiver<InboxEvent>,
    wake: wake::WakeReceiver,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl InboxHandle {
    /// Returns false when the AMQP thread is gone.
    pub fn send(&self, command: InboxCommand) -> bool {
        self.commands.send(command).is_ok()
    }

    /// The file descriptor to wait on for readability; it becomes readable when events arrive.
    pub fn wake_fd(&self) -> RawFd {
        self.wake.fd()
    }

    /// Takes every pending event (and consumes the wake-ups that announced them).
    pub fn drain_events(&self) -> Vec<InboxEvent> {
        self.wake.clear();
        self.events.try_iter().collect()
    }

    /// Consumes the pending wake-ups. Call it before taking events with
    /// [`try_recv`](Self::try_recv), so an event queued meanwhile wakes the next wait.
    pub fn clear_wake(&self) {
        self.wake.clear();
    }

    /// The next pending event, without waiting.
    pub fn try_recv(&self) -> Option<InboxEvent> {
        self.events.try_recv().ok()
    }

    /// Asks the AMQP thread to stop (consumers cancelled, connections closed) and waits for
    /// it, at most `timeout`.
    pub fn shutdown(mut self, timeout: Duration) {
        let _ = self.commands.send(InboxCommand::Shutdown);
        if let Some(t) = self.thread.take() {
            runtime_thread::join_within(t, timeout);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spawn_and_shutdown() {
        let handle = spawn().unwrap();
        assert!(handle.wake_fd() >= 0);
        assert!(handle.send(InboxCommand::Configure(vec![])));
        assert!(handle.try_recv().is_none());
        handle.shutdown(Duration::from_secs(5));
    }
}
