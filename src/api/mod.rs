//! SQL-callable functions. They run in user backends: no threads, no network.

mod admin;
mod jsonb_arg;
mod key_row;
mod known_brokers;
pub(crate) mod message_id;
mod outbox_row;
mod parked;
mod publish;
mod publish_later;
mod row_params;
pub(crate) mod run_as;
mod standbys;
mod status;
mod table_write;
mod topology;
