//! A subtransaction over a client connection: a SAVEPOINT, released when the work succeeds and
//! rolled back to when it raised an ERROR, which is then returned as the worker words a caught
//! error ([`Caught`]). Used by both of the engine's hosts in the relay ([`crate::client_outbox`],
//! [`crate::client_inbox`]).

use amqp_outbox_engine::outbox::Caught;
use postgres::error::DbError;
use postgres::Error;

// One name for every level: PostgreSQL keeps an outer savepoint of the same name, and ROLLBACK
// TO / RELEASE act on the innermost, so nested subtransactions need no names of their own.
const SAVEPOINT_SQL: &str = "SAVEPOINT amqp_outbox_relay";
const RELEASE_SQL: &str = "RELEASE SAVEPOINT amqp_outbox_relay";
const UNDO_SQL: &str =
    "ROLLBACK TO SAVEPOINT amqp_outbox_relay; RELEASE SAVEPOINT amqp_outbox_relay";

/// A host whose statements run on one connection.
pub trait OnConnection {
    fn batch_execute(&mut self, sql: &str) -> Result<(), Error>;
}

/// Runs `work` in a savepoint. `Ok(Ok)`: it ran to its end; `Err`: it raised an ERROR and
/// everything it did is rolled back; `Ok(Err)`: the connection failed (nothing can be undone,
/// the caller's transaction is lost).
pub fn run<H: OnConnection, R>(
    host: &mut H,
    work: impl FnOnce(&mut H) -> Result<R, Error>,
) -> Result<Result<R, Error>, Caught> {
    if let Err(e) = host.batch_execute(SAVEPOINT_SQL) {
        // Not begun (the transaction is aborted, or gone): nothing to undo.
        return Ok(Err(e));
    }
    match work(host) {
        Ok(r) => match host.batch_execute(RELEASE_SQL) {
            Ok(()) => Ok(Ok(r)),
            Err(e) if e.as_db_error().is_some() => undo(host, e),
            Err(e) => Ok(Err(e)),
        },
        Err(e) if e.as_db_error().is_some() => undo(host, e),
        Err(e) => {
            // The savepoint is still good; its end changes nothing when the connection is
            // gone, so the first error is the one to report.
            let _ = host.batch_execute(RELEASE_SQL);
            Ok(Err(e))
        }
    }
}

/// Rolls back to the savepoint after the ERROR `error`.
fn undo<H: OnConnection, R>(host: &mut H, error: Error) -> Result<Result<R, Error>, Caught> {
    match (host.batch_execute(UNDO_SQL), error.as_db_error()) {
        (Ok(()), Some(db)) => Err(caught(db)),
        // The transaction cannot go on (the connection is gone): the caller's error.
        _ => Ok(Err(error)),
    }
}

/// As the worker words a caught error: the message, then its detail.
pub fn caught(db: &DbError) -> Caught {
    let mut message = db.message().to_owned();
    if let Some(d) = db.detail() {
        message.push_str(": ");
        message.push_str(d);
    }
    Caught {
        sqlstate: db.code().code().to_owned(),
        message,
    }
}
