//! The `message_id` every message carries: made once, when the row is inserted, and stored in
//! it, so it stays the same across resends, dumps, restores and upgrades. A UUIDv7 (RFC 9562):
//! 48 bits of Unix milliseconds, then 74 random bits from the server's strong random source.
//! Nothing in it comes from a sequence or from the cluster, so a point-in-time recovery or a
//! copy of the database that hands out the same row ids again still makes new message ids.

use pgrx::prelude::*;

pub use amqp_outbox_broker::identity::uuid_v7;

/// The default of `amqp.message.message_id`, so direct INSERTs get one too.
#[pg_extern(volatile, parallel_safe, name = "_new_message_id")]
pub(crate) fn new_message_id() -> String {
    let mut random = [0u8; 10];
    // SAFETY: the buffer is ours and exactly `len` bytes long.
    let ok = unsafe { pg_sys::pg_strong_random(random.as_mut_ptr().cast(), random.len()) };
    if !ok {
        error!("amqp_outbox: could not generate random bytes for a message_id");
    }
    let unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    uuid_v7(unix_ms, random)
}
