//! Every SQL statement the worker runs. Each runs inside a short transaction opened by the
//! caller ([`super::pg::transaction`]); none waits on the broker.

use amqp_outbox_broker::{
    BindingDecl, BrokerConfig, Endpoint, ExchangeDecl, ProofMode, QueueDecl, TlsOptions,
};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::{SpiClient, SpiResult};
use std::collections::BTreeMap;
use std::time::Duration;

thread_local! {
    /// The worker's hot statements, planned once and kept (re-planned by PostgreSQL itself when
    /// the table changes). Cleared when the extension goes away.
    static PLANS: std::cell::RefCell<std::collections::HashMap<&'static str, pgrx::spi::OwnedPreparedStatement>> =
        std::cell::RefCell::new(std::collections::HashMap::new());
}

/// Forgets the kept plans (the extension was dropped: they refer to dropped tables).
pub fn forget_plans() {
    PLANS.with_borrow_mut(|p| p.clear());
}

/// Runs `sql` from a kept plan, preparing it on first use.
fn run_kept<'conn, R>(
    client: &mut SpiClient<'conn>,
    sql: &'static str,
    args: &[DatumWithOid],
    mutating: bool,
    read: impl FnOnce(pgrx::spi::SpiTupleTable<'conn>) -> SpiResult<R>,
) -> SpiResult<R> {
    PLANS.with_borrow_mut(|plans| {
        let plan = match plans.entry(sql) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let oids: Vec<PgOid> = args.iter().map(|a| PgOid::from(a.oid())).collect();
                let prepared = if mutating {
                    client.prepare_mut(sql, &oids)?
                } else {
                    client.prepare(sql, &oids)?
                };
                v.insert(prepared.keep())
            }
        };
        let table = if mutating {
            client.update(&*plan, None, args)?
        } else {
            client.select(&*plan, None, args)?
        };
        read(table)
    })
}

/// Microseconds from the Unix epoch to PostgreSQL's (2000-01-01).
const PG_EPOCH_OFFSET_MICROS: i64 = 946_684_800_000_000;

/// One claimed row of `amqp.message`.
pub struct Row {
    pub id: i64,
    pub message_id: String,
    pub broker_id: i32,
    pub exchange: String,
    pub routing_key: String,
    pub body: Vec<u8>,
    pub delivery_mode: i16,
    pub content_type: Option<String>,
    pub reply_to: Option<String>,
    pub correlation_id: Option<String>,
    /// As the text of the jsonb value: parsed by the worker, which parks a row whose headers
    /// cannot be sent instead of failing the whole claim.
    pub headers: Option<String>,
    pub producer_pid: i32,
    /// Unix microseconds.
    pub producer_started_at: i64,
    /// Unix microseconds.
    pub created_at: i64,
    pub attempts: i32,
}

/// Whether the extension is installed; if so, also takes a share lock on `amqp.message` until
/// the end of the transaction, so a concurrent DROP EXTENSION waits for the worker's short
/// transaction instead of pulling the table from under its statements.
pub fn extension_exists() -> bool {
    unsafe {
        if pg_sys::get_extension_oid(c"amqp_outbox".as_ptr(), true) == pg_sys::InvalidOid {
            return false;
        }
        let table = pg_sys::makeRangeVar(
            c"amqp".as_ptr().cast_mut(),
            c"message".as_ptr().cast_mut(),
            -1,
        );
        pg_sys::RangeVarGetRelidExtended(
            table,
            pg_sys::AccessShareLock as pg_sys::LOCKMODE,
            pg_sys::RVROption::RVR_MISSING_OK,
            None,
            std::ptr::null_mut(),
        ) != pg_sys::InvalidOid
    }
}

/// The acknowledgement queue of this database: a name no other database can have, even one on
/// another cluster using the same broker.
pub fn ack_queue_name() -> String {
    let sysid = unsafe { pg_sys::GetSystemIdentifier() };
    let dboid = unsafe { pg_sys::MyDatabaseId }.to_u32();
    format!("amqp_outbox.ack.{sysid:x}.{dboid:x}")
}

/// The version of the SQL objects this library's statements are written for.
pub const LIBRARY_VERSION: &str = env!("CARGO_PKG_VERSION");

/// `Some(installed)` when the extension's SQL objects are at another version than this library
/// (the library was upgraded and `ALTER EXTENSION amqp_outbox UPDATE` has not run yet): the
/// tables may lack what the worker reads, so it waits instead of failing on every step.
pub fn version_mismatch() -> Option<String> {
    let installed = Spi::get_one::<String>(
        "SELECT extversion FROM pg_catalog.pg_extension WHERE extname OPERATOR(pg_catalog.=) 'amqp_outbox'",
    );
    match installed {
        Ok(Some(v)) if v != LIBRARY_VERSION => Some(v),
        _ => None,
    }
}

fn unix_micros(ts: Option<TimestampWithTimeZone>) -> i64 {
    ts.map(|t| pg_sys::TimestampTz::from(t) + PG_EPOCH_OFFSET_MICROS)
        .unwrap_or(0)
}

/// The next rows to publish, in id order: not in flight or held back (`$3`), and no more body
/// bytes than `$4` (the first row always: it may be larger). `octet_length` reads a toasted
/// body's size from its pointer, so rows past the budget cost no detoasting.
const CLAIM_SQL: &str = "\
SELECT id, broker_id, exchange, routing_key, body, delivery_mode, content_type, reply_to, \
       correlation_id, headers::pg_catalog.text, producer_pid, producer_started_at, created_at, \
       attempts, message_id \
  FROM (SELECT id, broker_id, exchange, routing_key, body, delivery_mode, content_type, \
               reply_to, correlation_id, headers, producer_pid, producer_started_at, created_at, \
               attempts, message_id, pg_catalog.octet_length(body) AS size, \
               pg_catalog.sum(pg_catalog.octet_length(body)) OVER (ORDER BY id) AS upto \
          FROM amqp.message \
         WHERE broker_id OPERATOR(pg_catalog.=) ANY ($1) \
           AND parked_at IS NULL \
           AND (next_attempt_at IS NULL OR next_attempt_at OPERATOR(pg_catalog.<=) pg_catalog.now()) \
           AND id OPERATOR(pg_catalog.<>) ALL ($3) \
         ORDER BY id \
         LIMIT $2) candidates \
 WHERE upto OPERATOR(pg_catalog.-) size OPERATOR(pg_catalog.<) $4 \
 ORDER BY id";

const CLAIM_BY_ID_SQL: &str = "\
SELECT id, broker_id, exchange, routing_key, body, delivery_mode, content_type, reply_to, \
       correlation_id, headers::pg_catalog.text, producer_pid, producer_started_at, created_at, \
       attempts, message_id \
  FROM amqp.message \
 WHERE id OPERATOR(pg_catalog.=) ANY ($1) AND parked_at IS NULL \
 ORDER BY id";

fn rows_from(table: pgrx::spi::SpiTupleTable<'_>) -> SpiResult<Vec<Row>> {
    let mut rows = Vec::with_capacity(table.len());
    for r in table {
        rows.push(Row {
            id: r.get::<i64>(1)?.unwrap_or_default(),
            broker_id: r.get::<i32>(2)?.unwrap_or_default(),
            exchange: r.get::<String>(3)?.unwrap_or_default(),
            routing_key: r.get::<String>(4)?.unwrap_or_default(),
            body: r.get::<Vec<u8>>(5)?.unwrap_or_default(),
            delivery_mode: r.get::<i16>(6)?.unwrap_or(2),
            content_type: r.get::<String>(7)?,
            reply_to: r.get::<String>(8)?,
            correlation_id: r.get::<String>(9)?,
            headers: r.get::<String>(10)?,
            producer_pid: r.get::<i32>(11)?.unwrap_or_default(),
            producer_started_at: unix_micros(r.get::<TimestampWithTimeZone>(12)?),
            created_at: unix_micros(r.get::<TimestampWithTimeZone>(13)?),
            attempts: r.get::<i32>(14)?.unwrap_or_default(),
            message_id: r.get::<String>(15)?.unwrap_or_default(),
        });
    }
    Ok(rows)
}

/// The first rows, in id order, that are not parked and are due, of these brokers. Selected by
/// state from the lowest id every time, never from a high-water mark: ids are taken at INSERT
/// and transactions commit in another order, so a mark would skip (or delay, breaking each
/// session's order) a row that committed late with a smaller id. The caller skips the rows it
/// already has in flight, so `limit` includes them.
pub fn claim(
    client: &mut SpiClient<'_>,
    brokers: &[i32],
    limit: usize,
    skip: &[i64],
    max_bytes: usize,
) -> SpiResult<Vec<Row>> {
    let args: [DatumWithOid; 4] = [
        brokers.to_vec().into(),
        (limit as i64).into(),
        skip.to_vec().into(),
        (max_bytes.min(i64::MAX as usize) as i64).into(),
    ];
    run_kept(client, CLAIM_SQL, &args, false, rows_from)
}

pub fn claim_ids(client: &SpiClient<'_>, ids: &[i64]) -> SpiResult<Vec<Row>> {
    let args: [DatumWithOid; 1] = [ids.to_vec().into()];
    rows_from(client.select(CLAIM_BY_ID_SQL, None, &args)?)
}

/// Deletes rows whose delivery is proven. Returns how many existed.
pub fn delete_delivered(client: &mut SpiClient<'_>, ids: &[i64]) -> SpiResult<usize> {
    let args: [DatumWithOid; 1] = [ids.to_vec().into()];
    run_kept(
        client,
        "DELETE FROM amqp.message WHERE id OPERATOR(pg_catalog.=) ANY ($1)",
        &args,
        true,
        |t| Ok(t.len()),
    )
}

pub struct Recorded {
    pub attempts: i32,
    pub parked: bool,
    /// How long until the retry is due.
    pub retry_in: Option<Duration>,
}

/// A refused publish: count the attempt, keep the error, schedule the retry with exponential
/// backoff and jitter, or park the row once `max_attempts` is reached. `None` when the row is gone.
pub fn record_failure(
    client: &mut SpiClient<'_>,
    id: i64,
    error: &str,
    max_attempts: i32,
    backoff_min_ms: i64,
    backoff_max_ms: i64,
) -> SpiResult<Option<Recorded>> {
    let args: [DatumWithOid; 5] = [
        id.into(),
        error.into(),
        max_attempts.into(),
        backoff_min_ms.into(),
        backoff_max_ms.into(),
    ];
    let table = client.update(
        "UPDATE amqp.message \
            SET attempts = attempts OPERATOR(pg_catalog.+) 1, \
                last_error = $2, \
                next_attempt_at = pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) \
                    pg_catalog.make_interval(secs => \
                        LEAST($5::pg_catalog.float8, \
                            $4::pg_catalog.float8 OPERATOR(pg_catalog.*) \
                            pg_catalog.power(2::pg_catalog.float8, LEAST(attempts, 30))) \
                        OPERATOR(pg_catalog./) 1000 \
                        OPERATOR(pg_catalog.*) (0.75 OPERATOR(pg_catalog.+) (pg_catalog.random() OPERATOR(pg_catalog./) 2))), \
                parked_at = CASE WHEN attempts OPERATOR(pg_catalog.+) 1 OPERATOR(pg_catalog.>=) $3 \
                                 THEN pg_catalog.clock_timestamp() END \
          WHERE id OPERATOR(pg_catalog.=) $1 \
      RETURNING attempts, parked_at IS NOT NULL, \
                pg_catalog.date_part('epoch', next_attempt_at OPERATOR(pg_catalog.-) pg_catalog.clock_timestamp())",
        None,
        &args,
    )?;
    let mut out = None;
    for r in table {
        out = Some(Recorded {
            attempts: r.get::<i32>(1)?.unwrap_or_default(),
            parked: r.get::<bool>(2)?.unwrap_or(false),
            retry_in: r
                .get::<f64>(3)?
                .map(|secs| Duration::from_secs_f64(secs.max(0.0))),
        });
    }
    Ok(out)
}

/// Messages known lost (gap rule) or without proof past the timeout: count the attempt, keep
/// why, publish again at once, or park once `max_attempts` is reached. Returns the parked ids.
pub fn record_resend(
    client: &mut SpiClient<'_>,
    ids: &[i64],
    reason: &str,
    max_attempts: i32,
) -> SpiResult<Vec<i64>> {
    let args: [DatumWithOid; 3] = [ids.to_vec().into(), reason.into(), max_attempts.into()];
    let table = client.update(
        "UPDATE amqp.message \
            SET attempts = attempts OPERATOR(pg_catalog.+) 1, last_error = $2, next_attempt_at = NULL, \
                parked_at = CASE WHEN attempts OPERATOR(pg_catalog.+) 1 OPERATOR(pg_catalog.>=) $3 \
                                 THEN pg_catalog.clock_timestamp() END \
          WHERE id OPERATOR(pg_catalog.=) ANY ($1) AND parked_at IS NULL \
      RETURNING id, parked_at IS NOT NULL",
        None,
        &args,
    )?;
    let mut parked = Vec::new();
    for r in table {
        if r.get::<bool>(2)?.unwrap_or(false) {
            parked.push(r.get::<i64>(1)?.unwrap_or_default());
        }
    }
    Ok(parked)
}

/// Parks a row at once (a row that can never be published as it is).
pub fn park(client: &mut SpiClient<'_>, id: i64, error: &str) -> SpiResult<()> {
    let args: [DatumWithOid; 2] = [id.into(), error.into()];
    client.update(
        "UPDATE amqp.message SET attempts = attempts OPERATOR(pg_catalog.+) 1, last_error = $2, \
                parked_at = pg_catalog.clock_timestamp() \
          WHERE id OPERATOR(pg_catalog.=) $1",
        None,
        &args,
    )?;
    Ok(())
}

/// The brokers (hosts grouped by broker_id, in a stable order) and their declarations.
pub fn load_brokers(
    client: &SpiClient<'_>,
    template: &BrokerConfig,
) -> SpiResult<Vec<BrokerConfig>> {
    let mut brokers: BTreeMap<i32, BrokerConfig> = BTreeMap::new();
    let hosts = client.select(
        "SELECT broker_id, host, port, vhost, username, password, proof, \
                tls, tls_ca_file, tls_cert_file, tls_key_file, tls_server_name \
           FROM amqp.broker ORDER BY broker_id, host, port",
        None,
        &[],
    )?;
    for r in hosts {
        let broker_id = r.get::<i32>(1)?.unwrap_or_default();
        let port = r.get::<i32>(3)?.unwrap_or(5672);
        let endpoint = Endpoint {
            host: r.get::<String>(2)?.unwrap_or_default(),
            port: u16::try_from(port).unwrap_or(5672),
            vhost: r.get::<String>(4)?.unwrap_or_else(|| "/".into()),
            username: r.get::<String>(5)?.unwrap_or_else(|| "guest".into()),
            password: r.get::<String>(6)?.unwrap_or_else(|| "guest".into()),
            tls: if r.get::<bool>(8)?.unwrap_or(false) {
                Some(TlsOptions {
                    ca_file: r.get::<String>(9)?,
                    cert_file: r.get::<String>(10)?,
                    key_file: r.get::<String>(11)?,
                    server_name: r.get::<String>(12)?,
                })
            } else {
                None
            },
        };
        // The first host row of a broker decides its proof mode.
        let proof = match r.get::<String>(7)?.as_deref() {
            Some("confirm") => ProofMode::Confirm,
            _ => ProofMode::AckQueue,
        };
        brokers
            .entry(broker_id)
            .or_insert_with(|| BrokerConfig {
                broker_id,
                proof,
                ..template.clone()
            })
            .hosts
            .push(endpoint);
    }
    let exchanges = client.select(
        "SELECT broker_id, exchange, exchange_type, passive, durable, auto_delete \
           FROM amqp.exchange ORDER BY broker_id, exchange",
        None,
        &[],
    )?;
    for r in exchanges {
        let broker_id = r.get::<i32>(1)?.unwrap_or_default();
        if let Some(b) = brokers.get_mut(&broker_id) {
            b.exchanges.push(ExchangeDecl {
                name: r.get::<String>(2)?.unwrap_or_default(),
                kind: r.get::<String>(3)?.unwrap_or_else(|| "direct".into()),
                passive: r.get::<bool>(4)?.unwrap_or(false),
                durable: r.get::<bool>(5)?.unwrap_or(true),
                auto_delete: r.get::<bool>(6)?.unwrap_or(false),
            });
        }
    }
    let queues = client.select(
        "SELECT broker_id, queue, durable, auto_delete, arguments::pg_catalog.text FROM amqp.queue \
          ORDER BY broker_id, queue",
        None,
        &[],
    )?;
    for r in queues {
        let broker_id = r.get::<i32>(1)?.unwrap_or_default();
        let name = r.get::<String>(2)?.unwrap_or_default();
        let Some(arguments) = declaration_arguments(r.get::<String>(5)?, "queue", &name) else {
            continue;
        };
        if let Some(b) = brokers.get_mut(&broker_id) {
            b.queues.push(QueueDecl {
                name,
                durable: r.get::<bool>(3)?.unwrap_or(true),
                auto_delete: r.get::<bool>(4)?.unwrap_or(false),
                arguments,
            });
        }
    }
    let bindings = client.select(
        "SELECT broker_id, queue, exchange, routing_key, arguments::pg_catalog.text FROM amqp.binding \
          ORDER BY broker_id, queue, exchange, routing_key",
        None,
        &[],
    )?;
    for r in bindings {
        let broker_id = r.get::<i32>(1)?.unwrap_or_default();
        let queue = r.get::<String>(2)?.unwrap_or_default();
        let Some(arguments) =
            declaration_arguments(r.get::<String>(5)?, "binding of queue", &queue)
        else {
            continue;
        };
        if let Some(b) = brokers.get_mut(&broker_id) {
            b.bindings.push(BindingDecl {
                queue,
                exchange: r.get::<String>(3)?.unwrap_or_default(),
                routing_key: r.get::<String>(4)?.unwrap_or_default(),
                arguments,
            });
        }
    }
    Ok(brokers.into_values().collect())
}

/// A declaration's arguments, or `None` (with a warning) when they cannot be sent: a number
/// out of range, nesting deeper than the parser allows. Such a declaration is left out; the
/// others, and publishing, go on.
fn declaration_arguments(
    text: Option<String>,
    what: &str,
    name: &str,
) -> Option<serde_json::Map<String, serde_json::Value>> {
    match crate::headers::json_object(text.as_deref()) {
        Ok(map) => Some(map),
        Err(why) => {
            warning!("amqp_outbox: {what} {name:?} is not declared: its arguments {why}");
            None
        }
    }
}

/// The backlog per broker, for `amqp_outbox.max_pending`: rows waiting to be taken by the
/// broker. Rows the broker refused (waiting for their retry, or parked) are left out: they say
/// nothing about how fast the broker takes messages, and must not turn publishers away.
pub fn count_pending(client: &SpiClient<'_>) -> SpiResult<std::collections::HashMap<i32, i64>> {
    let table = client.select(
        "SELECT broker_id, pg_catalog.count(*) FROM amqp.message \
          WHERE parked_at IS NULL AND attempts OPERATOR(pg_catalog.=) 0 \
          GROUP BY broker_id",
        None,
        &[],
    )?;
    let mut counts = std::collections::HashMap::new();
    for r in table {
        counts.insert(
            r.get::<i32>(1)?.unwrap_or_default(),
            r.get::<i64>(2)?.unwrap_or_default(),
        );
    }
    Ok(counts)
}

/// Parks the rows whose broker_id names no broker (inserted directly, or the broker was
/// removed): they could never be published, and must not wait unseen. One statement, so the
/// check and the update see the same brokers. Returns how many.
pub fn park_orphans(client: &mut SpiClient<'_>) -> SpiResult<usize> {
    let table = client.update(
        "UPDATE amqp.message m \
            SET attempts = m.attempts OPERATOR(pg_catalog.+) 1, parked_at = pg_catalog.clock_timestamp(), \
                last_error = 'broker ' OPERATOR(pg_catalog.||) m.broker_id::pg_catalog.text \
                             OPERATOR(pg_catalog.||) ' does not exist in amqp.broker' \
          WHERE m.parked_at IS NULL \
            AND NOT EXISTS (SELECT FROM amqp.broker b \
                             WHERE b.broker_id OPERATOR(pg_catalog.=) m.broker_id) \
      RETURNING m.id",
        None,
        &[],
    )?;
    Ok(table.len())
}
