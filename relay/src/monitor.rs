//! The reconciliation monitor for one database while this relay holds its lease: the engine's
//! rounds ([`amqp_outbox_engine::monitor`]) about once a second on a connection of its own,
//! compensations run as their handlers' owners ([`crate::runners`]). Its own thread, beside
//! the delivery and the consuming side, as the extension's monitor is its own process.

use crate::config::Config;
use crate::connect;
use crate::lease::Lease;
use crate::leased::Ended;
use crate::log::Log;
use crate::runners::Runners;
use crate::savepoint;
use crate::stop;
use amqp_outbox_engine::monitor::{
    Due, MonitorHost, Schedule, CLAIM_COMPENSATION_SQL, COMPENSATION_FAILED_SQL,
    MARK_COMPENSATED_SQL, NEXT_COMPENSATION_SQL, ROUND_EVERY, STILL_DUE_SQL,
};
use amqp_outbox_engine::outbox::Caught;
use amqp_outbox_engine::telemetry::Level;
use postgres::types::Type;
use postgres::Client;
use std::time::{Duration, Instant};

/// The session's settings, as the extension's monitor pins them: a compensation's effects and
/// its done mark are durable once committed; the pass statement is never JIT-compiled (it cost
/// seconds a pass); lock waits bounded; its own statements resolve in pg_catalog. Returns the
/// search_path compensations run with (the session's before).
const SESSION_SQL: &str = "\
SELECT pg_catalog.current_setting('search_path'), \
       pg_catalog.set_config('synchronous_commit', 'on', false), \
       pg_catalog.set_config('jit', 'off', false), \
       pg_catalog.set_config('lock_timeout', '10s', false), \
       pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', false)";

/// The monitor's session pid, for `amqp.worker_status` and `amqp.health()`.
const MONITOR_PID_SQL: &str = "\
INSERT INTO amqp._relay_counters AS c (one, monitor_pid) \
VALUES (true, pg_catalog.pg_backend_pid()) \
ON CONFLICT (one) DO UPDATE SET monitor_pid = excluded.monitor_pid";

const LOCK_WAIT_SQL: &str = "SELECT pg_catalog.set_config('lock_timeout', $1, true)";
const STATEMENT_TIMEOUT_SQL: &str = "SELECT pg_catalog.set_config('statement_timeout', $1, true)";

/// How often the owners' functions are made again (an owner's rights, and the relay's right to
/// act as it, as they are then).
const RUNNERS_EVERY: Duration = Duration::from_secs(30);

struct ClientMonitor {
    client: Client,
    runners: Runners,
    runners_at: Instant,
    log: Log,
    /// The connection failed: the monitor starts again.
    broken: Option<String>,
}

impl ClientMonitor {
    /// A failure that is not an ERROR of a statement: the connection is gone.
    fn connection_error(&mut self, e: postgres::Error) -> Caught {
        let text = connect::describe(&e);
        self.broken.get_or_insert(text.clone());
        Caught {
            sqlstate: "08006".into(),
            message: text,
        }
    }

    fn caught(&mut self, e: postgres::Error) -> Caught {
        match e.as_db_error() {
            Some(db) => savepoint::caught(db),
            None => self.connection_error(e),
        }
    }
}

impl MonitorHost for ClientMonitor {
    fn statement_alone(
        &mut self,
        _what: &str,
        sql: &'static str,
        lock_wait: Option<Duration>,
    ) -> Result<Option<String>, Caught> {
        let done = self.client.transaction().and_then(|mut t| {
            if let Some(wait) = lock_wait {
                let wait = format!("{}ms", wait.as_millis());
                t.query_one(LOCK_WAIT_SQL, &[&wait])?;
            }
            let rows = t.query(sql, &[])?;
            let value: Option<String> = match rows.first() {
                Some(r) => r.try_get(0)?,
                None => None,
            };
            t.commit()?;
            Ok(value)
        });
        done.map_err(|e| self.caught(e))
    }

    fn claim_compensation(
        &mut self,
        delay: &dyn Fn(i32) -> Duration,
    ) -> Result<Option<Due>, String> {
        let describe = |e: postgres::Error| connect::describe(&e);
        let mut t = self.client.transaction().map_err(describe)?;
        let rows = t.query(NEXT_COMPENSATION_SQL, &[]).map_err(describe)?;
        let Some(r) = rows.first() else {
            return Ok(None);
        };
        let decode = || -> Result<Due, postgres::Error> {
            Ok(Due {
                message_id: r.try_get::<_, Option<String>>(0)?.unwrap_or_default(),
                consumer: r.try_get::<_, Option<String>>(1)?.unwrap_or_default(),
                attempts: r.try_get::<_, Option<i32>>(2)?.unwrap_or_default(),
                function: r.try_get::<_, Option<String>>(3)?.unwrap_or_default(),
                function_oid: r.try_get::<_, Option<u32>>(4)?.unwrap_or_default(),
                owner: r.try_get::<_, Option<u32>>(5)?.unwrap_or_default(),
                original: r.try_get(6)?,
                failure: r.try_get(7)?,
            })
        };
        let due = decode().map_err(describe)?;
        let micros = i64::try_from(delay(due.attempts).as_micros()).unwrap_or(i64::MAX);
        let claim = t
            .prepare_typed(
                CLAIM_COMPENSATION_SQL,
                &[Type::TEXT, Type::TEXT, Type::INT8],
            )
            .map_err(describe)?;
        t.execute(&claim, &[&due.message_id, &due.consumer, &micros])
            .map_err(describe)?;
        t.commit().map_err(describe)?;
        Ok(Some(due))
    }

    fn compensate(&mut self, due: &Due, timeout: Duration) -> Result<bool, Caught> {
        let calls = match self.runners.ensure(&mut self.client, due.owner) {
            Ok(calls) => calls,
            Err(why) => {
                return Err(Caught {
                    sqlstate: "42501".into(),
                    message: why,
                })
            }
        };
        let done = self.client.transaction().and_then(|mut t| {
            if t.query(STILL_DUE_SQL, &[&due.message_id, &due.consumer])?
                .is_empty()
            {
                return Ok(false);
            }
            let bound = format!("{}ms", timeout.as_millis());
            t.query_one(STATEMENT_TIMEOUT_SQL, &[&bound])?;
            t.execute(
                calls.compensation.as_str(),
                &[&due.original, &due.failure, &due.function_oid],
            )?;
            t.query_one(STATEMENT_TIMEOUT_SQL, &[&"0"])?;
            t.execute(MARK_COMPENSATED_SQL, &[&due.message_id, &due.consumer])?;
            t.commit()?;
            Ok(true)
        });
        done.map_err(|e| self.caught(e))
    }

    fn compensation_failed(&mut self, due: &Due, error: &str) -> Result<(), String> {
        self.client
            .execute(
                COMPENSATION_FAILED_SQL,
                &[&due.message_id, &due.consumer, &error],
            )
            .map(drop)
            .map_err(|e| connect::describe(&e))
    }

    fn log(&mut self, level: Level, text: &str) {
        self.log.line(level, text);
    }

    fn pause(&mut self, pause: Duration) -> bool {
        stop::wait(&[], pause);
        !stop::requested()
    }
}

/// One connection's monitor until the relay stops, the lease is lost or the connection fails.
fn run(config: &Config, url: &str, lease: &Lease, log: &Log, generation: u64) -> Ended {
    let started = connect::connect(url, &config.postgres_tls).and_then(|mut client| {
        let search_path: String = client
            .query_one(SESSION_SQL, &[])
            .and_then(|r| r.try_get(0))
            .map_err(|e| connect::describe(&e))?;
        client
            .execute(MONITOR_PID_SQL, &[])
            .map_err(|e| connect::describe(&e))?;
        Ok(ClientMonitor {
            client,
            runners: Runners::new(search_path),
            runners_at: Instant::now(),
            log: log.clone(),
            broken: None,
        })
    });
    let mut host = match started {
        Ok(host) => host,
        Err(e) => return Ended::Failed(e),
    };
    let mut schedule = Schedule::default();
    loop {
        if stop::requested() {
            return Ended::Stopped;
        }
        if lease.held() != Some(generation) {
            return Ended::LeaseLost;
        }
        let round_started = Instant::now();
        if host.runners_at.elapsed() >= RUNNERS_EVERY {
            host.runners.forget();
            host.runners_at = Instant::now();
        }
        schedule.round(
            &mut host,
            &config.settings.retry_backoff(),
            config.handler_timeout,
        );
        if let Some(e) = host.broken.take() {
            return Ended::Failed(e);
        }
        let rest = ROUND_EVERY.saturating_sub(round_started.elapsed());
        if !rest.is_zero() {
            stop::wait(&[], rest.min(lease.expires_in()));
        }
    }
}

/// Serves the monitor of the database of `url` while the lease is held, starting again after
/// every failure, until the relay stops.
pub fn serve(url: &str, config: &Config, lease: &Lease, log: &Log) {
    crate::leased::while_leased("monitor", lease, log, |generation| {
        run(config, url, lease, log, generation)
    });
}
