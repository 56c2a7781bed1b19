//! Which `broker_id`s exist, remembered per backend so that `publish()` does not look the broker
//! up on every call (an index scan per message, about 5 % of a publish).
//!
//! The list is dropped whenever `amqp.broker` gets a relcache invalidation. Row changes do not
//! send one by themselves, so the table's statement trigger sends it (see `_config_changed`):
//! the changing session sees its own change at once, the others at their next transaction, as
//! they would see the committed rows. A message naming a broker deleted meanwhile is parked by
//! the worker, as a row inserted directly would be.

use pgrx::prelude::*;
use std::cell::{Cell, RefCell};

struct Known {
    /// `amqp.broker`'s oid: the invalidations that concern the list.
    table: pg_sys::Oid,
    ids: Vec<i32>,
}

thread_local! {
    static KNOWN: RefCell<Option<Known>> = const { RefCell::new(None) };
    static CALLBACK_REGISTERED: Cell<bool> = const { Cell::new(false) };
}

const LOAD_SQL: &str = "\
SELECT 'amqp.broker'::pg_catalog.regclass::pg_catalog.oid, \
       pg_catalog.array_agg(DISTINCT broker_id) FROM amqp.broker";

/// Runs in the middle of cache invalidation processing: only forgets, never raises.
#[pg_guard]
unsafe extern "C-unwind" fn on_relcache_invalidation(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    // Borrowed elsewhere only around a lookup, which runs no invalidation; be safe anyway.
    let _ = KNOWN.try_with(|k| {
        if let Ok(mut k) = k.try_borrow_mut() {
            if relid == pg_sys::InvalidOid || k.as_ref().is_some_and(|known| known.table == relid) {
                *k = None;
            }
        }
    });
}

/// Whether `broker_id` names a row of `amqp.broker`. Loading the list reads the table with the
/// rights of the extension's owner (it holds passwords; callers need no rights on it).
pub fn exists(broker_id: i32) -> pgrx::spi::SpiResult<bool> {
    if !CALLBACK_REGISTERED.replace(true) {
        // SAFETY: on the backend's main thread, once per process (the flag above). The callback
        // has PostgreSQL's RelcacheCallbackFunction signature and lives as long as the library.
        unsafe {
            pg_sys::CacheRegisterRelcacheCallback(
                Some(on_relcache_invalidation),
                pg_sys::Datum::from(0),
            )
        };
    }
    if let Some(found) = KNOWN.with_borrow(|k| k.as_ref().map(|k| k.ids.contains(&broker_id))) {
        return Ok(found);
    }
    let owner = super::run_as::extension_owner();
    let (table, ids) = Spi::connect(|client| {
        // Only this fixed, fully qualified statement runs as the owner.
        let _as_owner = super::run_as::RunAs::new(owner);
        client
            .select(LOAD_SQL, Some(1), &[])?
            .first()
            .get_two::<pg_sys::Oid, Vec<i32>>()
    })?;
    let ids = ids.unwrap_or_default();
    let found = ids.contains(&broker_id);
    if let Some(table) = table {
        KNOWN.with_borrow_mut(|k| *k = Some(Known { table, ids }));
    }
    Ok(found)
}

/// `amqp.broker` changed in this transaction: every session must drop its list.
pub fn invalidate(table: pg_sys::Oid) {
    // SAFETY: on the backend's main thread, in the transaction that changed the table; `table`
    // is the triggering relation's oid, so its catalog lookup succeeds.
    unsafe { pg_sys::CacheInvalidateRelcacheByRelid(table) };
}
