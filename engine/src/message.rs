//! Builds the message handed to the AMQP thread from a claimed row: the caller's properties and
//! headers, plus the producer headers every consumer can rely on.

use crate::row::Row;
use amqp_outbox_broker::OutboundMessage;

/// Header names the worker adds to every message.
pub const HEADER_PRODUCER_PID: &str = "x-amqp-outbox-producer-pid";
pub const HEADER_PRODUCER_START: &str = "x-amqp-outbox-producer-start";
pub const HEADER_SEQUENCE: &str = "x-amqp-outbox-seq";
/// The reconciliation tags.
pub const HEADER_SYSTEM_ID: &str = "x-amqp-outbox-system-id";
pub const HEADER_HOST_ID: &str = "x-amqp-outbox-host-id";
pub const HEADER_BUSINESS_TYPE: &str = "x-amqp-outbox-business-type";
pub const HEADER_BUSINESS_KEY: &str = "x-amqp-outbox-business-key";
/// Creation time, Unix microseconds.
pub const HEADER_CREATED_AT: &str = "x-amqp-outbox-created-at";
/// W3C trace context, under its standard name.
pub const HEADER_TRACEPARENT: &str = "traceparent";

/// The defaults of the system and host tags.
pub struct Origin<'a> {
    pub system_id: &'a str,
    pub host_id: &'a str,
}

pub fn to_message(
    row: Row,
    mut headers: serde_json::Map<String, serde_json::Value>,
    origin: &Origin<'_>,
) -> OutboundMessage {
    headers.insert(HEADER_PRODUCER_PID.into(), row.producer_pid.into());
    headers.insert(HEADER_PRODUCER_START.into(), row.producer_started_at.into());
    headers.insert(HEADER_SEQUENCE.into(), row.id.into());
    let tags = row.tags;
    headers.insert(
        HEADER_SYSTEM_ID.into(),
        tags.system_id
            .unwrap_or_else(|| origin.system_id.into())
            .into(),
    );
    headers.insert(
        HEADER_HOST_ID.into(),
        tags.host_id.unwrap_or_else(|| origin.host_id.into()).into(),
    );
    headers.insert(
        HEADER_BUSINESS_TYPE.into(),
        tags.business_type
            .unwrap_or_else(|| row.routing_key.clone())
            .into(),
    );
    if let Some(key) = tags.business_key {
        headers.insert(HEADER_BUSINESS_KEY.into(), key.into());
    }
    headers.insert(HEADER_CREATED_AT.into(), row.created_at.into());
    if let Some(t) = tags.traceparent {
        headers.insert(HEADER_TRACEPARENT.into(), t.into());
    }
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

/// The time the production log files a message under (Unix µs): the time in its UUIDv7
/// message_id, as `amqp._uuid7_time()` reads it, else its `created_at`. Computed here, once
/// per message, rather than by a regular expression per row in the statement that deletes it.
pub fn message_at(m: &OutboundMessage) -> i64 {
    uuid7_unix_ms(&m.message_id)
        .map(|ms| ms.saturating_mul(1000))
        .or_else(|| m.headers.get(HEADER_CREATED_AT).and_then(|v| v.as_i64()))
        .unwrap_or(0)
}

/// The Unix milliseconds of a lowercase UUIDv7 in its canonical form; `None` for anything else
/// (`amqp._uuid7_time()`'s pattern: `^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`).
pub fn uuid7_unix_ms(id: &str) -> Option<i64> {
    let b = id.as_bytes();
    if b.len() != 36 {
        return None;
    }
    let hex = |c: u8| c.is_ascii_digit() || (b'a'..=b'f').contains(&c);
    for (i, &c) in b.iter().enumerate() {
        let ok = match i {
            8 | 13 | 18 | 23 => c == b'-',
            14 => c == b'7',
            19 => matches!(c, b'8' | b'9' | b'a' | b'b'),
            _ => hex(c),
        };
        if !ok {
            return None;
        }
    }
    let digits: String = id[..8].chars().chain(id[9..13].chars()).collect();
    i64::from_str_radix(&digits, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(headers: Option<serde_json::Value>, delivery_mode: i16) -> OutboundMessage {
        let headers = match headers {
            Some(serde_json::Value::Object(map)) => map,
            _ => serde_json::Map::new(),
        };
        to_message(
            row(delivery_mode),
            headers,
            &Origin {
                system_id: "shop",
                host_id: "db1",
            },
        )
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
            tags: Default::default(),
            writer: 0,
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
        assert_eq!(m.headers.len(), 7, "{:?}", m.headers);
    }

    #[test]
    fn tags_default_to_database_host_and_routing_key_and_the_stored_ones_win() {
        let m = message(None, 2);
        assert_eq!(m.headers[HEADER_SYSTEM_ID], "shop");
        assert_eq!(m.headers[HEADER_HOST_ID], "db1");
        assert_eq!(m.headers[HEADER_BUSINESS_TYPE], "order.created");
        assert_eq!(m.headers[HEADER_CREATED_AT], 1_700_000_100_999_999i64);
        assert!(!m.headers.contains_key(HEADER_BUSINESS_KEY));
        assert!(!m.headers.contains_key(HEADER_TRACEPARENT));
        let mut r = row(2);
        r.tags = crate::row::RowTags {
            business_type: Some("order".into()),
            business_key: Some("42".into()),
            traceparent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into()),
            system_id: Some("billing".into()),
            host_id: Some("h2".into()),
        };
        let origin = Origin {
            system_id: "shop",
            host_id: "db1",
        };
        let m = to_message(r, serde_json::Map::new(), &origin);
        assert_eq!(m.headers[HEADER_SYSTEM_ID], "billing");
        assert_eq!(m.headers[HEADER_HOST_ID], "h2");
        assert_eq!(m.headers[HEADER_BUSINESS_TYPE], "order");
        assert_eq!(m.headers[HEADER_BUSINESS_KEY], "42");
        assert_eq!(
            m.headers[HEADER_TRACEPARENT],
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        );
    }

    #[test]
    fn the_log_time_is_the_uuid7_time_else_created_at() {
        assert_eq!(
            uuid7_unix_ms("01912345-6789-7fff-bfff-ffffffffffff"),
            Some(0x0191_2345_6789)
        );
        let made = amqp_outbox_broker::identity::uuid_v7(1_700_000_000_123, [7; 10]);
        assert_eq!(uuid7_unix_ms(&made), Some(1_700_000_000_123));
        for other in [
            "01912345-6789-4fff-bfff-ffffffffffff", // version 4
            "01912345-6789-7fff-cfff-ffffffffffff", // variant
            "01912345-6789-7FFF-bfff-ffffffffffff", // upper case
            "01912345x6789-7fff-bfff-ffffffffffff",
            "legacy-prefix-42",
            "",
        ] {
            assert_eq!(uuid7_unix_ms(other), None, "{other}");
        }
        let mut m = message(None, 2);
        m.message_id = made;
        assert_eq!(message_at(&m), 1_700_000_000_123_000);
        m.message_id = "legacy-prefix-42".into();
        assert_eq!(
            message_at(&m),
            m.headers[HEADER_CREATED_AT].as_i64().unwrap()
        );
    }
}
