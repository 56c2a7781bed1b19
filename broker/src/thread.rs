//! The AMQP thread: spawned with every signal blocked (so SIGTERM, SIGHUP, SIGINT… always reach
//! PostgreSQL's main thread, and lapin's io-loop threads inherit the mask), running a
//! current-thread tokio runtime with the supervisor.

use crate::bridge::{Command, Event};
use crate::events::{panic_message, EventSink};
use crate::{supervisor, wake};
use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::time::Duration;

pub(crate) const THREAD_NAME: &str = "amqp_outbox-amqp";

/// Starts the AMQP thread and returns the worker's end of the bridge.
pub fn spawn() -> io::Result<BrokerHandle> {
    let (wake_rx, wake_tx) = wake::pair()?;
    let (cmd_tx, cmd_rx) = tokio::sync::mpsc::unbounded_channel::<Command>();
    let (ev_tx, ev_rx) = mpsc::channel::<Event>();
    let sink = EventSink::new(ev_tx, wake_tx);

    let old_mask = block_all_signals()?;
    let spawned = std::thread::Builder::new()
        .name(THREAD_NAME.into())
        .spawn(move || thread_main(cmd_rx, sink));
    // Restore the caller's mask whatever happened: only the new thread keeps signals blocked.
    restore_signals(&old_mask);
    let thread = spawned?;

    Ok(BrokerHandle {
        commands: cmd_tx,
        events: ev_rx,
        wake: wake_rx,
        thread: Some(thread),
    })
}

fn block_all_signals() -> io::Result<libc::sigset_t> {
    // SAFETY: sigset_t is plain data; sigfillset/pthread_sigmask get valid pointers.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        if libc::sigfillset(&mut all) != 0 {
            return Err(io::Error::last_os_error());
        }
        let rc = libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(old)
    }
}

fn restore_signals(old: &libc::sigset_t) {
    // SAFETY: `old` was filled by pthread_sigmask. Restoring a mask we just read cannot fail.
    unsafe {
        libc::pthread_sigmask(libc::SIG_SETMASK, old, std::ptr::null_mut());
    }
}

fn thread_main(commands: tokio::sync::mpsc::UnboundedReceiver<Command>, sink: EventSink) {
    let fatal_sink = sink.clone();
    // A panic must never unwind into (or abort) the PostgreSQL process: report it instead, and
    // the worker exits and is restarted.
    let result = catch_unwind(AssertUnwindSafe(move || {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                sink.send(Event::Fatal(format!(
                    "cannot start the AMQP thread's runtime: {e}"
                )));
                return;
            }
        };
        runtime.block_on(supervisor::run(commands, sink));
        // Do not wait for stuck blocking tasks (a DNS lookup, say) on the way out.
        runtime.shutdown_timeout(Duration::from_secs(1));
    }));
    if let Err(panic) = result {
        fatal_sink.send(Event::Fatal(format!(
            "the AMQP thread panicked: {}",
            panic_message(&*panic)
        )));
    }
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
            let deadline = std::time::Instant::now() + timeout;
            while !t.is_finished() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn current_mask() -> libc::sigset_t {
        // SAFETY: sigset_t is plain data; pthread_sigmask only writes the mask it is given.
        unsafe {
            let mut m: libc::sigset_t = std::mem::zeroed();
            libc::pthread_sigmask(libc::SIG_SETMASK, std::ptr::null(), &mut m);
            m
        }
    }

    fn is_blocked(m: &libc::sigset_t, sig: libc::c_int) -> bool {
        // SAFETY: `m` is a valid, initialised signal set.
        unsafe { libc::sigismember(m, sig) == 1 }
    }

    #[test]
    fn spawned_thread_blocks_signals_and_caller_mask_is_restored() {
        let before = current_mask();
        assert!(!is_blocked(&before, libc::SIGTERM));
        let old = block_all_signals().unwrap();
        let inside = std::thread::spawn(current_mask).join().unwrap();
        restore_signals(&old);
        let after = current_mask();
        assert!(is_blocked(&inside, libc::SIGTERM));
        assert!(is_blocked(&inside, libc::SIGHUP));
        assert!(is_blocked(&inside, libc::SIGINT));
        assert!(!is_blocked(&after, libc::SIGTERM));
    }

    #[test]
    fn spawn_and_shutdown() {
        let handle = spawn().unwrap();
        assert!(handle.wake_fd() >= 0);
        assert!(handle.send(Command::Configure(vec![])));
        handle.shutdown(Duration::from_secs(5));
    }
}
