//! A row of the outbox as AMQP publishes it: exchange, routing key and properties, or why it can
//! never be published as it is.

use crate::amqp_values::{table_size, to_field_table, truncate};
use crate::bridge::OutboundMessage;
use lapin::types::ShortString;
use lapin::BasicProperties;

pub(crate) fn short(value: &str, what: &str) -> Result<ShortString, String> {
    ShortString::try_new(value).map_err(|_| {
        format!(
            "{what} is longer than 255 bytes: {}...",
            truncate(value, 40)
        )
    })
}

/// Bytes of a message's content header frame: frame header and end (8); class, weight, body
/// size and property flags (14); delivery mode, timestamp, message_id and headers (always
/// present); the optional short strings.
fn header_frame_size(
    m: &OutboundMessage,
    headers: &lapin::types::FieldTable,
    user: Option<&ShortString>,
) -> usize {
    let optional = [&m.content_type, &m.reply_to, &m.correlation_id]
        .iter()
        .filter_map(|v| v.as_ref().map(|s| 1 + s.len()))
        .sum::<usize>()
        + user.map_or(0, |u| 1 + u.as_str().len());
    8 + 14 + 1 + 8 + 1 + m.message_id.len() + table_size(headers) + optional
}

/// The header that makes a message a receipt (see amqp.send_receipt()).
const RECEIPT_FOR: &str = "x-amqp-outbox-receipt-for";

/// The message as lapin publishes it, or why it cannot be published on a connection whose
/// frames are at most `frame_max` bytes (AMQP does not split a content header across frames).
/// A receipt carries `user` (the connection's user) as its user_id: RabbitMQ refuses a
/// user_id that is not the publishing connection's, so the producer that collects receipts
/// can tell who sent each one.
pub(crate) fn build(
    m: &OutboundMessage,
    frame_max: usize,
    user: Option<&ShortString>,
) -> Result<(ShortString, ShortString, BasicProperties), String> {
    let exchange = short(&m.exchange, "exchange name")?;
    let routing_key = short(&m.routing_key, "routing key")?;
    let headers = to_field_table(&m.headers)?;
    let user = user.filter(|_| m.headers.contains_key(RECEIPT_FOR));
    let size = header_frame_size(m, &headers, user);
    if size > frame_max {
        return Err(format!(
            "its properties and headers take {size} bytes, more than the broker's frame size \
             ({frame_max} bytes) allows"
        ));
    }
    let mut props = BasicProperties::default()
        .with_delivery_mode(m.delivery_mode)
        .with_message_id(short(&m.message_id, "message_id")?)
        .with_timestamp(m.timestamp)
        .with_headers(headers);
    if let Some(v) = &m.content_type {
        props = props.with_content_type(short(v, "content_type")?);
    }
    if let Some(v) = &m.reply_to {
        props = props.with_reply_to(short(v, "reply_to")?);
    }
    if let Some(v) = &m.correlation_id {
        props = props.with_correlation_id(short(v, "correlation_id")?);
    }
    if let Some(u) = user {
        props = props.with_user_id(u.clone());
    }
    Ok((exchange, routing_key, props))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bridge::fixtures::message;

    fn msg() -> OutboundMessage {
        OutboundMessage {
            exchange: "x".into(),
            routing_key: "rk".into(),
            body: b"b".to_vec(),
            content_type: Some("application/json".into()),
            correlation_id: Some("c".into()),
            message_id: "m-1".into(),
            timestamp: 1_700_000_000,
            ..message(1)
        }
    }

    #[test]
    fn build_sets_properties() {
        let (ex, rk, p) = build(&msg(), 131_072, None).unwrap();
        assert_eq!(ex.as_str(), "x");
        assert_eq!(rk.as_str(), "rk");
        assert_eq!(*p.delivery_mode(), Some(2));
        assert_eq!(p.message_id().as_ref().map(|s| s.as_str()), Some("m-1"));
        assert_eq!(p.correlation_id().as_ref().map(|s| s.as_str()), Some("c"));
        assert_eq!(*p.timestamp(), Some(1_700_000_000));
        assert!(p.reply_to().is_none());
    }

    #[test]
    fn receipts_and_only_receipts_carry_the_connections_user() {
        let user = ShortString::from("billing");
        let (_, _, p) = build(&msg(), 131_072, Some(&user)).unwrap();
        assert!(p.user_id().is_none());
        let mut receipt = msg();
        receipt
            .headers
            .insert(RECEIPT_FOR.into(), serde_json::Value::String("m-0".into()));
        let (_, _, p) = build(&receipt, 131_072, Some(&user)).unwrap();
        assert_eq!(p.user_id().as_ref().map(|u| u.as_str()), Some("billing"));
    }

    #[test]
    fn build_rejects_overlong_names_without_panicking() {
        let mut m = msg();
        m.routing_key = "r".repeat(256);
        assert!(build(&m, 131_072, None)
            .unwrap_err()
            .contains("routing key"));
        let mut m = msg();
        m.exchange = "e".repeat(300);
        assert!(build(&m, 131_072, None).unwrap_err().contains("exchange"));
    }

    #[test]
    fn build_refuses_properties_larger_than_a_frame() {
        let mut m = msg();
        m.headers
            .insert("big".into(), serde_json::Value::String("x".repeat(200_000)));
        let e = build(&m, 131_072, None).unwrap_err();
        assert!(e.contains("frame size (131072 bytes)"), "{e}");
        // The computed size is the frame's: 8 + 14 + delivery mode, timestamp, message_id,
        // headers (4 + 1 + 3 + 1 + 4 + 200,000) and content_type, correlation_id.
        let expected = 8 + 14 + 1 + 8 + 4 + (4 + 1 + 3 + 1 + 4 + 200_000) + 17 + 2;
        assert!(e.contains(&format!("take {expected} bytes")), "{e}");
        m.headers
            .insert("big".into(), serde_json::Value::String("x".repeat(100_000)));
        assert!(build(&m, 131_072, None).is_ok());
    }
}
