//! What identifies a message and its origin, without PostgreSQL: the UUIDv7 layout of a
//! `message_id` and the host name that `amqp_outbox.host_id` defaults to. The extension fills
//! in the random bytes and the time; the benchmark's raw publisher makes look-alikes.

/// Formats a UUIDv7 (RFC 9562) from its Unix milliseconds and 10 random bytes (only 74 of their
/// 80 bits are used: the version and variant take the rest).
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

/// This machine's host name, or "localhost" when it cannot be read.
pub fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is ours and its length is passed; gethostname NUL-terminates within it
    // on success (the last byte stays 0 if the name was truncated).
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len() - 1) };
    if rc != 0 {
        return "localhost".to_string();
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn host_name_is_not_empty() {
        assert!(!host_name().is_empty());
    }
}
