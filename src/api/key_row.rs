//! Claims an idempotency key by writing its row into `amqp.idempotency_key` directly
//! ([`super::table_write`]), leaving the upsert through SPI to the rare cases.
//!
//! Why: the `INSERT … ON CONFLICT … RETURNING` through SPI made a keyed publish cost three
//! times a plain one (38 against 11 µs a call), nearly all of it the executor around a one-row
//! statement.
//!
//! How it decides as the upsert would: the key is looked up in the primary key with a dirty
//! snapshot (as a unique check does) while the session holds a lock on the key, from the lookup
//! until the new row's index entry is in, so two sessions never both find nothing and insert.
//! The lock is an object lock on the table's oid and the key's hash (visible in `pg_locks` for
//! that instant; another key with the same hash only waits as long). What the lookup finds:
//! nothing — the row is inserted, the publish is the first; a committed row within the window —
//! its id; a row of a transaction still running, or an expired row — the upsert decides (it
//! waits for that transaction at the primary key, it updates an expired row). Under REPEATABLE
//! READ and SERIALIZABLE the upsert always decides: it raises 40001 for a key taken after the
//! transaction's snapshot. So does a table not as the extension made it (a trigger, a constraint,
//! a column a DBA added).

use super::table_write::{ShapeCache, Shaped};
use pgrx::prelude::*;
use pgrx::IntoDatum;
use std::ffi::CStr;

extern "C-unwind" {
    /// PostgreSQL's hash of a byte string (common/hashfn.h), exported by the server, missing
    /// from pgrx's bindings. Never raises.
    fn hash_bytes(k: *const u8, keylen: i32) -> u32;
}

/// What the direct path decided.
pub enum Claim {
    /// The key's row is inserted: this publish is the first.
    First,
    /// A committed publish took the key within the window, as this message.
    Seen(i64),
    /// Not decided here: the upsert must.
    Ask,
}

#[derive(Clone, Copy)]
enum Shape {
    /// Written directly: the primary key's oid and each column's place in the tuple.
    Direct {
        relid: pg_sys::Oid,
        pkey: pg_sys::Oid,
        key: usize,
        id: usize,
        published_at: usize,
    },
    /// Changed by a DBA: only the upsert honours what was added.
    General { relid: pg_sys::Oid },
}

impl Shaped for Shape {
    fn relid(&self) -> pg_sys::Oid {
        match self {
            Shape::Direct { relid, .. } | Shape::General { relid } => *relid,
        }
    }

    /// The primary key too: a REINDEX CONCURRENTLY gives it another oid.
    fn depends_on(&self, relid: pg_sys::Oid) -> bool {
        match self {
            Shape::Direct { relid: r, pkey, .. } => *r == relid || *pkey == relid,
            Shape::General { relid: r } => *r == relid,
        }
    }
}

thread_local! {
    static SHAPE: ShapeCache<Shape> = const { ShapeCache::new() };
}

/// The table's one CHECK constraint, enforced by `Later::check` before a key gets here.
const KNOWN_CHECK: &str = "idempotency_key_valid";

/// Reads the shape of the open relation.
///
/// # Safety
/// `rel` is open (and locked) in this transaction.
unsafe fn shape_of(rel: pg_sys::Relation) -> Shape {
    // SAFETY: the caller keeps `rel` open; its relcache fields are valid meanwhile.
    unsafe {
        let relid = (*rel).rd_id;
        let general = Shape::General { relid };
        let class = &*(*rel).rd_rel;
        if class.relkind != pg_sys::RELKIND_RELATION as std::ffi::c_char
            || !(*rel).trigdesc.is_null()
        {
            return general;
        }
        let desc = (*rel).rd_att;
        let constr = (*desc).constr;
        if constr.is_null() {
            return general;
        }
        let constr = &*constr;
        if constr.has_generated_stored
            || constr.num_check != 1
            || CStr::from_ptr((*constr.check).ccname).to_bytes() != KNOWN_CHECK.as_bytes()
        {
            return general;
        }
        let (mut key, mut id, mut published_at) = (None, None, None);
        for (i, att) in crate::pg_compat::tuple_desc_attrs(desc).iter().enumerate() {
            if att.attisdropped {
                continue;
            }
            let (place, type_oid) = match CStr::from_ptr(att.attname.data.as_ptr()).to_bytes() {
                b"key" => (&mut key, pg_sys::TEXTOID),
                b"id" => (&mut id, pg_sys::INT8OID),
                b"published_at" => (&mut published_at, pg_sys::TIMESTAMPTZOID),
                _ => return general,
            };
            if att.atttypid != type_oid || att.attgenerated != 0 || place.is_some() {
                return general;
            }
            *place = Some(i);
        }
        let (Some(key), Some(id), Some(published_at)) = (key, id, published_at) else {
            return general;
        };
        // The primary key must be the btree on the key alone, checked at once.
        pg_sys::list_free(pg_sys::RelationGetIndexList(rel));
        let pkey = (*rel).rd_pkindex;
        if pkey == pg_sys::InvalidOid {
            return general;
        }
        let index = pg_sys::index_open(pkey, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        let form = &*(*index).rd_index;
        let on_key = (*(*index).rd_rel).relam == pg_sys::BTREE_AM_OID
            && form.indisunique
            && form.indimmediate
            && form.indnkeyatts == 1
            && form.indnatts == 1
            && i64::from(*form.indkey.values.as_ptr()) == key as i64 + 1;
        pg_sys::index_close(index, pg_sys::NoLock as pg_sys::LOCKMODE);
        if !on_key {
            return general;
        }
        Shape::Direct {
            relid,
            pkey,
            key,
            id,
            published_at,
        }
    }
}

/// Opens the table for an INSERT, with its shape; `None` when it is not there (before 0.8.0).
fn open() -> Option<(pg_sys::Relation, Shape)> {
    super::table_write::open_cached(&SHAPE, c"idempotency_key", shape_of)
        .map(|(rel, shape, _)| (rel, shape))
}

/// What the primary key holds for the key, as a unique check sees it.
enum Found {
    Nothing,
    /// Committed (or this transaction's own): its id and time.
    Row {
        id: i64,
        published_at: i64,
    },
    /// Being inserted, updated or deleted by a transaction still running, or more than one.
    Unsettled,
}

/// # Safety
/// `rel` is the table of the `Direct` shape `pkey` comes from, open in this transaction.
unsafe fn look_up(
    rel: pg_sys::Relation,
    pkey: pg_sys::Oid,
    columns: (usize, usize),
    key: pg_sys::Datum,
) -> Found {
    // SAFETY: the caller's contract; the scan, its snapshot and slot live within this call.
    unsafe {
        let mut dirty: pg_sys::SnapshotData = std::mem::zeroed();
        dirty.snapshot_type = pg_sys::SnapshotType::SNAPSHOT_DIRTY;
        let index = pg_sys::index_open(pkey, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        let mut scan_key: pg_sys::ScanKeyData = std::mem::zeroed();
        pg_sys::ScanKeyEntryInitialize(
            &mut scan_key,
            0,
            1,
            pg_sys::BTEqualStrategyNumber as pg_sys::StrategyNumber,
            pg_sys::InvalidOid,
            *(*index).rd_indcollation,
            pg_sys::Oid::from(pg_sys::F_TEXTEQ),
            key,
        );
        let scan = crate::pg_compat::index_beginscan(rel, index, &mut dirty, 1);
        pg_sys::index_rescan(scan, &mut scan_key, 1, std::ptr::null_mut(), 0);
        let slot = pg_sys::table_slot_create(rel, std::ptr::null_mut());
        let mut found = Found::Nothing;
        while pg_sys::index_getnext_slot(scan, pg_sys::ScanDirection::ForwardScanDirection, slot) {
            let running = dirty.xmin != pg_sys::InvalidTransactionId
                || dirty.xmax != pg_sys::InvalidTransactionId;
            if running || !matches!(found, Found::Nothing) {
                found = Found::Unsettled;
                break;
            }
            let (id_at, published_at_at) = columns;
            let wanted = id_at.max(published_at_at) as i32 + 1;
            if i32::from((*slot).tts_nvalid) < wanted {
                pg_sys::slot_getsomeattrs_int(slot, wanted);
            }
            let null = |i: usize| *(*slot).tts_isnull.add(i);
            let value = |i: usize| (*(*slot).tts_values.add(i)).value() as i64;
            found = if null(id_at) || null(published_at_at) {
                Found::Unsettled
            } else {
                Found::Row {
                    id: value(id_at),
                    published_at: value(published_at_at),
                }
            };
        }
        pg_sys::index_endscan(scan);
        pg_sys::ExecDropSingleTupleTableSlot(slot);
        pg_sys::index_close(index, pg_sys::NoLock as pg_sys::LOCKMODE);
        found
    }
}

/// Inserts the key's row (published now, as the column's default).
///
/// # Safety
/// `rel` is the table of the `Direct` shape the places come from, open with RowExclusiveLock.
unsafe fn insert(
    rel: pg_sys::Relation,
    places: (usize, usize, usize),
    key: pg_sys::Datum,
    id: i64,
) {
    // SAFETY: the caller's contract; the slot is made and dropped here.
    unsafe {
        let desc = (*rel).rd_att;
        let natts = (*desc).natts as usize;
        let slot = pg_sys::MakeSingleTupleTableSlot(desc, &pg_sys::TTSOpsVirtual);
        let values = std::slice::from_raw_parts_mut((*slot).tts_values, natts);
        let nulls = std::slice::from_raw_parts_mut((*slot).tts_isnull, natts);
        nulls.fill(true);
        let (key_at, id_at, published_at_at) = places;
        for (at, value) in [
            (key_at, key),
            (id_at, pg_sys::Datum::from(id)),
            (
                published_at_at,
                pg_sys::Datum::from(pg_sys::GetCurrentTransactionStartTimestamp()),
            ),
        ] {
            values[at] = value;
            nulls[at] = false;
        }
        pg_sys::ExecStoreVirtualTuple(slot);
        super::table_write::insert_slot(rel, slot);
        pg_sys::ExecDropSingleTupleTableSlot(slot);
    }
}

/// Claims `key` for the message `id` if this publish is the first with it within
/// `window_minutes`, as the upsert would; [`Claim::Ask`] where only the upsert can decide.
pub fn claim(key: &str, id: i64, window_minutes: i32) -> Claim {
    // SAFETY: a global of the backend, read on its main thread.
    if unsafe { pg_sys::XactIsoLevel } >= pg_sys::XACT_REPEATABLE_READ as i32 {
        return Claim::Ask;
    }
    // The executor's own checks for an INSERT, with the same errors (25006...).
    // SAFETY: on the backend's main thread; the command name is a static C string.
    unsafe {
        pg_sys::PreventCommandIfReadOnly(c"INSERT".as_ptr());
        pg_sys::PreventCommandIfParallelMode(c"INSERT".as_ptr());
    }
    let Some((rel, shape)) = open() else {
        return Claim::Ask;
    };
    let close = || {
        // SAFETY: opened above; the lock stays until the transaction ends, as for an INSERT.
        unsafe { pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE) }
    };
    let Shape::Direct {
        relid,
        pkey,
        key: key_at,
        id: id_at,
        published_at: published_at_at,
    } = shape
    else {
        close();
        return Claim::Ask;
    };
    let Some(key_datum) = key.into_datum() else {
        close();
        return Claim::Ask;
    };
    // SAFETY: the key's bytes, read by the hash function within the call.
    let hash = unsafe { hash_bytes(key.as_ptr(), key.len() as i32) };
    let lock = pg_sys::ExclusiveLock as pg_sys::LOCKMODE;
    // SAFETY: inside the transaction on the main thread; `rel` is of the Direct shape and open.
    let claim = unsafe {
        pg_sys::LockDatabaseObject(relid, pg_sys::Oid::from(hash), 0, lock);
        let claim = match look_up(rel, pkey, (id_at, published_at_at), key_datum) {
            Found::Nothing => {
                insert(rel, (key_at, id_at, published_at_at), key_datum, id);
                Claim::First
            }
            Found::Row { id, published_at } => {
                let window = i64::from(window_minutes) * 60 * 1_000_000;
                let now = pg_sys::GetCurrentTransactionStartTimestamp();
                if published_at >= now.saturating_sub(window) {
                    Claim::Seen(id)
                } else {
                    Claim::Ask
                }
            }
            Found::Unsettled => Claim::Ask,
        };
        // Another session looking the key up from here on finds this row.
        pg_sys::UnlockDatabaseObject(relid, pg_sys::Oid::from(hash), 0, lock);
        claim
    };
    close();
    claim
}
