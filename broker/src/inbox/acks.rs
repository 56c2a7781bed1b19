//! Which acknowledgements to send on a consumer channel. Only tags delivered on it and not yet
//! acknowledged are sent (acknowledging any other tag is a channel error that would requeue
//! everything), and `multiple=true` only where it is exact: `basic.ack(N, multiple)` covers
//! *every* unacknowledged tag up to N, so it is used for the longest run of the oldest
//! outstanding tags that are all being acknowledged, and single acks for the rest.

use std::collections::BTreeSet;

/// One `basic.ack` frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AckFrame {
    pub(crate) tag: u64,
    pub(crate) multiple: bool,
}

/// The tags delivered on the current channel and not acknowledged yet. At most the prefetch
/// count (or what the worker has not acknowledged, when prefetch is unlimited).
#[derive(Debug, Default)]
pub(crate) struct Outstanding {
    tags: BTreeSet<u64>,
}

impl Outstanding {
    pub(crate) fn delivered(&mut self, tag: u64) {
        self.tags.insert(tag);
    }

    /// The frames that acknowledge `tags` (those that are outstanding; others are ignored),
    /// which are no longer outstanding afterwards.
    pub(crate) fn acknowledge(&mut self, tags: &[u64]) -> Vec<AckFrame> {
        let wanted: BTreeSet<u64> = tags
            .iter()
            .copied()
            .filter(|t| self.tags.contains(t))
            .collect();
        let mut frames = Vec::new();
        // The oldest outstanding tags, as long as each is acknowledged now.
        let prefix: Vec<u64> = self
            .tags
            .iter()
            .copied()
            .take_while(|t| wanted.contains(t))
            .collect();
        if let Some(&last) = prefix.last() {
            frames.push(AckFrame {
                tag: last,
                multiple: prefix.len() > 1,
            });
        }
        for &t in wanted.iter().skip(prefix.len()) {
            frames.push(AckFrame {
                tag: t,
                multiple: false,
            });
        }
        for t in &wanted {
            self.tags.remove(t);
        }
        frames
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.tags.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outstanding(tags: impl IntoIterator<Item = u64>) -> Outstanding {
        let mut o = Outstanding::default();
        for t in tags {
            o.delivered(t);
        }
        o
    }

    fn single(tag: u64) -> AckFrame {
        AckFrame {
            tag,
            multiple: false,
        }
    }

    #[test]
    fn the_oldest_run_is_one_multiple_ack() {
        let mut o = outstanding(1..=10);
        assert_eq!(
            o.acknowledge(&[3, 1, 2, 4]),
            vec![AckFrame {
                tag: 4,
                multiple: true
            }]
        );
        assert_eq!(o.len(), 6);
        // 5 is still outstanding: 6..=8 cannot be covered by a multiple ack.
        assert_eq!(
            o.acknowledge(&[6, 7, 8]),
            vec![single(6), single(7), single(8)]
        );
        // Now 5 is the oldest, then 9 and 10 (6..=8 are gone).
        assert_eq!(
            o.acknowledge(&[10, 5, 9]),
            vec![AckFrame {
                tag: 10,
                multiple: true
            }]
        );
        assert_eq!(o.len(), 0);
    }

    #[test]
    fn one_tag_is_a_single_ack() {
        let mut o = outstanding([4, 7]);
        assert_eq!(o.acknowledge(&[4]), vec![single(4)]);
        assert_eq!(o.acknowledge(&[7]), vec![single(7)]);
    }

    #[test]
    fn unknown_and_repeated_tags_are_ignored() {
        let mut o = outstanding([1, 2, 3]);
        assert_eq!(o.acknowledge(&[2, 2, 99]), vec![single(2)]);
        assert_eq!(o.acknowledge(&[2]), vec![]);
        assert_eq!(
            o.acknowledge(&[1, 3, 1]),
            vec![AckFrame {
                tag: 3,
                multiple: true
            }]
        );
        assert_eq!(o.acknowledge(&[]), vec![]);
    }
}
