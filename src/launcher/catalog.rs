//! The databases of the cluster, read from the shared catalog `pg_database`: the launcher is
//! connected to no database, so it scans the catalog itself (as autovacuum's launcher does).

use pgrx::pg_sys;
use std::ffi::CStr;

/// `datconnlimit` of a database a failed `DROP DATABASE` left half-dropped.
const DATCONNLIMIT_INVALID_DB: i32 = -2;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Database {
    pub oid: u32,
    pub name: String,
}

/// The databases a worker may connect to: not templates, connections allowed, not invalid.
pub fn connectable_databases() -> Vec<Database> {
    let mut found = Vec::new();
    // SAFETY: the launcher's main thread, between transactions. The scan runs inside its own
    // transaction; every tuple is read before the next heap_getnext, and GETSTRUCT of a
    // pg_database tuple is a FormData_pg_database whose fixed part (read here) is always there.
    // An ERROR (longjmp) is turned into a panic by pgrx's guards and ends the launcher, which
    // the postmaster restarts.
    unsafe {
        pg_sys::StartTransactionCommand();
        // A snapshot for the catalog scan, as autovacuum's get_database_list takes one.
        let _ = pg_sys::GetTransactionSnapshot();
        let rel = pg_sys::table_open(
            pg_sys::DatabaseRelationId,
            pg_sys::AccessShareLock as pg_sys::LOCKMODE,
        );
        let scan = pg_sys::table_beginscan_catalog(rel, 0, std::ptr::null_mut());
        loop {
            let tuple = pg_sys::heap_getnext(scan, pg_sys::ScanDirection::ForwardScanDirection);
            if tuple.is_null() {
                break;
            }
            let form = pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_database>(tuple);
            if (*form).datistemplate
                || !(*form).datallowconn
                || (*form).datconnlimit == DATCONNLIMIT_INVALID_DB
            {
                continue;
            }
            let name = CStr::from_ptr((*form).datname.data.as_ptr())
                .to_string_lossy()
                .into_owned();
            found.push(Database {
                oid: (*form).oid.to_u32(),
                name,
            });
        }
        pg_sys::table_endscan(scan);
        pg_sys::table_close(rel, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        pg_sys::CommitTransactionCommand();
    }
    found
}
