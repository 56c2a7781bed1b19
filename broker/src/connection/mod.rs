//! One connection to one host, the lowest layer: opening it (plain or TLS) and closing it,
//! describing its errors, and keeping passwords out of what it reports.

mod errors;
mod open;
mod redact;
mod relay;
mod sanitize;
mod tls;

pub(crate) use errors::{better_error, describe_error, message_may_be_at_fault};
pub(crate) use open::{close_connection, frame_limit, open_connection, CLOSE_WAIT};
pub(crate) use redact::Redactor;
pub use tls::client_config as tls_client_config;
