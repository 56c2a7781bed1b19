//! What the AMQP thread reports: connection changes are applied to the in-flight state at once;
//! delivery outcomes become a [`Settlement`] for the next transaction; log lines are logged here,
//! on the thread that may call PostgreSQL (the host's [`Telemetry`]).

use crate::flight::{Flight, Verdict};
use crate::settings::WorkerSettings;
use crate::settle::Settlement;
use crate::telemetry::{Counter, Level, Telemetry};
use amqp_outbox_broker::{Event, Failure, LogLevel};

/// What the host shows of the brokers' connections (the extension's status views).
pub trait BrokerStatus {
    /// A broker connected, disconnected, or its flow control changed: its state is shown anew.
    fn mark_changed(&mut self);
}

/// The AMQP thread failed: the worker cannot go on (the extension raises an ERROR with this).
#[derive(Debug)]
pub struct ThreadFailed(pub String);

/// Takes the events in order. `Err` at the first [`Event::Fatal`]: the events after it are left
/// untaken, the settlement so far dropped (the host stops).
pub fn take(
    events: Vec<Event>,
    telemetry: &impl Telemetry,
    settings: &WorkerSettings,
    flight: &mut Flight,
    status: &mut impl BrokerStatus,
) -> Result<Settlement, ThreadFailed> {
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
                telemetry.log(
                    Level::Log,
                    &format!(
                        "amqp_outbox: broker {broker_id} connected to {host} (channel {epoch})"
                    ),
                );
                b.host = Some(host);
            }
            Event::Disconnected { broker_id, error } => {
                flight.forget_unconfirmed(broker_id);
                let b = flight.broker(broker_id);
                b.connected = false;
                b.host = None;
                telemetry.log(
                    Level::Warning,
                    &format!("amqp_outbox: broker {broker_id} unavailable: {error}"),
                );
                b.error = Some(error);
                status.mark_changed();
            }
            Event::Blocked { broker_id, blocked } => {
                flight.set_blocked(broker_id, blocked);
                status.mark_changed();
            }
            Event::Confirmed { ids, .. } => {
                telemetry.count(Counter::Confirmed, ids.len() as u64);
                for id in ids {
                    flight.holds.release(id);
                    // Delivered ones wait in the flight for their batched DELETE.
                    let _ = flight.confirmed(id);
                }
            }
            Event::Acked { ids, .. } => {
                telemetry.count(Counter::Acknowledged, ids.len() as u64);
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
                    telemetry.count(Counter::ResentGap, lost.len() as u64);
                    telemetry.log(
                        Level::Log,
                        &format!(
                            "amqp_outbox: {} message(s) lost in transit (a later acknowledgement arrived first), publishing again: {lost:?}",
                            lost.len()
                        ),
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
                        hold_nacked(telemetry, id, settings, flight);
                    }
                    Failure::Rejected => {
                        flight.broker(broker_id).suspects.remove(&id);
                        telemetry.count(Counter::Failed, 1);
                        s.rejected.push((id, error));
                    }
                    Failure::Unsendable => {
                        flight.broker(broker_id).suspects.remove(&id);
                        telemetry.count(Counter::Failed, 1);
                        s.unsendable.push((id, error));
                    }
                }
            }
            Event::Log { level, message } => {
                let level = match level {
                    LogLevel::Debug => Level::Debug,
                    LogLevel::Info => Level::Log,
                    LogLevel::Warning => Level::Warning,
                };
                telemetry.log(level, &format!("amqp_outbox: {message}"));
            }
            Event::Fatal(why) => return Err(ThreadFailed(why)),
        }
    }
    Ok(s)
}

/// A nack is the broker's trouble, not the message's: held back with the product's backoff,
/// no attempt counted. One log line a while.
fn hold_nacked(
    telemetry: &impl Telemetry,
    id: i64,
    settings: &WorkerSettings,
    flight: &mut Flight,
) {
    if let Some(n) = flight.holds.hold_nacked(id, &settings.retry_backoff()) {
        telemetry.log(
            Level::Log,
            &format!(
                "amqp_outbox: {n} message(s) nacked by the broker since the last report; each is published again after a growing delay"
            ),
        );
    }
}
