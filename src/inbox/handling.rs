//! The subscription worker and the lanes as the engine's handling sees them
//! ([`amqp_outbox_engine::consume::handling`]): its statements through SPI, each message in a
//! subtransaction, the handler run as its owner with `SetUserIdAndSecContext` (see
//! [`guarded::as_owner`]), and handlers that ended an earlier process taken from the traps.

use super::guarded;
use super::queries;
use crate::shmem::handler_trap::Ended;
use crate::watchdog;
use amqp_outbox_engine::consume::handling::{FailedRecord, InboxHost, Rules, QUERY_CANCELED};
use amqp_outbox_engine::consume::message::{Message, Sub};
use amqp_outbox_engine::outbox::Caught;
use pgrx::pg_sys;
use pgrx::spi::{SpiClient, SpiError};
use std::collections::BTreeSet;
use std::time::Duration;

pub use amqp_outbox_engine::consume::handling::{handle_all, Outcome};

/// The rules now: the handler timeout and receipts exchange as set, the backoff of the
/// worker's snapshot of the settings.
pub fn rules(settings: &crate::gucs::WorkerSettings) -> Rules {
    use crate::gucs;
    Rules {
        handler_timeout: Duration::from_millis(gucs::HANDLER_TIMEOUT.get().max(0) as u64),
        receipts: gucs::RECEIPTS_EXCHANGE
            .get()
            .is_some_and(|e| !e.as_bytes().is_empty()),
        backoff: settings.retry_backoff(),
    }
}

/// Handling through SPI, in the worker's (or a lane's) transaction.
pub struct SpiInbox<'a, 'conn> {
    client: &'a mut SpiClient<'conn>,
    /// Messages whose handler ended a previous worker or lane (see [`watchdog`]): each is
    /// recorded as failed when it comes, without running its handler again.
    left: &'a mut Vec<(Ended, String, String)>,
}

impl<'a, 'conn> SpiInbox<'a, 'conn> {
    pub fn new(
        client: &'a mut SpiClient<'conn>,
        left: &'a mut Vec<(Ended, String, String)>,
    ) -> Self {
        SpiInbox { client, left }
    }
}

impl InboxHost for SpiInbox<'_, '_> {
    type Error = SpiError;

    fn constraints_immediate(&mut self) -> Result<(), SpiError> {
        queries::constraints_immediate(self.client)
    }

    fn with_failed(&mut self, subs: &[String]) -> Result<BTreeSet<String>, SpiError> {
        queries::with_failed(self.client, subs.to_vec())
    }

    fn stop_requested(&self) -> bool {
        crate::worker::pg::shutdown_requested()
    }

    fn subscriptions_written(&mut self) -> bool {
        crate::commit_wake::take_subscriptions_written()
    }

    fn subscription_names(&mut self) -> Result<Vec<String>, SpiError> {
        queries::subscription_names(self.client)
    }

    fn derived_message_id(&mut self, content: Vec<u8>) -> Result<String, SpiError> {
        queries::derived_message_id(self.client, content)
    }

    fn left_behind(&mut self, subscription: &str, message_id: &str) -> Option<Caught> {
        let i = self
            .left
            .iter()
            .position(|(_, s, id)| s == subscription && id == message_id)?;
        let (ended, _, _) = self.left.remove(i);
        Some(Caught {
            sqlstate: QUERY_CANCELED.into(),
            message: watchdog::reason(ended).into(),
        })
    }

    fn consume(&mut self, subscription: &str, message_id: &str) -> Result<bool, SpiError> {
        queries::consume_once(self.client, subscription, message_id)
    }

    fn call_handler(
        &mut self,
        sub: &Sub,
        m: &Message,
        message_id: &str,
        timeout: Duration,
    ) -> Result<(), SpiError> {
        let call = sub.call().unwrap_or_default();
        let traceparent = m.traceparent();
        let _watched = watchdog::Watched::handler(&sub.name, message_id, timeout);
        let client = &mut *self.client;
        guarded::as_owner(pg_sys::Oid::from(sub.owner), timeout, || {
            if let Some(t) = traceparent {
                queries::set_traceparent(client, t)?;
            }
            queries::call_handler(client, &call, m, message_id)
        })
    }

    fn resolve_failed(&mut self, subscription: &str, message_id: &str) -> Result<(), SpiError> {
        queries::resolve_failed(self.client, subscription, message_id)
    }

    fn runs_as_problem(&mut self, subscription: &str) -> Result<Option<String>, SpiError> {
        queries::runs_as_problem(self.client, subscription)
    }

    fn record_failure(
        &mut self,
        m: &Message,
        message_id: &str,
        caught: &Caught,
        max_attempts: i32,
        delays: &[i64],
    ) -> Result<FailedRecord, SpiError> {
        queries::record_failure(self.client, m, message_id, caught, max_attempts, delays)
    }

    fn dead_letter(
        &mut self,
        sub: &Sub,
        exchange: &str,
        m: &Message,
        headers: serde_json::Map<String, serde_json::Value>,
    ) -> Result<(), SpiError> {
        queries::dead_letter(self.client, sub, exchange, m, headers)
    }

    fn receipt(
        &mut self,
        sub: &Sub,
        message_id: &str,
        error: Option<&str>,
        business_type: Option<&str>,
    ) -> Result<(), SpiError> {
        queries::receipt(self.client, sub, message_id, error, business_type)
    }

    fn note_dead_letter_refused(
        &mut self,
        subscription: &str,
        message_id: &str,
        why: &str,
    ) -> Result<(), SpiError> {
        queries::note_dead_letter_refused(self.client, subscription, message_id, why)
    }

    fn warning(&mut self, text: &str) {
        pgrx::warning!("amqp_outbox: {text}");
    }

    /// An SPI error inside (not an ERROR raised by PostgreSQL) is raised as one, so that the
    /// subtransaction is rolled back like for any other failure.
    fn subtransaction<R>(
        &mut self,
        work: impl FnOnce(&mut Self) -> Result<R, SpiError>,
    ) -> Result<Result<R, SpiError>, Caught> {
        guarded::subtransaction(|| {
            work(self)
                .map(Ok)
                .unwrap_or_else(|e| pgrx::error!("amqp_outbox: {e}"))
        })
    }
}
