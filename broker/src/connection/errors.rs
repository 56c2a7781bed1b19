//! What a lapin error says, in words for a log line, and whom it blames.

use lapin::protocol::AMQPErrorKind;
use lapin::ErrorKind;

/// `404 NOT_FOUND - no exchange 'x' in vhost '/'` for broker errors, lapin's text otherwise.
pub(crate) fn describe_error(e: &lapin::Error) -> String {
    match e.kind() {
        ErrorKind::ProtocolError(a) => format!("{} {}", a.get_id(), a.get_message()),
        _ => e.to_string(),
    }
}

/// Could a message published on the channel have caused this error? Channel-level (soft)
/// errors: yes (404 no exchange, 403, 406 too large…). Connection-level errors that a malformed
/// publish provokes: yes. Everything else (I/O, heartbeat, forced close…): no.
pub(crate) fn message_may_be_at_fault(e: &lapin::Error) -> bool {
    match e.kind() {
        ErrorKind::ProtocolError(a) => match a.kind() {
            AMQPErrorKind::Soft(_) => true,
            // FRAME_ERROR, SYNTAX_ERROR, COMMAND_INVALID, UNEXPECTED_FRAME.
            AMQPErrorKind::Hard(_) => matches!(a.get_id(), 501 | 502 | 503 | 505),
        },
        _ => false,
    }
}

/// Prefer the broker's own explanation over a secondary state error.
pub(crate) fn better_error(new: &lapin::Error, current: &lapin::Error) -> bool {
    matches!(new.kind(), ErrorKind::ProtocolError(_))
        && !matches!(current.kind(), ErrorKind::ProtocolError(_))
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::protocol::{AMQPError, AMQPHardError, AMQPSoftError};

    #[test]
    fn blame_rules() {
        let soft: lapin::Error = ErrorKind::ProtocolError(AMQPError::new(
            AMQPSoftError::NOTFOUND.into(),
            "NOT_FOUND - no exchange 'x' in vhost '/'".into(),
        ))
        .into();
        assert!(message_may_be_at_fault(&soft));
        assert_eq!(
            describe_error(&soft),
            "404 NOT_FOUND - no exchange 'x' in vhost '/'"
        );
        let forced: lapin::Error = ErrorKind::ProtocolError(AMQPError::new(
            AMQPHardError::CONNECTIONFORCED.into(),
            "CONNECTION_FORCED".into(),
        ))
        .into();
        assert!(!message_may_be_at_fault(&forced));
        let io: lapin::Error = std::io::Error::other("reset").into();
        assert!(!message_may_be_at_fault(&io));
        assert!(better_error(&soft, &io));
        assert!(!better_error(&io, &soft));
    }
}
