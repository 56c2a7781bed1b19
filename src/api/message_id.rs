//! The `message_id` every message carries: made once, when the row is inserted, and stored in
//! it, so it stays the same across resends, dumps, restores and upgrades. A UUIDv7 (RFC 9562):
//! 48 bits of Unix milliseconds, then 74 random bits from the server's strong random source.
//! Nothing in it comes from a sequence or from the cluster, so a point-in-time recovery or a
//! copy of the database that hands out the same row ids again still makes new message ids.

use pgrx::prelude::*;

/// Formats a UUIDv7 from its timestamp and 10 random bytes (only 74 of their 80 bits are used:
/// the version and variant take the rest).
pub fn uuid_v7(unix_ms: u64, random: [u8; 10]) -> String {
    let mut b = [0u8; 16];
    b[..6].copy_from_slice(&unix_ms.to_be_bytes()[2..]);
    b[6..].copy_from_slice(&random);
    b[6] = 0x70 | (b[6] & 0x0f);
    b[8] = 0x80 | (b[8] & 0x3f);
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(36);
    for (i, byte) in b.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            out.push('-');
        }
        out.push(HEX[usize::from(byte >> 4)] as char);
        out.push(HEX[usize::from(byte & 0x0f)] as char);
    }
    out
}

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

#[cfg(test)]
mod tests {
    use super::uuid_v7;

    #[test]
    fn layout_follows_rfc_9562() {
        let id = uuid_v7(0x0191_2345_6789, [0xff; 10]);
        assert_eq!(id, "01912345-6789-7fff-bfff-ffffffffffff");
        let id = uuid_v7(1, [0; 10]);
        assert_eq!(id, "00000000-0001-7000-8000-000000000000");
    }

    #[test]
    fn later_milliseconds_sort_later() {
        let a = uuid_v7(1_700_000_000_000, [0xff; 10]);
        let b = uuid_v7(1_700_000_000_001, [0; 10]);
        assert!(a < b);
    }
}
