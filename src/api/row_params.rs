//! The parameters of a message row for the SQL INSERTs (the outbox's ordinary INSERT, which
//! honours what a DBA added to the table, and the delayed messages' INSERT), shared by both.

use super::outbox_row::Row;
use pgrx::datum::{DatumWithOid, TimestampWithTimeZone};

/// The columns [`row_args`] gives values for, in its order: the message, then its tags.
pub const MESSAGE_COLUMNS: &str = "producer_pid, producer_started_at, broker_id, \
exchange, routing_key, body, delivery_mode, content_type, reply_to, correlation_id, headers";
pub const TAG_COLUMNS: &str = "business_type, business_key, traceparent, system_id, host_id";
/// The parameters of [`MESSAGE_COLUMNS`], then of [`TAG_COLUMNS`].
pub const MESSAGE_VALUES: &str = "$1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11::pg_catalog.jsonb";
pub const TAG_VALUES: &str = "$12, $13, $14, $15, $16";

/// The values of [`MESSAGE_COLUMNS`], and of [`TAG_COLUMNS`] when `tags`.
pub fn row_args<'a>(row: &'a Row<'a>, tags: bool) -> Vec<DatumWithOid<'a>> {
    let mut args: Vec<DatumWithOid> = vec![
        row.producer_pid.into(),
        // The row's own start time (MyStartTimestamp), as `amqp._producer_started_at()`.
        TimestampWithTimeZone::try_from(row.producer_started_at)
            .unwrap_or_else(|_| TimestampWithTimeZone::negative_infinity())
            .into(),
        row.broker_id.into(),
        row.exchange.into(),
        row.routing_key.into(),
        row.body.into(),
        row.delivery_mode.into(),
        row.content_type.into(),
        row.reply_to.into(),
        row.correlation_id.into(),
        row.headers.into(),
    ];
    if tags {
        args.extend([
            row.business_type.into(),
            row.business_key.into(),
            row.traceparent.into(),
            row.system_id.into(),
            row.host_id.into(),
        ]);
    }
    args
}
