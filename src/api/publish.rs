//! `amqp.publish()` and friends: validate, INSERT one row into `amqp.message` in the caller's
//! transaction, and arrange for the worker to be woken when that transaction commits.
//! Runs in user backends: no threads, no network.

use super::jsonb_arg::JsonbArg;
use super::known_brokers;
use super::outbox_row;
use super::publish_later::{self, KeyClaim, Later};
use super::row_params::{row_args, MESSAGE_COLUMNS, MESSAGE_VALUES, TAG_COLUMNS, TAG_VALUES};
use super::run_as::{extension_owner, RunAs};
use crate::error::{OrRaise, OutboxError};
use crate::headers::Unsendable;
use crate::{commit_wake, shmem};
use pgrx::datum::Interval;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;
use pgrx::spi::OwnedPreparedStatement;
use std::cell::{Cell, RefCell};

/// AMQP short strings (exchange, routing key, properties) are at most 255 bytes.
const SHORTSTR_MAX: usize = 255;

/// The largest encoded header table publish() accepts. A message's properties travel in one
/// frame, and RabbitMQ's frames are 128 KiB unless configured otherwise: this leaves room for
/// the other properties and the worker's own headers. (A broker with smaller frames still
/// refuses larger ones: the worker parks such a message at once, with the reason.)
const HEADERS_MAX: usize = 64 * 1024;

/// The INSERT, planned once per session and kept across transactions, and the role it runs as.
struct Insert {
    plan: OwnedPreparedStatement,
    /// The extension's owner: callers need EXECUTE on the function, not rights on the tables.
    owner: pg_sys::Oid,
}

thread_local! {
    /// Indexed by [`Statement::index`].
    static INSERTS: RefCell<[Option<Insert>; 4]> = const { RefCell::new([None, None, None, None]) };
    static LAST_ID: Cell<Option<i64>> = const { Cell::new(None) };
    /// Whether this session was checked for publishing in a database the worker does not serve.
    static NOT_SERVED_CHECKED: Cell<bool> = const { Cell::new(false) };
}

/// The ordinary INSERT's variants: with tags (0.4.0) and with an id drawn already (an
/// idempotency key, 0.8.0). A message without either takes the plain statement: it is the
/// cheaper one, and it still works while the library is newer than the installed SQL (before
/// `ALTER EXTENSION amqp_outbox UPDATE`).
#[derive(Clone, Copy)]
struct Statement {
    tagged: bool,
    with_id: bool,
}

impl Statement {
    fn index(self) -> usize {
        usize::from(self.tagged) * 2 + usize::from(self.with_id)
    }

    /// Built from the fixed parts above only; every value is a parameter.
    fn sql(self) -> String {
        let mut columns = MESSAGE_COLUMNS.to_owned();
        let mut values = MESSAGE_VALUES.to_owned();
        let mut n = 11;
        if self.tagged {
            columns = format!("{columns}, {TAG_COLUMNS}");
            values = format!("{values}, {TAG_VALUES}");
            n = 16;
        }
        if self.with_id {
            columns.push_str(", id");
            values.push_str(&format!(", ${}", n + 1));
        }
        format!("INSERT INTO amqp.message ({columns}) VALUES ({values}) RETURNING id")
    }
}

/// Longest business type, system id and host id; business keys may be longer (as in
/// `consume_once`).
const TAG_MAX: usize = 255;
const BUSINESS_KEY_MAX: usize = 1000;

/// The reconciliation tags a caller gave (each optional).
#[derive(Default, Clone, Copy)]
pub struct Tags<'a> {
    pub business_type: Option<&'a str>,
    pub business_key: Option<&'a str>,
    pub traceparent: Option<&'a str>,
}

/// The tags to store: the caller's, and the session's settings where the caller gave none.
/// `None` for system and host id means the worker's default (database and host name).
#[derive(Default, PartialEq, Eq)]
struct StoredTags {
    business_type: Option<String>,
    business_key: Option<String>,
    traceparent: Option<String>,
    system_id: Option<String>,
    host_id: Option<String>,
}

fn tag(value: Option<&str>, what: &'static str, max: usize) -> Result<Option<String>, OutboxError> {
    match value {
        None => Ok(None),
        Some("") => Err(OutboxError::EmptyName(what)),
        Some(v) if v.len() > max => Err(OutboxError::TagTooLong {
            what,
            bytes: v.len(),
            max,
        }),
        Some(v) => Ok(Some(v.to_owned())),
    }
}

impl StoredTags {
    fn check(given: Tags<'_>) -> Result<Self, OutboxError> {
        let traceparent = match given.traceparent {
            Some(t) => Some(t.to_owned()),
            None => crate::gucs::text(&crate::gucs::TRACEPARENT),
        };
        if let Some(t) = &traceparent {
            if !crate::headers::valid_traceparent(t) {
                return Err(OutboxError::InvalidTraceparent(
                    t.chars().take(80).collect(),
                ));
            }
        }
        Ok(StoredTags {
            business_type: tag(given.business_type, "business_type", TAG_MAX)?,
            business_key: tag(given.business_key, "business_key", BUSINESS_KEY_MAX)?,
            traceparent,
            system_id: tag(
                crate::gucs::text(&crate::gucs::SYSTEM_ID).as_deref(),
                "amqp_outbox.system_id",
                TAG_MAX,
            )?,
            host_id: tag(
                crate::gucs::text(&crate::gucs::HOST_ID).as_deref(),
                "amqp_outbox.host_id",
                TAG_MAX,
            )?,
        })
    }
}

/// A message to insert, already checked.
pub struct NewMessage<'a> {
    pub broker_id: i32,
    pub exchange: &'a str,
    pub routing_key: &'a str,
    pub body: &'a [u8],
    pub delivery_mode: i16,
    pub content_type: Option<&'a str>,
    pub reply_to: Option<&'a str>,
    pub correlation_id: Option<&'a str>,
    /// The headers' jsonb text, checked: a JSON object that AMQP can carry.
    pub headers: Option<String>,
    tags: StoredTags,
}

fn required<T>(value: Option<T>, name: &'static str) -> Result<T, OutboxError> {
    value.ok_or(OutboxError::NullArgument(name))
}

fn short_string(value: &str, what: &'static str) -> Result<(), OutboxError> {
    if value.len() > SHORTSTR_MAX {
        return Err(OutboxError::TooLong {
            what,
            bytes: value.len(),
        });
    }
    Ok(())
}

fn delivery_mode(mode: Option<i32>) -> Result<i16, OutboxError> {
    match mode {
        None | Some(2) => Ok(2),
        Some(1) => Ok(1),
        Some(other) => Err(OutboxError::InvalidDeliveryMode(other)),
    }
}

/// What the worker would refuse is refused here, synchronously: values serde_json cannot hold
/// (`1e400`, nesting deeper than 128), header names over 255 bytes, tables too large for a frame.
fn check_headers(headers: Option<JsonbArg>) -> Result<Option<String>, OutboxError> {
    let Some(JsonbArg(text)) = headers else {
        return Ok(None);
    };
    let map = crate::headers::parse_object(&text).map_err(|e| {
        OutboxError::InvalidHeaders(match e {
            Unsendable::NotObject(kind) => {
                format!("expected a JSON object of header names to values, got {kind}")
            }
            other => other.to_string(),
        })
    })?;
    let bytes = amqp_outbox_broker::header_table_size(&map).map_err(OutboxError::InvalidHeaders)?;
    if bytes > HEADERS_MAX {
        return Err(OutboxError::HeadersTooLarge {
            bytes,
            max: HEADERS_MAX,
        });
    }
    Ok(Some(text))
}

impl<'a> NewMessage<'a> {
    #[allow(clippy::too_many_arguments)]
    pub fn check(
        broker_id: Option<i32>,
        exchange: Option<&'a str>,
        routing_key: Option<&'a str>,
        body: Option<&'a [u8]>,
        headers: Option<JsonbArg>,
        mode: Option<i32>,
        content_type: Option<&'a str>,
        reply_to: Option<&'a str>,
        correlation_id: Option<&'a str>,
        tags: Tags<'_>,
    ) -> Result<Self, OutboxError> {
        let broker_id = required(broker_id, "broker_id")?;
        let exchange = required(exchange, "exchange")?;
        let routing_key = required(routing_key, "routing_key")?;
        let body = required(body, "message")?;
        short_string(exchange, "exchange")?;
        short_string(routing_key, "routing_key")?;
        for (value, what) in [
            (content_type, "content_type"),
            (reply_to, "reply_to"),
            (correlation_id, "correlation_id"),
        ] {
            if let Some(v) = value {
                short_string(v, what)?;
            }
        }
        let delivery_mode = delivery_mode(mode)?;
        let max = crate::gucs::MAX_MESSAGE_SIZE.get().max(0) as usize;
        if body.len() > max {
            return Err(OutboxError::BodyTooLarge {
                bytes: body.len(),
                max,
            });
        }
        let headers = check_headers(headers)?;
        let tags = StoredTags::check(tags)?;
        Ok(NewMessage {
            broker_id,
            exchange,
            routing_key,
            body,
            delivery_mode,
            content_type,
            reply_to,
            correlation_id,
            headers,
            tags,
        })
    }

    /// Inserts the row and returns its id.
    pub fn insert(self) -> i64 {
        self.insert_with(Later::default())
    }

    /// Inserts the row, or schedules it, or finds the message its idempotency key published;
    /// returns the message's id.
    pub fn insert_with(self, later: Later<'_>) -> i64 {
        if !shmem::ready() {
            ErrorReport::new(
                PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
                "amqp_outbox: the library is not loaded at server start, so no worker would publish this message",
                "amqp_outbox",
            )
            .set_hint("Add amqp_outbox to shared_preload_libraries in postgresql.conf and restart the server.")
            .report(PgLogLevel::ERROR);
        }
        warn_once_if_not_served();
        if let Some(cap) = pending_cap_exceeded(self.broker_id) {
            ErrorReport::new(
                PgSqlErrorCode::ERRCODE_CONFIGURATION_LIMIT_EXCEEDED,
                format!(
                    "amqp_outbox: broker {} has {} messages waiting, amqp_outbox.max_pending is {cap}",
                    self.broker_id,
                    shmem::pending(self.broker_id).unwrap_or_default()
                ),
                "amqp_outbox",
            )
            .set_hint("The broker is not taking messages fast enough (see amqp.broker_status); retry later.")
            .report(PgLogLevel::ERROR);
        }
        // The transaction takes its id before the row draws one from the sequence: the worker's
        // scan floor relies on that order (engine/src/scan_floor.rs). The INSERT would take it
        // anyway, a moment later.
        // (Not in a read-only transaction or on a standby: the INSERT raises the proper error.)
        // SAFETY: inside the caller's transaction, on the backend's main thread; globals read
        // on that thread.
        unsafe {
            if !pg_sys::XactReadOnly && !pg_sys::RecoveryInProgress() {
                pg_sys::GetCurrentTransactionId();
            }
        }
        match known_brokers::exists(self.broker_id) {
            Ok(true) => {}
            Ok(false) => OutboxError::UnknownBroker(self.broker_id).raise(),
            Err(e) => insert_failed(e),
        }
        let id = match later.idempotency_key.map(publish_later::claim_key) {
            None => None,
            Some(Ok(KeyClaim::First(id))) => Some(id),
            Some(Ok(KeyClaim::Seen(id))) => {
                // Published before: nothing new to publish, and nothing to wake the worker for.
                LAST_ID.set(Some(id));
                return id;
            }
            Some(Err(e)) => insert_failed(e),
        };
        // SAFETY: globals set once at process start, read on the backend's main thread.
        let (pid, started_at) = unsafe { (pg_sys::MyProcPid, pg_sys::MyStartTimestamp) };
        let row = outbox_row::Row {
            id,
            producer_pid: pid,
            producer_started_at: started_at,
            broker_id: self.broker_id,
            exchange: self.exchange,
            routing_key: self.routing_key,
            body: self.body,
            delivery_mode: self.delivery_mode,
            content_type: self.content_type,
            reply_to: self.reply_to,
            correlation_id: self.correlation_id,
            headers: self.headers.as_deref(),
            business_type: self.tags.business_type.as_deref(),
            business_key: self.tags.business_key.as_deref(),
            traceparent: self.tags.traceparent.as_deref(),
            system_id: self.tags.system_id.as_deref(),
            host_id: self.tags.host_id.as_deref(),
        };
        if let Some(delay) = later.deliver_after {
            // Not due yet: at commit the worker learns when it is (the table's trigger).
            let id = publish_later::schedule(&row, id, delay).unwrap_or_else(|e| insert_failed(e));
            LAST_ID.set(Some(id));
            return id;
        }
        let id = match outbox_row::insert(&row) {
            Some(id) => id,
            None => Self::insert_with_spi(&row),
        };
        LAST_ID.set(Some(id));
        commit_wake::wake_worker_at_commit();
        id
    }

    /// The ordinary INSERT, planned once per session: for a table a DBA changed (a trigger, a
    /// constraint, a column), which [`outbox_row`] leaves to the executor.
    fn insert_with_spi(row: &outbox_row::Row<'_>) -> i64 {
        let statement = Statement {
            tagged: row.tagged(),
            with_id: row.id.is_some(),
        };
        let mut args = row_args(row, statement.tagged);
        if let Some(id) = row.id {
            args.push(id.into());
        }
        let id = Spi::connect_mut(|client| {
            INSERTS.with_borrow_mut(|inserts| {
                let slot = &mut inserts[statement.index()];
                let insert = match slot {
                    Some(insert) => insert,
                    None => {
                        let owner = extension_owner();
                        let oids: Vec<PgOid> = args.iter().map(|a| PgOid::from(a.oid())).collect();
                        let plan = client.prepare_mut(&statement.sql(), &oids)?.keep();
                        slot.insert(Insert { plan, owner })
                    }
                };
                // Only these fixed, fully qualified statements run as the owner.
                let _as_owner = RunAs::new(insert.owner);
                let table = client.update(&insert.plan, None, &args)?;
                table.first().get_one::<i64>()
            })
        });
        match id {
            Ok(Some(id)) => id,
            Ok(None) => insert_failed("the INSERT returned no id"),
            Err(e) => {
                // A stale plan (extension dropped and re-created) must not stay cached.
                INSERTS.with_borrow_mut(|p| p[statement.index()] = None);
                insert_failed(e)
            }
        }
    }
}

fn insert_failed(e: impl std::fmt::Display) -> ! {
    ErrorReport::new(
        PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
        format!("amqp_outbox: could not insert into amqp.message: {e}"),
        "amqp_outbox",
    )
    .report(PgLogLevel::ERROR);
    unreachable!()
}

/// Workers serve the databases `amqp_outbox.database` allows, up to `amqp_outbox.max_workers`:
/// a session that publishes in another one is warned once, since its messages wait there.
fn warn_once_if_not_served() {
    if NOT_SERVED_CHECKED.replace(true) {
        return;
    }
    // SAFETY: MyDatabaseId is set in a backend connected to a database; get_database_name
    // returns a palloc'd copy of its name, or NULL when it no longer exists.
    let (oid, this) = unsafe {
        let name = pg_sys::get_database_name(pg_sys::MyDatabaseId);
        if name.is_null() {
            return;
        }
        let this = std::ffi::CStr::from_ptr(name)
            .to_string_lossy()
            .into_owned();
        (pg_sys::MyDatabaseId.to_u32(), this)
    };
    let (why, hint) = if !crate::gucs::database_filter().allows(&this) {
        (
            format!(
                "amqp_outbox.database = '{}'",
                crate::gucs::database_filter_text()
            ),
            "Add this database to amqp_outbox.database in postgresql.conf and reload the configuration.",
        )
    } else if crate::shmem::launch::unserved()
        .iter()
        .any(|(o, _)| *o == oid)
    {
        (
            format!("amqp_outbox.max_workers = {}", crate::gucs::max_workers()),
            "Raise amqp_outbox.max_workers (and max_worker_processes) and restart the server.",
        )
    } else {
        return;
    };
    ErrorReport::new(
        PgSqlErrorCode::ERRCODE_WARNING,
        format!(
            "amqp_outbox: no worker serves database \"{this}\" ({why}): messages published here wait until it is served"
        ),
        "amqp_outbox",
    )
    .set_hint(hint)
    .report(PgLogLevel::WARNING);
}

/// `Some(cap)` when `amqp_outbox.max_pending` is set and the broker's backlog (as the worker last
/// counted it, about once a second) has reached it.
fn pending_cap_exceeded(broker_id: i32) -> Option<i32> {
    let cap = crate::gucs::MAX_PENDING.get();
    if cap <= 0 {
        return None;
    }
    (shmem::pending(broker_id)? >= cap as i64).then_some(cap)
}

/// pg_amqp's signature: existing callers work unchanged.
#[pg_extern(volatile, parallel_unsafe)]
#[allow(clippy::too_many_arguments)]
fn publish(
    broker_id: Option<i32>,
    exchange: Option<&str>,
    routing_key: Option<&str>,
    message: Option<&str>,
    delivery_mode: default!(Option<i32>, "NULL"),
    content_type: default!(Option<&str>, "NULL"),
    reply_to: default!(Option<&str>, "NULL"),
    correlation_id: default!(Option<&str>, "NULL"),
) -> bool {
    NewMessage::check(
        broker_id,
        exchange,
        routing_key,
        message.map(str::as_bytes),
        None,
        delivery_mode,
        content_type,
        reply_to,
        correlation_id,
        Tags::default(),
    )
    .or_raise()
    .insert();
    true
}

/// Like `publish`, with AMQP headers, the reconciliation tags, a delay and an idempotency key;
/// returns the message id (with a key published before within the window: that message's id).
#[pg_extern(volatile, parallel_unsafe, name = "publish_message")]
#[allow(clippy::too_many_arguments)]
fn publish_message_later(
    broker_id: Option<i32>,
    exchange: Option<&str>,
    routing_key: Option<&str>,
    body: Option<&str>,
    headers: default!(Option<JsonbArg>, "NULL"),
    delivery_mode: default!(Option<i32>, "NULL"),
    content_type: default!(Option<&str>, "NULL"),
    reply_to: default!(Option<&str>, "NULL"),
    correlation_id: default!(Option<&str>, "NULL"),
    business_type: default!(Option<&str>, "NULL"),
    business_key: default!(Option<&str>, "NULL"),
    traceparent: default!(Option<&str>, "NULL"),
    deliver_after: default!(Option<Interval>, "NULL"),
    idempotency_key: default!(Option<&str>, "NULL"),
) -> i64 {
    let message = NewMessage::check(
        broker_id,
        exchange,
        routing_key,
        body.map(str::as_bytes),
        headers,
        delivery_mode,
        content_type,
        reply_to,
        correlation_id,
        Tags {
            business_type,
            business_key,
            traceparent,
        },
    )
    .or_raise();
    message.insert_with(Later::check(deliver_after, idempotency_key).or_raise())
}

/// A binary body; returns the message id.
#[pg_extern(volatile, parallel_unsafe, name = "publish_bytes")]
#[allow(clippy::too_many_arguments)]
fn publish_bytes_later(
    broker_id: Option<i32>,
    exchange: Option<&str>,
    routing_key: Option<&str>,
    body: Option<&[u8]>,
    headers: default!(Option<JsonbArg>, "NULL"),
    delivery_mode: default!(Option<i32>, "NULL"),
    content_type: default!(Option<&str>, "NULL"),
    reply_to: default!(Option<&str>, "NULL"),
    correlation_id: default!(Option<&str>, "NULL"),
    business_type: default!(Option<&str>, "NULL"),
    business_key: default!(Option<&str>, "NULL"),
    traceparent: default!(Option<&str>, "NULL"),
    deliver_after: default!(Option<Interval>, "NULL"),
    idempotency_key: default!(Option<&str>, "NULL"),
) -> i64 {
    let message = NewMessage::check(
        broker_id,
        exchange,
        routing_key,
        body,
        headers,
        delivery_mode,
        content_type,
        reply_to,
        correlation_id,
        Tags {
            business_type,
            business_key,
            traceparent,
        },
    )
    .or_raise();
    message.insert_with(Later::check(deliver_after, idempotency_key).or_raise())
}

/// The twelve-argument entry points of versions 0.4.0 to 0.7.0, kept (without SQL of their own)
/// for the SQL definitions of an installed older version: until `ALTER EXTENSION amqp_outbox
/// UPDATE` runs, those still call these symbols.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
#[allow(clippy::too_many_arguments)]
fn publish_message_tagged(
    broker_id: Option<i32>,
    exchange: Option<&str>,
    routing_key: Option<&str>,
    body: Option<&str>,
    headers: default!(Option<JsonbArg>, "NULL"),
    delivery_mode: default!(Option<i32>, "NULL"),
    content_type: default!(Option<&str>, "NULL"),
    reply_to: default!(Option<&str>, "NULL"),
    correlation_id: default!(Option<&str>, "NULL"),
    business_type: default!(Option<&str>, "NULL"),
    business_key: default!(Option<&str>, "NULL"),
    traceparent: default!(Option<&str>, "NULL"),
) -> i64 {
    publish_message_later(
        broker_id,
        exchange,
        routing_key,
        body,
        headers,
        delivery_mode,
        content_type,
        reply_to,
        correlation_id,
        business_type,
        business_key,
        traceparent,
        None,
        None,
    )
}

#[pg_extern(volatile, parallel_unsafe, sql = false)]
#[allow(clippy::too_many_arguments)]
fn publish_bytes_tagged(
    broker_id: Option<i32>,
    exchange: Option<&str>,
    routing_key: Option<&str>,
    body: Option<&[u8]>,
    headers: default!(Option<JsonbArg>, "NULL"),
    delivery_mode: default!(Option<i32>, "NULL"),
    content_type: default!(Option<&str>, "NULL"),
    reply_to: default!(Option<&str>, "NULL"),
    correlation_id: default!(Option<&str>, "NULL"),
    business_type: default!(Option<&str>, "NULL"),
    business_key: default!(Option<&str>, "NULL"),
    traceparent: default!(Option<&str>, "NULL"),
) -> i64 {
    publish_bytes_later(
        broker_id,
        exchange,
        routing_key,
        body,
        headers,
        delivery_mode,
        content_type,
        reply_to,
        correlation_id,
        business_type,
        business_key,
        traceparent,
        None,
        None,
    )
}

/// The nine-argument entry points of versions before 0.4.0, kept (without SQL of their own) for
/// the SQL definitions of an installed older version: until `ALTER EXTENSION amqp_outbox
/// UPDATE` runs, those still call these symbols.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
#[allow(clippy::too_many_arguments)]
fn publish_message(
    broker_id: Option<i32>,
    exchange: Option<&str>,
    routing_key: Option<&str>,
    body: Option<&str>,
    headers: default!(Option<JsonbArg>, "NULL"),
    delivery_mode: default!(Option<i32>, "NULL"),
    content_type: default!(Option<&str>, "NULL"),
    reply_to: default!(Option<&str>, "NULL"),
    correlation_id: default!(Option<&str>, "NULL"),
) -> i64 {
    publish_message_tagged(
        broker_id,
        exchange,
        routing_key,
        body,
        headers,
        delivery_mode,
        content_type,
        reply_to,
        correlation_id,
        None,
        None,
        None,
    )
}

#[pg_extern(volatile, parallel_unsafe, sql = false)]
#[allow(clippy::too_many_arguments)]
fn publish_bytes(
    broker_id: Option<i32>,
    exchange: Option<&str>,
    routing_key: Option<&str>,
    body: Option<&[u8]>,
    headers: default!(Option<JsonbArg>, "NULL"),
    delivery_mode: default!(Option<i32>, "NULL"),
    content_type: default!(Option<&str>, "NULL"),
    reply_to: default!(Option<&str>, "NULL"),
    correlation_id: default!(Option<&str>, "NULL"),
) -> i64 {
    publish_bytes_tagged(
        broker_id,
        exchange,
        routing_key,
        body,
        headers,
        delivery_mode,
        content_type,
        reply_to,
        correlation_id,
        None,
        None,
        None,
    )
}

/// The id of the last message this session published (like `lastval()`).
#[pg_extern(volatile, parallel_restricted)]
fn last_message_id() -> i64 {
    LAST_ID.get().ok_or(OutboxError::NoMessageYet).or_raise()
}

/// This session's start time: with `pg_backend_pid()`, the producer key. The default of
/// `amqp.message.producer_started_at`, so direct INSERTs get it too.
#[pg_extern(stable, parallel_safe, name = "_producer_started_at")]
fn producer_started_at() -> TimestampWithTimeZone {
    // SAFETY: a global set once at process start, read on the backend's main thread.
    TimestampWithTimeZone::try_from(unsafe { pg_sys::MyStartTimestamp })
        .unwrap_or_else(|_| TimestampWithTimeZone::negative_infinity())
}
