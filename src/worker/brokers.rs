//! The brokers the AMQP thread works with: read from `amqp.broker` and the declaration tables
//! when something asks for it (start, SIGHUP, a change of the tables, the extension appearing),
//! sent over only when they changed; and the rows that name no broker at all.

use super::flight::Flight;
use super::pacer::Pacer;
use super::queries;
use super::status::Status;
use crate::gucs::WorkerSettings;
use crate::shmem;
use amqp_outbox_broker::{
    AckQueueConfig, BrokerConfig, BrokerHandle, Command, ProofMode, RecordWait,
};
use pgrx::prelude::*;
use pgrx::spi::{SpiClient, SpiResult};
use std::time::{Duration, Instant};

/// How often rows naming no broker are looked for (and on every configuration change), while
/// that read of the whole table is cheap.
const ORPHAN_CHECK_EVERY: Duration = Duration::from_secs(10);

pub struct Brokers {
    /// The configuration last sent to the AMQP thread.
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

    /// Reconnects these brokers (`None`: all), as `amqp.reconnect()` asked.
    pub fn reconnect(&self, which: Option<Vec<i32>>, handle: &BrokerHandle) {
        let ids: Vec<i32> = match which {
            Some(ids) => ids,
            None => self.sent.iter().map(|b| b.broker_id).collect(),
        };
        for broker_id in ids {
            log!("amqp_outbox: reconnecting broker {broker_id} as requested");
            handle.send(Command::Reconnect { broker_id });
        }
    }

    /// Reads the configuration if asked to, and sends it when it changed.
    pub fn reload_if_requested(
        &mut self,
        client: &SpiClient<'_>,
        settings: &WorkerSettings,
        flight: &mut Flight,
        status: &mut Status,
        handle: &BrokerHandle,
    ) -> SpiResult<()> {
        if !self.need_reload {
            return Ok(());
        }
        let brokers = queries::load_brokers(client, &template(settings))?;
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
        status: &mut Status,
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

    /// Whether [`Brokers::park_orphans_when_due`] would look now.
    pub fn orphan_check_due(&self) -> bool {
        self.orphan_check.due(Instant::now())
    }

    /// Parks the rows whose broker_id names no broker, every `ORPHAN_CHECK_EVERY` (or less
    /// often, by its cost) and after each reload: they could never be published, and must not
    /// wait unseen.
    pub fn park_orphans_when_due(&mut self, client: &mut SpiClient<'_>) -> SpiResult<()> {
        let started = Instant::now();
        if !self.orphan_check.due(started) {
            return Ok(());
        }
        let parked = queries::park_orphans(client)?;
        self.orphan_check.ran(started, started.elapsed());
        if parked > 0 {
            shmem::count(|c| &c.parked, parked as u64);
            warning!("amqp_outbox: {parked} message(s) parked: their broker_id names no row of amqp.broker");
        }
        Ok(())
    }
}

/// What every broker shares: the settings, and this database's acknowledgement queue.
pub(crate) fn template(s: &WorkerSettings) -> BrokerConfig {
    BrokerConfig {
        broker_id: 0,
        hosts: Vec::new(),
        randomize_hosts: s.randomize_hosts,
        exchanges: Vec::new(),
        queues: Vec::new(),
        bindings: Vec::new(),
        proof: ProofMode::AckQueue,
        ack_queue: AckQueueConfig {
            name: crate::ack_queue::name(),
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
