//! Runs a piece of work in a subtransaction of the current one and catches its ERROR, as
//! PL/pgSQL's `BEGIN … EXCEPTION` does: used by the subscription worker around each message and
//! by the outbox worker around what a user's objects could make fail.

use pgrx::pg_sys;
use pgrx::prelude::*;

// An error caught in a subtransaction: the engine's, whose `Outbox::subtransaction` returns it.
pub use amqp_outbox_engine::outbox::Caught;

fn caught_from_report(e: &pg_sys::panic::ErrorReportWithLevel) -> Caught {
    let mut message = e.message().to_string();
    if let Some(d) = e.detail() {
        message.push_str(": ");
        message.push_str(d);
    }
    Caught {
        sqlstate: sqlstate_text(e.sql_error_code() as i32),
        message,
    }
}

/// PostgreSQL packs the five SQLSTATE characters six bits each (MAKE_SQLSTATE).
fn sqlstate_text(code: i32) -> String {
    (0..5)
        .map(|i| (((code >> (6 * i)) & 0x3F) as u8 + b'0') as char)
        .collect()
}

/// Runs `work` in a subtransaction of the current transaction. `Ok`: it committed into the
/// transaction; `Err`: it raised, everything it did is rolled back and the error is returned.
pub fn subtransaction<R>(work: impl FnOnce() -> R) -> Result<R, Caught> {
    // SAFETY: on the worker's main thread inside a transaction. The memory context and resource
    // owner are restored after the subtransaction ends either way, as PL/pgSQL does.
    let (context, owner) = unsafe {
        let context = pg_sys::CurrentMemoryContext;
        let owner = pg_sys::CurrentResourceOwner;
        pg_sys::BeginInternalSubTransaction(std::ptr::null());
        (context, owner)
    };
    let result = PgTryBuilder::new(std::panic::AssertUnwindSafe(|| Ok(work())))
        .catch_others(|e| match e {
            pg_sys::panic::CaughtError::PostgresError(r)
            | pg_sys::panic::CaughtError::ErrorReport(r)
            | pg_sys::panic::CaughtError::RustPanic { ereport: r, .. } => {
                Err(caught_from_report(&r))
            }
        })
        .execute();
    // SAFETY: the subtransaction begun above is the current one (an error inside was caught
    // and its state flushed by PgTryBuilder); ending it and restoring the caller's memory
    // context and resource owner is what PL/pgSQL's exception blocks do.
    unsafe {
        match result {
            Ok(_) => pg_sys::ReleaseCurrentSubTransaction(),
            Err(_) => pg_sys::RollbackAndReleaseCurrentSubTransaction(),
        }
        pg_sys::MemoryContextSwitchTo(context);
        pg_sys::CurrentResourceOwner = owner;
    }
    result
}

#[cfg(test)]
mod tests {
    use super::sqlstate_text;

    #[test]
    fn sqlstates_unpack_from_postgres_encoding() {
        // MAKE_SQLSTATE('5','7','0','1','4') and ('2','2','0','1','2').
        let make = |s: &str| {
            s.bytes()
                .enumerate()
                .map(|(i, c)| (((c - b'0') & 0x3F) as i32) << (6 * i))
                .sum::<i32>()
        };
        assert_eq!(sqlstate_text(make("57014")), "57014");
        assert_eq!(sqlstate_text(make("P0001")), "P0001");
        assert_eq!(sqlstate_text(make("22012")), "22012");
    }
}
