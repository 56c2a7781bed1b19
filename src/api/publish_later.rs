//! The two publish options that need more than the outbox row: `deliver_after` (the message
//! waits in `amqp.scheduled_message` until it is due; the worker moves it into `amqp.message`)
//! and `idempotency_key` (a key row in `amqp.idempotency_key` decides, under its primary key,
//! whether this publish is the first with that key within the window). Both run fixed,
//! fully qualified statements through SPI as the extension's owner: publishers need EXECUTE on
//! the function, not rights on the tables; most keys are claimed without SPI
//! ([`super::key_row`]), the upsert here deciding the rest.

use super::key_row::{self, Claim};
use super::outbox_row::Row;
use super::row_params::{row_args, MESSAGE_COLUMNS, MESSAGE_VALUES, TAG_COLUMNS, TAG_VALUES};
use super::run_as::{extension_owner, RunAs};
use crate::error::OutboxError;
use pgrx::datum::{DatumWithOid, Interval};
use pgrx::prelude::*;
use pgrx::spi::OwnedPreparedStatement;
use std::cell::RefCell;

/// The longest idempotency key (the primary key's btree takes up to about 2,700 bytes).
const KEY_MAX: usize = 1000;

/// The options a caller gave, checked.
#[derive(Default)]
pub struct Later<'a> {
    /// A positive delay; `None` (or a zero one) publishes at once.
    pub deliver_after: Option<Interval>,
    pub idempotency_key: Option<&'a str>,
}

impl<'a> Later<'a> {
    pub fn check(
        deliver_after: Option<Interval>,
        idempotency_key: Option<&'a str>,
    ) -> Result<Self, OutboxError> {
        let deliver_after = match deliver_after {
            None => None,
            Some(d) if d.months() == i32::MAX || d.months() == i32::MIN => {
                return Err(OutboxError::InvalidDeliverAfter("infinite"));
            }
            // As PostgreSQL compares intervals: a month is 30 days, a day 24 hours.
            Some(d) if d.as_micros() < 0 => {
                return Err(OutboxError::InvalidDeliverAfter("negative"));
            }
            Some(d) if d.as_micros() == 0 => None,
            Some(d) => Some(d),
        };
        let idempotency_key = match idempotency_key {
            Some("") => return Err(OutboxError::EmptyName("idempotency_key")),
            Some(k) if k.len() > KEY_MAX => {
                return Err(OutboxError::TagTooLong {
                    what: "idempotency_key",
                    bytes: k.len(),
                    max: KEY_MAX,
                })
            }
            k => k,
        };
        Ok(Later {
            deliver_after,
            idempotency_key,
        })
    }
}

/// What the key decided.
pub enum KeyClaim {
    /// The first publish with this key within the window: the message gets this id.
    First(i64),
    /// Published before, within the window, as this message: publish nothing.
    Seen(i64),
}

/// Statements planned once per session and kept across transactions, each with the role it
/// runs as.
struct Plan {
    plan: OwnedPreparedStatement,
    owner: pg_sys::Oid,
}

thread_local! {
    static PLANS: RefCell<[Option<Plan>; 4]> = const { RefCell::new([None, None, None, None]) };
}

#[derive(Clone, Copy)]
enum Statement {
    ClaimKey = 0,
    SeenKey = 1,
    Schedule = 2,
    ScheduleWithId = 3,
}

/// Takes a key for a new message, or finds the message it already published. The new id is
/// drawn here (`$3`, or the sequence's `nextval()`), before the row exists (after the transaction took its id, as the worker's scan
/// floor requires). A key older than the window is taken again; a session racing another with
/// the same key waits for its end at the primary key, as with a unique index.
const CLAIM_KEY_SQL: &str = "\
INSERT INTO amqp.idempotency_key AS k (key, id, published_at) \
VALUES ($1, \
        coalesce($3, pg_catalog.nextval(pg_catalog.pg_get_serial_sequence('amqp.message', 'id')::pg_catalog.regclass)), \
        pg_catalog.now()) \
ON CONFLICT (key) DO UPDATE SET id = EXCLUDED.id, published_at = EXCLUDED.published_at \
 WHERE k.published_at OPERATOR(pg_catalog.<) (pg_catalog.now() OPERATOR(pg_catalog.-) $2) \
RETURNING id";

const SEEN_KEY_SQL: &str =
    "SELECT id FROM amqp.idempotency_key WHERE key OPERATOR(pg_catalog.=) $1";

/// Built from constants only; every value is a parameter.
fn sql(statement: Statement) -> String {
    let schedule = |id_column: &str, id_value: &str| {
        format!(
            "INSERT INTO amqp.scheduled_message ({MESSAGE_COLUMNS}, {TAG_COLUMNS}, deliver_at{id_column}) \
             VALUES ({MESSAGE_VALUES}, {TAG_VALUES}, \
                     pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) $17{id_value}) \
             RETURNING id"
        )
    };
    match statement {
        Statement::ClaimKey => CLAIM_KEY_SQL.into(),
        Statement::SeenKey => SEEN_KEY_SQL.into(),
        Statement::Schedule => schedule("", ""),
        Statement::ScheduleWithId => schedule(", id", ", $18"),
    }
}

/// Runs one of the statements as the extension's owner; its first column of the first row.
fn run(statement: Statement, args: &[DatumWithOid]) -> Result<Option<i64>, pgrx::spi::SpiError> {
    let result = Spi::connect_mut(|client| {
        PLANS.with_borrow_mut(|plans| {
            let slot = &mut plans[statement as usize];
            let plan = match slot {
                Some(plan) => plan,
                None => {
                    let oids: Vec<PgOid> = args.iter().map(|a| PgOid::from(a.oid())).collect();
                    let plan = client.prepare_mut(&sql(statement), &oids)?.keep();
                    slot.insert(Plan {
                        plan,
                        owner: extension_owner(),
                    })
                }
            };
            let _as_owner = RunAs::new(plan.owner);
            let table = client.update(&plan.plan, None, args)?;
            if table.is_empty() {
                return Ok(None);
            }
            table.first().get_one::<i64>()
        })
    });
    if result.is_err() {
        // A stale plan (extension dropped and re-created) must not stay cached.
        PLANS.with_borrow_mut(|plans| plans[statement as usize] = None);
    }
    result
}

/// Decides whether this publish is the first with `key` within `amqp_outbox.idempotency_window`.
pub fn claim_key(key: &str) -> Result<KeyClaim, pgrx::spi::SpiError> {
    let minutes = crate::gucs::IDEMPOTENCY_WINDOW.get().max(1);
    // Drawn directly where the outbox's shape allows, as publish() draws its ids.
    let id = super::outbox_row::draw_id();
    if let Some(id) = id {
        match key_row::claim(key, id, minutes) {
            Claim::First => return Ok(KeyClaim::First(id)),
            Claim::Seen(seen) => return Ok(KeyClaim::Seen(seen)),
            Claim::Ask => {}
        }
    }
    let window = Interval::from_minutes(minutes);
    if let Some(id) = run(Statement::ClaimKey, &[key.into(), window.into(), id.into()])? {
        return Ok(KeyClaim::First(id));
    }
    // Taken within the window: by a committed transaction (a racing one has ended by now,
    // the INSERT waited for it), so this statement's snapshot sees the row.
    match run(Statement::SeenKey, &[key.into()])? {
        Some(id) => Ok(KeyClaim::Seen(id)),
        None => Err(pgrx::spi::SpiError::NoTupleTable),
    }
}

/// Inserts a delayed message into `amqp.scheduled_message`; returns its id.
pub fn schedule(
    row: &Row<'_>,
    id: Option<i64>,
    deliver_after: Interval,
) -> Result<i64, pgrx::spi::SpiError> {
    let mut args = row_args(row, true);
    args.push(deliver_after.into());
    let statement = match id {
        Some(id) => {
            args.push(id.into());
            Statement::ScheduleWithId
        }
        None => Statement::Schedule,
    };
    run(statement, &args)?.ok_or(pgrx::spi::SpiError::NoTupleTable)
}
