//! A clean stop on SIGTERM or SIGINT: the signal sets a flag and makes one socket readable for
//! good, and every wait of the relay includes that socket, so every loop sees the stop at once.

use amqp_outbox_broker::wake::{self, WakeReceiver, WakeSender};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

static STOPPING: AtomicBool = AtomicBool::new(false);
static STOP: OnceLock<(WakeReceiver, WakeSender)> = OnceLock::new();

/// Installs the handlers (once, before any thread starts).
pub fn install() -> std::io::Result<()> {
    let pair = wake::pair()?;
    let _ = STOP.set(pair);
    for signal in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: `on_signal` only stores an atomic and writes one byte with send(2), both
        // async-signal-safe.
        let previous =
            unsafe { libc::signal(signal, on_signal as *const () as libc::sighandler_t) };
        if previous == libc::SIG_ERR {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

extern "C" fn on_signal(_: libc::c_int) {
    request();
}

/// Asks every loop to stop (what the signals do).
pub fn request() {
    STOPPING.store(true, Ordering::SeqCst);
    if let Some((_, sender)) = STOP.get() {
        sender.wake();
    }
}

pub fn requested() -> bool {
    STOPPING.load(Ordering::SeqCst)
}

/// Readable once a stop is requested (`None` before [`install`]).
pub fn fd() -> Option<RawFd> {
    STOP.get().map(|(receiver, _)| receiver.fd())
}

/// Waits until one of `fds` is readable, a stop is requested, or `timeout` has passed.
pub fn wait(fds: &[RawFd], timeout: std::time::Duration) {
    if requested() {
        return;
    }
    let mut polled: Vec<libc::pollfd> = fds
        .iter()
        .copied()
        .chain(fd())
        .map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ms = amqp_outbox_engine::wait_ms::wait_ms(timeout);
    // SAFETY: `polled` is a valid array of pollfd for its length; EINTR only ends the wait.
    unsafe { libc::poll(polled.as_mut_ptr(), polled.len() as libc::nfds_t, ms) };
}
