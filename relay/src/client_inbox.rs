//! The engine's consuming side ([`amqp_outbox_engine::consume`]) over a client connection: the
//! statements the extension's subscription worker runs through SPI, with the same texts and
//! parameter types, and the handler run as the subscription's owner.
//!
//! Handlers run as their subscriptions' owners through [`crate::runners`].

use crate::runners::Runners;
use amqp_outbox_engine::consume::book::{Book, BookRow};
use amqp_outbox_engine::consume::handling::{FailedRecord, InboxHost};
use amqp_outbox_engine::consume::lanes::MAX_LANES;
use amqp_outbox_engine::consume::message::{Message, Ordering, Sub};
use amqp_outbox_engine::consume::statements as sql;
use amqp_outbox_engine::outbox::Caught;
use postgres::types::{ToSql, Type};
use postgres::{Client, Error, GenericClient, Statement};
use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

/// The session's settings: its own statements resolve in pg_catalog only; its commits are
/// durable (a message is acknowledged once its handling committed), whatever the server's
/// default; lock waits are bounded as the worker's. Returns the search_path the session had
/// before (the database's and the role's), which handlers run with.
const SESSION_SQL: &str = "\
SELECT pg_catalog.current_setting('search_path'), \
       pg_catalog.set_config('synchronous_commit', 'on', false), \
       pg_catalog.set_config('lock_timeout', '10s', false), \
       pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', false)";

/// Before a handler's call, for the rest of the transaction: its bound of time (`$1`), and the
/// message's trace context (`$2`) when it has one.
const BEFORE_HANDLER_SQL: &str = "\
SELECT pg_catalog.set_config('statement_timeout', $1, true), \
       CASE WHEN $2::text IS NOT NULL \
            THEN pg_catalog.set_config('amqp_outbox.traceparent', $2, true) END";

/// The subscriptions as they are after a handler's call: called in the same statement as the
/// handler (after it, with a snapshot of its own, so it sees what the handler wrote), which
/// saves a round trip per message for what a client cannot otherwise learn, that a handler
/// wrote `amqp.subscription` (`amqp.unsubscribe()` on itself). Made by the relay's role in
/// its session's temporary schema, which no other session sees and a handler's owner cannot
/// replace (not its function).
const SUBSCRIPTIONS_FN_SQL: &str = "\
CREATE OR REPLACE FUNCTION pg_temp.amqp_outbox_subscriptions() RETURNS text[] \
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $names$ \
BEGIN \
    RETURN ARRAY(SELECT s.subscription FROM amqp.subscription s); \
END \
$names$";

/// What a relay keeps for its consuming connection: the prepared statements, the owners'
/// functions made on it. Made again after a reconnection.
pub struct InboxSession {
    prepared: HashMap<String, Statement>,
    runners: Runners,
    /// The subscriptions as the last handler's call left them, not yet asked for.
    seen_after_handler: Option<Vec<String>>,
    /// No reading of the subscriptions in this transaction yet: the first message of each
    /// batch reads them (the previous batch may have removed one, and the relay learns of it
    /// from a notification that can come after this batch began).
    names_unread: bool,
}

impl InboxSession {
    /// Sets the session's settings (outside a transaction block).
    pub fn new(client: &mut Client) -> Result<InboxSession, Error> {
        let row = client.query_one(SESSION_SQL, &[])?;
        client.batch_execute(SUBSCRIPTIONS_FN_SQL)?;
        Ok(InboxSession {
            prepared: HashMap::new(),
            runners: Runners::new(row.try_get(0)?),
            seen_after_handler: None,
            names_unread: true,
        })
    }

    /// Makes (again) each owner's functions ([`Runners::ensure`]), outside a transaction
    /// block: at every reading of the subscriptions, so that an owner's rights and the relay's
    /// right to act as it are those of now.
    pub fn make_runners(&mut self, client: &mut Client, owners: BTreeSet<u32>) {
        self.runners.forget();
        for owner in owners {
            // Kept with the runners: asked by `runner_problem`.
            let _ = self.runners.ensure(client, owner);
        }
    }

    /// Why the relay cannot run code as this owner, if it cannot.
    pub fn runner_problem(&self, owner: u32) -> Option<String> {
        match self.runners.calls(owner) {
            Some(_) => None,
            None => Some(self.runners.why_not(owner)),
        }
    }
}

/// The consuming statements through a client connection, inside the transaction the caller
/// opened and ends.
pub struct ClientInbox<'a, C: GenericClient> {
    client: &'a mut C,
    session: &'a mut InboxSession,
    log: &'a crate::log::Log,
}

impl<'a, C: GenericClient> ClientInbox<'a, C> {
    pub fn new(client: &'a mut C, session: &'a mut InboxSession, log: &'a crate::log::Log) -> Self {
        // A new transaction: what earlier ones saw of the subscriptions may be out of date.
        session.seen_after_handler = None;
        session.names_unread = true;
        ClientInbox {
            client,
            session,
            log,
        }
    }

    fn statement(&mut self, text: &str, types: &[Type]) -> Result<Statement, Error> {
        if let Some(s) = self.session.prepared.get(text) {
            return Ok(s.clone());
        }
        let s = self.client.prepare_typed(text, types)?;
        self.session.prepared.insert(text.to_owned(), s.clone());
        Ok(s)
    }

    fn query(
        &mut self,
        text: &str,
        types: &[Type],
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<postgres::Row>, Error> {
        let s = self.statement(text, types)?;
        self.client.query(&s, params)
    }

    /// The active subscriptions, the handler left out (with why) when the relay cannot run as
    /// its owner.
    pub fn subscriptions(&mut self) -> Result<Vec<Sub>, Error> {
        let rows = self.query(sql::SUBSCRIPTIONS_SQL, &[], &[])?;
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            let owner: u32 = r.try_get::<_, Option<u32>>(6)?.unwrap_or(0);
            let mut problem: Option<String> = r.try_get(9)?;
            let handler = match (
                r.try_get::<_, Option<String>>(7)?,
                r.try_get::<_, Option<u32>>(8)?,
            ) {
                (Some(f), Some(oid)) if problem.is_none() => Some((f, oid)),
                _ => None,
            };
            let ordering: Option<String> = r.try_get(11)?;
            out.push(Sub {
                name: r.try_get::<_, Option<String>>(0)?.unwrap_or_default(),
                broker_id: r.try_get::<_, Option<i32>>(1)?.unwrap_or_default(),
                queue: r.try_get::<_, Option<String>>(2)?.unwrap_or_default(),
                prefetch: u16::try_from(r.try_get::<_, Option<i32>>(3)?.unwrap_or(100))
                    .unwrap_or(100),
                max_attempts: r.try_get::<_, Option<i32>>(4)?.unwrap_or(10),
                dead_letter_exchange: r.try_get(5)?,
                owner,
                handler,
                problem: problem.take(),
                parallelism: usize::try_from(r.try_get::<_, Option<i32>>(10)?.unwrap_or(1))
                    .unwrap_or(1)
                    .clamp(1, MAX_LANES),
                ordering: Ordering::parse(ordering.as_deref().unwrap_or("none")),
            });
        }
        Ok(out)
    }

    /// Puts a delivery of a subscription with an ordering into `amqp.inbox_waiting`; returns its
    /// row's id (the one it already has when delivered again while it waits), `None` when that
    /// row went meanwhile (its handling committed: this copy is a duplicate).
    pub fn stage(&mut self, m: &Message, message_id: &str) -> Result<Option<i64>, Error> {
        use Type as T;
        let headers = json(&m.headers);
        let timestamp = m.timestamp.map(|t| t as f64);
        let rows = self.query(
            sql::STAGE_SQL,
            &[
                T::TEXT,
                T::TEXT,
                T::TEXT,
                T::TEXT,
                T::TEXT,
                T::BYTEA,
                T::JSONB,
                T::TEXT,
                T::TEXT,
                T::TEXT,
                T::FLOAT8,
                T::TEXT,
                T::BOOL,
            ],
            &[
                &m.subscription,
                &message_id,
                &m.key,
                &m.exchange,
                &m.routing_key,
                &m.body,
                &headers,
                &m.content_type,
                &m.correlation_id,
                &m.reply_to,
                &timestamp,
                &m.user_id,
                &m.redelivered,
            ],
        )?;
        if let Some(r) = rows.first() {
            return r.try_get(0);
        }
        let rows = self.query(
            sql::WAITING_ID_SQL,
            &[T::TEXT, T::TEXT],
            &[&m.subscription, &message_id],
        )?;
        match rows.first() {
            Some(r) => r.try_get(0),
            None => Ok(None),
        }
    }

    /// Which of these waiting rows are gone (handled, duplicates, failed).
    pub fn gone_from_waiting(&mut self, ids: &[i64]) -> Result<Vec<i64>, Error> {
        self.query(sql::GONE_FROM_WAITING_SQL, &[Type::INT8_ARRAY], &[&ids])?
            .iter()
            .map(|r| Ok(r.try_get::<_, Option<i64>>(0)?.unwrap_or_default()))
            .collect()
    }

    /// Claims up to `limit` waiting messages of these subscriptions that may be handled now
    /// (their key is not held back by an earlier or failed message).
    pub fn claim_waiting(&mut self, subs: &[String], limit: i64) -> Result<Vec<Message>, Error> {
        let rows = self.query(
            sql::CLAIM_WAITING_SQL,
            &[Type::TEXT_ARRAY, Type::INT8],
            &[&subs, &limit],
        )?;
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            let headers: Option<String> = r.try_get(6)?;
            out.push(Message {
                subscription: r.try_get::<_, Option<String>>(1)?.unwrap_or_default(),
                message_id: r.try_get(2)?,
                exchange: r.try_get::<_, Option<String>>(3)?.unwrap_or_default(),
                routing_key: r.try_get::<_, Option<String>>(4)?.unwrap_or_default(),
                body: r.try_get::<_, Option<Vec<u8>>>(5)?.unwrap_or_default(),
                headers: headers_of(headers),
                content_type: r.try_get(7)?,
                correlation_id: r.try_get(8)?,
                reply_to: r.try_get(9)?,
                timestamp: r.try_get::<_, Option<f64>>(10)?.map(|t| t.max(0.0) as u64),
                user_id: r.try_get(11)?,
                redelivered: r.try_get::<_, Option<bool>>(12)?.unwrap_or(false),
                delivery: None,
                attempt: 1,
                retry: false,
                key: r.try_get(13)?,
                waiting_id: r.try_get(0)?,
            });
        }
        Ok(out)
    }

    /// How many waiting messages of these subscriptions may be handled now (in progress in
    /// other lanes included).
    pub fn claimable(&mut self, subs: &[String]) -> Result<usize, Error> {
        let rows = self.query(sql::CLAIMABLE_COUNT_SQL, &[Type::TEXT_ARRAY], &[&subs])?;
        let n: i64 = match rows.first() {
            Some(r) => r.try_get(0)?,
            None => 0,
        };
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// Removes handled (or failed, or duplicate) messages from `amqp.inbox_waiting`.
    pub fn done_waiting(&mut self, ids: &[i64]) -> Result<(), Error> {
        self.query(sql::DONE_WAITING_SQL, &[Type::INT8_ARRAY], &[&ids])
            .map(drop)
    }

    /// Failed messages due for a retry, of these subscriptions.
    pub fn due_retries(&mut self, subs: &[String], limit: i64) -> Result<Vec<Message>, Error> {
        let rows = self.query(
            sql::DUE_RETRIES_SQL,
            &[Type::TEXT_ARRAY, Type::INT8],
            &[&subs, &limit],
        )?;
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            let headers: Option<String> = r.try_get(5)?;
            out.push(Message {
                subscription: r.try_get::<_, Option<String>>(0)?.unwrap_or_default(),
                message_id: r.try_get(1)?,
                exchange: r.try_get::<_, Option<String>>(2)?.unwrap_or_default(),
                routing_key: r.try_get::<_, Option<String>>(3)?.unwrap_or_default(),
                body: r.try_get::<_, Option<Vec<u8>>>(4)?.unwrap_or_default(),
                headers: headers_of(headers),
                content_type: r.try_get(6)?,
                correlation_id: r.try_get(7)?,
                reply_to: r.try_get(8)?,
                timestamp: r.try_get::<_, Option<f64>>(9)?.map(|t| t.max(0.0) as u64),
                redelivered: true,
                delivery: None,
                attempt: r.try_get::<_, Option<i32>>(10)?.unwrap_or(0) + 1,
                retry: true,
                user_id: r.try_get(11)?,
                key: r.try_get(12)?,
                waiting_id: None,
            });
        }
        Ok(out)
    }

    /// Seconds until the next failed message of these subscriptions is due.
    pub fn next_retry_in(&mut self, subs: &[String]) -> Result<Option<f64>, Error> {
        let rows = self.query(sql::NEXT_RETRY_SQL, &[Type::TEXT_ARRAY], &[&subs])?;
        Ok(match rows.first() {
            Some(r) => r.try_get(0)?,
            None => None,
        })
    }

    /// Writes the counters and states noted in `book`.
    pub fn write_book(&mut self, book: &mut Book) -> Result<(), Error> {
        for r in book.take() {
            self.write_book_row(r)?;
        }
        Ok(())
    }

    fn write_book_row(&mut self, r: BookRow) -> Result<(), Error> {
        use Type as T;
        self.query(
            sql::BOOK_SQL,
            &[
                T::TEXT,
                T::INT8,
                T::INT8,
                T::INT8,
                T::INT8,
                T::INT8,
                T::BOOL,
                T::BOOL,
                T::TEXT,
                T::BOOL,
                T::TEXT,
                T::BOOL,
                T::INT8,
                T::INT4,
                T::BOOL,
                T::FLOAT8,
            ],
            &[
                &r.subscription,
                &r.delivered,
                &r.handled,
                &r.duplicates,
                &r.failed,
                &r.dead_lettered,
                &r.connection_changed,
                &r.connected,
                &r.host,
                &r.error_changed,
                &r.error,
                &r.queue_seen,
                &r.queue_ready,
                &r.queue_consumers,
                &r.handled_now,
                &r.caught_up,
            ],
        )
        .map(drop)
    }

    /// At start: no consumer is connected yet, whatever the last run left.
    pub fn reset_connections(&mut self) -> Result<(), Error> {
        self.query(sql::RESET_CONNECTIONS_SQL, &[], &[]).map(drop)
    }
}

/// The headers' JSON text, as an object (anything else: none).
fn headers_of(text: Option<String>) -> serde_json::Map<String, serde_json::Value> {
    match text.and_then(|h| serde_json::from_str::<serde_json::Value>(&h).ok()) {
        Some(serde_json::Value::Object(m)) => m,
        _ => serde_json::Map::new(),
    }
}

fn json(map: &serde_json::Map<String, serde_json::Value>) -> serde_json::Value {
    serde_json::Value::Object(map.clone())
}

impl<C: GenericClient> InboxHost for ClientInbox<'_, C> {
    type Error = Error;

    fn constraints_immediate(&mut self) -> Result<(), Error> {
        self.client.batch_execute(sql::CONSTRAINTS_IMMEDIATE_SQL)
    }

    fn with_failed(&mut self, subs: &[String]) -> Result<BTreeSet<String>, Error> {
        self.query(sql::WITH_FAILED_SQL, &[Type::TEXT_ARRAY], &[&subs])?
            .iter()
            .map(|r| Ok(r.try_get::<_, Option<String>>(0)?.unwrap_or_default()))
            .collect()
    }

    fn stop_requested(&self) -> bool {
        crate::stop::requested()
    }

    /// A client cannot see a handler's writes to `amqp.subscription`; the call of each handler
    /// returns the subscriptions after it, so "written" is "not read yet in this transaction,
    /// or a handler ran since they were last read" (a handler's failure rolled back what it wrote:
    /// nothing to look at then).
    fn subscriptions_written(&mut self) -> bool {
        self.session.names_unread || self.session.seen_after_handler.is_some()
    }

    fn subscription_names(&mut self) -> Result<Vec<String>, Error> {
        if !self.session.names_unread {
            if let Some(names) = self.session.seen_after_handler.take() {
                return Ok(names);
            }
        }
        let names = self
            .query(sql::SUBSCRIPTION_NAMES_SQL, &[], &[])?
            .iter()
            .map(|r| Ok(r.try_get::<_, Option<String>>(0)?.unwrap_or_default()))
            .collect::<Result<Vec<String>, Error>>()?;
        self.session.names_unread = false;
        self.session.seen_after_handler = None;
        Ok(names)
    }

    fn derived_message_id(&mut self, content: Vec<u8>) -> Result<String, Error> {
        let rows = self.query(sql::DERIVED_MESSAGE_ID_SQL, &[Type::BYTEA], &[&content])?;
        match rows.first() {
            Some(r) => Ok(r.try_get::<_, Option<String>>(0)?.unwrap_or_default()),
            None => Ok(String::new()),
        }
    }

    /// A relay's handler call ends with its statement (a timeout cancels it); nothing is left
    /// behind by an earlier process.
    fn left_behind(&mut self, _subscription: &str, _message_id: &str) -> Option<Caught> {
        None
    }

    fn consume(&mut self, subscription: &str, message_id: &str) -> Result<bool, Error> {
        let consumer = sql::consumer_name(subscription);
        let rows = self.query(
            sql::CONSUME_SQL,
            &[Type::TEXT, Type::TEXT],
            &[&consumer, &message_id],
        )?;
        match rows.first() {
            Some(r) => Ok(r.try_get::<_, Option<bool>>(0)?.unwrap_or(false)),
            None => Ok(false),
        }
    }

    fn call_handler(
        &mut self,
        sub: &Sub,
        m: &Message,
        message_id: &str,
        timeout: Duration,
    ) -> Result<(), Error> {
        let Some((_, handler_oid)) = sub.handler.clone() else {
            return Ok(());
        };
        // Checked when the subscriptions were read: a subscription whose owner has no runner
        // has no handler.
        let Some(call) = self
            .session
            .runners
            .calls(sub.owner)
            .map(|c| c.handler.clone())
        else {
            return Ok(());
        };
        let bound = format!("{}ms", timeout.as_millis());
        let trace = m.traceparent();
        self.query(
            BEFORE_HANDLER_SQL,
            &[Type::TEXT, Type::TEXT],
            &[&bound, &trace],
        )?;
        use Type as T;
        let headers = json(&m.headers);
        let tag = m.delivery.map(|(_, tag)| tag as i64);
        let timestamp = m.timestamp.map(|t| t as f64);
        let had_trace = trace.is_some();
        let rows = self.query(
            &call,
            &[
                T::TEXT,
                T::TEXT,
                T::TEXT,
                T::TEXT,
                T::BYTEA,
                T::JSONB,
                T::TEXT,
                T::TEXT,
                T::TEXT,
                T::BOOL,
                T::INT8,
                T::FLOAT8,
                T::INT4,
                T::TEXT,
                T::OID,
                T::BOOL,
            ],
            &[
                &m.subscription,
                &message_id,
                &m.exchange,
                &m.routing_key,
                &m.body,
                &headers,
                &m.content_type,
                &m.correlation_id,
                &m.reply_to,
                &m.redelivered,
                &tag,
                &timestamp,
                &m.attempt,
                &m.user_id,
                &handler_oid,
                &had_trace,
            ],
        )?;
        // The same statement took the bound and the trace away again (the next message's
        // statements run without them) and read the subscriptions after the handler.
        let names: Option<Vec<Option<String>>> = match rows.first() {
            Some(r) => r.try_get(1)?,
            None => None,
        };
        self.session.seen_after_handler = Some(
            names
                .unwrap_or_default()
                .into_iter()
                .map(Option::unwrap_or_default)
                .collect(),
        );
        Ok(())
    }

    fn resolve_failed(&mut self, subscription: &str, message_id: &str) -> Result<(), Error> {
        self.query(
            sql::RESOLVE_FAILED_SQL,
            &[Type::TEXT, Type::TEXT],
            &[&subscription, &message_id],
        )
        .map(drop)
    }

    fn runs_as_problem(&mut self, subscription: &str) -> Result<Option<String>, Error> {
        let rows = self.query(sql::RUNS_AS_PROBLEM_SQL, &[Type::TEXT], &[&subscription])?;
        match rows.first() {
            Some(r) => r.try_get(0),
            None => Ok(None),
        }
    }

    fn record_failure(
        &mut self,
        m: &Message,
        message_id: &str,
        caught: &Caught,
        max_attempts: i32,
        delays: &[i64],
    ) -> Result<FailedRecord, Error> {
        use Type as T;
        let headers = json(&m.headers);
        let timestamp = m.timestamp.map(|t| t as f64);
        let rows = self.query(
            sql::RECORD_FAILURE_SQL,
            &[
                T::TEXT,
                T::TEXT,
                T::TEXT,
                T::TEXT,
                T::BYTEA,
                T::JSONB,
                T::TEXT,
                T::TEXT,
                T::TEXT,
                T::FLOAT8,
                T::TEXT,
                T::TEXT,
                T::INT4,
                T::INT8_ARRAY,
                T::INT4,
                T::TEXT,
                T::TEXT,
            ],
            &[
                &m.subscription,
                &message_id,
                &m.exchange,
                &m.routing_key,
                &m.body,
                &headers,
                &m.content_type,
                &m.correlation_id,
                &m.reply_to,
                &timestamp,
                &caught.message,
                &caught.sqlstate,
                &max_attempts,
                &delays,
                &m.attempt,
                &m.user_id,
                &m.key,
            ],
        )?;
        let Some(r) = rows.first() else {
            return Ok(FailedRecord {
                attempts: 1,
                dead: false,
            });
        };
        Ok(FailedRecord {
            attempts: r.try_get::<_, Option<i32>>(0)?.unwrap_or(1),
            dead: r.try_get::<_, Option<bool>>(1)?.unwrap_or(false),
        })
    }

    fn dead_letter(
        &mut self,
        sub: &Sub,
        exchange: &str,
        m: &Message,
        headers: serde_json::Map<String, serde_json::Value>,
    ) -> Result<(), Error> {
        use Type as T;
        let headers = serde_json::Value::Object(headers);
        self.query(
            sql::DEAD_LETTER_SQL,
            &[
                T::INT4,
                T::TEXT,
                T::TEXT,
                T::BYTEA,
                T::JSONB,
                T::TEXT,
                T::TEXT,
            ],
            &[
                &sub.broker_id,
                &exchange,
                &m.routing_key,
                &m.body,
                &headers,
                &m.content_type,
                &m.correlation_id,
            ],
        )
        .map(drop)
    }

    fn receipt(
        &mut self,
        sub: &Sub,
        message_id: &str,
        error: Option<&str>,
        business_type: Option<&str>,
    ) -> Result<(), Error> {
        use Type as T;
        self.query(
            sql::RECEIPT_SQL,
            &[T::INT4, T::TEXT, T::TEXT, T::BOOL, T::TEXT, T::TEXT],
            &[
                &sub.broker_id,
                &sub.name,
                &message_id,
                &error.is_none(),
                &error,
                &business_type,
            ],
        )
        .map(drop)
    }

    fn note_dead_letter_refused(
        &mut self,
        subscription: &str,
        message_id: &str,
        why: &str,
    ) -> Result<(), Error> {
        self.query(
            sql::NOTE_DEAD_LETTER_REFUSED_SQL,
            &[Type::TEXT, Type::TEXT, Type::TEXT],
            &[&subscription, &message_id, &why],
        )
        .map(drop)
    }

    fn warning(&mut self, text: &str) {
        self.log.warning(text);
    }

    fn subtransaction<R>(
        &mut self,
        work: impl FnOnce(&mut Self) -> Result<R, Error>,
    ) -> Result<Result<R, Error>, Caught> {
        crate::savepoint::run(self, work)
    }
}

impl<C: GenericClient> crate::savepoint::OnConnection for ClientInbox<'_, C> {
    fn batch_execute(&mut self, sql: &str) -> Result<(), Error> {
        self.client.batch_execute(sql)
    }
}
