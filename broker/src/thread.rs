//! The outbox's AMQP thread (see `runtime_thread` for its frame: signals blocked, a
//! current-thread runtime, panics reported) running the supervisor, and the worker's end of
//! its bridge.

use crate::bridge::{Command, Event};
use crate::events::EventSink;
use crate::{runtime_thread, supervisor, wake};
use std::io;
use std::sync::mpsc;
use std::time::Duration;

pub(crate) const THREAD_NAME: &str = "amqp_outbox-amqp";

/// Starts the AMQP thread and returns the worker's end of the bridge.
pub fn spawn() -> io::Result<BrokerHandle> {
    let (wake_rx, wake_tx) = wake::pair()?;
    let (cmd_tx, cmd_rx) = tokio::sync::mpsc::unbounded_channel::<Command>();
    let (ev_tx, ev_rx) = mpsc::channel::<Event>();
    let sink = EventSink::new(ev_tx, wake_tx);
    let thread =
        runtime_thread::spawn(THREAD_NAME, sink, move |sink| supervisor::run(cmd_rx, sink))?;
    Ok(BrokerHandle {
        commands: cmd_tx,
        events: ev_rx,
        wake: wake_rx,
        thread: Some(thread),
    })
}

/// The worker's end of the bridge.
pub struct BrokerHandle {
    commands: tokio::sync::mpsc::UnboundedSender<Command>,
    events: std::sync::mpsc::Receiver<Event>,
    wake: wake::WakeReceiver,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl BrokerHandle {
    /// Returns false when the AMQP thread is gone.
    pub fn send(&self, command: Command) -> bool {
        self.commands.send(command).is_ok()
    }

    /// The file descriptor to wait on for readability; it becomes readable when events arrive.
    pub fn wake_fd(&self) -> std::os::fd::RawFd {
        self.wake.fd()
    }

    /// Takes every pending event (and consumes the wake-ups that announced them).
    pub fn drain_events(&self) -> Vec<Event> {
        self.wake.clear();
        self.events.try_iter().collect()
    }

    /// Asks the AMQP thread to stop and waits for it, at most `timeout`.
    pub fn shutdown(mut self, timeout: Duration) {
        let _ = self.commands.send(Command::Shutdown);
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
        assert!(handle.send(Command::Configure(vec![])));
        handle.shutdown(Duration::from_secs(5));
    }
}
