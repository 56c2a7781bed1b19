//! One task per publishing channel: publishes messages in order (pipelined, many confirms
//! outstanding) and turns confirms, returns, nacks and channel deaths into events.
//!
//! A task owns exactly one lapin channel, and every confirm it awaits was produced by that
//! channel: when the channel dies the task ends, so a confirm can never settle a message of an
//! earlier channel (delivery tags restart on each channel). Every message handed to the task is
//! reported exactly once, Confirmed or Failed: by the task once it has taken the message from
//! its batch, by the batch itself (`batch.rs`) while it is still queued. The one exception is
//! the test hook `lose_in_transit` (see `Command::Publish`).

use crate::ack::{self, SharedTracker};
use crate::batch::Batch;
use crate::bridge::{Event, Failure, LogLevel};
use crate::config::RecordWait;
use crate::connection::{better_error, describe_error, message_may_be_at_fault, Redactor};
use crate::events::EventSink;
use crate::exchange_probe::{ExchangeProbe, Probe};
use crate::outbound::{build, short};
use futures_util::future::{BoxFuture, FutureExt};
use futures_util::stream::{FuturesUnordered, StreamExt};
use lapin::message::BasicReturnMessage;
use lapin::options::BasicPublishOptions;
use lapin::types::ShortString;
use lapin::Connection;
use lapin::{BasicProperties, Channel, Confirmation};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

/// How long a dying channel may take to fail its outstanding confirms (lapin rejects them all at
/// once when the channel closes; this only bounds a channel that never finishes closing).
const DYING_WAIT: Duration = Duration::from_secs(5);
/// Nacks in a row (no positive confirm between them) after which the channel is given up: a
/// channel opened while a quorum queue elects its leader can keep nacking every publish.
const NACKS_BEFORE_RECONNECT: u32 = 5;

/// How often an idle task checks that its channel is still open.
const CHANNEL_CHECK: Duration = Duration::from_secs(1);

/// A command that leaves fewer ids than this unrecorded does not get a record of its own (see
/// [`RecordWait`]).
const RECORD_MIN_IDS: usize = 64;
/// How long a stopping task waits for the confirm of the record it flushed (well below the
/// broker task's wait for it to stop).
const RECORD_FLUSH_WAIT: Duration = Duration::from_secs(1);

pub(crate) enum Job {
    Publish(Batch),
    SetConfirmTimeout(Duration),
}

/// Why a publishing task ended. In every case its messages have been reported already.
#[derive(Debug)]
pub(crate) enum ChannelEnd {
    /// The channel closed (by a channel error, or with its connection); the text says why.
    Closed(String),
    /// A confirm did not arrive within the confirm timeout.
    Hung(String),
    /// Stopped by the broker task (reconnect, shutdown, connection lost).
    Stopped,
    /// The broker nacked every recent publish: replace the connection, after a delay.
    Refusing(String),
}

pub(crate) struct ChannelCtx {
    pub(crate) broker_id: i32,
    pub(crate) epoch: u64,
    pub(crate) channel: Channel,
    /// The channel's connection: exchanges are probed on a channel of their own.
    pub(crate) conn: Arc<Connection>,
    pub(crate) sink: EventSink,
    pub(crate) redactor: Redactor,
    pub(crate) confirm_timeout: Duration,
    /// The connection's negotiated frame size: a content header must fit in one frame.
    pub(crate) frame_max: usize,
    /// The connection's user, set as the user_id of receipts (RabbitMQ validates it).
    pub(crate) user: Option<ShortString>,
    /// True while the broker blocks the connection (resource alarm): lapin then writes nothing,
    /// so missing confirms are not a hang.
    pub(crate) blocked: watch::Receiver<bool>,
    /// `AckQueue` mode: where and how acknowledgement records go.
    pub(crate) ack: Option<AckCtx>,
}

pub(crate) struct AckCtx {
    /// The acknowledgement queue, reached through the default exchange.
    pub(crate) queue: ShortString,
    pub(crate) session: String,
    pub(crate) tracker: SharedTracker,
    pub(crate) wait: RecordWait,
}

/// An acknowledgement record published and not yet confirmed.
struct RecordInFlight {
    /// To match a return.
    message_id: String,
    ids: Vec<i64>,
    /// Publish order of the messages it lists (this channel's).
    listed: std::ops::Range<u64>,
}

struct Pending {
    id: i64,
    message_id: String,
    sent_at: Instant,
    solo: bool,
}

type ConfirmResult = (u64, lapin::Result<Confirmation>);

struct Publisher {
    ctx: ChannelCtx,
    /// Received, not yet published (solo messages wait here until nothing is unsettled). What
    /// is still here when the task ends is failed by the batches themselves.
    queue: VecDeque<Batch>,
    /// Published on this channel, not yet settled; keyed by publish order.
    unsettled: BTreeMap<u64, Pending>,
    confirms: FuturesUnordered<BoxFuture<'static, ConfirmResult>>,
    /// basic.return seen but not yet matched to a message's confirm, by message_id. lapin hands
    /// a return to whichever confirm of a multiple-ack it resolves first, not necessarily the
    /// returned message's own, so returns are matched by message_id instead.
    returned: HashMap<String, VecDeque<(u16, String)>>,
    next_seq: u64,
    /// Unsettled solo messages (0 or 1): nothing else is published meanwhile.
    solo_unsettled: usize,
    /// Acknowledgement records published and not yet confirmed, by publish order. Their
    /// confirms are never reported to the worker.
    records_unsettled: HashMap<u64, RecordInFlight>,
    /// `AckQueue` mode: ids confirmed on this channel (or handed over by an earlier one) whose
    /// record has not been confirmed. When the channel ends they go to the next one, which
    /// records them first: a confirmed message is in its queue, and without a record it would
    /// wait for the worker's timeout sweep and be published again.
    unrecorded: HashSet<i64>,
    /// `AckQueue` mode: ids whose record was confirmed before their own confirm came. RabbitMQ
    /// confirms a channel's publishes out of order when they go to different queues (the
    /// record's, the message's), so a message confirmed after its record must not become
    /// unrecorded: it would never leave that set, and the next channel would record it again.
    recorded_early: HashSet<i64>,
    /// Ids published since the last record: the next record lists them.
    batch_ids: Vec<i64>,
    /// Publish order of the first message `batch_ids` can hold: the next record lists
    /// messages published from here on (and ids carried from an earlier channel).
    batch_from: u64,
    /// When the next record is due, while `batch_ids` waits for more (see [`RECORD_MIN_IDS`]).
    record_due: Option<Instant>,
    /// The latest it may be due: `RecordWait::most` after the first id it waits with.
    record_by: Option<Instant>,
    /// The last record number used on this channel (records are numbered 1, 2, …).
    record_seq: u64,
    /// A refused record was logged on this channel: one line per channel, not per batch.
    record_warned: bool,
    blocked: bool,
    /// The sender of `ctx.blocked` is still there.
    blocked_open: bool,
    /// When the last block ended: the confirm timeout counts from here at the earliest.
    resumed_at: Instant,
    /// Nacks since the last positive confirm.
    nacks_in_a_row: u32,
    probe: ExchangeProbe,
}

/// Runs until the channel dies or `stop` fires; reports every message it was given. `carried`:
/// confirmed ids whose record an earlier channel could not deliver (see `unrecorded`); returns
/// the ones this channel could not either.
pub(crate) async fn run(
    ctx: ChannelCtx,
    mut jobs: mpsc::UnboundedReceiver<Job>,
    mut stop: oneshot::Receiver<String>,
    carried: Vec<i64>,
) -> (ChannelEnd, Vec<i64>) {
    let blocked = *ctx.blocked.borrow();
    let probe = ExchangeProbe::new(ctx.conn.clone(), ctx.confirm_timeout);
    let mut p = Publisher {
        ctx,
        queue: VecDeque::new(),
        unsettled: BTreeMap::new(),
        confirms: FuturesUnordered::new(),
        returned: HashMap::new(),
        next_seq: 0,
        solo_unsettled: 0,
        records_unsettled: HashMap::new(),
        unrecorded: carried.iter().copied().collect(),
        recorded_early: HashSet::new(),
        // Handed over by the channel before: their record goes first.
        record_due: (!carried.is_empty()).then(Instant::now),
        record_by: (!carried.is_empty()).then(Instant::now),
        batch_ids: carried,
        batch_from: 0,
        record_seq: 0,
        record_warned: false,
        blocked,
        blocked_open: true,
        resumed_at: Instant::now(),
        nacks_in_a_row: 0,
        probe,
    };
    let end = p.main(&mut jobs, &mut stop).await;
    if let Some(a) = &p.ctx.ack {
        ack::lock(&a.tracker).close(p.ctx.epoch);
    }
    // Batches still queued fail their messages as they are dropped; one sent after this
    // comes back to its sender, which drops it likewise.
    drop(jobs);
    (end, p.unrecorded.into_iter().collect())
}

impl Publisher {
    async fn main(
        &mut self,
        jobs: &mut mpsc::UnboundedReceiver<Job>,
        stop: &mut oneshot::Receiver<String>,
    ) -> ChannelEnd {
        let mut check = tokio::time::interval(CHANNEL_CHECK);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            if let Some(end) = self.publish_ready(stop).await {
                return end;
            }
            // No hang check while the broker blocks us: confirms cannot come then.
            let deadline = if self.blocked {
                None
            } else {
                self.unsettled
                    .values()
                    .next()
                    .map(|p| later(p.sent_at.max(self.resumed_at), self.ctx.confirm_timeout))
            };
            let sleep_until = some_instant(deadline);
            let record_at = some_instant(self.record_due);
            tokio::select! {
                biased;
                reason = &mut *stop => {
                    self.flush_record_before_stop().await;
                    return self.stopped(reason);
                }
                Some(first) = self.confirms.next(), if !self.confirms.is_empty() => {
                    let batch = self.ready_batch(first);
                    if let Some(err) = self.settle(batch) {
                        return self.dying(Some(err), stop).await;
                    }
                    if let Some(end) = self.refusing() {
                        return end;
                    }
                }
                job = jobs.recv() => match job {
                    Some(Job::Publish(batch)) => self.enqueue(batch),
                    Some(Job::SetConfirmTimeout(d)) => self.ctx.confirm_timeout = d,
                    None => {
                        self.fail_everything("publisher stopped");
                        return ChannelEnd::Stopped;
                    }
                },
                changed = self.ctx.blocked.changed(), if self.blocked_open => {
                    self.on_blocked_change(changed.is_ok());
                }
                _ = tokio::time::sleep_until(sleep_until), if deadline.is_some() => {
                    let text = self.hung_text();
                    self.fail_everything(&text);
                    return ChannelEnd::Hung(text);
                }
                // Only wakes the loop: `publish_ready` sends the record that came due.
                _ = tokio::time::sleep_until(record_at), if self.record_due.is_some() => {}
                _ = check.tick() => {
                    // A channel closed with nothing in flight has no confirm to tell us.
                    if !self.ctx.channel.status().connected() && self.confirms.is_empty() {
                        return self.dying(None, stop).await;
                    }
                }
            }
        }
    }

    /// After too many nacks in a row, gives the channel up: what is unsettled is published again
    /// on the next connection.
    fn refusing(&mut self) -> Option<ChannelEnd> {
        if self.nacks_in_a_row < NACKS_BEFORE_RECONNECT {
            return None;
        }
        let text = format!(
            "the broker nacked {} publishes in a row; replacing the connection",
            self.nacks_in_a_row
        );
        self.fail_everything(&text);
        Some(ChannelEnd::Refusing(text))
    }

    fn enqueue(&mut self, batch: Batch) {
        if !batch.is_empty() {
            self.queue.push_back(batch);
        }
    }

    fn on_blocked_change(&mut self, sender_alive: bool) {
        if !sender_alive {
            self.blocked_open = false;
            return;
        }
        let blocked = *self.ctx.blocked.borrow_and_update();
        if self.blocked && !blocked {
            self.resumed_at = Instant::now();
        }
        self.blocked = blocked;
    }

    /// Publishes queued messages, in order, until the queue is empty or a solo message must wait
    /// for the ones before it to settle. In `AckQueue` mode it also publishes the record of the
    /// ids published so far: once due, before a solo message and after it, and after a command
    /// that leaves at least [`RECORD_MIN_IDS`] of them (else it sets `record_due`).
    async fn publish_ready(&mut self, stop: &mut oneshot::Receiver<String>) -> Option<ChannelEnd> {
        // A record come due goes first (woken by its timer, or passing by while confirms keep
        // the select's other branches busy).
        if self.record_due.is_some_and(|t| t <= Instant::now()) {
            if let Some(end) = self.publish_record(stop).await {
                return Some(end);
            }
        }
        while let Some(solo) = self.queue.front().map(Batch::solo) {
            // A solo message may be one that closes the channel: the ids waiting for a record
            // get theirs before it, or a channel error would leave them to the timeout sweep.
            if solo && !self.batch_ids.is_empty() {
                if let Some(end) = self.publish_record(stop).await {
                    return Some(end);
                }
            }
            // A solo message goes out alone: after everything before it settled, and before
            // anything after it, so a channel error can only be its own.
            if (solo && !self.unsettled.is_empty()) || self.solo_unsettled > 0 {
                return None;
            }
            let Some(front) = self.queue.front_mut() else {
                break;
            };
            let Some(mut msg) = front.take_next() else {
                self.queue.pop_front();
                continue;
            };
            // The last message of its batch: the batch's record follows it.
            let last = front.is_empty();
            if last {
                self.queue.pop_front();
            }
            let mut published = false;
            if msg.lose_in_transit {
                // Test hook: as if the message and a record of its own, published just before
                // the rest of its batch, were lost. No publish, no confirm, no event from here.
                if let Some(a) = &self.ctx.ack {
                    self.record_seq += 1;
                    ack::lock(&a.tracker).register(
                        self.ctx.broker_id,
                        self.ctx.epoch,
                        self.record_seq,
                        vec![msg.id],
                    );
                }
            } else {
                match build(&msg, self.ctx.frame_max, self.ctx.user.as_ref()) {
                    // Nothing about the broker can change what is wrong with the message itself.
                    Err(e) => self.fail(msg.id, Failure::Unsendable, &e),
                    Ok((exchange, routing_key, properties)) => {
                        if let Probe::Missing(e) = self.probe.check(exchange.as_str()).await {
                            let text = self.describe(&e);
                            self.fail(msg.id, Failure::Rejected, &text);
                        } else {
                            let body = std::mem::take(&mut msg.body);
                            let channel = self.ctx.channel.clone();
                            match Self::start(channel, exchange, routing_key, body, properties)
                                .await
                            {
                                Ok(publish) => {
                                    let seq = self.next_seq;
                                    self.next_seq += 1;
                                    if solo {
                                        self.solo_unsettled += 1;
                                    }
                                    self.unsettled.insert(
                                        seq,
                                        Pending {
                                            id: msg.id,
                                            message_id: msg.message_id.clone(),
                                            sent_at: Instant::now(),
                                            solo,
                                        },
                                    );
                                    self.confirms.push(publish.map(move |r| (seq, r)).boxed());
                                    if self.ctx.ack.is_some() {
                                        self.batch_ids.push(msg.id);
                                    }
                                    published = true;
                                }
                                Err(e) => {
                                    // The channel is closing or closed: this one was not sent.
                                    let text = self.describe(&e);
                                    self.fail(
                                        msg.id,
                                        Failure::Transient,
                                        &format!("publishing channel closed: {text}"),
                                    );
                                    return Some(self.dying(Some(e), stop).await);
                                }
                            }
                        }
                    }
                }
            }
            if !self.batch_ids.is_empty() {
                if solo || (last && self.batch_ids.len() >= RECORD_MIN_IDS) {
                    if let Some(end) = self.publish_record(stop).await {
                        return Some(end);
                    }
                } else if last {
                    let now = Instant::now();
                    let wait = self.ctx.ack.as_ref().map(|a| a.wait).unwrap_or_default();
                    let by = *self.record_by.get_or_insert(now + wait.most);
                    self.record_due = Some((now + wait.quiet).min(by));
                }
            }
            if solo && published {
                return None;
            }
            // During a long batch, settle what is already confirmed now and then: it keeps the
            // hang check honest and notices a dead channel early.
            if published && self.next_seq.is_multiple_of(64) {
                if let Some(Some(first)) = self.confirms.next().now_or_never() {
                    let batch = self.ready_batch(first);
                    if let Some(err) = self.settle(batch) {
                        return Some(self.dying(Some(err), stop).await);
                    }
                    if let Some(end) = self.refusing() {
                        return Some(end);
                    }
                }
            }
        }
        None
    }

    /// Hands one publish to lapin without waiting for its frames to be written: one poll queues
    /// them (so the order on the wire, and the delivery tags, follow the calls), and lapin's I/O
    /// loop writes them while this task queues the next. The returned future completes with the
    /// confirm, or with the error that kept the frames from being written, and is awaited with
    /// every other confirm, under the same confirm timeout. Waiting for each write instead would
    /// cost a round trip between this thread and the I/O loop per message. `Err`: the channel
    /// refused the publish at once (closing or closed); nothing was queued.
    async fn start(
        channel: Channel,
        exchange: ShortString,
        routing_key: ShortString,
        body: Vec<u8>,
        properties: BasicProperties,
    ) -> lapin::Result<BoxFuture<'static, lapin::Result<Confirmation>>> {
        let mut publish = async move {
            let options = BasicPublishOptions {
                mandatory: true,
                immediate: false,
            };
            let confirm = channel
                .basic_publish(exchange, routing_key, options, &body, properties)
                .await?;
            confirm.await
        }
        .boxed();
        match std::future::poll_fn(|cx| Poll::Ready(publish.as_mut().poll(cx))).await {
            Poll::Pending => Ok(publish),
            Poll::Ready(Err(e)) => Err(e),
            Poll::Ready(Ok(confirmation)) => Ok(std::future::ready(Ok(confirmation)).boxed()),
        }
    }

    /// At a stop (a configuration change closes the connection right after), the ids waiting
    /// for a record get it, and its confirm is awaited briefly: once confirmed, the record is in
    /// the acknowledgement queue, where the listener finds it after this channel is gone.
    /// Otherwise those messages would wait for the timeout sweep. Best effort.
    async fn flush_record_before_stop(&mut self) {
        if self.batch_ids.is_empty() || self.send_record().await.is_err() {
            return;
        }
        let deadline = Instant::now() + RECORD_FLUSH_WAIT;
        while !self.records_unsettled.is_empty() && !self.confirms.is_empty() {
            tokio::select! {
                Some(first) = self.confirms.next() => {
                    let batch = self.ready_batch(first);
                    if self.settle(batch).is_some() {
                        return;
                    }
                }
                _ = tokio::time::sleep_until(deadline) => return,
            }
        }
    }

    /// Publishes the record of `batch_ids`; a channel that refuses it is dying.
    async fn publish_record(&mut self, stop: &mut oneshot::Receiver<String>) -> Option<ChannelEnd> {
        match self.send_record().await {
            Ok(()) => None,
            Err(e) => Some(self.dying(Some(e), stop).await),
        }
    }

    /// Publishes the record of `batch_ids` (if any) to the acknowledgement queue, on this
    /// channel, after the messages it lists. It is registered with the tracker first, so the
    /// listener can never see a record the tracker does not know. `Err`: the channel refused it.
    async fn send_record(&mut self) -> lapin::Result<()> {
        self.record_due = None;
        self.record_by = None;
        let ids = std::mem::take(&mut self.batch_ids);
        let listed = std::mem::replace(&mut self.batch_from, self.next_seq)..self.next_seq;
        let Some(a) = &self.ctx.ack else {
            return Ok(());
        };
        if ids.is_empty() {
            return Ok(());
        }
        self.record_seq += 1;
        let (epoch, seq) = (self.ctx.epoch, self.record_seq);
        let body = ack::record_body(&a.session, epoch, seq, &ids);
        let message_id = ack::record_message_id(&a.session, epoch, seq);
        let queue = a.queue.clone();
        ack::lock(&a.tracker).register(self.ctx.broker_id, epoch, seq, ids.clone());
        let properties = match short(&message_id, "record message_id") {
            Ok(mid) => BasicProperties::default()
                .with_delivery_mode(2)
                .with_content_type(ShortString::from("application/json"))
                .with_message_id(mid),
            Err(e) => {
                // Cannot happen (the id is short); the record is then simply missing.
                self.warn_record(&e);
                return Ok(());
            }
        };
        let channel = self.ctx.channel.clone();
        let publish = Self::start(channel, ShortString::from(""), queue, body, properties).await?;
        let seq = self.next_seq;
        self.next_seq += 1;
        self.records_unsettled.insert(
            seq,
            RecordInFlight {
                message_id,
                ids,
                listed,
            },
        );
        self.confirms.push(publish.map(move |r| (seq, r)).boxed());
        Ok(())
    }

    /// A record was refused: its messages will be reported Lost or time out. Said once per
    /// channel, since it usually means every record is refused.
    fn warn_record(&mut self, what: &str) {
        if self.record_warned {
            return;
        }
        self.record_warned = true;
        let queue = self
            .ctx
            .ack
            .as_ref()
            .map(|a| a.queue.as_str().to_string())
            .unwrap_or_default();
        self.ctx.sink.send(Event::Log {
            level: LogLevel::Warning,
            message: self.ctx.redactor.clean(&format!(
                "broker {}: acknowledgement record {what}: the acknowledgement queue \"{queue}\" \
                 is missing or refusing messages (not repeated for this channel)",
                self.ctx.broker_id
            )),
        });
    }

    /// `first` plus every other confirm that is already complete: confirms resolved together
    /// (one multiple-ack) become one event.
    fn ready_batch(&mut self, first: ConfirmResult) -> Vec<ConfirmResult> {
        let mut batch = vec![first];
        while let Some(Some(r)) = self.confirms.next().now_or_never() {
            batch.push(r);
        }
        batch
    }

    /// Settles the positive and negative confirms of a batch; returns the first error, if any
    /// (the channel is dead then; the errored messages stay unsettled for `dying`).
    fn settle(&mut self, batch: Vec<ConfirmResult>) -> Option<lapin::Error> {
        let mut error: Option<lapin::Error> = None;
        let mut outcomes = Vec::with_capacity(batch.len());
        // Record every return of the batch before settling anything (see `returned`).
        for (seq, res) in batch {
            match res {
                Ok(Confirmation::Ack(ret)) => {
                    self.record_return(ret);
                    outcomes.push((seq, Some(true)));
                }
                Ok(Confirmation::Nack(ret)) => {
                    self.record_return(ret);
                    outcomes.push((seq, Some(false)));
                }
                Ok(Confirmation::NotRequested) => outcomes.push((seq, None)),
                Err(e) => {
                    if error.as_ref().is_none_or(|cur| better_error(&e, cur)) {
                        error = Some(e);
                    }
                }
            }
        }
        // In publish order: within a batch a record's confirm then comes after those of the
        // messages it lists (across batches it may not, see `recorded_early`).
        outcomes.sort_unstable_by_key(|(seq, _)| *seq);
        let mut confirmed = Vec::new();
        for (seq, outcome) in outcomes {
            if let Some(record) = self.records_unsettled.remove(&seq) {
                // Settled either way: a refused record is not retried (its messages are
                // reported lost by a later record, or time out). Only a message still waiting
                // for its own confirm was recorded early: one that already failed (nacked,
                // returned) would stay in that set, and its next publish on this channel would
                // not be carried if its record died with the channel.
                let waiting: HashSet<i64> = self
                    .unsettled
                    .range(record.listed)
                    .map(|(_, p)| p.id)
                    .collect();
                for id in &record.ids {
                    if !self.unrecorded.remove(id) && waiting.contains(id) {
                        self.recorded_early.insert(*id);
                    }
                }
                // A record's confirm is ours alone; only a refusal is worth a word.
                let returned = self.take_return(&record.message_id);
                match (outcome, returned) {
                    (Some(true), None) | (None, _) => {}
                    (Some(true), Some((code, text))) => {
                        self.warn_record(&format!("returned as unroutable: {code} {text}"))
                    }
                    (Some(false), _) => self.warn_record("nacked by broker"),
                }
                continue;
            }
            let Some(p) = self.take_unsettled(seq) else {
                continue;
            };
            let recorded = self.recorded_early.remove(&p.id);
            match outcome {
                Some(true) => match self.take_return(&p.message_id) {
                    None => {
                        if self.ctx.ack.is_some() && !recorded {
                            self.unrecorded.insert(p.id);
                        }
                        confirmed.push(p.id)
                    }
                    Some((code, text)) => self.fail(
                        p.id,
                        Failure::Rejected,
                        &format!("returned by broker as unroutable: {code} {text}"),
                    ),
                },
                Some(false) => {
                    self.nacks_in_a_row += 1;
                    self.fail(p.id, Failure::Nacked, "nacked by broker");
                }
                // Cannot happen on a confirm-mode channel; without a confirm nothing is proven.
                None => self.fail(
                    p.id,
                    Failure::Transient,
                    "publisher confirms were not enabled on the channel",
                ),
            }
        }
        if !confirmed.is_empty() {
            self.nacks_in_a_row = 0;
            self.ctx.sink.send(Event::Confirmed {
                broker_id: self.ctx.broker_id,
                epoch: self.ctx.epoch,
                ids: confirmed,
            });
        }
        error
    }

    fn take_unsettled(&mut self, seq: u64) -> Option<Pending> {
        let p = self.unsettled.remove(&seq)?;
        if p.solo {
            self.solo_unsettled = self.solo_unsettled.saturating_sub(1);
        }
        Some(p)
    }

    fn record_return(&mut self, ret: Option<BasicReturnMessage>) {
        if let Some(ret) = ret {
            let message_id = ret
                .delivery
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.as_str().to_string())
                .unwrap_or_default();
            self.returned
                .entry(message_id)
                .or_default()
                .push_back((ret.reply_code, ret.reply_text.as_str().to_string()));
        }
    }

    fn take_return(&mut self, message_id: &str) -> Option<(u16, String)> {
        let list = self.returned.get_mut(message_id)?;
        let first = list.pop_front();
        if list.is_empty() {
            self.returned.remove(message_id);
        }
        first
    }

    /// The channel is dead: collect the remaining confirms (lapin fails them all at once), settle
    /// any that were acked just before, and blame the rest according to the error.
    async fn dying(
        &mut self,
        first: Option<lapin::Error>,
        stop: &mut oneshot::Receiver<String>,
    ) -> ChannelEnd {
        let mut error = first;
        let deadline = Instant::now() + DYING_WAIT;
        while !self.confirms.is_empty() {
            tokio::select! {
                biased;
                reason = &mut *stop => return self.stopped(reason),
                Some(r) = self.confirms.next() => {
                    let batch = self.ready_batch(r);
                    if let Some(e) = self.settle(batch) {
                        if error.as_ref().is_none_or(|cur| better_error(&e, cur)) {
                            error = Some(e);
                        }
                    }
                }
                _ = tokio::time::sleep_until(deadline) => break,
            }
        }
        let text = match &error {
            Some(e) => self.describe(e),
            None => "publishing channel closed".to_string(),
        };
        let n = self.unsettled.len();
        let (failure, detail) = match &error {
            Some(e) if message_may_be_at_fault(e) => {
                // Alone in flight (always so for a solo message): it is the culprit.
                if n == 1 {
                    (
                        Failure::Rejected,
                        format!("channel closed by broker: {text}"),
                    )
                } else {
                    (
                        Failure::Ambiguous,
                        format!(
                            "channel closed by broker while {n} messages were unconfirmed \
                             (publish alone to find which): {text}"
                        ),
                    )
                }
            }
            _ => (
                Failure::Transient,
                format!("publishing channel lost: {text}"),
            ),
        };
        self.solo_unsettled = 0;
        for (_, p) in std::mem::take(&mut self.unsettled) {
            self.fail(p.id, failure, &detail);
        }
        self.drop_queue(&format!(
            "publishing channel closed before the message was sent: {text}"
        ));
        self.clear_in_flight();
        ChannelEnd::Closed(text)
    }

    fn hung_text(&self) -> String {
        format!(
            "no publisher confirm within {:?}: the connection is considered hung",
            self.ctx.confirm_timeout
        )
    }

    /// Told to stop (with a reason, or by a dropped sender): everything in flight is retried later.
    fn stopped(&mut self, reason: Result<String, oneshot::error::RecvError>) -> ChannelEnd {
        let reason = reason.unwrap_or_else(|_| "publisher stopped".to_string());
        self.fail_everything(&reason);
        ChannelEnd::Stopped
    }

    /// Everything unsettled or queued will be published again later (`Transient`).
    fn fail_everything(&mut self, error: &str) {
        self.solo_unsettled = 0;
        for (_, p) in std::mem::take(&mut self.unsettled) {
            self.fail(p.id, Failure::Transient, error);
        }
        self.drop_queue(error);
        self.clear_in_flight();
    }

    /// The queued batches fail their messages, with this reason, as they are dropped.
    fn drop_queue(&mut self, why: &str) {
        let why = self.ctx.redactor.clean(why);
        for mut batch in std::mem::take(&mut self.queue) {
            batch.unsent_because(why.clone());
        }
    }

    /// Forgets every confirm and record still pending (the channel is done).
    fn clear_in_flight(&mut self) {
        self.confirms.clear();
        self.returned.clear();
        self.records_unsettled.clear();
        self.batch_ids.clear();
        self.batch_from = self.next_seq;
        self.record_due = None;
        self.record_by = None;
        self.recorded_early.clear();
    }

    fn fail(&self, id: i64, failure: Failure, error: &str) {
        self.ctx.sink.send(Event::Failed {
            broker_id: self.ctx.broker_id,
            id,
            failure,
            error: self.ctx.redactor.clean(error),
        });
    }

    fn describe(&self, e: &lapin::Error) -> String {
        self.ctx.redactor.clean(&describe_error(e))
    }
}

/// A sleep future is built even when its branch is disabled: give it some instant.
fn some_instant(t: Option<Instant>) -> Instant {
    t.unwrap_or_else(|| Instant::now() + Duration::from_secs(3600))
}

/// `t + d`, without the panic of an overflowing Instant (a huge timeout means "never").
fn later(t: Instant, d: Duration) -> Instant {
    t.checked_add(d)
        .or_else(|| t.checked_add(Duration::from_secs(10 * 365 * 86_400)))
        .unwrap_or(t)
}
