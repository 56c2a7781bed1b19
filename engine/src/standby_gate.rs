//! `amqp_outbox.standby_names`: what the worker claimed leaves for the broker only once the
//! named standbys have flushed the WAL of the commits it saw. Plain Rust, no PostgreSQL calls
//! (the standbys' positions are read by the caller).
//!
//! Why: with asynchronous replication a failover loses the last commits the standby did not
//! get. A message published for such a commit would announce something the surviving database
//! never did (a phantom). Every row a claim saw was committed before the claim's snapshot, so
//! its commit record lies before the WAL insert position taken after the claim; once a standby
//! has flushed past that position, a promotion of it keeps those rows.

use std::collections::VecDeque;

/// Which standbys must have a commit: the setting, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Standbys {
    /// Empty setting: nothing waits.
    Off,
    /// `*`: every standby connected now, and at least one.
    AllConnected,
    /// These `application_name`s, each of them.
    Named(Vec<String>),
}

impl Standbys {
    /// A comma list of names, `*`, or empty. Names are trimmed; empty items are ignored, and so
    /// is `own_name`, this server's `cluster_name`: a server is not its own standby, and after a
    /// promotion the list it inherited still names it.
    pub fn parse(setting: &str, own_name: &str) -> Standbys {
        let names: Vec<String> = setting
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty() && (own_name.is_empty() || *n != own_name))
            .map(str::to_string)
            .collect();
        if names.is_empty() {
            Standbys::Off
        } else if names.iter().any(|n| n == "*") {
            Standbys::AllConnected
        } else {
            Standbys::Named(names)
        }
    }

    pub fn is_off(&self) -> bool {
        *self == Standbys::Off
    }

    /// How far every required standby has flushed, given the connected ones' `(name, flush
    /// position)`; `None` when one is missing (not connected, or `*` with none connected).
    pub fn flushed(&self, connected: &[(String, u64)]) -> Option<u64> {
        match self {
            Standbys::Off => Some(u64::MAX),
            Standbys::AllConnected => connected.iter().map(|(_, lsn)| *lsn).min(),
            Standbys::Named(names) => names
                .iter()
                .map(|name| {
                    // A name connected twice (a restarted walsender not gone yet): the furthest.
                    connected
                        .iter()
                        .filter(|(n, _)| n == name)
                        .map(|(_, lsn)| *lsn)
                        .max()
                })
                .try_fold(u64::MAX, |low, lsn| lsn.map(|l| low.min(l))),
        }
    }

    /// The required standbys that are not connected (for the status and the log).
    pub fn missing(&self, connected: &[(String, u64)]) -> Vec<String> {
        match self {
            Standbys::Off => Vec::new(),
            Standbys::AllConnected if connected.is_empty() => vec!["*".to_string()],
            Standbys::AllConnected => Vec::new(),
            Standbys::Named(names) => names
                .iter()
                .filter(|name| !connected.iter().any(|(n, _)| n == *name))
                .cloned()
                .collect(),
        }
    }
}

/// The sizes that place WAL pages and their headers, as the server was built and initialized.
#[derive(Clone, Copy, Debug)]
pub struct WalLayout {
    pub page_size: u64,
    pub segment_size: u64,
    /// The header of a page (`SizeOfXLogShortPHD`)...
    pub short_header: u64,
    /// ...and of a segment's first page (`SizeOfXLogLongPHD`).
    pub long_header: u64,
}

impl WalLayout {
    /// The WAL insert position as the end of the last record. PostgreSQL's insert position
    /// points past the page header when it sits at the start of a page, a place no WAL reaches
    /// until the next record: flushing to it fails ("xlog flush request … is not satisfied"),
    /// and a standby may report the page's start for a long time.
    pub fn record_end(&self, insert: u64) -> u64 {
        let in_segment = insert % self.segment_size.max(1);
        let in_page = insert % self.page_size.max(1);
        if in_segment == self.long_header {
            insert - self.long_header
        } else if in_page == self.short_header && in_segment >= self.page_size {
            insert - self.short_header
        } else {
            insert
        }
    }
}

/// Claimed batches waiting for the standbys, oldest first.
#[derive(Debug)]
pub struct Held<T> {
    batches: VecDeque<(u64, Vec<T>)>,
}

impl<T> Default for Held<T> {
    fn default() -> Self {
        Held {
            batches: VecDeque::new(),
        }
    }
}

impl<T> Held<T> {
    /// Holds `items` until the standbys have flushed `lsn`.
    pub fn hold(&mut self, lsn: u64, items: Vec<T>) {
        if !items.is_empty() {
            self.batches.push_back((lsn, items));
        }
    }

    /// The batches the standbys have flushed past, in claim order (a later batch never leaves
    /// before an earlier one).
    pub fn release(&mut self, flushed: Option<u64>) -> Vec<T> {
        let mut out = Vec::new();
        let Some(flushed) = flushed else {
            return out;
        };
        while self.batches.front().is_some_and(|(lsn, _)| *lsn <= flushed) {
            if let Some((_, items)) = self.batches.pop_front() {
                out.extend(items);
            }
        }
        out
    }

    /// The position the last held batch waits for.
    pub fn newest(&self) -> Option<u64> {
        self.batches.back().map(|(lsn, _)| *lsn)
    }

    /// Everything held, whatever the standbys (the setting was cleared).
    pub fn release_all(&mut self) -> Vec<T> {
        self.batches
            .drain(..)
            .flat_map(|(_, items)| items)
            .collect()
    }

    pub fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }

    pub fn len(&self) -> usize {
        self.batches.iter().map(|(_, items)| items.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(list: &[(&str, u64)]) -> Vec<(String, u64)> {
        list.iter().map(|(n, l)| (n.to_string(), *l)).collect()
    }

    #[test]
    fn the_setting_parses() {
        assert_eq!(Standbys::parse("", ""), Standbys::Off);
        assert_eq!(Standbys::parse(" , ", ""), Standbys::Off);
        assert_eq!(Standbys::parse("*", ""), Standbys::AllConnected);
        assert_eq!(Standbys::parse("a, *", ""), Standbys::AllConnected);
        assert_eq!(
            Standbys::parse(" s1 ,s2,", ""),
            Standbys::Named(vec!["s1".into(), "s2".into()])
        );
    }

    #[test]
    fn a_promoted_standby_does_not_wait_for_itself() {
        assert_eq!(Standbys::parse("s1", "s1"), Standbys::Off);
        assert_eq!(
            Standbys::parse("s1, s2", "s1"),
            Standbys::Named(vec!["s2".into()])
        );
        assert_eq!(Standbys::parse("*", "s1"), Standbys::AllConnected);
    }

    #[test]
    fn named_standbys_must_each_have_flushed() {
        let s = Standbys::parse("s1,s2", "");
        assert_eq!(s.flushed(&at(&[("s1", 100), ("s2", 80)])), Some(80));
        assert_eq!(s.flushed(&at(&[("s1", 100), ("other", 500)])), None);
        assert_eq!(s.missing(&at(&[("s1", 100)])), vec!["s2".to_string()]);
        // A name connected twice: the furthest counts.
        assert_eq!(
            s.flushed(&at(&[("s1", 10), ("s1", 90), ("s2", 95)])),
            Some(90)
        );
    }

    #[test]
    fn a_star_needs_one_standby_and_waits_for_the_slowest() {
        let s = Standbys::AllConnected;
        assert_eq!(s.flushed(&[]), None);
        assert_eq!(s.missing(&[]), vec!["*".to_string()]);
        assert_eq!(s.flushed(&at(&[("a", 7), ("b", 5)])), Some(5));
        assert!(s.missing(&at(&[("a", 7)])).is_empty());
    }

    #[test]
    fn the_insert_position_at_a_page_start_is_the_previous_page_end() {
        let wal = WalLayout {
            page_size: 8192,
            segment_size: 16 << 20,
            short_header: 24,
            long_header: 40,
        };
        let segment = 3 * (16u64 << 20);
        // Inside a page, and right after a record in the middle of a segment: as it is.
        assert_eq!(wal.record_end(segment + 8192 + 512), segment + 8192 + 512);
        assert_eq!(
            wal.record_end(segment + 40),
            segment,
            "a segment's first page"
        );
        assert_eq!(wal.record_end(segment + 5 * 8192 + 24), segment + 5 * 8192);
        // 24 bytes into a segment's first page is inside its long header: no record ends
        // there, and it is not taken for a short header.
        assert_eq!(wal.record_end(segment + 24), segment + 24);
        assert_eq!(wal.record_end(segment + 8192 + 40), segment + 8192 + 40);
    }

    #[test]
    fn batches_leave_in_order_once_flushed() {
        let mut h = Held::default();
        h.hold(10, vec!['a']);
        h.hold(20, vec!['b', 'c']);
        h.hold(30, vec!['d']);
        h.hold(40, Vec::new());
        assert_eq!(h.len(), 4);
        assert_eq!(h.newest(), Some(30), "an empty batch is not held");
        assert!(
            h.release(None).is_empty(),
            "a standby missing holds everything"
        );
        assert!(h.release(Some(9)).is_empty());
        assert_eq!(h.release(Some(25)), vec!['a', 'b', 'c']);
        assert_eq!(h.len(), 1);
        assert_eq!(h.release_all(), vec!['d']);
        assert!(h.is_empty());
    }
}
