//! Whether publishers ring the relay's doorbell (`NOTIFY`) at their commit. PostgreSQL commits
//! notifying transactions one at a time (a database-wide lock held until the commit is flushed),
//! so a `NOTIFY` per publishing transaction caps publishing at about one commit per disk flush.
//! The plain-SQL install's publish (`amqp._wake_relay()`) notifies only while the lock
//! [`AWAKE`] is free; every publishing transaction also holds [`BARRIER`] in share mode until it
//! ends. So while commits come fast the relay holds [`AWAKE`] and claims at short intervals
//! instead of being notified; once claims find nothing it releases it (new commits notify
//! again) and keeps claiming until it can take [`BARRIER`] alone, which means that every
//! transaction that saw it awake (and did not notify) has ended; one more claim after that, and
//! it may sleep. No commit falls between its last claim and its sleep.
//!
//! A plain-SQL install of 0.8.0 always notifies: with it this changes nothing.

use postgres::{Client, Error};
use std::time::{Duration, Instant};

/// Held by the relay while it claims without being notified.
pub const AWAKE: (i32, i32) = (1_634_562_416, 2);
/// Held in share mode by every publishing transaction until it ends.
pub const BARRIER: (i32, i32) = (1_634_562_416, 3);

/// How long claims find nothing before the relay lets publishers notify again.
const IDLE_BEFORE_SLEEP: Duration = Duration::from_millis(20);
/// How often the relay claims while it waits for the transactions that saw it awake.
const DRAIN_POLL: Duration = Duration::from_millis(10);

const LOCK_SQL: &str = "SELECT pg_catalog.pg_advisory_lock($1, $2)";
const UNLOCK_SQL: &str = "SELECT pg_catalog.pg_advisory_unlock($1, $2)";
const TRY_LOCK_SQL: &str = "SELECT pg_catalog.pg_try_advisory_lock($1, $2)";

#[derive(Debug, Default, PartialEq)]
enum State {
    /// Publishers notify; the relay sleeps between their commits.
    #[default]
    Asleep,
    /// The relay holds [`AWAKE`] and claims every poll; since when its claims found nothing.
    Awake { idle_since: Option<Instant> },
    /// [`AWAKE`] released; waiting until no transaction that saw it held is still open.
    Draining,
}

#[derive(Debug, Default)]
pub struct Doorbell {
    state: State,
}

impl Doorbell {
    /// After a claim that took `messages`, `busy` when commits come fast (the cadence gathers
    /// them). Returns whether to claim again without waiting for a notification.
    pub fn after_claim(
        &mut self,
        client: &mut Client,
        messages: usize,
        busy: bool,
    ) -> Result<bool, Error> {
        match self.state {
            State::Asleep if busy && messages > 0 => {
                client.execute(LOCK_SQL, &[&AWAKE.0, &AWAKE.1])?;
                self.state = State::Awake { idle_since: None };
                Ok(true)
            }
            State::Asleep => Ok(false),
            State::Awake { .. } if messages > 0 => {
                self.state = State::Awake { idle_since: None };
                Ok(true)
            }
            State::Awake { idle_since } => {
                let since = idle_since.unwrap_or_else(Instant::now);
                if since.elapsed() < IDLE_BEFORE_SLEEP {
                    self.state = State::Awake {
                        idle_since: Some(since),
                    };
                } else {
                    client.execute(UNLOCK_SQL, &[&AWAKE.0, &AWAKE.1])?;
                    self.state = State::Draining;
                }
                Ok(true)
            }
            State::Draining if busy && messages > 0 => {
                client.execute(LOCK_SQL, &[&AWAKE.0, &AWAKE.1])?;
                self.state = State::Awake { idle_since: None };
                Ok(true)
            }
            State::Draining => {
                let alone: bool = client
                    .query_one(TRY_LOCK_SQL, &[&BARRIER.0, &BARRIER.1])?
                    .get(0);
                if alone {
                    client.execute(UNLOCK_SQL, &[&BARRIER.0, &BARRIER.1])?;
                    self.state = State::Asleep;
                }
                // Once more after the barrier: what committed before it is visible now.
                Ok(true)
            }
        }
    }

    /// The longest the relay may wait for a notification now (`None`: as long as it likes).
    pub fn poll(&self, batch_interval: Duration) -> Option<Duration> {
        match self.state {
            State::Asleep => None,
            State::Awake { .. } => Some(batch_interval.max(Duration::from_millis(1))),
            State::Draining => Some(DRAIN_POLL),
        }
    }

    /// Whether the relay claims without notifications now.
    pub fn awake(&self) -> bool {
        self.state != State::Asleep
    }
}
