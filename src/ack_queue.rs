//! The name of this database's acknowledgement queue: declared and read by the worker, shown
//! by `amqp.worker_status` in user backends.

use pgrx::pg_sys;

/// A name no other database can have, even one on another cluster using the same broker.
pub fn name() -> String {
    // SAFETY: a plain value PostgreSQL sets at connection (this process's database).
    name_for(unsafe { pg_sys::MyDatabaseId }.to_u32())
}

/// The acknowledgement queue of the database `dboid` of this cluster.
pub fn name_for(dboid: u32) -> String {
    // SAFETY: the control file's identifier, set once at start; reading it has no side effect,
    // and every caller runs on a PostgreSQL thread.
    let sysid = unsafe { pg_sys::GetSystemIdentifier() };
    format!("amqp_outbox.ack.{sysid:x}.{dboid:x}")
}
