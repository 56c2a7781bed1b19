//! `amqp.message` found by name and locked, inside the caller's transaction: the worker's
//! transactions and `DROP EXTENSION` lock it before any other table of the extension, so the
//! two always queue on it rather than deadlock on the tables behind it.

use pgrx::pg_sys;

/// Whether the extension is installed in this database and its `amqp.message` exists, locked in
/// `mode` until the end of the transaction when it does.
pub fn installed_and_locked(mode: u32) -> bool {
    installed_table(mode).is_some()
}

/// As [`installed_and_locked`], returning `amqp.message`'s oid.
pub fn installed_table(mode: u32) -> Option<pg_sys::Oid> {
    // SAFETY: called inside a transaction (catalog lookups need one); the name is a
    // NUL-terminated literal PostgreSQL only reads; with missing_ok a missing extension returns
    // InvalidOid instead of raising.
    let installed =
        unsafe { pg_sys::get_extension_oid(c"amqp_outbox".as_ptr(), true) } != pg_sys::InvalidOid;
    if installed {
        lock(mode)
    } else {
        None
    }
}

/// Locks `amqp.message` in `mode` until the end of the transaction and returns its oid; `None`
/// when it does not exist (after a DROP EXTENSION that committed while this waited, too).
pub fn lock(mode: u32) -> Option<pg_sys::Oid> {
    // SAFETY: called inside a transaction (catalog lookups need one); the names are
    // NUL-terminated literals that PostgreSQL only reads (makeRangeVar copies the pointers into
    // a node of the transaction's memory context); with RVR_MISSING_OK a missing table returns
    // InvalidOid instead of raising.
    let oid = unsafe {
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
        )
    };
    (oid != pg_sys::InvalidOid).then_some(oid)
}
