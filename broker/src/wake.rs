//! The wake socket: the AMQP thread writes a byte when it queues events, and the worker's main
//! thread waits for the read end with `WaitLatchOrSocket`. A flag shared by both ends keeps at
//! most one byte in flight, so a burst of events costs one syscall. (Public: a relay wakes its
//! loop the same way from the thread that listens to PostgreSQL.)
//!
//! An event that can wait (a proof of delivery: the loop acts on it only at its next step or
//! at the DELETE batched 20 ms later) wakes the loop [`SOON`] after it was queued, unless the loop
//! took the events meanwhile, woken by anything else (at a steady rate, the next commit). At 200
//! messages a second a confirm and a record per message would otherwise wake it twice more
//! between two commits.

use std::io::{self, Read};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How long an event that can wait waits for the loop to take it before it wakes the loop.
pub const SOON: Duration = Duration::from_millis(5);

/// The worker's end: readable when events are pending.
pub struct WakeReceiver {
    stream: UnixStream,
    pending: Arc<AtomicBool>,
    deferred: Arc<Deferred>,
}

/// The AMQP thread's end.
#[derive(Clone)]
pub struct WakeSender {
    stream: Arc<UnixStream>,
    pending: Arc<AtomicBool>,
    deferred: Arc<Deferred>,
}

/// Events that can wait, and the timer that wakes the loop for them.
#[derive(Default)]
struct Deferred {
    /// Queued since the loop last took the events.
    untaken: AtomicBool,
    /// A timer runs that will wake the loop if they are still untaken.
    armed: AtomicBool,
}

/// A connected, non-blocking, close-on-exec pair.
pub fn pair() -> io::Result<(WakeReceiver, WakeSender)> {
    let (rx, tx) = UnixStream::pair()?;
    rx.set_nonblocking(true)?;
    tx.set_nonblocking(true)?;
    let pending = Arc::new(AtomicBool::new(false));
    let deferred = Arc::new(Deferred::default());
    Ok((
        WakeReceiver {
            stream: rx,
            pending: pending.clone(),
            deferred: deferred.clone(),
        },
        WakeSender {
            stream: Arc::new(tx),
            pending,
            deferred,
        },
    ))
}

impl WakeReceiver {
    pub fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// Consumes the pending wake-ups. Call it *before* taking the events. The socket is
    /// drained first and the flag cleared after: a wake-up that comes in between finds the flag
    /// still set and writes nothing, but its events were queued before it, so the caller takes
    /// them next. (Cleared first, a wake-up in between wrote a byte the drain then swallowed,
    /// leaving the flag set with nothing to read: every later wake-up wrote nothing, and the
    /// worker slept until its naptime.)
    pub fn clear(&self) {
        self.clear_with(|| {});
    }

    /// [`Self::clear`], with `between` run in the middle (where a racing wake-up may come).
    fn clear_with(&self, between: impl FnOnce()) {
        self.drain();
        between();
        self.pending.store(false, Ordering::SeqCst);
        // The caller takes the events next, so every event that can wait queued before this
        // is taken; one queued after sets the flag again.
        self.deferred.untaken.store(false, Ordering::SeqCst);
    }

    fn drain(&self) {
        let mut buf = [0u8; 64];
        loop {
            match (&self.stream).read(&mut buf) {
                Ok(0) => break, // the AMQP thread is gone; nothing more will come
                Ok(_) => continue,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => break, // WouldBlock: drained
            }
        }
    }
}

impl WakeSender {
    /// Call after queueing an event that can wait: the loop is woken [`SOON`] after, unless it
    /// takes the events before. Outside a Tokio runtime (no timer to run), at once.
    pub fn wake_soon(&self) {
        self.deferred.untaken.store(true, Ordering::SeqCst);
        if self.pending.load(Ordering::SeqCst) {
            return; // a wake-up is on its way, and the loop takes every event with it
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.wake();
            return;
        };
        if self.deferred.armed.swap(true, Ordering::SeqCst) {
            return; // the running timer covers this event too
        }
        let sender = self.clone();
        runtime.spawn(async move {
            tokio::time::sleep(SOON).await;
            sender.deferred.armed.store(false, Ordering::SeqCst);
            if sender.deferred.untaken.load(Ordering::SeqCst) {
                sender.wake();
            }
        });
    }

    /// Call after queueing an event. Writes only when no wake-up is pending.
    pub fn wake(&self) {
        if self.pending.swap(true, Ordering::SeqCst) {
            return;
        }
        let byte = [1u8];
        loop {
            // MSG_NOSIGNAL: if the worker is gone, no SIGPIPE (this thread blocks signals
            // anyway, but a pending SIGPIPE is better never raised).
            // SAFETY: the fd is owned by `self.stream` and valid for its lifetime; the buffer
            // is one valid byte.
            let n = unsafe {
                libc::send(
                    self.stream.as_raw_fd(),
                    byte.as_ptr().cast(),
                    1,
                    libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
                )
            };
            if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            // A full buffer (impossible with one pending byte) or a closed peer: nothing to do.
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn readable(fd: RawFd) -> bool {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        n == 1 && (p.revents & libc::POLLIN) != 0
    }

    #[test]
    fn one_byte_per_burst_and_clear_drains() {
        let (rx, tx) = pair().unwrap();
        assert!(!readable(rx.fd()));
        tx.wake();
        tx.wake();
        tx.wake();
        assert!(readable(rx.fd()));
        rx.clear();
        assert!(!readable(rx.fd()));
        tx.wake();
        assert!(readable(rx.fd()));
        rx.clear();
        assert!(!readable(rx.fd()));
    }

    /// A wake-up in the middle of a clear (its events are taken right after the clear): the
    /// next wake-up still makes the socket readable.
    #[test]
    fn a_wake_up_during_a_clear_loses_no_later_one() {
        let (rx, tx) = pair().unwrap();
        tx.wake();
        rx.clear_with(|| tx.wake());
        tx.wake();
        assert!(readable(rx.fd()), "a later wake-up was lost");
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
    }

    /// Whether `fd` becomes readable within a second (the timer task runs meanwhile).
    async fn readable_soon(fd: RawFd) -> bool {
        let until = std::time::Instant::now() + Duration::from_secs(1);
        while std::time::Instant::now() < until {
            if readable(fd) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        false
    }

    #[test]
    fn an_event_that_can_wait_wakes_soon_after() {
        let (rx, tx) = pair().unwrap();
        runtime().block_on(async {
            tx.wake_soon();
            tx.wake_soon();
            assert!(!readable(rx.fd()), "woken at once");
            assert!(readable_soon(rx.fd()).await, "not woken after {SOON:?}");
        });
        rx.clear();
        assert!(!readable(rx.fd()), "woken twice for one burst");
    }

    #[test]
    fn events_taken_before_the_timer_wake_nothing() {
        let (rx, tx) = pair().unwrap();
        runtime().block_on(async {
            tx.wake_soon();
            // The loop, woken by something else, takes the events.
            rx.clear();
            tokio::time::sleep(SOON * 3).await;
            assert!(!readable(rx.fd()), "woken for events already taken");
            // A later one arms a timer of its own.
            tx.wake_soon();
            assert!(readable_soon(rx.fd()).await, "the later event woke nothing");
        });
    }

    #[test]
    fn an_event_that_can_wait_after_a_clear_still_wakes() {
        let (rx, tx) = pair().unwrap();
        runtime().block_on(async {
            tx.wake_soon();
            // Taken; a second event after that must still wake the loop, although the timer
            // that runs is the first one's.
            rx.clear();
            tx.wake_soon();
            assert!(
                readable_soon(rx.fd()).await,
                "the second event woke nothing"
            );
        });
    }

    #[test]
    fn outside_a_runtime_an_event_that_can_wait_wakes_at_once() {
        let (rx, tx) = pair().unwrap();
        tx.wake_soon();
        assert!(readable(rx.fd()));
    }

    #[test]
    fn wake_after_receiver_dropped_does_not_fail() {
        let (rx, tx) = pair().unwrap();
        drop(rx);
        tx.wake();
        tx.wake();
    }
}
