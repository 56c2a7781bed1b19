//! Writes one checked message into `amqp.message` with the table access method directly, as
//! logical replication's apply does, instead of through SPI and a second executor.
//!
//! Why: a publish is one statement that calls a function; through SPI that function planned
//! nothing but still started a whole executor for its INSERT (plan revalidation, a snapshot,
//! memory contexts, a projection evaluating the column defaults, and the table's CHECK
//! constraints read back from their stored form), which made `publish()` 10–25 % slower than
//! the same INSERT typed by hand. Here the row is built in Rust and stored as
//! [`super::table_write::insert_slot`] says.
//!
//! The table's CHECK constraint is not evaluated again: [`super::publish::NewMessage::check`]
//! enforces each of its rules before the row is built. That only holds for the table as the
//! extension made it, so the direct path is taken only while the table is exactly that shape
//! (known columns, NOT NULL only where the row always has a value, the extension's CHECK
//! constraint or the eight of versions before 0.11.0, no trigger, a plain table). Anything else
//! a DBA adds (a trigger, a constraint, a column) sends every publish through the ordinary
//! INSERT, which honours it. The shape is cached per session and dropped on the table's
//! relcache invalidation, which any `ALTER TABLE`, `CREATE TRIGGER` or `DROP` sends. Row
//! security applies to neither path: the row is written for the extension's owner, a superuser.

use super::table_write::{ShapeCache, Shaped};
use pgrx::prelude::*;
use pgrx::{direct_function_call, IntoDatum};
use std::ffi::{CStr, CString};

/// A column of `amqp.message` that the direct path writes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Col {
    Id,
    ProducerPid,
    ProducerStartedAt,
    BrokerId,
    Exchange,
    RoutingKey,
    Body,
    DeliveryMode,
    ContentType,
    ReplyTo,
    CorrelationId,
    Headers,
    CreatedAt,
    Attempts,
    NextAttemptAt,
    LastError,
    ParkedAt,
    MessageId,
    BusinessType,
    BusinessKey,
    Traceparent,
    SystemId,
    HostId,
    Resends,
}

const COLS: usize = Col::Resends as usize + 1;

impl Col {
    /// The column's name, type and whether the row always carries a value for it (so that a
    /// NOT NULL constraint on it is already met).
    fn of(name: &str) -> Option<(Col, pg_sys::Oid, bool)> {
        use pg_sys::TIMESTAMPTZOID as TSTZ;
        use pg_sys::{BYTEAOID, INT2OID, INT4OID, INT8OID, JSONBOID, TEXTOID};
        Some(match name {
            "id" => (Col::Id, INT8OID, true),
            "producer_pid" => (Col::ProducerPid, INT4OID, true),
            "producer_started_at" => (Col::ProducerStartedAt, TSTZ, true),
            "broker_id" => (Col::BrokerId, INT4OID, true),
            "exchange" => (Col::Exchange, TEXTOID, true),
            "routing_key" => (Col::RoutingKey, TEXTOID, true),
            "body" => (Col::Body, BYTEAOID, true),
            "delivery_mode" => (Col::DeliveryMode, INT2OID, true),
            "content_type" => (Col::ContentType, TEXTOID, false),
            "reply_to" => (Col::ReplyTo, TEXTOID, false),
            "correlation_id" => (Col::CorrelationId, TEXTOID, false),
            "headers" => (Col::Headers, JSONBOID, false),
            "created_at" => (Col::CreatedAt, TSTZ, true),
            "attempts" => (Col::Attempts, INT4OID, true),
            "next_attempt_at" => (Col::NextAttemptAt, TSTZ, false),
            "last_error" => (Col::LastError, TEXTOID, false),
            "parked_at" => (Col::ParkedAt, TSTZ, false),
            "message_id" => (Col::MessageId, TEXTOID, true),
            "business_type" => (Col::BusinessType, TEXTOID, false),
            "business_key" => (Col::BusinessKey, TEXTOID, false),
            "traceparent" => (Col::Traceparent, TEXTOID, false),
            "system_id" => (Col::SystemId, TEXTOID, false),
            "host_id" => (Col::HostId, TEXTOID, false),
            "resends" => (Col::Resends, INT4OID, true),
            _ => return None,
        })
    }
}

/// The CHECK constraint the extension puts on `amqp.message` (0.11.0): its rules are enforced by
/// `NewMessage::check` (or, for `message_id`, by how the id is made).
const KNOWN_CHECKS: [&str; 1] = ["message_valid"];

/// The eight it had before 0.11.0 (the same rules), until `ALTER EXTENSION … UPDATE`.
const KNOWN_CHECKS_BEFORE_0_11: [&str; 8] = [
    "message_exchange_length",
    "message_routing_key_length",
    "message_content_type_length",
    "message_reply_to_length",
    "message_correlation_id_length",
    "message_delivery_mode_valid",
    "message_headers_object",
    "message_message_id_valid",
];

/// Columns that versions before 0.4.0 do not have (until `ALTER EXTENSION … UPDATE`).
const TAG_COLS: [Col; 6] = [
    Col::BusinessType,
    Col::BusinessKey,
    Col::Traceparent,
    Col::SystemId,
    Col::HostId,
    Col::Resends,
];

/// What the session knows about `amqp.message`.
#[derive(Clone, Copy)]
enum Shape {
    /// The direct path may write it: each column's index in the tuple descriptor.
    Direct {
        relid: pg_sys::Oid,
        sequence: pg_sys::Oid,
        index: [Option<u16>; COLS],
    },
    /// Something was added that only the executor honours.
    General {
        relid: pg_sys::Oid,
        why: &'static str,
    },
}

impl Shaped for Shape {
    fn relid(&self) -> pg_sys::Oid {
        match self {
            Shape::Direct { relid, .. } | Shape::General { relid, .. } => *relid,
        }
    }
}

extern "C-unwind" {
    /// `nextval()` without its ACL check (the row is written for the extension's owner, as
    /// the INSERT it replaces ran as that owner). Exported by the server, missing from pgrx's
    /// bindings (commands/sequence.h). Called only through `pg_guard_ffi_boundary`: it raises
    /// (a sequence at its maximum).
    fn nextval_internal(relid: pg_sys::Oid, check_permissions: bool) -> i64;
}

thread_local! {
    static SHAPE: ShapeCache<Shape> = const { ShapeCache::new() };
}

/// The values of one message; `None` is SQL NULL.
pub struct Row<'a> {
    /// Drawn already (an idempotency key took it); `None`: from the sequence, here.
    pub id: Option<i64>,
    pub producer_pid: i32,
    pub producer_started_at: pg_sys::TimestampTz,
    pub broker_id: i32,
    pub exchange: &'a str,
    pub routing_key: &'a str,
    pub body: &'a [u8],
    pub delivery_mode: i16,
    pub content_type: Option<&'a str>,
    pub reply_to: Option<&'a str>,
    pub correlation_id: Option<&'a str>,
    /// Checked JSON object text.
    pub headers: Option<&'a str>,
    pub business_type: Option<&'a str>,
    pub business_key: Option<&'a str>,
    pub traceparent: Option<&'a str>,
    pub system_id: Option<&'a str>,
    pub host_id: Option<&'a str>,
}

impl Row<'_> {
    /// Whether any tag has a value (the plain statements leave their columns out).
    pub fn tagged(&self) -> bool {
        self.business_type.is_some()
            || self.business_key.is_some()
            || self.traceparent.is_some()
            || self.system_id.is_some()
            || self.host_id.is_some()
    }
}

/// Reads the shape of the open relation.
///
/// # Safety
/// `rel` is open (and locked) in this transaction.
unsafe fn shape_of(rel: pg_sys::Relation) -> Shape {
    // SAFETY: the caller keeps `rel` open; its relcache fields are valid meanwhile.
    unsafe {
        let relid = (*rel).rd_id;
        let general = |why| Shape::General { relid, why };
        let class = &*(*rel).rd_rel;
        if class.relkind != pg_sys::RELKIND_RELATION as std::ffi::c_char {
            return general("it is not a plain table");
        }
        if !(*rel).trigdesc.is_null() {
            return general("it has a trigger");
        }
        let desc = (*rel).rd_att;
        let constr = (*desc).constr;
        if constr.is_null() {
            return general("its CHECK constraints are not the extension's");
        }
        let constr = &*constr;
        if constr.has_generated_stored {
            return general("it has a generated column");
        }
        let checks = usize::from(constr.num_check);
        let all_known = |known: &[&str]| {
            checks == known.len()
                && (0..checks).all(|i| {
                    let name = CStr::from_ptr((*constr.check.add(i)).ccname);
                    known.iter().any(|k| k.as_bytes() == name.to_bytes())
                })
        };
        if !all_known(&KNOWN_CHECKS) && !all_known(&KNOWN_CHECKS_BEFORE_0_11) {
            return general("its CHECK constraints are not the extension's");
        }
        let mut index = [None; COLS];
        let attrs = crate::pg_compat::tuple_desc_attrs(desc);
        for (i, att) in attrs.iter().enumerate() {
            if att.attisdropped {
                continue;
            }
            let name = CStr::from_ptr(att.attname.data.as_ptr());
            let Some((col, type_oid, always_set)) = name.to_str().ok().and_then(Col::of) else {
                return general("it has a column the extension did not make");
            };
            if att.atttypid != type_oid || att.attgenerated != 0 || index[col as usize].is_some() {
                return general("a column's type is not the extension's");
            }
            if att.attnotnull && !always_set {
                return general("a column publish() may leave NULL is NOT NULL");
            }
            // A tuple descriptor has at most 1,600 attributes.
            index[col as usize] = u16::try_from(i).ok();
        }
        // Every column but the 0.4.0 tags must be there; a tagless table is 0.3.0's.
        let required_missing = (0..COLS)
            .filter(|c| index[*c].is_none())
            .any(|c| !TAG_COLS.iter().any(|t| *t as usize == c));
        let tags_partial = TAG_COLS.iter().any(|t| index[*t as usize].is_some())
            && TAG_COLS.iter().any(|t| index[*t as usize].is_none());
        if required_missing || tags_partial {
            return general("a column the extension made is missing");
        }
        let Some(id_attnum) = index[Col::Id as usize] else {
            return general("a column the extension made is missing");
        };
        let sequence = crate::pg_compat::identity_sequence(rel, id_attnum as i16 + 1, true);
        if sequence == pg_sys::InvalidOid {
            return general("its id is not an identity column");
        }
        Shape::Direct {
            relid,
            sequence,
            index,
        }
    }
}

/// Opens `amqp.message` for an INSERT and returns it with its shape, or `None` when the
/// table is not there (the ordinary INSERT then raises the proper error).
fn open() -> Option<(pg_sys::Relation, Shape)> {
    let (rel, shape, fresh) = super::table_write::open_cached(&SHAPE, c"message", shape_of)?;
    if let (true, Shape::General { why, .. }) = (fresh, shape) {
        // Once per session and change of the table: why publish() costs an executor here.
        debug1!("amqp_outbox: publish() writes amqp.message with an INSERT, since {why}");
    }
    Some((rel, shape))
}

/// Draws the next message id from `amqp.message`'s sequence, as [`insert`] does: `None` when
/// the table is not in the shape this path knows (the caller then asks SQL's `nextval()`).
pub fn draw_id() -> Option<i64> {
    let (rel, shape) = open()?;
    let id = match shape {
        // SAFETY: on the backend's main thread; `nextval_internal` raises through the guard.
        Shape::Direct { sequence, .. } => Some(unsafe {
            pg_sys::ffi::pg_guard_ffi_boundary(|| nextval_internal(sequence, false))
        }),
        Shape::General { .. } => None,
    };
    // SAFETY: opened above; the lock stays until the transaction ends, as for an INSERT.
    unsafe { pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE) };
    id
}

/// Inserts the row and returns its id, or `None` (nothing done) when the table is not in the
/// shape this path can write: the caller then runs the ordinary INSERT.
pub fn insert(row: &Row<'_>) -> Option<i64> {
    // The executor's own checks for an INSERT, with the same errors (25006, 25000...).
    // SAFETY: on the backend's main thread; the command name is a static C string.
    unsafe {
        pg_sys::PreventCommandIfReadOnly(c"INSERT".as_ptr());
        pg_sys::PreventCommandIfParallelMode(c"INSERT".as_ptr());
    }
    let (rel, shape) = open()?;
    let Shape::Direct {
        sequence, index, ..
    } = shape
    else {
        // SAFETY: opened above; the lock stays until the transaction ends, as for an INSERT.
        unsafe { pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE) };
        return None;
    };
    if row.tagged() && index[Col::BusinessType as usize].is_none() {
        // SAFETY: as above.
        unsafe { pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE) };
        return None;
    }
    // SAFETY: `rel` is open and locked for the rest of the transaction; every pointer below is
    // made here and freed here, or palloc'd in the call's memory context.
    unsafe { Some(write(rel, sequence, &index, row)) }
}

/// # Safety
/// `rel` is `amqp.message`, open with RowExclusiveLock, of the `Direct` shape `index` describes.
unsafe fn write(
    rel: pg_sys::Relation,
    sequence: pg_sys::Oid,
    index: &[Option<u16>; COLS],
    row: &Row<'_>,
) -> i64 {
    // SAFETY: see the function's contract.
    unsafe {
        let desc = (*rel).rd_att;
        let natts = (*desc).natts as usize;
        let slot = pg_sys::MakeSingleTupleTableSlot(desc, &pg_sys::TTSOpsVirtual);
        let values = std::slice::from_raw_parts_mut((*slot).tts_values, natts);
        let nulls = std::slice::from_raw_parts_mut((*slot).tts_isnull, natts);
        nulls.fill(true);
        let mut set = |col: Col, datum: Option<pg_sys::Datum>| {
            if let (Some(i), Some(d)) = (index[col as usize], datum) {
                values[usize::from(i)] = d;
                nulls[usize::from(i)] = false;
            }
        };
        // The id is drawn after the caller took its transaction id (the worker's scan floor).
        let id = match row.id {
            Some(id) => id,
            None => pg_sys::ffi::pg_guard_ffi_boundary(|| nextval_internal(sequence, false)),
        };
        set(Col::Id, Some(pg_sys::Datum::from(id)));
        set(Col::ProducerPid, row.producer_pid.into_datum());
        set(
            Col::ProducerStartedAt,
            Some(pg_sys::Datum::from(row.producer_started_at)),
        );
        set(Col::BrokerId, row.broker_id.into_datum());
        set(Col::Exchange, row.exchange.into_datum());
        set(Col::RoutingKey, row.routing_key.into_datum());
        set(Col::Body, row.body.into_datum());
        set(Col::DeliveryMode, row.delivery_mode.into_datum());
        set(Col::ContentType, row.content_type.into_datum());
        set(Col::ReplyTo, row.reply_to.into_datum());
        set(Col::CorrelationId, row.correlation_id.into_datum());
        set(Col::Headers, row.headers.map(jsonb));
        // now(): the transaction's start, as the column's default.
        set(
            Col::CreatedAt,
            Some(pg_sys::Datum::from(
                pg_sys::GetCurrentTransactionStartTimestamp(),
            )),
        );
        set(Col::Attempts, 0i32.into_datum());
        set(
            Col::MessageId,
            super::message_id::new_message_id().into_datum(),
        );
        set(Col::BusinessType, row.business_type.into_datum());
        set(Col::BusinessKey, row.business_key.into_datum());
        set(Col::Traceparent, row.traceparent.into_datum());
        set(Col::SystemId, row.system_id.into_datum());
        set(Col::HostId, row.host_id.into_datum());
        set(Col::Resends, 0i32.into_datum());
        pg_sys::ExecStoreVirtualTuple(slot);

        super::table_write::insert_slot(rel, slot);
        pg_sys::ExecDropSingleTupleTableSlot(slot);
        pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        id
    }
}

/// The checked header text as a `jsonb` datum (raises jsonb's own error for what it refuses,
/// such as `\u0000`, as the INSERT's cast did).
fn jsonb(text: &str) -> pg_sys::Datum {
    // JSON text has no raw NUL (jsonb_out escapes it); an empty string is refused by jsonb_in.
    let text = CString::new(text).unwrap_or_default();
    // SAFETY: jsonb_in takes a C string and returns a palloc'd jsonb, or raises.
    let datum = unsafe {
        direct_function_call::<pg_sys::Datum>(pg_sys::jsonb_in, &[text.as_c_str().into_datum()])
    };
    match datum {
        Some(d) => d,
        None => crate::error::OutboxError::InvalidHeaders("not a jsonb value".into()).raise(),
    }
}
