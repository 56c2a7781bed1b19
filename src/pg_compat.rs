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

/// Whether this PostgreSQL lets an extension name its waits (custom wait events: 17 and later).
pub const CUSTOM_WAIT_EVENTS: bool = cfg!(not(any(
    feature = "pg13",
    feature = "pg14",
    feature = "pg15",
    feature = "pg16"
)));

/// The `wait_event_info` of the custom wait event `name` (type `Extension`), registered in
/// shared memory the first time any process of the cluster asks for it (`WaitEventExtensionNew`,
/// PostgreSQL 17); `None` before 17, where an extension's waits all show as `Extension`.
///
/// # Safety
/// On a PostgreSQL process's main thread, inside a (sub)transaction that catches its ERROR
/// (more than 128 custom wait events in the cluster, or no shared memory left for one).
pub unsafe fn custom_wait_event(name: &std::ffi::CStr) -> Option<u32> {
    #[cfg(any(feature = "pg13", feature = "pg14", feature = "pg15", feature = "pg16"))]
    {
        let _ = name;
        None
    }
    #[cfg(not(any(feature = "pg13", feature = "pg14", feature = "pg15", feature = "pg16")))]
    {
        // SAFETY: the caller's contract; the name is NUL-terminated and copied into shared
        // memory.
        let info = unsafe { pg_sys::WaitEventExtensionNew(name.as_ptr()) };
        Some(info)
    }
}

/// A wait event set for `nevents` events that lives until the process exits.
///
/// Up to 16 it is allocated in the given memory context (TopMemoryContext here); from 17 on
/// `CreateWaitEventSet` takes the resource owner that tracks it, and none (null) means it is
/// never released with a transaction's resources (it is allocated in TopMemoryContext then).
///
/// # Safety
/// On a PostgreSQL process's main thread.
pub unsafe fn create_lasting_wait_event_set(nevents: i32) -> *mut pg_sys::WaitEventSet {
    // SAFETY: the caller's contract.
    unsafe {
        #[cfg(any(feature = "pg13", feature = "pg14", feature = "pg15", feature = "pg16"))]
        let set = pg_sys::CreateWaitEventSet(pg_sys::TopMemoryContext, nevents);
        #[cfg(not(any(feature = "pg13", feature = "pg14", feature = "pg15", feature = "pg16")))]
        let set = pg_sys::CreateWaitEventSet(std::ptr::null_mut(), nevents);
        set
    }
}

/// Starts an index scan (`index_beginscan`) without instrumentation.
///
/// PostgreSQL 18 added the `instrument` argument (NULL: nothing counted for EXPLAIN).
///
/// # Safety
/// `heap` and `index` are open in this transaction, `index` an index of `heap`; `snapshot`
/// outlives the scan.
pub unsafe fn index_beginscan(
    heap: pg_sys::Relation,
    index: pg_sys::Relation,
    snapshot: pg_sys::Snapshot,
    nkeys: i32,
) -> pg_sys::IndexScanDesc {
    // SAFETY: the caller's contract.
    unsafe {
        #[cfg(not(feature = "pg18"))]
        return pg_sys::index_beginscan(heap, index, snapshot, nkeys, 0);
        #[cfg(feature = "pg18")]
        return pg_sys::index_beginscan(heap, index, snapshot, std::ptr::null_mut(), nkeys, 0);
    }
}

/// The oldest transaction id whose status CLOG still holds (`oldestClogXid`), from
/// `ShmemVariableCache` up to 16 and `TransamVariables` from 17.
///
/// # Safety
/// In a process attached to shared memory, holding `XactTruncationLock` (the value moves with
/// CLOG's truncation).
pub unsafe fn oldest_clog_xid() -> pg_sys::TransactionId {
    // SAFETY: the caller's contract; the struct is set up before any backend runs.
    unsafe {
        #[cfg(not(any(feature = "pg17", feature = "pg18")))]
        let vars = pg_sys::ShmemVariableCache;
        #[cfg(any(feature = "pg17", feature = "pg18"))]
        let vars = pg_sys::TransamVariables;
        (*vars).oldestClogXid
    }
}
