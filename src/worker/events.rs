//! What the AMQP thread reports: connection changes are applied to the in-flight state at once;
//! delivery outcomes become a [`Settlement`] for the next transaction; log lines are logged here,
//! on the thread that may call PostgreSQL.

use super::flight::{Flight, Verdict};
use super::settle::Settlement;
use super::status::Status;
use crate::gucs::WorkerSettings;
use crate::shmem;
use amqp_outbox_broker::{Event, Failure, LogLevel};
use pgrx::prelude::*;

pub fn take(
    events: Vec<Event>,
    settings: &WorkerSettings,
    flight: &mut Flight,
    status: &mut Status,
) -> Settlement {
    let mut s = Settlement::default();
    for event in events {
        s.reopened |= !matches!(
            event,
            Event::Confirmed { .. } | Event::Acked { .. } | Event::Log { .. }
        );
        match event {
            Event::Connected {
                broker_id,
                host,
                epoch,
            } => {
                flight.forget_unconfirmed(broker_id);
                let b = flight.broker(broker_id);
                b.connected = true;
                b.epoch = epoch;
                b.error = None;
                status.mark_changed();
                log!("amqp_outbox: broker {broker_id} connected to {host} (channel {epoch})");
                b.host = Some(host);
            }
            Event::Disconnected { broker_id, error } => {
                flight.forget_unconfirmed(broker_id);
                let b = flight.broker(broker_id);
                b.connected = false;
                b.host = None;
                warning!("amqp_outbox: broker {broker_id} unavailable: {error}");
                b.error = Some(error);
                status.mark_changed();
            }
            Event::Blocked { broker_id, blocked } => {
                flight.set_blocked(broker_id, blocked);
                status.mark_changed();
            }
            Event::Confirmed { ids, .. } => {
                shmem::count(|c| &c.confirmed, ids.len() as u64);
                for id in ids {
                    flight.holds.release(id);
                    // Delivered ones wait in the flight for their batched DELETE.
                    let _ = flight.confirmed(id);
                }
            }
            Event::Acked { ids, .. } => {
                shmem::count(|c| &c.acknowledged, ids.len() as u64);
                for id in ids {
                    let _ = flight.acked(id);
                }
            }
            Event::Lost { ids, .. } => {
                let mut lost = Vec::new();
                for id in ids {
                    if flight.lost(id) == Verdict::Resend {
                        lost.push(id);
                    }
                }
                if !lost.is_empty() {
                    shmem::count(|c| &c.resent_gap, lost.len() as u64);
                    log!(
                        "amqp_outbox: {} message(s) lost in transit (a later acknowledgement arrived first), publishing again: {lost:?}",
                        lost.len()
                    );
                    s.resend.push((lost, "lost in transit: a later message of the same channel was acknowledged first"));
                }
            }
            Event::Failed {
                broker_id,
                id,
                failure,
                error,
            } => {
                flight.settle(id);
                match failure {
                    // Claimed again once the broker is connected.
                    Failure::Transient => {}
                    Failure::Ambiguous => {
                        flight.broker(broker_id).suspects.insert(id);
                    }
                    Failure::Nacked => {
                        flight.broker(broker_id).suspects.remove(&id);
                        hold_nacked(id, settings, flight);
                    }
                    Failure::Rejected => {
                        flight.broker(broker_id).suspects.remove(&id);
                        shmem::count(|c| &c.failed, 1);
                        s.rejected.push((id, error));
                    }
                    Failure::Unsendable => {
                        flight.broker(broker_id).suspects.remove(&id);
                        shmem::count(|c| &c.failed, 1);
                        s.unsendable.push((id, error));
                    }
                }
            }
            Event::Log { level, message } => match level {
                LogLevel::Debug => debug1!("amqp_outbox: {message}"),
                LogLevel::Info => log!("amqp_outbox: {message}"),
                LogLevel::Warning => warning!("amqp_outbox: {message}"),
            },
            Event::Fatal(why) => {
                error!("amqp_outbox: the AMQP thread failed: {why}");
            }
        }
    }
    s
}

/// A nack is the broker's trouble, not the message's: held back with the product's backoff,
/// no attempt counted. One log line a while.
fn hold_nacked(id: i64, settings: &WorkerSettings, flight: &mut Flight) {
    if let Some(n) = flight.holds.hold_nacked(id, &settings.retry_backoff()) {
        log!(
            "amqp_outbox: {n} message(s) nacked by the broker since the last report; each is published again after a growing delay"
        );
    }
}
