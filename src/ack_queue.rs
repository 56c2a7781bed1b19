//! The name of this database's acknowledgement queue: declared and read by the worker, shown
//! by `amqp.worker_status` in user backends.

use pgrx::pg_sys;

/// A name no other database can have, even one on another cluster using the same broker.
pub fn name() -> String {
    // SAFETY: both are plain values PostgreSQL sets once at start and at connection (the
    // control file's identifier, this backend's database); reading them has no side effect,
    // and every caller runs on a PostgreSQL thread.
    let (sysid, dboid) = unsafe { (pg_sys::GetSystemIdentifier(), pg_sys::MyDatabaseId) };
    format!("amqp_outbox.ack.{sysid:x}.{:x}", dboid.to_u32())
}
