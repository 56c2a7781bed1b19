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

/// The columns both tables share, `amqp.discarded`'s first ones too.
pub const COLUMNS: &str = "id, producer_pid, producer_started_at, broker_id, exchange, \
routing_key, body, delivery_mode, content_type, reply_to, correlation_id, headers, created_at, \
attempts, next_attempt_at, last_error, parked_at, message_id, business_type, business_key, \
traceparent, system_id, host_id, resends";

/// Moves the rows whose ids `$1` (bigint[]) lists; returns nothing, its count is the number
/// moved. Built from the constant above only.
pub fn move_sql() -> String {
    format!(
        "WITH due AS (DELETE FROM amqp.scheduled_message \
                       WHERE id OPERATOR(pg_catalog.=) ANY ($1) RETURNING *) \
         INSERT INTO amqp.message ({COLUMNS}) SELECT {COLUMNS} FROM due"
    )
}
