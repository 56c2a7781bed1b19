//! What the active relay tells the database's status views (the plain-SQL install's
//! `amqp.worker_status` and `amqp.broker_status`): its counters in `amqp._relay_counters`, each
//! broker's connection in `amqp._relay_broker`; written when a connection changes and about
//! once a second while anything else does.

use crate::log::Log;
use amqp_outbox_engine::events::BrokerStatus;
use amqp_outbox_engine::flight::Flight;
use amqp_outbox_engine::telemetry::{Counter, Level, Telemetry};
use postgres::GenericClient;
use std::cell::Cell;
use std::time::{Duration, Instant};

/// Counters written at most this often while only they change.
pub const REPORT_EVERY: Duration = Duration::from_secs(1);

const COUNTERS_SQL: &str = "\
INSERT INTO amqp._relay_counters AS c (one, published, confirmed, acknowledged, resent_lost, \
       resent_timeout, failed, parked, steps, commit_wakeups, reported_at) \
VALUES (true, $1, $2, $3, $4, $5, $6, $7, $8, $9, pg_catalog.now()) \
ON CONFLICT (one) DO UPDATE SET published = excluded.published, \
       confirmed = excluded.confirmed, acknowledged = excluded.acknowledged, \
       resent_lost = excluded.resent_lost, resent_timeout = excluded.resent_timeout, \
       failed = excluded.failed, parked = excluded.parked, steps = excluded.steps, \
       commit_wakeups = excluded.commit_wakeups, reported_at = excluded.reported_at";

const FORGET_BROKERS_SQL: &str =
    "DELETE FROM amqp._relay_broker WHERE broker_id OPERATOR(pg_catalog.<>) ALL ($1)";

const BROKER_SQL: &str = "\
INSERT INTO amqp._relay_broker AS b (broker_id, connected, host, channel, since, in_flight, \
       last_error) \
VALUES ($1, $2, $3, $4, pg_catalog.now(), $5, $6) \
ON CONFLICT (broker_id) DO UPDATE SET connected = excluded.connected, host = excluded.host, \
       channel = excluded.channel, in_flight = excluded.in_flight, \
       last_error = excluded.last_error, \
       since = CASE WHEN b.connected IS DISTINCT FROM excluded.connected \
                      OR b.host IS DISTINCT FROM excluded.host \
                    THEN excluded.since ELSE b.since END";

/// The delivery's counters since this relay took the database over, and its log.
pub struct RelayTelemetry {
    pub log: Log,
    counts: [Cell<i64>; 9],
}

/// The counters' places, in the order of `COUNTERS_SQL`.
const PUBLISHED: usize = 0;
const CONFIRMED: usize = 1;
const ACKNOWLEDGED: usize = 2;
const RESENT_LOST: usize = 3;
const RESENT_TIMEOUT: usize = 4;
const FAILED: usize = 5;
const PARKED: usize = 6;
/// Steps run.
pub const STEPS: usize = 7;
/// Wake-ups by a commit's NOTIFY.
pub const COMMIT_WAKEUPS: usize = 8;

impl RelayTelemetry {
    pub fn new(log: Log) -> Self {
        RelayTelemetry {
            log,
            counts: Default::default(),
        }
    }

    /// Adds to one of the loop's own counters ([`STEPS`], [`COMMIT_WAKEUPS`]).
    pub fn add(&self, which: usize, n: u64) {
        let c = &self.counts[which];
        c.set(c.get().saturating_add(i64::try_from(n).unwrap_or(i64::MAX)));
    }
}

impl Telemetry for RelayTelemetry {
    fn count(&self, counter: Counter, n: u64) {
        let which = match counter {
            Counter::Published => PUBLISHED,
            Counter::Confirmed => CONFIRMED,
            Counter::Acknowledged => ACKNOWLEDGED,
            Counter::Failed => FAILED,
            Counter::Parked => PARKED,
            Counter::ResentGap => RESENT_LOST,
            Counter::ResentTimeout => RESENT_TIMEOUT,
        };
        self.add(which, n);
    }

    fn log(&self, level: Level, text: &str) {
        self.log.line(level, text);
    }
}

/// When the status tables are written next.
#[derive(Default)]
pub struct Report {
    /// A connection or the configuration changed: the broker rows are written at once.
    changed: bool,
    reported_at: Option<Instant>,
    reported_changes: u64,
}

impl BrokerStatus for Report {
    fn mark_changed(&mut self) {
        self.changed = true;
    }
}

impl Report {
    /// Whether anything is to be written now.
    pub fn due(&self, flight: &Flight) -> bool {
        self.changed
            || self.reported_at.is_none_or(|t| {
                t.elapsed() >= REPORT_EVERY
                    && (flight.changes() != self.reported_changes
                        || t.elapsed() >= REPORT_EVERY * 10)
            })
    }

    /// Writes the counters and the brokers' rows (inside the caller's transaction).
    pub fn write(
        &mut self,
        client: &mut impl GenericClient,
        telemetry: &RelayTelemetry,
        flight: &Flight,
    ) -> Result<(), postgres::Error> {
        let c: Vec<i64> = telemetry.counts.iter().map(Cell::get).collect();
        client.execute(
            COUNTERS_SQL,
            &[
                &c[0], &c[1], &c[2], &c[3], &c[4], &c[5], &c[6], &c[7], &c[8],
            ],
        )?;
        let ids: Vec<i32> = flight.brokers().map(|(id, _)| *id).collect();
        client.execute(FORGET_BROKERS_SQL, &[&ids])?;
        for (id, b) in flight.brokers() {
            let channel = i64::try_from(b.epoch).unwrap_or(i64::MAX);
            let in_flight = i32::try_from(b.in_flight).unwrap_or(i32::MAX);
            client.execute(
                BROKER_SQL,
                &[id, &b.connected, &b.host, &channel, &in_flight, &b.error],
            )?;
        }
        self.changed = false;
        self.reported_at = Some(Instant::now());
        self.reported_changes = flight.changes();
        Ok(())
    }
}
