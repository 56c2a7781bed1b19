//! Errors raised to SQL callers, each with its own SQLSTATE so applications can tell them apart.

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::{PgLogLevel, PgSqlErrorCode};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutboxError {
    /// An argument that must not be NULL was NULL.
    NullArgument(&'static str),
    /// No row of amqp.broker has this broker_id.
    UnknownBroker(i32),
    /// An AMQP short string longer than 255 bytes.
    TooLong {
        what: &'static str,
        bytes: usize,
    },
    InvalidDeliveryMode(i32),
    BodyTooLarge {
        bytes: usize,
        max: usize,
    },
    InvalidHeaders(String),
    /// Headers whose AMQP encoding is larger than publish() accepts.
    HeadersTooLarge {
        bytes: usize,
        max: usize,
    },
    InvalidExchangeType(String),
    EmptyExchangeName,
    EmptyName(&'static str),
    /// Queue or binding arguments that are not a JSON object.
    InvalidArguments,
    /// Queue or binding arguments that AMQP cannot carry.
    InvalidArgumentValues(String),
    /// amqp.retry()/amqp.discard() of a message that is not parked.
    NotParked(i64),
    /// amqp.last_message_id() before any publish in this session.
    NoMessageYet,
    /// A tag (business type or key, system or host id) over its limit.
    TagTooLong {
        what: &'static str,
        bytes: usize,
        max: usize,
    },
    /// A traceparent that is not W3C trace context (version-traceid-parentid-flags).
    InvalidTraceparent(String),
    /// A negative timeout.
    NegativeTimeout,
    /// A deliver_after that is negative or infinite.
    InvalidDeliverAfter(&'static str),
}

impl OutboxError {
    pub fn sqlstate(&self) -> PgSqlErrorCode {
        use OutboxError::*;
        use PgSqlErrorCode::*;
        match self {
            NullArgument(_) => ERRCODE_NULL_VALUE_NOT_ALLOWED,
            UnknownBroker(_) => ERRCODE_UNDEFINED_OBJECT,
            TooLong { .. } | TagTooLong { .. } => ERRCODE_STRING_DATA_RIGHT_TRUNCATION,
            InvalidTraceparent(_) | NegativeTimeout | InvalidDeliverAfter(_) => {
                ERRCODE_INVALID_PARAMETER_VALUE
            }
            InvalidDeliveryMode(_)
            | InvalidHeaders(_)
            | InvalidExchangeType(_)
            | EmptyExchangeName
            | EmptyName(_)
            | InvalidArguments
            | InvalidArgumentValues(_) => ERRCODE_INVALID_PARAMETER_VALUE,
            NotParked(_) => ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            BodyTooLarge { .. } | HeadersTooLarge { .. } => ERRCODE_PROGRAM_LIMIT_EXCEEDED,
            NoMessageYet => ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
        }
    }

    pub fn message(&self) -> String {
        use OutboxError::*;
        match self {
            NullArgument(arg) => format!("amqp_outbox: {arg} must not be NULL"),
            UnknownBroker(id) => format!("amqp_outbox: broker {id} does not exist in amqp.broker"),
            TooLong { what, bytes } => {
                format!("amqp_outbox: {what} is {bytes} bytes long; AMQP allows at most 255")
            }
            InvalidDeliveryMode(mode) => {
                format!("amqp_outbox: invalid delivery_mode {mode}; use 1 (transient) or 2 (persistent)")
            }
            BodyTooLarge { bytes, max } => format!(
                "amqp_outbox: message body is {bytes} bytes, over amqp_outbox.max_message_size ({max} bytes)"
            ),
            InvalidHeaders(why) => format!("amqp_outbox: invalid headers: {why}"),
            HeadersTooLarge { bytes, max } => format!(
                "amqp_outbox: headers take {bytes} bytes in AMQP, more than the {max} bytes a message's headers may take"
            ),
            InvalidExchangeType(t) => format!(
                "amqp_outbox: invalid exchange type \"{t}\"; use direct, fanout, topic or headers"
            ),
            EmptyExchangeName => {
                "amqp_outbox: the default exchange (\"\") cannot be declared".to_string()
            }
            EmptyName(what) => format!("amqp_outbox: {what} must not be empty"),
            InvalidArguments => "amqp_outbox: arguments must be a JSON object".to_string(),
            InvalidArgumentValues(why) => format!("amqp_outbox: invalid arguments: {why}"),
            NotParked(id) => format!("amqp_outbox: message {id} is neither parked nor scheduled"),
            NoMessageYet => {
                "amqp_outbox: no message has been published in this session yet".to_string()
            }
            TagTooLong { what, bytes, max } => {
                format!("amqp_outbox: {what} is {bytes} bytes long; at most {max} are allowed")
            }
            NegativeTimeout => "amqp_outbox: timeout must not be negative".to_string(),
            InvalidDeliverAfter(why) => format!("amqp_outbox: deliver_after must not be {why}"),
            InvalidTraceparent(v) => format!(
                "amqp_outbox: invalid traceparent \"{v}\"; expected W3C trace context: 00-<32 hex>-<16 hex>-<2 hex>, lower case"
            ),
        }
    }

    /// Raises the error (ERROR level); the caller's transaction is aborted.
    pub fn raise(self) -> ! {
        ErrorReport::new(self.sqlstate(), self.message(), "amqp_outbox").report(PgLogLevel::ERROR);
        unreachable!("ERROR does not return")
    }
}

pub trait OrRaise<T> {
    fn or_raise(self) -> T;
}

impl<T> OrRaise<T> for Result<T, OutboxError> {
    fn or_raise(self) -> T {
        match self {
            Ok(v) => v,
            Err(e) => e.raise(),
        }
    }
}
