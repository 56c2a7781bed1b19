//! Claims the next rows (suspects first, alone), fits them into each broker's window of
//! messages and bytes, and turns them into publish commands for the AMQP thread.

use crate::faults::Faults;
use crate::flight::{Flight, Room};
use crate::message::{message_at, to_message};
use crate::outbox::Outbox;
use crate::row::Row;
use crate::scan_floor::{Reach, ScanFloor};
use crate::settings::WorkerSettings;
use crate::settle::park_now;
use crate::telemetry::{Counter, Level, Telemetry};
use amqp_outbox_broker::{Command, OutboundMessage};
use std::collections::BTreeMap;
use std::time::Instant;

pub struct Claimed {
    /// To send once the transaction has committed.
    pub commands: Vec<Command>,
    /// The claim filled its batch or byte budget: there is probably more, claim again at once.
    pub more: bool,
    /// It handed over every row its snapshot showed due: every connected broker had room, none
    /// was publishing suspects alone, nothing was left for later. Until a commit, a connection
    /// change or a message leaving flight without proof, another claim would find nothing (a
    /// confirm or an acknowledgement alone does not need one).
    pub complete: bool,
    /// The transactions that wrote the claimed rows (`xmin`; 0 when unknown), for
    /// `amqp_outbox.standby_names`.
    pub writers: Vec<u32>,
}

impl Claimed {
    /// Nothing claimed, and the next wake-up claims again.
    pub fn nothing() -> Self {
        Claimed {
            commands: Vec::new(),
            more: false,
            complete: false,
            writers: Vec::new(),
        }
    }
}

pub fn claim<O: Outbox>(
    outbox: &mut O,
    telemetry: &impl Telemetry,
    settings: &WorkerSettings,
    flight: &mut Flight,
    floor: &mut ScanFloor,
    faults: &mut Faults,
) -> Result<Claimed, O::Error> {
    let mut commands = Vec::new();
    let mut writers = Vec::new();
    // Rows to park are written last: a statement that writes would give the statements after
    // it a newer snapshot than the probe's (see the worker's step, src/worker/step.rs).
    let mut parks = Vec::new();
    floor.note_released(flight.released());

    // Suspects first: alone on their channel, one at a time.
    for (broker_id, ids) in flight.isolation_ready() {
        let rows = outbox.claim_ids(&ids)?;
        let found: Vec<i64> = rows.iter().map(|r| r.id).collect();
        flight
            .broker(broker_id)
            .suspects
            .retain(|id| found.contains(id));
        let messages = prepare(rows, &*outbox, settings, faults, &mut parks, &mut writers);
        for m in &messages {
            flight.mark_sent(broker_id, m.id, m.body.len(), message_at(m));
        }
        if !messages.is_empty() {
            commands.push(Command::Publish {
                broker_id,
                messages,
                solo: true,
            });
        }
    }

    let open = flight.open_brokers(settings.max_in_flight, settings.max_in_flight_bytes);
    let every_broker_open = open.len() == flight.connected_brokers() && !flight.any_isolating();
    if open.is_empty() {
        park_all(outbox, telemetry, parks, settings, flight)?;
        return Ok(Claimed {
            commands,
            more: false,
            complete: false,
            writers,
        });
    }
    let mut room: BTreeMap<i32, Room> = open.into_iter().map(|r| (r.broker_id, r)).collect();
    let broker_ids: Vec<i32> = room.keys().copied().collect();
    let probe = outbox.probe()?;
    let from = match &probe {
        Some(probe) => {
            floor.observe(probe, Instant::now());
            floor.from(&broker_ids)
        }
        // The sequence hands out ids out of order: every claim reads from the lowest id.
        None => {
            floor.reset();
            0
        }
    };
    // What is in flight or held back is not read again (bodies included); below `from` the
    // statement reads nothing anyway.
    let mut skip: Vec<i64> = flight.ids().filter(|id| *id > from).collect();
    skip.extend(
        flight
            .holds
            .held_now(Instant::now(), settings.retry_backoff_max)
            .into_iter()
            .filter(|id| *id > from),
    );
    let budget: usize = room.values().map(|r| r.bytes.max(1)).sum();
    let limit = settings.batch_size;
    let started = Instant::now();
    let rows = outbox.claim(&broker_ids, limit, &skip, budget, from)?;
    let cost = started.elapsed();
    if from == 0 {
        say_what_was_passed(telemetry, floor.passed(), &rows);
    }
    let fetched: usize = rows.iter().map(|r| r.body.len()).sum();
    // A full batch, or one cut short by the byte budget: there is probably more.
    let mut more = rows.len() == limit || fetched.saturating_mul(2) >= budget;
    let mut reach = if more {
        Reach::UpTo(rows.last().map_or(from, |r| r.id))
    } else {
        Reach::End
    };
    let mut taken = 0;
    let mut batches: BTreeMap<i32, Vec<Row>> = BTreeMap::new();
    for row in rows {
        // A broker whose window is full (messages or bytes) takes nothing more until what it
        // has in flight settles.
        let fits = room
            .get_mut(&row.broker_id)
            .is_some_and(|r| r.take(row.body.len()));
        if fits {
            taken += 1;
            batches.entry(row.broker_id).or_default().push(row);
        } else if !matches!(reach, Reach::UpTo(id) if id < row.id) {
            // Left for a later claim: the floor stays below it.
            reach = Reach::UpTo(row.id - 1);
        }
    }
    if probe.is_some() {
        floor.covered(&broker_ids, from, reach, started, cost);
    }
    if taken == 0 || room.values().all(|r| r.messages == 0 || r.bytes == 0) {
        // Nothing more fits until confirms arrive (they wake the worker).
        more = false;
    }
    for (broker_id, rows) in batches {
        let messages = prepare(rows, &*outbox, settings, faults, &mut parks, &mut writers);
        if messages.is_empty() {
            continue;
        }
        for m in &messages {
            flight.mark_sent(broker_id, m.id, m.body.len(), message_at(m));
        }
        telemetry.count(Counter::Published, messages.len() as u64);
        commands.push(Command::Publish {
            broker_id,
            messages,
            solo: false,
        });
    }
    park_all(outbox, telemetry, parks, settings, flight)?;
    Ok(Claimed {
        commands,
        more,
        complete: every_broker_open && !more && reach == Reach::End,
        writers,
    })
}

fn park_all<O: Outbox>(
    outbox: &mut O,
    telemetry: &impl Telemetry,
    parks: Vec<(i64, String)>,
    settings: &WorkerSettings,
    flight: &mut Flight,
) -> Result<(), O::Error> {
    let backoff = settings.retry_backoff();
    for (id, why) in parks {
        park_now(outbox, telemetry, id, &why, &backoff, flight)?;
    }
    Ok(())
}

/// A read from the lowest id found rows at or below the floor it had before: rows nothing
/// announced (inserted directly rather than through `amqp.publish()`, or retried by hand).
fn say_what_was_passed(telemetry: &impl Telemetry, passed: i64, rows: &[Row]) {
    let below: Vec<i64> = rows
        .iter()
        .map(|r| r.id)
        .filter(|id| *id <= passed)
        .collect();
    if !below.is_empty() {
        telemetry.log(
            Level::Log,
            &format!(
                "amqp_outbox: the claim found {} row(s) at or below its last scan floor {passed}: {below:?}",
                below.len()
            ),
        );
    }
}

/// Turns rows into messages; rows that can never be published as they are go to `parks`, the
/// transactions that wrote the others to `writers`.
fn prepare(
    rows: Vec<Row>,
    outbox: &impl Outbox,
    settings: &WorkerSettings,
    faults: &mut Faults,
    parks: &mut Vec<(i64, String)>,
    writers: &mut Vec<u32>,
) -> Vec<OutboundMessage> {
    let max_size = settings.max_message_size;
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        if row.body.len() > max_size {
            let why = format!(
                "body is {} bytes, over amqp_outbox.max_message_size ({max_size} bytes)",
                row.body.len()
            );
            parks.push((row.id, why));
            continue;
        }
        let headers = match crate::headers::json_object(row.headers.as_deref()) {
            Ok(headers) => headers,
            Err(why) => {
                // Retrying cannot help: the row is parked at once, the others go on.
                parks.push((row.id, format!("headers {why}")));
                continue;
            }
        };
        writers.push(row.writer);
        let first_attempt = row.attempts == 0;
        let origin = outbox.origin();
        let mut message = to_message(row, headers, &origin);
        message.lose_in_transit = faults.lose_this_one(settings, first_attempt);
        out.push(message);
    }
    out
}
