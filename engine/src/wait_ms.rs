//! The timeout of a wait that counts whole milliseconds (PostgreSQL's `WaitLatch` and
//! `WaitEventSetWait`, `poll`), rounded up. Rounded down, the last fraction of a millisecond
//! before a timed event (a batch of deliveries due for its DELETE, a retry, a pass) became a
//! wait of zero that returned at once, and the loop ran through its checks again and again
//! until the time came: about 30 turns and a millisecond of CPU before each DELETE.

use std::time::Duration;

/// `timeout` in whole milliseconds, rounded up (zero stays zero: a poll), at most `i32::MAX`.
pub fn wait_ms(timeout: Duration) -> i32 {
    let ms = timeout.as_nanos().div_ceil(1_000_000);
    i32::try_from(ms).unwrap_or(i32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fraction_of_a_millisecond_waits_a_whole_one() {
        assert_eq!(wait_ms(Duration::ZERO), 0);
        assert_eq!(wait_ms(Duration::from_nanos(1)), 1);
        assert_eq!(wait_ms(Duration::from_micros(900)), 1);
        assert_eq!(wait_ms(Duration::from_millis(1)), 1);
        assert_eq!(wait_ms(Duration::from_micros(15_100)), 16);
        assert_eq!(wait_ms(Duration::from_secs(u64::MAX)), i32::MAX);
    }
}
