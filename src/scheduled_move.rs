//! The statement that moves delayed messages from `amqp.scheduled_message` into `amqp.message`
//! (same id, same message_id): run by the worker when they are due, by `amqp.retry()` at once;
//! and whether the tables of 0.8.0 are there yet.

/// Whether `amqp.scheduled_message` exists: the update to 0.8.0 made it, with
/// `amqp.idempotency_key`; before `ALTER EXTENSION amqp_outbox UPDATE` neither is there. A
/// catalog lookup, inside a transaction, without SPI.
pub fn tables_present() -> bool {
    // SAFETY: called inside a transaction (catalog lookups need one); the names are
    // NUL-terminated literals PostgreSQL only reads; missing_ok returns InvalidOid.
    unsafe {
        let schema = pgrx::pg_sys::get_namespace_oid(c"amqp".as_ptr(), true);
        schema != pgrx::pg_sys::InvalidOid
            && pgrx::pg_sys::get_relname_relid(c"scheduled_message".as_ptr(), schema)
                != pgrx::pg_sys::InvalidOid
    }
}

/// The columns both tables share, `amqp.discarded`'s first ones too (the engine's).
pub const COLUMNS: &str = amqp_outbox_engine::statements::SCHEDULED_COLUMNS;

/// Moves the rows whose ids `$1` (bigint[]) lists; returns nothing, its count is the number
/// moved (the engine's statement, the one the worker runs).
pub fn move_sql() -> &'static str {
    amqp_outbox_engine::statements::MOVE_SCHEDULED_SQL
}
