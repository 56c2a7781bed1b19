//! The engine's [`Outbox`] over a client connection: the very statements the background worker
//! runs through SPI (`src/worker/queries.rs`), with the same bound parameters (same types), and
//! their rows decoded as the worker decodes them.
//!
//! The worker's claim transaction reads in one snapshot (taken at its start) until it writes;
//! the scan floor relies on that: a writer the probe saw running must stay invisible to the
//! claim, or the claim could publish its rows above the floor before those below it. Over a
//! client connection, READ COMMITTED takes a snapshot per statement, so a relay runs its claims
//! in REPEATABLE READ transactions (one snapshot, taken at the first statement) that read
//! before they write; [`ClientOutbox::probe`] answers `None` (no floor: read from the lowest
//! id) otherwise. The settling (refusals, resends, the DELETE of delivered rows) runs, as the
//! worker's does, in READ COMMITTED transactions, which wait for a row lock instead of failing
//! on a row updated since their start.

use amqp_outbox_engine::brokers::{BindingRow, BrokerTables, ExchangeRow, HostRow, QueueRow};
use amqp_outbox_engine::flight::Proof;
use amqp_outbox_engine::message::Origin;
use amqp_outbox_engine::outbox::{Caught, Outbox, Recorded, RetryDelays};
use amqp_outbox_engine::row::{Row, RowTags};
use amqp_outbox_engine::scan_floor::Probe;
use amqp_outbox_engine::statements;
use postgres::types::{FromSql, ToSql, Type};
use postgres::{Client, Error, GenericClient, Statement};
use std::collections::HashMap;

/// Sets the delivery's session settings on the connection, as the worker pins its own (the
/// statements are written for them: `statements::SESSION_SETTINGS` says why each), and reads
/// the database's name: the default of the system tag.
const SESSION_SQL: &str = "\
SELECT (SELECT pg_catalog.count(pg_catalog.set_config(n, v, false)) \
          FROM ROWS FROM (pg_catalog.unnest($1::text[]), pg_catalog.unnest($2::text[])) \
               AS s (n, v)), \
       pg_catalog.current_database()::text";

/// Microseconds from the Unix epoch to PostgreSQL's (2000-01-01).
const PG_EPOCH_OFFSET_MICROS: i64 = 946_684_800_000_000;

/// What a relay keeps for one connection, across its transactions: the origin tags, the
/// statements prepared on it, the id sequence's oid. Made again after a reconnection.
pub struct Session {
    system_id: String,
    host_id: String,
    prepared: HashMap<&'static str, Statement>,
    /// Looked up once, again after a probe found no usable sequence (as the worker does).
    id_sequence: Option<u32>,
}

impl Session {
    /// Sets the session settings for the rest of the connection's life and reads the database's
    /// name. Call outside a transaction block (a rollback would undo them).
    pub fn new(client: &mut Client) -> Result<Session, Error> {
        let (names, values): (Vec<&str>, Vec<&str>) =
            statements::SESSION_SETTINGS.iter().copied().unzip();
        let row = client.query_one(SESSION_SQL, &[&names, &values])?;
        Ok(Session {
            system_id: row.try_get::<_, Option<String>>(1)?.unwrap_or_default(),
            host_id: amqp_outbox_broker::identity::host_name(),
            prepared: HashMap::new(),
            id_sequence: None,
        })
    }

    /// A session for statements that need none of the delivery's settings nor its tags (the
    /// broker tables read on the consuming side's connection).
    pub fn plain() -> Session {
        Session {
            system_id: String::new(),
            host_id: String::new(),
            prepared: HashMap::new(),
            id_sequence: None,
        }
    }

    /// Forgets the prepared statements (the extension's objects were dropped and made again
    /// with other types).
    pub fn forget_statements(&mut self) {
        self.prepared.clear();
        self.id_sequence = None;
    }
}

/// `amqp.message` through a client connection, inside the transaction the caller opened (a
/// [`postgres::Transaction`], or a [`Client`] after its own `BEGIN`), which the caller ends.
/// `session` must be the one made on this connection.
pub struct ClientOutbox<'a, C: GenericClient> {
    client: &'a mut C,
    session: &'a mut Session,
}

impl<'a, C: GenericClient> ClientOutbox<'a, C> {
    pub fn new(client: &'a mut C, session: &'a mut Session) -> Self {
        ClientOutbox { client, session }
    }

    /// `sql` as prepared on the connection with the worker's parameter types (on first use).
    fn statement(&mut self, sql: &'static str, types: &[Type]) -> Result<Statement, Error> {
        if let Some(s) = self.session.prepared.get(sql) {
            return Ok(s.clone());
        }
        let s = self.client.prepare_typed(sql, types)?;
        self.session.prepared.insert(sql, s.clone());
        Ok(s)
    }

    fn query(
        &mut self,
        sql: &'static str,
        types: &[Type],
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<postgres::Row>, Error> {
        let s = self.statement(sql, types)?;
        self.client.query(&s, params)
    }

    fn ids(&mut self, sql: &'static str, ids: &[i64]) -> Result<Vec<i64>, Error> {
        self.query(sql, &[Type::INT8_ARRAY], &[&ids])?
            .iter()
            .map(|r| Ok(r.try_get::<_, Option<i64>>(0)?.unwrap_or_default()))
            .collect()
    }
}

/// A `timestamptz` as Unix microseconds, from its binary form (microseconds since 2000-01-01),
/// as the worker reads the datum; the infinities saturate.
struct UnixMicros(i64);

impl<'a> FromSql<'a> for UnixMicros {
    fn from_sql(_: &Type, raw: &'a [u8]) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        let micros = i64::from_be_bytes(raw.try_into()?);
        Ok(UnixMicros(micros.saturating_add(PG_EPOCH_OFFSET_MICROS)))
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::TIMESTAMPTZ
    }
}

fn unix_micros(r: &postgres::Row, i: usize) -> Result<i64, Error> {
    Ok(r.try_get::<_, Option<UnixMicros>>(i)?.map_or(0, |t| t.0))
}

/// The claim's columns (both claims select the same), with the worker's defaults for NULLs.
fn rows_from(rows: Vec<postgres::Row>) -> Result<Vec<Row>, Error> {
    rows.iter()
        .map(|r| {
            Ok(Row {
                id: r.try_get::<_, Option<i64>>(0)?.unwrap_or_default(),
                broker_id: r.try_get::<_, Option<i32>>(1)?.unwrap_or_default(),
                exchange: r.try_get::<_, Option<String>>(2)?.unwrap_or_default(),
                routing_key: r.try_get::<_, Option<String>>(3)?.unwrap_or_default(),
                body: r.try_get::<_, Option<Vec<u8>>>(4)?.unwrap_or_default(),
                delivery_mode: r.try_get::<_, Option<i16>>(5)?.unwrap_or(2),
                content_type: r.try_get(6)?,
                reply_to: r.try_get(7)?,
                correlation_id: r.try_get(8)?,
                headers: r.try_get(9)?,
                producer_pid: r.try_get::<_, Option<i32>>(10)?.unwrap_or_default(),
                producer_started_at: unix_micros(r, 11)?,
                created_at: unix_micros(r, 12)?,
                attempts: r.try_get::<_, Option<i32>>(13)?.unwrap_or_default(),
                message_id: r.try_get::<_, Option<String>>(14)?.unwrap_or_default(),
                tags: RowTags {
                    business_type: r.try_get(15)?,
                    business_key: r.try_get(16)?,
                    traceparent: r.try_get(17)?,
                    system_id: r.try_get(18)?,
                    host_id: r.try_get(19)?,
                },
                writer: r
                    .try_get::<_, Option<i64>>(20)?
                    .and_then(|x| u32::try_from(x).ok())
                    .unwrap_or(0),
            })
        })
        .collect()
}

impl<C: GenericClient> Outbox for ClientOutbox<'_, C> {
    type Error = Error;

    /// This database's name (read once per connection) and this host's name, as the worker
    /// takes them.
    fn origin(&self) -> Origin<'_> {
        Origin {
            system_id: &self.session.system_id,
            host_id: &self.session.host_id,
        }
    }

    fn claim(
        &mut self,
        brokers: &[i32],
        limit: usize,
        skip: &[i64],
        max_bytes: usize,
        after: i64,
    ) -> Result<Vec<Row>, Error> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let max_bytes = i64::try_from(max_bytes).unwrap_or(i64::MAX);
        let rows = self.query(
            statements::CLAIM_SQL,
            &[
                Type::INT4_ARRAY,
                Type::INT8,
                Type::INT8_ARRAY,
                Type::INT8,
                Type::INT8,
            ],
            &[&brokers, &limit, &skip, &max_bytes, &after],
        )?;
        rows_from(rows)
    }

    fn claim_ids(&mut self, ids: &[i64]) -> Result<Vec<Row>, Error> {
        let rows = self.query(statements::CLAIM_BY_ID_SQL, &[Type::INT8_ARRAY], &[&ids])?;
        rows_from(rows)
    }

    /// The probe and the next transaction id, in one statement
    /// ([`statements::PROBE_WITH_XID_SQL`]). The worker reads `ReadNextFullTransactionId()`
    /// once the probe has returned; a client cannot read that counter, and a later snapshot's
    /// xmax is no substitute: it is one past the highest *completed* transaction id, below a
    /// running publisher that took the newest id (the floor would then pass over its rows).
    /// So the transaction takes an id of its own, `pg_current_xact_id()`, after the probe's
    /// row is made: ids are assigned in increasing order, so it is above every id assigned when
    /// the last value was read, i.e. at least the worker's reading, and a transaction with a
    /// higher id began after the last value was read and draws above it (this one draws none).
    /// It costs an id and a commit record; a claim that writes nothing else commits without
    /// waiting for a WAL flush (PostgreSQL flushes only for transactions that wrote WAL).
    /// `None` when the transaction had an id before or runs in READ COMMITTED (see the
    /// statement).
    fn probe(&mut self) -> Result<Option<Probe>, Error> {
        let seq = match self.session.id_sequence {
            Some(oid) => oid,
            None => {
                let found = self.query(statements::ID_SEQUENCE_SQL, &[], &[])?;
                let oid = match found.first() {
                    Some(r) => r.try_get::<_, Option<u32>>(0)?,
                    None => None,
                };
                let Some(oid) = oid else {
                    return Ok(None);
                };
                self.session.id_sequence = Some(oid);
                oid
            }
        };
        let found = self.query(statements::PROBE_WITH_XID_SQL, &[Type::OID], &[&seq])?;
        let Some(r) = found.first() else {
            // The sequence caches, cycles or is gone.
            self.session.id_sequence = None;
            return Ok(None);
        };
        let (Some(xmin), Some(xmax), Some(running), Some(last_value)) = (
            r.try_get::<_, Option<i64>>(0)?,
            r.try_get::<_, Option<i64>>(1)?,
            r.try_get::<_, Option<Vec<i64>>>(2)?,
            r.try_get::<_, Option<i64>>(3)?,
        ) else {
            self.session.id_sequence = None;
            return Ok(None);
        };
        let Some(next_xid) = r.try_get::<_, Option<i64>>(4)? else {
            return Ok(None);
        };
        Ok(Some(Probe {
            xmin: xmin.max(0) as u64,
            xmax: xmax.max(0) as u64,
            running: running.into_iter().map(|x| x.max(0) as u64).collect(),
            last_value,
            next_xid: next_xid.max(0) as u64,
        }))
    }

    fn delete_delivered(&mut self, proofs: &[Proof], keep_log: bool) -> Result<usize, Error> {
        let ids: Vec<i64> = proofs.iter().map(|p| p.id).collect();
        let published: Vec<i64> = proofs.iter().map(|p| p.published).collect();
        let confirmed: Vec<Option<i64>> = proofs.iter().map(|p| p.confirmed).collect();
        let acknowledged: Vec<Option<i64>> = proofs.iter().map(|p| p.acknowledged).collect();
        let message_at: Vec<i64> = proofs.iter().map(|p| p.message_at).collect();
        let (system_id, host_id) = (self.session.system_id.clone(), self.session.host_id.clone());
        let rows = self.query(
            statements::DELETE_DELIVERED_SQL,
            &[
                Type::INT8_ARRAY,
                Type::INT8_ARRAY,
                Type::INT8_ARRAY,
                Type::INT8_ARRAY,
                Type::BOOL,
                Type::TEXT,
                Type::TEXT,
                Type::INT8_ARRAY,
            ],
            &[
                &ids,
                &published,
                &confirmed,
                &acknowledged,
                &keep_log,
                &system_id,
                &host_id,
                &message_at,
            ],
        )?;
        let existed = match rows.first() {
            Some(r) => r.try_get::<_, Option<i64>>(0)?.unwrap_or(0),
            None => 0,
        };
        Ok(usize::try_from(existed).unwrap_or(0))
    }

    fn set_lock_timeout(&mut self, timeout: &str) -> Result<(), Error> {
        self.query(statements::SET_LOCK_TIMEOUT_SQL, &[Type::TEXT], &[&timeout])?;
        Ok(())
    }

    fn lock_free(&mut self, ids: &[i64]) -> Result<Vec<i64>, Error> {
        self.ids(statements::LOCK_FREE_SQL, ids)
    }

    fn existing(&mut self, ids: &[i64]) -> Result<Vec<i64>, Error> {
        self.ids(statements::EXISTING_SQL, ids)
    }

    fn record_failure(
        &mut self,
        id: i64,
        error: &str,
        max_attempts: i32,
        delays: &RetryDelays,
    ) -> Result<Option<Recorded>, Error> {
        let micros = delays.micros();
        let rows = self.query(
            statements::RECORD_FAILURE_SQL,
            &[Type::INT8, Type::TEXT, Type::INT4, Type::INT8_ARRAY],
            &[&id, &error, &max_attempts, &micros],
        )?;
        let mut out = None;
        for r in &rows {
            let attempts = r.try_get::<_, Option<i32>>(0)?.unwrap_or_default();
            out = Some(Recorded {
                attempts,
                parked: r.try_get::<_, Option<bool>>(1)?.unwrap_or(false),
                retry_in: delays.after(attempts),
            });
        }
        Ok(out)
    }

    fn record_resend(
        &mut self,
        ids: &[i64],
        reason: &str,
        max_attempts: i32,
    ) -> Result<Vec<i64>, Error> {
        let rows = self.query(
            statements::RECORD_RESEND_SQL,
            &[Type::INT8_ARRAY, Type::TEXT, Type::INT4],
            &[&ids, &reason, &max_attempts],
        )?;
        let mut parked = Vec::new();
        for r in &rows {
            if r.try_get::<_, Option<bool>>(1)?.unwrap_or(false) {
                parked.push(r.try_get::<_, Option<i64>>(0)?.unwrap_or_default());
            }
        }
        Ok(parked)
    }

    fn park(&mut self, id: i64, error: &str) -> Result<bool, Error> {
        let s = self.statement(statements::PARK_SQL, &[Type::INT8, Type::TEXT])?;
        Ok(self.client.execute(&s, &[&id, &error])? == 1)
    }

    fn broker_tables(&mut self) -> Result<BrokerTables, Error> {
        let mut tables = BrokerTables::default();
        for r in self.query(statements::BROKER_HOSTS_SQL, &[], &[])? {
            tables.hosts.push(HostRow {
                broker_id: r.try_get::<_, Option<i32>>(0)?.unwrap_or_default(),
                host: r.try_get(1)?,
                port: r.try_get(2)?,
                vhost: r.try_get(3)?,
                username: r.try_get(4)?,
                password: r.try_get(5)?,
                proof: r.try_get(6)?,
                tls: r.try_get(7)?,
                tls_ca_file: r.try_get(8)?,
                tls_cert_file: r.try_get(9)?,
                tls_key_file: r.try_get(10)?,
                tls_server_name: r.try_get(11)?,
            });
        }
        for r in self.query(statements::EXCHANGES_SQL, &[], &[])? {
            tables.exchanges.push(ExchangeRow {
                broker_id: r.try_get::<_, Option<i32>>(0)?.unwrap_or_default(),
                exchange: r.try_get(1)?,
                exchange_type: r.try_get(2)?,
                passive: r.try_get(3)?,
                durable: r.try_get(4)?,
                auto_delete: r.try_get(5)?,
            });
        }
        for r in self.query(statements::QUEUES_SQL, &[], &[])? {
            tables.queues.push(QueueRow {
                broker_id: r.try_get::<_, Option<i32>>(0)?.unwrap_or_default(),
                queue: r.try_get(1)?,
                durable: r.try_get(2)?,
                auto_delete: r.try_get(3)?,
                arguments: r.try_get(4)?,
            });
        }
        for r in self.query(statements::BINDINGS_SQL, &[], &[])? {
            tables.bindings.push(BindingRow {
                broker_id: r.try_get::<_, Option<i32>>(0)?.unwrap_or_default(),
                queue: r.try_get(1)?,
                exchange: r.try_get(2)?,
                routing_key: r.try_get(3)?,
                arguments: r.try_get(4)?,
            });
        }
        Ok(tables)
    }

    fn park_orphans(&mut self) -> Result<usize, Error> {
        Ok(self.query(statements::PARK_ORPHANS_SQL, &[], &[])?.len())
    }

    fn due_scheduled(&mut self, limit: i64) -> Result<Vec<i64>, Error> {
        self.query(statements::DUE_SCHEDULED_SQL, &[Type::INT8], &[&limit])?
            .iter()
            .map(|r| Ok(r.try_get::<_, Option<i64>>(0)?.unwrap_or_default()))
            .collect()
    }

    fn move_scheduled(&mut self, ids: &[i64]) -> Result<usize, Error> {
        let s = self.statement(statements::MOVE_SCHEDULED_SQL, &[Type::INT8_ARRAY])?;
        Ok(usize::try_from(self.client.execute(&s, &[&ids])?).unwrap_or(usize::MAX))
    }

    fn postpone_scheduled(&mut self, id: i64, error: &str) -> Result<(), Error> {
        let s = self.statement(
            statements::POSTPONE_SCHEDULED_SQL,
            &[Type::INT8, Type::TEXT],
        )?;
        self.client.execute(&s, &[&id, &error])?;
        Ok(())
    }

    fn next_scheduled_ms(&mut self) -> Result<Option<f64>, Error> {
        match self
            .query(statements::NEXT_SCHEDULED_SQL, &[], &[])?
            .first()
        {
            Some(r) => r.try_get(0),
            None => Ok(None),
        }
    }

    fn expire_keys(&mut self, window_minutes: i32, limit: i64) -> Result<(), Error> {
        let s = self.statement(statements::EXPIRE_KEYS_SQL, &[Type::INT4, Type::INT8])?;
        self.client.execute(&s, &[&window_minutes, &limit])?;
        Ok(())
    }

    /// A savepoint: released when `work` ends, rolled back when it returns (or went on after)
    /// an ERROR, which is then `Caught`. Other errors (a value that could not be decoded, the
    /// connection lost) are `work`'s own, `Ok(Err(_))`, as the worker's SPI errors are.
    fn subtransaction<R>(
        &mut self,
        work: impl FnOnce(&mut Self) -> Result<R, Error>,
    ) -> Result<Result<R, Error>, Caught> {
        crate::savepoint::run(self, work)
    }
}

impl<C: GenericClient> crate::savepoint::OnConnection for ClientOutbox<'_, C> {
    fn batch_execute(&mut self, sql: &str) -> Result<(), Error> {
        self.client.batch_execute(sql)
    }
}
