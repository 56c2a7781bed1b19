//! The statement that moves delayed messages from `amqp.scheduled_message` into `amqp.message`
//! (same id, same message_id): run by the worker when they are due, by `amqp.retry()` at once.

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
