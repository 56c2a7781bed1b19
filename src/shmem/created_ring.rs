//! The last databases where `CREATE EXTENSION amqp_outbox` committed, for the launcher: a
//! counter and a ring of tagged entries in shared memory, written by any backend at commit and
//! read by the launcher. Each commit takes its own number, so two at once never write one entry;
//! the reader checks each entry's tag, since it may read the count before the entry is written.

use std::sync::atomic::{AtomicU64, Ordering};

pub const CREATED_RING: usize = 16;

pub struct CreatedRing {
    /// Grows with every commit; entry `n % CREATED_RING` belongs to the n-th.
    created: AtomicU64,
    /// `(n + 1) << 32 | database` for the n-th commit (low 32 bits of n + 1): an entry whose tag
    /// is not the one a reader expects was not written yet or was overwritten.
    entries: [AtomicU64; CREATED_RING],
}

impl Default for CreatedRing {
    fn default() -> Self {
        CreatedRing {
            created: AtomicU64::new(0),
            entries: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl CreatedRing {
    /// A commit in `database`.
    pub fn record(&self, database: u32) {
        let n = self.created.fetch_add(1, Ordering::AcqRel);
        self.entries[(n as usize) % CREATED_RING].store(entry(n, database), Ordering::Release);
    }

    /// How many commits so far.
    pub fn count(&self) -> u64 {
        self.created.load(Ordering::Acquire)
    }

    /// The databases of the commits after the first `since`, up to `now`; `None` when too many
    /// came to tell, or one is still being written (then every database must be looked at).
    pub fn between(&self, since: u64, now: u64) -> Option<Vec<u32>> {
        if now.saturating_sub(since) > CREATED_RING as u64 {
            return None;
        }
        (since..now)
            .map(|n| {
                let e = self.entries[(n as usize) % CREATED_RING].load(Ordering::Acquire);
                (e >> 32 == entry(n, 0) >> 32).then_some(e as u32)
            })
            .collect()
    }
}

fn entry(n: u64, database: u32) -> u64 {
    (n.wrapping_add(1) & 0xFFFF_FFFF) << 32 | u64::from(database)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn commits_at_once_each_keep_their_entry() {
        for _ in 0..50 {
            let ring = Arc::new(CreatedRing::default());
            let threads: Vec<_> = (0..CREATED_RING as u32)
                .map(|db| {
                    let ring = ring.clone();
                    std::thread::spawn(move || ring.record(1000 + db))
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            let mut seen = ring.between(0, ring.count()).expect("every entry written");
            seen.sort_unstable();
            let want: Vec<u32> = (0..CREATED_RING as u32).map(|db| 1000 + db).collect();
            assert_eq!(seen, want, "an entry was overwritten");
        }
    }

    #[test]
    fn an_entry_not_written_yet_or_overwritten_means_look_at_everything() {
        let ring = CreatedRing::default();
        ring.record(7);
        // The count taken, the entry not yet stored (a commit in between its two steps).
        ring.created.fetch_add(1, Ordering::AcqRel);
        assert_eq!(ring.between(0, 1), Some(vec![7]));
        assert_eq!(ring.between(0, 2), None);
        // More commits than the ring holds since the reader last looked.
        let ring = CreatedRing::default();
        for db in 0..=CREATED_RING as u32 {
            ring.record(db);
        }
        assert_eq!(ring.between(0, ring.count()), None);
        assert_eq!(
            ring.between(1, ring.count()).map(|v| v.len()),
            Some(CREATED_RING)
        );
    }
}
