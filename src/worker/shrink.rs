//! Gives the space of a drained backlog back. Deleted rows leave `amqp.message`'s heap, its
//! TOAST table and its primary key index at their largest size: VACUUM reuses the space, and
//! trims only empty pages at the heap's end, never an index. When the worker finds the table
//! empty and larger than empty by more than [`SLACK_BYTES`], it truncates it, which is exact and
//! instant, but only if it can take the table's exclusive lock at once (no session is inserting,
//! reading or dumping it) and only after it saw, under that lock and with a fresh snapshot, that
//! no row is left.

use super::pacer::Pacer;
use super::pg;
use super::queries;
use pgrx::prelude::*;
use std::time::{Duration, Instant};

/// How often an idle worker looks at the table's size (less often when the look is costly: it
/// reads past the dead rows a long transaction keeps in the table).
const LOOK_EVERY: Duration = Duration::from_secs(10);

/// Size above the empty table's (one page per index) that is left alone.
pub const SLACK_BYTES: i64 = 64 * 1024;

pub struct Shrink {
    look: Pacer,
}

impl Default for Shrink {
    fn default() -> Self {
        Shrink {
            look: Pacer::new(LOOK_EVERY),
        }
    }
}

impl Shrink {
    /// Called when the worker has nothing in flight and its last claim found nothing.
    pub fn when_idle(&mut self) {
        let started = Instant::now();
        if !self.look.due(started) {
            return;
        }
        let result = pg::transaction("amqp_outbox: shrink the empty outbox", || {
            // Holds off a concurrent DROP EXTENSION until this transaction ends.
            if !queries::extension_exists() {
                return Ok(None);
            }
            Spi::connect_mut(|client| queries::truncate_if_empty(client, SLACK_BYTES))
        });
        self.look.ran(started, started.elapsed());
        match result {
            Ok(Some(bytes)) => {
                log!("amqp_outbox: amqp.message was empty; truncated it, giving back {bytes} bytes")
            }
            Ok(None) => {}
            Err(e) => warning!("amqp_outbox: could not shrink amqp.message: {e}"),
        }
    }
}
