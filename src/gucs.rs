//! The `amqp_outbox.*` settings. Read them only on a PostgreSQL thread; the worker copies what
//! the AMQP thread needs into plain values ([`WorkerSettings`]).

// Defaults shared with a relay.
use amqp_outbox_engine::settings::defaults::{self, millis};
use pgrx::guc::{GucContext, GucFlags, GucRegistry, GucSetting};
use std::ffi::CString;
use std::time::Duration;

pub static DATABASE: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(Some(c"*"));
pub static MAX_WORKERS: GucSetting<i32> = GucSetting::<i32>::new(8);
pub static ENABLED: GucSetting<bool> = GucSetting::<bool>::new(defaults::ENABLED);
pub static MAX_MESSAGE_SIZE: GucSetting<i32> =
    GucSetting::<i32>::new(defaults::MAX_MESSAGE_SIZE as i32);
pub static MAX_ATTEMPTS: GucSetting<i32> = GucSetting::<i32>::new(defaults::MAX_ATTEMPTS);
pub static NAPTIME: GucSetting<i32> = GucSetting::<i32>::new(millis(defaults::NAPTIME));
/// Milliseconds, fractions allowed ('500us').
pub static BATCH_INTERVAL: GucSetting<f64> =
    GucSetting::<f64>::new(millis(defaults::BATCH_INTERVAL) as f64);
pub static BATCH_SIZE: GucSetting<i32> = GucSetting::<i32>::new(defaults::BATCH_SIZE as i32);
pub static MAX_IN_FLIGHT: GucSetting<i32> = GucSetting::<i32>::new(defaults::MAX_IN_FLIGHT as i32);
pub static MAX_IN_FLIGHT_BYTES: GucSetting<i32> =
    GucSetting::<i32>::new(defaults::MAX_IN_FLIGHT_BYTES as i32);
pub static CONNECT_TIMEOUT: GucSetting<i32> =
    GucSetting::<i32>::new(millis(defaults::CONNECT_TIMEOUT));
pub static HEARTBEAT: GucSetting<i32> = GucSetting::<i32>::new(defaults::HEARTBEAT_SECS as i32);
pub static CONFIRM_TIMEOUT: GucSetting<i32> =
    GucSetting::<i32>::new(millis(defaults::CONFIRM_TIMEOUT));
pub static RETRY_BACKOFF_MIN: GucSetting<i32> =
    GucSetting::<i32>::new(millis(defaults::RETRY_BACKOFF_MIN));
pub static RETRY_BACKOFF_MAX: GucSetting<i32> =
    GucSetting::<i32>::new(millis(defaults::RETRY_BACKOFF_MAX));
pub static RESEND_AFTER: GucSetting<i32> = GucSetting::<i32>::new(millis(defaults::RESEND_AFTER));
pub static ACK_QUEUE_QUORUM: GucSetting<bool> = GucSetting::<bool>::new(defaults::ACK_QUEUE_QUORUM);
pub static RANDOMIZE_HOSTS: GucSetting<bool> = GucSetting::<bool>::new(defaults::RANDOMIZE_HOSTS);
pub static MAX_PENDING: GucSetting<i32> = GucSetting::<i32>::new(defaults::MAX_PENDING);
pub static HANDLER_TIMEOUT: GucSetting<i32> = GucSetting::<i32>::new(30_000);
/// Minutes (settings accept units: '15d').
pub static DEDUP_WINDOW: GucSetting<i32> = GucSetting::<i32>::new(15 * 24 * 60);
pub static DEDUP_RETENTION: GucSetting<i32> = GucSetting::<i32>::new(90 * 24 * 60);
pub static RECEIPTS_EXCHANGE: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(None);
pub static INBOX_BATCH_SIZE: GucSetting<i32> = GucSetting::<i32>::new(100);
/// Seconds (settings accept units: '5min').
pub static BLOCKED_KEY_WARNING: GucSetting<i32> = GucSetting::<i32>::new(300);
/// Tags: empty means the default (the database's name, the host's name).
pub static SYSTEM_ID: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
pub static HOST_ID: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
pub static TRACEPARENT: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
pub static STANDBY_NAMES: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
/// Minutes (settings accept units: '15d').
pub static RECONCILE_WINDOW: GucSetting<i32> = GucSetting::<i32>::new(15 * 24 * 60);
pub static STATS_RETENTION: GucSetting<i32> = GucSetting::<i32>::new(400 * 24 * 60);
/// Minutes (settings accept units: '24h').
pub static IDEMPOTENCY_WINDOW: GucSetting<i32> = GucSetting::<i32>::new(24 * 60);
/// Test builds only (feature `fault-injection`): absent from a user's build, and from SHOW ALL.
#[cfg(feature = "fault-injection")]
pub static TEST_LOSE_ONE_IN: GucSetting<i32> = GucSetting::<i32>::new(0);
#[cfg(feature = "fault-injection")]
pub static TEST_DELETE_AFTER: GucSetting<i32> = GucSetting::<i32>::new(0);

/// Defines the settings. `preloading`: `_PG_init` runs while `shared_preload_libraries` is
/// processed. A server-start setting can only be defined then (PostgreSQL ends the session with
/// FATAL otherwise), so a backend that loads the library later (CREATE EXTENSION without
/// preloading) leaves it out and still gets its clear error at the first publish.
pub fn init(preloading: bool) {
    GucRegistry::define_string_guc(
        c"amqp_outbox.database",
        c"Databases served: * (all), or comma-separated names.",
        c"The launcher starts an outbox worker and a subscription worker in every database that has the extension and is allowed here.",
        &DATABASE,
        GucContext::Sighup,
        GucFlags::default(),
    );
    if preloading {
        GucRegistry::define_int_guc(
            c"amqp_outbox.max_workers",
            c"Databases served at most (each gets two background workers).",
            c"Databases beyond it get a WARNING and a row in amqp.worker_status. Each served database uses two of max_worker_processes.",
            &MAX_WORKERS,
            1,
            crate::shmem::MAX_DATABASES as i32,
            GucContext::Postmaster,
            GucFlags::default(),
        );
    }
    GucRegistry::define_bool_guc(
        c"amqp_outbox.enabled",
        c"Whether the background worker publishes messages.",
        c"When off, committed messages wait in amqp.message until it is turned on again.",
        &ENABLED,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"amqp_outbox.max_message_size",
        c"Largest message body amqp.publish() accepts.",
        c"Bigger bodies are rejected with SQLSTATE 54000; the worker parks bigger rows inserted directly.",
        &MAX_MESSAGE_SIZE,
        0,
        i32::MAX,
        GucContext::Suset,
        GucFlags::UNIT_BYTE,
    );
    GucRegistry::define_int_guc(
        c"amqp_outbox.max_attempts",
        c"Failed publish attempts after which a message is parked.",
        c"A parked message stays in amqp.message with its last error and is not retried automatically.",
        &MAX_ATTEMPTS,
        1,
        1_000_000,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"amqp_outbox.naptime",
        c"Longest time the worker sleeps without being woken.",
        c"Commits wake the worker at once; this fallback finds rows no commit announced (COMMIT PREPARED, crash recovery) and retries that are due.",
        &NAPTIME,
        10,
        3_600_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_float_guc(
        c"amqp_outbox.batch_interval",
        c"How long commits gather before the worker's next claim at 2,000 commits a second.",
        c"The worker lets commits gather in proportion to the rate it sees: not at all below 250 messages a second, this long at 2,000, and with the square of the rate above that, up to four times this long at 4,000 and above, so one claim takes everything committed meanwhile. Longer means larger batches and less CPU per message (worker and broker) at high rates, and up to four times this much more latency there. Fractions are allowed ('250us'). 0 claims after every wake-up.",
        &BATCH_INTERVAL,
        0.0,
        1000.0,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"amqp_outbox.batch_size",
        c"Rows the worker claims from amqp.message per statement.",
        c"",
        &BATCH_SIZE,
        1,
        100_000,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"amqp_outbox.max_in_flight",
        c"Messages published but not yet confirmed, per broker.",
        c"Bounds the worker's memory and the duplicates a fault can cause.",
        &MAX_IN_FLIGHT,
        1,
        1_000_000,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"amqp_outbox.max_in_flight_bytes",
        c"Message bodies handed to the broker connection and not yet confirmed, per broker.",
        c"Bounds the worker's memory whatever the message sizes; a message larger than this still goes out, alone.",
        &MAX_IN_FLIGHT_BYTES,
        1024,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_BYTE,
    );
    GucRegistry::define_int_guc(
        c"amqp_outbox.connect_timeout",
        c"Time allowed to open a connection to a broker.",
        c"",
        &CONNECT_TIMEOUT,
        100,
        600_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"amqp_outbox.heartbeat",
        c"AMQP heartbeat interval; 0 disables heartbeats.",
        c"",
        &HEARTBEAT,
        0,
        600,
        GucContext::Sighup,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_int_guc(
        c"amqp_outbox.confirm_timeout",
        c"A publish not confirmed within this time means the connection is hung.",
        c"The connection is closed and reopened, and unconfirmed messages are published again.",
        &CONFIRM_TIMEOUT,
        100,
        3_600_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"amqp_outbox.retry_backoff_min",
        c"First delay before reconnecting to a broker or retrying a refused message.",
        c"",
        &RETRY_BACKOFF_MIN,
        1,
        3_600_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"amqp_outbox.retry_backoff_max",
        c"Longest delay between reconnects or retries (exponential backoff with jitter).",
        c"",
        &RETRY_BACKOFF_MAX,
        1,
        86_400_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"amqp_outbox.resend_after",
        c"A message without proof of delivery after this time is published again.",
        c"Proof is the confirm (and, in ack_queue mode, the acknowledgement record). Each resend counts as an attempt.",
        &RESEND_AFTER,
        100,
        86_400_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_bool_guc(
        c"amqp_outbox.ack_queue_quorum",
        c"Declare the acknowledgement queue as a quorum queue.",
        c"Takes effect for a new acknowledgement queue; an existing queue keeps its type.",
        &ACK_QUEUE_QUORUM,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_bool_guc(
        c"amqp_outbox.randomize_hosts",
        c"Try a broker's hosts in random order instead of in (host, port) order.",
        c"Spreads the connections over a cluster's nodes, like randomize in a failover URL.",
        &RANDOMIZE_HOSTS,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"amqp_outbox.max_pending",
        c"Messages a broker may have waiting before amqp.publish() refuses more (0 = no limit).",
        c"Checked against the worker's count, refreshed about once a second: approximate by design.",
        &MAX_PENDING,
        0,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"amqp_outbox.handler_timeout",
        c"Longest time a subscription handler may run for one message (0 = no limit).",
        c"A handler still running then is cancelled like a statement_timeout (SQLSTATE 57014): its message fails and is retried. One that catches the cancel is ended at twice the timeout (the worker restarts, the message is recorded as failed).",
        &HANDLER_TIMEOUT,
        0,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"amqp_outbox.blocked_key_warning",
        c"How long a key of an ordered subscription may wait for a failed message before amqp.health() warns.",
        c"While a message with a key is in amqp.inbox_failed (not dead), later messages with that key wait. 0 warns at once.",
        &BLOCKED_KEY_WARNING,
        0,
        i32::MAX,
        GucContext::Suset,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_int_guc(
        c"amqp_outbox.idempotency_window",
        c"How long an idempotency key of publish_message()/publish_bytes() counts.",
        c"A publish with a key published within it publishes nothing and returns the first message's id. The worker deletes older keys.",
        &IDEMPOTENCY_WINDOW,
        1,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_MIN,
    );
    GucRegistry::define_int_guc(
        c"amqp_outbox.dedup_window",
        c"How long consumption records stay in the hot unique tables (consume_once, subscriptions).",
        c"Within it a duplicate is always recognised, racing sessions included. Older records move to amqp.consumption_archive.",
        &DEDUP_WINDOW,
        1,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_MIN,
    );
    GucRegistry::define_int_guc(
        c"amqp_outbox.dedup_retention",
        c"How long archived consumption records are kept before their day is dropped.",
        c"Counted from consumption. Archived records still recognise duplicates of amqp_outbox's own (UUIDv7) message ids.",
        &DEDUP_RETENTION,
        1,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_MIN,
    );
    GucRegistry::define_string_guc(
        c"amqp_outbox.receipts_exchange",
        c"Exchange that receives a receipt for each message a subscription handled or failed (empty = none).",
        c"Receipts are published through the outbox, in the consumer's transaction: sent if and only if it committed.",
        &RECEIPTS_EXCHANGE,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"amqp_outbox.standby_names",
        c"Standbys that must have flushed a commit before a message it made leaves for the broker (empty = none).",
        c"Their application_name in pg_stat_replication, comma-separated, or * for every standby connected now (at least one). A standby that is down or behind holds messages back, never drops them; application commits never wait.",
        &STANDBY_NAMES,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"amqp_outbox.inbox_batch_size",
        c"Messages a subscription handles in one transaction at most (one subtransaction each).",
        c"Larger batches commit less often; a failing message only rolls back its own subtransaction.",
        &INBOX_BATCH_SIZE,
        1,
        10_000,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"amqp_outbox.system_id",
        c"Business system id sent with every message this session publishes (empty = the database's name).",
        c"Header x-amqp-outbox-system-id; kept in amqp.produced.",
        &SYSTEM_ID,
        GucContext::Userset,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"amqp_outbox.host_id",
        c"Host id sent with every message this session publishes (empty = the server's host name).",
        c"Header x-amqp-outbox-host-id; kept in amqp.produced.",
        &HOST_ID,
        GucContext::Userset,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"amqp_outbox.traceparent",
        c"W3C trace context (traceparent) sent with every message this session publishes (empty = none).",
        c"A subscription sets it for its handler from the message's traceparent header, so a trace crosses the broker.",
        &TRACEPARENT,
        GucContext::Userset,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"amqp_outbox.reconcile_window",
        c"How long the production log (amqp.produced) and receipts are kept; 0 = no production log.",
        c"Whole days are dropped; monitoring rules only see messages within the window.",
        &RECONCILE_WINDOW,
        0,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_MIN,
    );
    GucRegistry::define_int_guc(
        c"amqp_outbox.stats_retention",
        c"How long the per-day statistics (amqp.daily_stats) are kept.",
        c"Counted in whole days of message creation (UTC).",
        &STATS_RETENTION,
        1,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_MIN,
    );
    #[cfg(feature = "fault-injection")]
    GucRegistry::define_int_guc(
        c"amqp_outbox.test_lose_one_in",
        c"Fault injection for tests: pretend one first publish in N is lost in transit (0 = never).",
        c"Never set this in production: it exists to prove that lost messages are detected and resent.",
        &TEST_LOSE_ONE_IN,
        0,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::default(),
    );
    #[cfg(feature = "fault-injection")]
    GucRegistry::define_int_guc(
        c"amqp_outbox.test_delete_after",
        c"Fault injection for tests: how long delivered rows wait for their batched DELETE (0 = the built-in 20 ms).",
        c"Never set this in production: it exists to prove that a clean shutdown deletes what was delivered.",
        &TEST_DELETE_AFTER,
        0,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    // SAFETY: in `_PG_init` on the process's only thread, after the GUCs above are defined; the
    // prefix is a static C string (PostgreSQL keeps its own copy).
    unsafe { pgrx::pg_sys::MarkGUCPrefixReserved(c"amqp_outbox".as_ptr()) };
}

fn ms(setting: &GucSetting<i32>) -> Duration {
    Duration::from_millis(setting.get().max(0) as u64)
}

fn fractional_ms(setting: &GucSetting<f64>) -> Duration {
    // The GUC's own bounds keep it finite and within 0..=1000.
    Duration::try_from_secs_f64(setting.get() / 1000.0).unwrap_or_default()
}

// The settings the worker uses are a plain struct of the engine (a relay fills the same one
// from its own configuration); here they are read from the GUCs.
pub use amqp_outbox_engine::settings::WorkerSettings;

/// [`WorkerSettings`] from the GUCs, copied once per reload so the loop never reads a GUC
/// mid-way.
pub fn worker_settings() -> WorkerSettings {
    WorkerSettings {
        enabled: ENABLED.get(),
        max_message_size: MAX_MESSAGE_SIZE.get().max(0) as usize,
        max_attempts: MAX_ATTEMPTS.get(),
        naptime: ms(&NAPTIME),
        batch_interval: fractional_ms(&BATCH_INTERVAL),
        batch_size: BATCH_SIZE.get().max(1) as usize,
        max_in_flight: MAX_IN_FLIGHT.get().max(1) as usize,
        max_in_flight_bytes: MAX_IN_FLIGHT_BYTES.get().max(1024) as usize,
        connect_timeout: ms(&CONNECT_TIMEOUT),
        heartbeat_secs: HEARTBEAT.get().clamp(0, u16::MAX as i32) as u16,
        confirm_timeout: ms(&CONFIRM_TIMEOUT),
        retry_backoff_min: ms(&RETRY_BACKOFF_MIN),
        retry_backoff_max: ms(&RETRY_BACKOFF_MAX).max(ms(&RETRY_BACKOFF_MIN)),
        resend_after: ms(&RESEND_AFTER),
        ack_queue_quorum: ACK_QUEUE_QUORUM.get(),
        #[cfg(feature = "fault-injection")]
        lose_one_in: TEST_LOSE_ONE_IN.get().max(0) as u32,
        #[cfg(feature = "fault-injection")]
        delete_after: Some(ms(&TEST_DELETE_AFTER)).filter(|d| !d.is_zero()),
        max_pending: MAX_PENDING.get(),
        randomize_hosts: RANDOMIZE_HOSTS.get(),
        standby_names: text(&STANDBY_NAMES).unwrap_or_default(),
    }
}

/// A string setting's value, `None` when unset or empty.
pub fn text(setting: &GucSetting<Option<CString>>) -> Option<String> {
    setting
        .get()
        .and_then(|c| c.into_string().ok())
        .filter(|s| !s.is_empty())
}

/// `amqp_outbox.database`: which databases the launcher serves.
#[derive(Debug, PartialEq, Eq)]
pub struct DatabaseFilter {
    all: bool,
    names: Vec<String>,
}

impl DatabaseFilter {
    pub fn allows(&self, database: &str) -> bool {
        self.all || self.names.iter().any(|n| n == database)
    }
}

pub fn database_filter_text() -> String {
    DATABASE
        .get()
        .and_then(|c| c.into_string().ok())
        .unwrap_or_default()
}

pub fn database_filter() -> DatabaseFilter {
    parse_database_filter(&database_filter_text())
}

pub fn max_workers() -> usize {
    MAX_WORKERS.get().max(1) as usize
}

/// Names separated by commas, surrounding spaces ignored (a name with a comma cannot be
/// listed); empty, or a `*` among them, means every database.
fn parse_database_filter(list: &str) -> DatabaseFilter {
    let mut names: Vec<String> = Vec::new();
    for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        if !names.iter().any(|n| n == name) {
            names.push(name.to_string());
        }
    }
    DatabaseFilter {
        all: names.is_empty() || names.iter().any(|n| n == "*"),
        names,
    }
}

#[cfg(test)]
mod tests {
    use super::parse_database_filter;

    #[test]
    fn database_list_is_split_on_commas_trimmed_and_deduplicated() {
        let f = parse_database_filter(" shop , billing,shop,, ");
        assert!(f.allows("shop") && f.allows("billing"));
        assert!(!f.allows("postgres") && !f.allows(" shop"));
    }

    #[test]
    fn empty_or_a_star_means_every_database() {
        for list in ["", " , ", "*", "shop, *"] {
            assert!(parse_database_filter(list).allows("anything"), "{list:?}");
        }
    }
}
