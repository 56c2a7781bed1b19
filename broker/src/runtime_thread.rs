//! The frame of an AMQP thread (the outbox's and the inbox's): spawned with every signal
//! blocked (so SIGTERM, SIGHUP, SIGINT… always reach PostgreSQL's main thread, and lapin's
//! io-loop threads inherit the mask), running a current-thread tokio runtime, and reporting a
//! panic as a fatal event instead of unwinding into (or aborting) the PostgreSQL process.

use crate::events::{panic_message, EventSink, FatalEvent};
use std::future::Future;
use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

/// Starts thread `name` running `main(sink)` to completion on its own runtime.
pub(crate) fn spawn<E, F, Fut>(
    name: &str,
    sink: EventSink<E>,
    main: F,
) -> io::Result<std::thread::JoinHandle<()>>
where
    E: FatalEvent,
    F: FnOnce(EventSink<E>) -> Fut + Send + 'static,
    Fut: Future<Output = ()>,
{
    spawn_without_signals(name, move || thread_main(sink, main))
}

/// Starts thread `name` running `f` with every signal blocked from its first instruction on
/// (the mask is inherited, not set by the thread), so that signals sent to the process always
/// reach PostgreSQL's main thread.
pub fn spawn_without_signals(
    name: &str,
    f: impl FnOnce() + Send + 'static,
) -> io::Result<std::thread::JoinHandle<()>> {
    let old_mask = block_all_signals()?;
    let spawned = std::thread::Builder::new().name(name.into()).spawn(f);
    // Restore the caller's mask whatever happened: only the new thread keeps signals blocked.
    restore_signals(&old_mask);
    spawned
}

fn thread_main<E, F, Fut>(sink: EventSink<E>, main: F)
where
    E: FatalEvent,
    F: FnOnce(EventSink<E>) -> Fut,
    Fut: Future<Output = ()>,
{
    let fatal_sink = sink.clone();
    let result = catch_unwind(AssertUnwindSafe(move || {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                sink.send(E::fatal(format!(
                    "cannot start the AMQP thread's runtime: {e}"
                )));
                return;
            }
        };
        runtime.block_on(main(sink));
        // Do not wait for stuck blocking tasks (a DNS lookup, say) on the way out.
        runtime.shutdown_timeout(Duration::from_secs(1));
    }));
    if let Err(panic) = result {
        fatal_sink.send(E::fatal(format!(
            "the AMQP thread panicked: {}",
            panic_message(&*panic)
        )));
    }
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

/// Waits at most `timeout` for an AMQP thread that was asked to stop, and joins it if it
/// ended; a thread still running is left behind (the process is exiting).
pub(crate) fn join_within(thread: std::thread::JoinHandle<()>, timeout: Duration) {
    let deadline = std::time::Instant::now() + timeout;
    while !thread.is_finished() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    if thread.is_finished() {
        let _ = thread.join();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bridge::Event;

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
    fn a_panicking_thread_reports_a_fatal_event() {
        let (sink, rx, _wake) = EventSink::<Event>::for_test();
        let t = spawn("test-panics", sink, |_sink| async {
            panic!("boom");
        })
        .unwrap();
        t.join().unwrap();
        let events: Vec<Event> = rx.try_iter().collect();
        assert!(
            matches!(&events[..], [Event::Fatal(m)] if m == "the AMQP thread panicked: boom"),
            "{events:?}"
        );
    }
}
