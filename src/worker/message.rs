//! Builds the message handed to the AMQP thread from a claimed row: the caller's properties and
//! headers, plus the producer headers every consumer can rely on.

use super::queries::Row;
use amqp_outbox_broker::OutboundMessage;

/// Header names the worker adds to every message.
pub const HEADER_PRODUCER_PID: &str = "x-amqp-outbox-producer-pid";
pub const HEADER_PRODUCER_START: &str = "x-amqp-outbox-producer-start";
pub const HEADER_SEQUENCE: &str = "x-amqp-outbox-seq";

pub fn to_message(
    row: Row,
    mut headers: serde_json::Map<String, serde_json::Value>,
) -> OutboundMessage {
    headers.insert(HEADER_PRODUCER_PID.into(), row.producer_pid.into());
    headers.insert(HEADER_PRODUCER_START.into(), row.producer_started_at.into());
    headers.insert(HEADER_SEQUENCE.into(), row.id.into());
    OutboundMessage {
        id: row.id,
        message_id: row.message_id,
        exchange: row.exchange,
        routing_key: row.routing_key,
        body: row.body,
        delivery_mode: if row.delivery_mode == 1 { 1 } else { 2 },
        content_type: row.content_type,
        reply_to: row.reply_to,
        correlation_id: row.correlation_id,
        timestamp: (row.created_at.max(0) / 1_000_000) as u64,
        headers,
        lose_in_transit: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(headers: Option<serde_json::Value>, delivery_mode: i16) -> OutboundMessage {
        let headers = match headers {
            Some(serde_json::Value::Object(map)) => map,
            _ => serde_json::Map::new(),
        };
        to_message(row(delivery_mode), headers)
    }

    fn row(delivery_mode: i16) -> Row {
        Row {
            id: 42,
            message_id: "0190f0e2-1c3a-7b41-9d2e-5a6b7c8d9e0f".into(),
            broker_id: 1,
            exchange: "orders".into(),
            routing_key: "order.created".into(),
            body: b"{}".to_vec(),
            delivery_mode,
            content_type: Some("application/json".into()),
            reply_to: None,
            correlation_id: Some("c-1".into()),
            headers: None,
            producer_pid: 1234,
            producer_started_at: 1_700_000_000_123_456,
            created_at: 1_700_000_100_999_999,
            attempts: 0,
        }
    }

    #[test]
    fn a_message_carries_its_stable_id_producer_headers_and_properties() {
        let m = message(Some(serde_json::json!({"tenant": "acme"})), 2);
        assert_eq!(m.message_id, "0190f0e2-1c3a-7b41-9d2e-5a6b7c8d9e0f");
        assert_eq!(m.delivery_mode, 2);
        assert_eq!(m.timestamp, 1_700_000_100);
        assert_eq!(m.headers["tenant"], "acme");
        assert_eq!(m.headers[HEADER_PRODUCER_PID], 1234);
        assert_eq!(m.headers[HEADER_PRODUCER_START], 1_700_000_000_123_456i64);
        assert_eq!(m.headers[HEADER_SEQUENCE], 42);
        assert_eq!(m.correlation_id.as_deref(), Some("c-1"));
        assert!(!m.lose_in_transit);
    }

    #[test]
    fn producer_headers_win_over_the_callers_and_transient_is_kept() {
        let m = message(Some(serde_json::json!({HEADER_SEQUENCE: "forged"})), 1);
        assert_eq!(m.headers[HEADER_SEQUENCE], 42);
        assert_eq!(m.delivery_mode, 1);
        let m = message(None, 2);
        assert_eq!(m.headers.len(), 3);
    }
}
