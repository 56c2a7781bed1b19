//! Where PostgreSQL's C API differs between the supported majors (15, 16, 17, 18): one function
//! per difference, each with a variant per `pgNN` feature, so the rest of the crate calls one
//! signature and behaves the same on every version. Nothing else in the crate may use a
//! `#[cfg(feature = "pgNN")]`.

use pgrx::pg_sys;

/// Ends the process through PostgreSQL's `proc_exit` (exit callbacks, ours included).
///
/// PostgreSQL 18 marks `proc_exit` `_Noreturn` instead of `pg_attribute_noreturn()`, which
/// bindgen (with libclang 14) generates as returning `()` rather than `!`; this wrapper gives
/// every version the `-> !` the worker loops rely on.
///
/// # Safety
/// On a PostgreSQL process's main thread, outside any critical section.
// Unreachable code and a unit `let` when the bindings say `-> !` (up to 17, or a newer libclang
// on 18); needed when they say `()`.
#[allow(unreachable_code)]
pub unsafe fn proc_exit(code: i32) -> ! {
    // SAFETY: the caller's contract.
    unsafe { pg_sys::proc_exit(code) };
    unreachable!("proc_exit returned")
}

/// The attributes of a tuple descriptor, dropped ones included, in attribute-number order.
///
/// Up to 17, `TupleDescData.attrs` is the array itself; PostgreSQL 18 puts `compact_attrs`
/// there and the full `FormData_pg_attribute` array right after it (its `TupleDescAttr`).
///
/// # Safety
/// `desc` is a valid tuple descriptor that outlives the returned slice.
pub unsafe fn tuple_desc_attrs<'a>(desc: pg_sys::TupleDesc) -> &'a [pg_sys::FormData_pg_attribute] {
    // SAFETY: the caller's contract; natts is the length of both arrays.
    unsafe {
        let natts = usize::try_from((*desc).natts).unwrap_or(0);
        #[cfg(not(feature = "pg18"))]
        let first = (*desc).attrs.as_ptr();
        #[cfg(feature = "pg18")]
        let first = (*desc)
            .compact_attrs
            .as_ptr()
            .add(natts)
            .cast::<pg_sys::FormData_pg_attribute>();
        if natts == 0 {
            return &[];
        }
        std::slice::from_raw_parts(first, natts)
    }
}

/// The sequence of an identity column (`InvalidOid` when it is none and `missing_ok`).
///
/// PostgreSQL 17 takes the open relation instead of its oid.
///
/// # Safety
/// `rel` is an open relation; `attnum` one of its attribute numbers.
pub unsafe fn identity_sequence(
    rel: pg_sys::Relation,
    attnum: pg_sys::AttrNumber,
    missing_ok: bool,
) -> pg_sys::Oid {
    // SAFETY: the caller's contract.
    unsafe {
        #[cfg(any(feature = "pg13", feature = "pg14", feature = "pg15", feature = "pg16"))]
        let key = (*rel).rd_id;
        #[cfg(not(any(feature = "pg13", feature = "pg14", feature = "pg15", feature = "pg16")))]
        let key = rel;
        pg_sys::getIdentitySequence(key, attnum, missing_ok)
    }
}

/// Inserts the index entries of the tuple in `slot` into every index of `info`'s relation, as
/// an INSERT does (unique checks included, no ON CONFLICT arbiter).
///
/// PostgreSQL 16 added the `onlySummarizing` argument (false: every index, as an INSERT).
///
/// # Safety
/// `info` has its indexes open (`ExecOpenIndices`); `slot` holds the stored tuple; `estate`
/// is an executor state of the current transaction.
pub unsafe fn insert_index_tuples(
    info: *mut pg_sys::ResultRelInfo,
    slot: *mut pg_sys::TupleTableSlot,
    estate: *mut pg_sys::EState,
) {
    let (update, no_dup_err) = (false, false);
    let (spec_conflict, arbiter_indexes) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: the caller's contract. The returned list (recheck indexes, deferred constraints
    // only) is left to the memory context.
    unsafe {
        #[cfg(any(feature = "pg13", feature = "pg14", feature = "pg15"))]
        pg_sys::ExecInsertIndexTuples(
            info,
            slot,
            estate,
            update,
            no_dup_err,
            spec_conflict,
            arbiter_indexes,
        );
        #[cfg(not(any(feature = "pg13", feature = "pg14", feature = "pg15")))]
        pg_sys::ExecInsertIndexTuples(
            info,
            slot,
            estate,
            update,
            no_dup_err,
            spec_conflict,
            arbiter_indexes,
            false,
        );
    }
}

/// Installs a signal handler the way backend code does (`pqsignal`).
///
/// PostgreSQL 18 makes `pqsignal` a macro for the backend's `pqsignal_be` (which returns
/// nothing), so the bindings have only the latter.
///
/// # Safety
/// On a PostgreSQL process's main thread; `handler` is async-signal-safe.
pub unsafe fn pqsignal(signo: i32, handler: pg_sys::pqsigfunc) {
    // SAFETY: the caller's contract. Up to 17 the previous handler is returned; nothing here
    // wants it.
    unsafe {
        #[cfg(not(feature = "pg18"))]
        pg_sys::pqsignal(signo, handler);
        #[cfg(feature = "pg18")]
        pg_sys::pqsignal_be(signo, handler);
    }
}
