//! `amqp.message` found by name and locked, inside the caller's transaction: the worker's
//! transactions and `DROP EXTENSION` lock it before any other table of the extension, so the
//! two always queue on it rather than deadlock on the tables behind it.

use pgrx::pg_sys;

/// Locks `amqp.message` in `mode` until the end of the transaction; false when it does not
/// exist (after a DROP EXTENSION that committed while this waited, too).
pub fn lock(mode: u32) -> bool {
    // SAFETY: called inside a transaction (catalog lookups need one); the names are
    // NUL-terminated literals that PostgreSQL only reads (makeRangeVar copies the pointers into
    // a node of the transaction's memory context); with RVR_MISSING_OK a missing table returns
    // InvalidOid instead of raising.
    unsafe {
        let table = pg_sys::makeRangeVar(
            c"amqp".as_ptr().cast_mut(),
            c"message".as_ptr().cast_mut(),
            -1,
        );
        pg_sys::RangeVarGetRelidExtended(
            table,
            mode as pg_sys::LOCKMODE,
            pg_sys::RVROption::RVR_MISSING_OK,
            None,
            std::ptr::null_mut(),
        ) != pg_sys::InvalidOid
    }
}
