//! The brokers the AMQP thread works with: read from `amqp.broker` and the declaration tables
//! when something asks for it (start, a reload, a change of the tables), sent over only when
//! they changed; and the rows that name no broker at all. The host reads the four tables
//! ([`crate::statements`]: `BROKER_HOSTS_SQL` and the three after it) into [`BrokerTables`]
//! ([`crate::broker_tables`]); how they become a configuration is decided here, once for every
//! host.

pub use crate::broker_tables::{BindingRow, BrokerTables, ExchangeRow, HostRow, QueueRow};
use crate::events::BrokerStatus;
use crate::flight::Flight;
use crate::outbox::Outbox;
use crate::pacer::Pacer;
use crate::settings::WorkerSettings;
use crate::telemetry::{Counter, Level, Telemetry};
use amqp_outbox_broker::{
    AckQueueConfig, BindingDecl, BrokerConfig, BrokerHandle, Command, Endpoint, ExchangeDecl,
    ProofMode, QueueDecl, RecordWait, TlsOptions,
};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// How often rows naming no broker are looked for (and on every configuration change), while
/// that read of the whole table is cheap.
const ORPHAN_CHECK_EVERY: Duration = Duration::from_secs(10);

/// What every broker shares: the settings, and this database's acknowledgement queue.
pub fn template(s: &WorkerSettings, ack_queue: String) -> BrokerConfig {
    BrokerConfig {
        broker_id: 0,
        hosts: Vec::new(),
        randomize_hosts: s.randomize_hosts,
        exchanges: Vec::new(),
        queues: Vec::new(),
        bindings: Vec::new(),
        proof: ProofMode::AckQueue,
        ack_queue: AckQueueConfig {
            name: ack_queue,
            quorum: s.ack_queue_quorum,
            record_wait: RecordWait::default(),
        },
        connect_timeout: s.connect_timeout,
        heartbeat_secs: s.heartbeat_secs,
        confirm_timeout: s.confirm_timeout,
        reconnect_min: s.retry_backoff_min,
        reconnect_max: s.retry_backoff_max,
    }
}

/// The brokers (hosts grouped by broker_id, in a stable order) and their declarations. A
/// declaration whose arguments cannot be sent is left out, with a warning; the others, and
/// publishing, go on.
pub fn assemble(
    tables: BrokerTables,
    template: &BrokerConfig,
    telemetry: &impl Telemetry,
) -> Vec<BrokerConfig> {
    let mut brokers: BTreeMap<i32, BrokerConfig> = BTreeMap::new();
    for r in tables.hosts {
        let tls = r.tls.unwrap_or(false).then_some(TlsOptions {
            ca_file: r.tls_ca_file,
            cert_file: r.tls_cert_file,
            key_file: r.tls_key_file,
            server_name: r.tls_server_name,
        });
        let endpoint = Endpoint {
            host: r.host.unwrap_or_default(),
            port: u16::try_from(r.port.unwrap_or(5672)).unwrap_or(5672),
            vhost: r.vhost.unwrap_or_else(|| "/".into()),
            username: r.username.unwrap_or_else(|| "guest".into()),
            password: r.password.unwrap_or_else(|| "guest".into()),
            tls,
        };
        // The first host row of a broker decides its proof mode.
        let proof = match r.proof.as_deref() {
            Some("confirm") => ProofMode::Confirm,
            _ => ProofMode::AckQueue,
        };
        brokers
            .entry(r.broker_id)
            .or_insert_with(|| BrokerConfig {
                broker_id: r.broker_id,
                proof,
                ..template.clone()
            })
            .hosts
            .push(endpoint);
    }
    for r in tables.exchanges {
        if let Some(b) = brokers.get_mut(&r.broker_id) {
            b.exchanges.push(ExchangeDecl {
                name: r.exchange.unwrap_or_default(),
                kind: r.exchange_type.unwrap_or_else(|| "direct".into()),
                passive: r.passive.unwrap_or(false),
                durable: r.durable.unwrap_or(true),
                auto_delete: r.auto_delete.unwrap_or(false),
            });
        }
    }
    for r in tables.queues {
        let name = r.queue.unwrap_or_default();
        let Some(arguments) = arguments(r.arguments, "queue", &name, telemetry) else {
            continue;
        };
        if let Some(b) = brokers.get_mut(&r.broker_id) {
            b.queues.push(QueueDecl {
                name,
                durable: r.durable.unwrap_or(true),
                auto_delete: r.auto_delete.unwrap_or(false),
                arguments,
            });
        }
    }
    for r in tables.bindings {
        let queue = r.queue.unwrap_or_default();
        let Some(arguments) = arguments(r.arguments, "binding of queue", &queue, telemetry) else {
            continue;
        };
        if let Some(b) = brokers.get_mut(&r.broker_id) {
            b.bindings.push(BindingDecl {
                queue,
                exchange: r.exchange.unwrap_or_default(),
                routing_key: r.routing_key.unwrap_or_default(),
                arguments,
            });
        }
    }
    brokers.into_values().collect()
}

/// A declaration's arguments, or `None` (with a warning) when they cannot be sent: a number
/// out of range, nesting deeper than the parser allows.
fn arguments(
    text: Option<String>,
    what: &str,
    name: &str,
    telemetry: &impl Telemetry,
) -> Option<serde_json::Map<String, serde_json::Value>> {
    match crate::headers::json_object(text.as_deref()) {
        Ok(map) => Some(map),
        Err(why) => {
            telemetry.log(
                Level::Warning,
                &format!("amqp_outbox: {what} {name:?} is not declared: its arguments {why}"),
            );
            None
        }
    }
}

/// The configuration last sent to the AMQP thread, and when to read it again.
pub struct Brokers {
    sent: Vec<BrokerConfig>,
    need_reload: bool,
    orphan_check: Pacer,
}

impl Default for Brokers {
    fn default() -> Self {
        Brokers {
            sent: Vec::new(),
            need_reload: true,
            orphan_check: Pacer::new(ORPHAN_CHECK_EVERY),
        }
    }
}

impl Brokers {
    /// Read the tables again at the next step.
    pub fn request_reload(&mut self) {
        self.need_reload = true;
    }

    pub fn reload_pending(&self) -> bool {
        self.need_reload
    }

    /// Reconnects these brokers (`None`: all), as `amqp.disconnect()` asked.
    pub fn reconnect(
        &self,
        which: Option<Vec<i32>>,
        handle: &BrokerHandle,
        telemetry: &impl Telemetry,
    ) {
        let ids: Vec<i32> = match which {
            Some(ids) => ids,
            None => self.sent.iter().map(|b| b.broker_id).collect(),
        };
        for broker_id in ids {
            telemetry.log(
                Level::Log,
                &format!("amqp_outbox: reconnecting broker {broker_id} as requested"),
            );
            handle.send(Command::Reconnect { broker_id });
        }
    }

    /// Reads the configuration if asked to, and sends it when it changed.
    #[allow(clippy::too_many_arguments)]
    pub fn reload_if_requested<O: Outbox>(
        &mut self,
        outbox: &mut O,
        template: &BrokerConfig,
        telemetry: &impl Telemetry,
        flight: &mut Flight,
        status: &mut impl BrokerStatus,
        handle: &BrokerHandle,
    ) -> Result<(), O::Error> {
        if !self.need_reload {
            return Ok(());
        }
        let brokers = assemble(outbox.broker_tables()?, template, telemetry);
        self.need_reload = false;
        self.configure(brokers, flight, status, handle);
        self.orphan_check.hurry();
        Ok(())
    }

    /// Sends `brokers` to the AMQP thread if they differ from what it has; messages in flight to
    /// a broker that is gone are forgotten.
    pub fn configure(
        &mut self,
        brokers: Vec<BrokerConfig>,
        flight: &mut Flight,
        status: &mut impl BrokerStatus,
        handle: &BrokerHandle,
    ) {
        if brokers == self.sent {
            return;
        }
        let ids: Vec<i32> = brokers.iter().map(|b| b.broker_id).collect();
        flight.retain_brokers(&ids);
        for b in &brokers {
            flight.broker(b.broker_id).proof = b.proof;
        }
        self.sent = brokers.clone();
        status.mark_changed();
        handle.send(Command::Configure(brokers));
    }

    /// The brokers last sent.
    pub fn sent(&self) -> &[BrokerConfig] {
        &self.sent
    }

    /// Whether [`Brokers::park_orphans_when_due`] would look now.
    pub fn orphan_check_due(&self) -> bool {
        self.orphan_check.due(Instant::now())
    }

    /// Parks the rows whose broker_id names no broker, every `ORPHAN_CHECK_EVERY` (or less
    /// often, by its cost) and after each reload: they could never be published, and must not
    /// wait unseen.
    pub fn park_orphans_when_due<O: Outbox>(
        &mut self,
        outbox: &mut O,
        telemetry: &impl Telemetry,
    ) -> Result<(), O::Error> {
        let started = Instant::now();
        if !self.orphan_check.due(started) {
            return Ok(());
        }
        let parked = outbox.park_orphans()?;
        self.orphan_check.ran(started, started.elapsed());
        if parked > 0 {
            telemetry.count(Counter::Parked, parked as u64);
            telemetry.log(
                Level::Warning,
                &format!("amqp_outbox: {parked} message(s) parked: their broker_id names no row of amqp.broker"),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    #[derive(Default)]
    struct Lines(RefCell<Vec<String>>);

    impl Telemetry for Lines {
        fn count(&self, _: Counter, _: u64) {}
        fn log(&self, _: Level, text: &str) {
            self.0.borrow_mut().push(text.to_owned());
        }
    }

    fn settings() -> WorkerSettings {
        crate::settings::DEFAULTS.clone()
    }

    #[test]
    fn hosts_group_by_broker_and_defaults_fill_nulls() {
        let tables = BrokerTables {
            hosts: vec![
                HostRow {
                    broker_id: 2,
                    host: Some("b".into()),
                    proof: Some("confirm".into()),
                    ..HostRow::default()
                },
                HostRow {
                    broker_id: 1,
                    host: Some("a1".into()),
                    port: Some(70000),
                    ..HostRow::default()
                },
                HostRow {
                    broker_id: 1,
                    host: Some("a2".into()),
                    proof: Some("confirm".into()),
                    tls: Some(true),
                    tls_server_name: Some("n".into()),
                    ..HostRow::default()
                },
            ],
            exchanges: vec![ExchangeRow {
                broker_id: 1,
                exchange: Some("x".into()),
                ..ExchangeRow::default()
            }],
            ..BrokerTables::default()
        };
        let lines = Lines::default();
        let brokers = assemble(tables, &template(&settings(), "ack".into()), &lines);
        assert_eq!(brokers.len(), 2);
        let one = &brokers[0];
        assert_eq!(one.broker_id, 1);
        assert_eq!(one.proof, ProofMode::AckQueue, "the first host row decides");
        assert_eq!(one.hosts[0].port, 5672, "a port out of range falls back");
        assert_eq!(one.hosts[0].vhost, "/");
        assert_eq!(one.hosts[0].username, "guest");
        assert!(one.hosts[0].tls.is_none());
        assert_eq!(
            one.hosts[1]
                .tls
                .as_ref()
                .and_then(|t| t.server_name.as_deref()),
            Some("n")
        );
        assert_eq!(one.exchanges[0].kind, "direct");
        assert!(one.exchanges[0].durable);
        assert_eq!(one.ack_queue.name, "ack");
        assert_eq!(brokers[1].proof, ProofMode::Confirm);
        assert!(lines.0.borrow().is_empty());
    }

    #[test]
    fn a_declaration_that_cannot_be_sent_is_left_out_with_a_warning() {
        let tables = BrokerTables {
            hosts: vec![HostRow {
                broker_id: 1,
                ..HostRow::default()
            }],
            queues: vec![
                QueueRow {
                    broker_id: 1,
                    queue: Some("bad".into()),
                    arguments: Some(r#"{"x-max-length": 1e400}"#.into()),
                    ..QueueRow::default()
                },
                QueueRow {
                    broker_id: 1,
                    queue: Some("good".into()),
                    ..QueueRow::default()
                },
                QueueRow {
                    broker_id: 9,
                    queue: Some("no broker".into()),
                    ..QueueRow::default()
                },
            ],
            ..BrokerTables::default()
        };
        let lines = Lines::default();
        let brokers = assemble(tables, &template(&settings(), "ack".into()), &lines);
        let names: Vec<&str> = brokers[0].queues.iter().map(|q| q.name.as_str()).collect();
        assert_eq!(names, ["good"]);
        let lines = lines.0.borrow();
        assert_eq!(lines.len(), 1);
        assert!(
            lines[0].contains("queue \"bad\" is not declared"),
            "{lines:?}"
        );
    }
}
