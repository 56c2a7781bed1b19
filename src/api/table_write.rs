//! Storing a row with the table access method directly, as logical replication's apply does,
//! instead of through SPI and an executor: shared by the outbox row and the idempotency key.

use pgrx::prelude::*;

/// Stores the virtual tuple in `slot` into `rel` with `simple_table_tuple_insert` (TOAST, WAL,
/// statistics as for any INSERT), inserts its entries into every index of the table
/// (`ExecInsertIndexTuples`, unique checks included) and, as SPI does after a statement, lets
/// the transaction's later commands see it.
///
/// # Safety
/// `rel` is open with RowExclusiveLock in this transaction; `slot` is a virtual slot of its
/// tuple descriptor with the tuple stored; on the backend's main thread.
pub unsafe fn insert_slot(rel: pg_sys::Relation, slot: *mut pg_sys::TupleTableSlot) {
    // SAFETY: the caller's contract; the executor state and the result relation info are made
    // and freed here.
    unsafe {
        pg_sys::simple_table_tuple_insert(rel, slot);
        if (*(*rel).rd_rel).relhasindex {
            let estate = pg_sys::CreateExecutorState();
            let info = PgBox::<pg_sys::ResultRelInfo>::alloc_node(pg_sys::NodeTag::T_ResultRelInfo)
                .into_pg();
            pg_sys::InitResultRelInfo(info, rel, 1, std::ptr::null_mut(), 0);
            pg_sys::ExecOpenIndices(info, false);
            crate::pg_compat::insert_index_tuples(info, slot, estate);
            pg_sys::ExecCloseIndices(info);
            pg_sys::FreeExecutorState(estate);
        }
        pg_sys::CommandCounterIncrement();
    }
}
