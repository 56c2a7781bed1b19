//! Storing a row with the table access method directly, as logical replication's apply does,
//! instead of through SPI and an executor: shared by the outbox row and the idempotency key.

use pgrx::prelude::*;
use std::cell::{Cell, RefCell};
use std::ffi::CStr;
use std::thread::LocalKey;

/// What a session keeps of a table it writes directly, read from the open relation.
pub trait Shaped: Copy + 'static {
    fn relid(&self) -> pg_sys::Oid;
    /// Whether a change of the relation `relid` (its relcache invalidation) may change this.
    fn depends_on(&self, relid: pg_sys::Oid) -> bool {
        self.relid() == relid
    }
}

/// A session's shape of one table (in a `thread_local!`), forgotten when the table (or what
/// the shape [`Shaped::depends_on`]) changes: any `ALTER TABLE`, `CREATE TRIGGER` or `DROP`
/// sends the invalidation.
pub struct ShapeCache<S: 'static> {
    shape: RefCell<Option<S>>,
    registered: Cell<bool>,
}

impl<S> ShapeCache<S> {
    pub const fn new() -> Self {
        ShapeCache {
            shape: RefCell::new(None),
            registered: Cell::new(false),
        }
    }
}

/// Runs in the middle of cache invalidation processing: only forgets, never raises. `arg` is
/// the address of the `thread_local!` key of a `ShapeCache<S>` (see [`open_cached`]).
#[pg_guard]
unsafe extern "C-unwind" fn forget_shape<S: Shaped>(arg: pg_sys::Datum, relid: pg_sys::Oid) {
    // SAFETY: registered by open_cached with the address of a 'static LocalKey of this type.
    let key = unsafe { &*arg.cast_mut_ptr::<LocalKey<ShapeCache<S>>>() };
    let _ = key.try_with(|cache| {
        if let Ok(mut s) = cache.shape.try_borrow_mut() {
            if relid == pg_sys::InvalidOid || s.as_ref().is_some_and(|s| s.depends_on(relid)) {
                *s = None;
            }
        }
    });
}

/// The oid of `amqp.<name>`, or `None` when it is not there.
fn relid_of(name: &CStr) -> Option<pg_sys::Oid> {
    // SAFETY: catalog lookups on the backend's main thread inside a transaction; missing_ok.
    unsafe {
        let schema = pg_sys::get_namespace_oid(c"amqp".as_ptr(), true);
        if schema == pg_sys::InvalidOid {
            return None;
        }
        let relid = pg_sys::get_relname_relid(name.as_ptr(), schema);
        (relid != pg_sys::InvalidOid).then_some(relid)
    }
}

/// Opens `amqp.<name>` with RowExclusiveLock (kept until the transaction ends, as for an
/// INSERT) with its shape: the one in `cache`, or read by `shape_of` (then `true`, a new
/// reading). `None` when the table is not there.
pub fn open_cached<S: Shaped>(
    cache: &'static LocalKey<ShapeCache<S>>,
    name: &CStr,
    shape_of: unsafe fn(pg_sys::Relation) -> S,
) -> Option<(pg_sys::Relation, S, bool)> {
    if !cache.with(|c| c.registered.replace(true)) {
        // SAFETY: on the backend's main thread, once per process and cache (the flag). The
        // callback has PostgreSQL's RelcacheCallbackFunction signature and lives as long as
        // the library; its argument is the address of a 'static thread-local key.
        unsafe {
            pg_sys::CacheRegisterRelcacheCallback(
                Some(forget_shape::<S>),
                pg_sys::Datum::from(cache as *const LocalKey<ShapeCache<S>> as usize),
            )
        };
    }
    let lock = pg_sys::RowExclusiveLock as pg_sys::LOCKMODE;
    let cached = cache.with(|c| c.shape.borrow().map(|s| s.relid()));
    let mut rel = match cached {
        // SAFETY: on the backend's main thread inside a transaction; try_table_open returns
        // NULL for a relation dropped since it was cached.
        Some(relid) => unsafe { pg_sys::try_table_open(relid, lock) },
        None => std::ptr::null_mut(),
    };
    if rel.is_null() {
        cache.with(|c| *c.shape.borrow_mut() = None);
        // SAFETY: as above; the oid was just looked up.
        rel = unsafe { pg_sys::try_table_open(relid_of(name)?, lock) };
        if rel.is_null() {
            return None;
        }
    }
    // Taking the lock processed pending invalidations: a cached shape still here is current.
    if let Some(shape) = cache.with(|c| *c.shape.borrow()) {
        return Some((rel, shape, false));
    }
    // SAFETY: `rel` is open and locked.
    let shape = unsafe { shape_of(rel) };
    cache.with(|c| *c.shape.borrow_mut() = Some(shape));
    Some((rel, shape, true))
}

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
