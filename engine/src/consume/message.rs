//! What the consuming side works with: a subscription as handling needs it, and a message to
//! handle. No SQL here (see [`super::statements`]), no handling (see [`super::handling`]).

use amqp_outbox_broker::inbox::Delivery;

/// One active subscription, as the handling needs it.
#[derive(Clone, Debug, PartialEq)]
pub struct Sub {
    pub name: String,
    pub broker_id: i32,
    pub queue: String,
    pub prefetch: u16,
    pub max_attempts: i32,
    pub dead_letter_exchange: Option<String>,
    /// The role the handler runs as (its oid).
    pub owner: u32,
    /// The handler function, `schema.function` quoted by PostgreSQL (`format('%I.%I')`), and
    /// its oid; `None` when it cannot run (see `problem`).
    pub handler: Option<(String, u32)>,
    /// Why the handler cannot run as its owner: the function or the owner is gone, or the owner
    /// may not execute it. Its messages then stay in the queue.
    pub problem: Option<String>,
    /// Messages in progress at once (1 to `MAX_LANES`).
    pub parallelism: usize,
    pub ordering: Ordering,
}

/// Which messages of a subscription must be handled one after another.
#[derive(Clone, Debug, PartialEq)]
pub enum Ordering {
    None,
    /// Messages with the same value of this header, in the order they arrived.
    Header(String),
}

impl Ordering {
    /// The column's text: 'none', 'business_key' or 'header:<name>'.
    pub fn parse(text: &str) -> Ordering {
        match text {
            "business_key" => Ordering::Header(HEADER_BUSINESS_KEY.to_string()),
            _ => text
                .strip_prefix("header:")
                .filter(|h| !h.is_empty())
                .map_or(Ordering::None, |h| Ordering::Header(h.to_string())),
        }
    }
}

/// A key longer than this is kept as its digest (an index entry must stay small).
const KEY_MAX: usize = 200;

impl Sub {
    /// `SELECT schema.function(ROW($1, …)::amqp.delivery)`: the handler's call with the
    /// message's 14 values bound (see [`super::statements::DELIVERY_ROW`]).
    pub fn call(&self) -> Option<String> {
        self.handler
            .as_ref()
            .map(|(f, _)| format!("SELECT {f}({})", super::statements::DELIVERY_ROW))
    }

    /// Its messages go through lanes (`amqp.inbox_waiting`) rather than being handled by the
    /// subscription worker as they arrive.
    pub fn has_lanes(&self) -> bool {
        self.parallelism > 1 || self.ordering != Ordering::None
    }

    /// The message's ordering key: the header's value (a string as it is, anything else as its
    /// JSON text); `None` for no ordering, no header or a JSON null. A long key, or one that
    /// PostgreSQL text cannot hold, becomes its SHA-256.
    pub fn key_of(&self, m: &Message) -> Option<String> {
        let Ordering::Header(name) = &self.ordering else {
            return None;
        };
        let key = match m.headers.get(name)? {
            serde_json::Value::Null => return None,
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        if key.len() <= KEY_MAX && !key.contains('\0') {
            return Some(key);
        }
        use sha2::Digest;
        let digest = sha2::Sha256::digest(key.as_bytes());
        Some(format!("sha256:{}", hex(&digest)))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A message to handle: a delivery from the broker, or a failed one retried from the table.
#[derive(Clone, Debug)]
pub struct Message {
    pub subscription: String,
    pub message_id: Option<String>,
    pub exchange: String,
    pub routing_key: String,
    pub body: Vec<u8>,
    pub headers: serde_json::Map<String, serde_json::Value>,
    pub content_type: Option<String>,
    pub correlation_id: Option<String>,
    pub reply_to: Option<String>,
    /// The AMQP user_id property (validated by RabbitMQ against the publisher's user).
    pub user_id: Option<String>,
    pub timestamp: Option<u64>,
    pub redelivered: bool,
    /// From the broker: (channel epoch, delivery tag), acknowledged after commit.
    pub delivery: Option<(u64, u64)>,
    /// 1 for the first try.
    pub attempt: i32,
    /// Retried from `amqp.inbox_failed`.
    pub retry: bool,
    /// Its key under the subscription's ordering (messages handled by lanes).
    pub key: Option<String>,
    /// Its row in `amqp.inbox_waiting` (messages handled by lanes).
    pub waiting_id: Option<i64>,
}

impl From<Delivery> for Message {
    fn from(d: Delivery) -> Message {
        Message {
            subscription: d.subscription,
            message_id: d.message_id.filter(|id| !id.is_empty()),
            exchange: d.exchange,
            routing_key: d.routing_key,
            body: d.body,
            headers: d.headers,
            content_type: d.content_type,
            correlation_id: d.correlation_id,
            reply_to: d.reply_to,
            user_id: d.user_id,
            timestamp: d.timestamp,
            redelivered: d.redelivered,
            delivery: Some((d.epoch, d.delivery_tag)),
            attempt: 1,
            retry: false,
            key: None,
            waiting_id: None,
        }
    }
}

/// Headers RabbitMQ sets or changes on a message after it was published: the delivery count
/// of a quorum queue (grows at each redelivery), dead-lettering's history, and the source a
/// shovel or federation link writes. Left out of a derived id.
const BROKER_HEADERS: [&str; 3] = ["x-delivery-count", "x-death", "x-received-from"];

fn is_broker_header(name: &str) -> bool {
    BROKER_HEADERS.contains(&name)
        || name.starts_with("x-first-death-")
        || name.starts_with("x-last-death-")
}

/// The header a receipt carries (see amqp.send_receipt): no receipt answers a receipt.
const HEADER_RECEIPT_FOR: &str = "x-amqp-outbox-receipt-for";
const HEADER_BUSINESS_TYPE: &str = "x-amqp-outbox-business-type";
const HEADER_BUSINESS_KEY: &str = "x-amqp-outbox-business-key";
const HEADER_TRACEPARENT: &str = "traceparent";

impl Message {
    /// Whether this message is itself a receipt.
    pub fn is_receipt(&self) -> bool {
        self.headers.contains_key(HEADER_RECEIPT_FOR)
    }

    pub fn business_type(&self) -> Option<&str> {
        self.headers
            .get(HEADER_BUSINESS_TYPE)
            .and_then(|v| v.as_str())
    }

    /// The W3C trace context it carries, if it is one (anything else is ignored: a consumer
    /// does not fail a message over a malformed trace header).
    pub fn traceparent(&self) -> Option<&str> {
        self.headers
            .get(HEADER_TRACEPARENT)
            .and_then(|v| v.as_str())
            .filter(|t| crate::headers::valid_traceparent(t))
    }

    /// What identifies a message that came without a message_id: everything it carries but
    /// what RabbitMQ adds or changes on its way (see [`BROKER_HEADERS`]), so a redelivery of it
    /// is recognised. (Two messages equal in all of this are one message.)
    pub fn digest_input(&self) -> Vec<u8> {
        let mut headers = self.headers.clone();
        headers.retain(|k, _| !is_broker_header(k));
        let mut v = Vec::with_capacity(self.body.len() + 128);
        for part in [
            self.exchange.as_bytes(),
            self.routing_key.as_bytes(),
            self.correlation_id.as_deref().unwrap_or("").as_bytes(),
            self.timestamp.unwrap_or(0).to_string().as_bytes(),
            serde_json::Value::Object(headers).to_string().as_bytes(),
        ] {
            v.extend_from_slice(&(part.len() as u64).to_be_bytes());
            v.extend_from_slice(part);
        }
        v.extend_from_slice(&self.body);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn message(headers: serde_json::Value) -> Message {
        Message {
            subscription: "s".into(),
            message_id: None,
            exchange: "ex".into(),
            routing_key: "rk".into(),
            body: b"body".to_vec(),
            headers: headers.as_object().cloned().unwrap_or_default(),
            content_type: None,
            correlation_id: None,
            reply_to: None,
            user_id: None,
            timestamp: Some(1),
            redelivered: false,
            delivery: Some((1, 1)),
            attempt: 1,
            retry: false,
            key: None,
            waiting_id: None,
        }
    }

    fn sub(ordering: &str) -> Sub {
        Sub {
            name: "s".into(),
            broker_id: 1,
            queue: "q".into(),
            prefetch: 10,
            max_attempts: 1,
            dead_letter_exchange: None,
            owner: 0,
            handler: None,
            problem: None,
            parallelism: 1,
            ordering: Ordering::parse(ordering),
        }
    }

    #[test]
    fn the_key_comes_from_the_header_the_ordering_names() {
        let m = message(json!({"x-amqp-outbox-business-key": "order-7", "tenant": 3}));
        assert_eq!(sub("business_key").key_of(&m).as_deref(), Some("order-7"));
        assert_eq!(sub("header:tenant").key_of(&m).as_deref(), Some("3"));
        assert_eq!(sub("header:missing").key_of(&m), None);
        assert_eq!(sub("none").key_of(&m), None);
        assert!(!sub("none").has_lanes());
        assert!(sub("business_key").has_lanes());
        // Unknown text is no ordering (the table's CHECK allows nothing else).
        assert_eq!(Ordering::parse("header:"), Ordering::None);
    }

    #[test]
    fn a_long_or_nul_key_becomes_its_digest() {
        let long = "k".repeat(10_000);
        let m = message(json!({ "x-amqp-outbox-business-key": long }));
        let key = sub("business_key").key_of(&m).unwrap_or_default();
        assert!(key.starts_with("sha256:") && key.len() == 7 + 64, "{key}");
        let nul = message(json!({ "x-amqp-outbox-business-key": "a\u{0}b" }));
        let key = sub("business_key").key_of(&nul).unwrap_or_default();
        assert!(key.starts_with("sha256:"), "{key}");
        assert_eq!(
            sub("business_key").key_of(&message(json!({ "x-amqp-outbox-business-key": null }))),
            None
        );
    }

    #[test]
    fn a_redelivery_with_broker_headers_keeps_its_derived_id() {
        let first = message(json!({"tenant": "a"}));
        let quorum_redelivery = message(json!({"tenant": "a", "x-delivery-count": 2}));
        let dead_lettered = message(json!({
            "tenant": "a",
            "x-death": [{"count": 1, "queue": "q", "reason": "rejected"}],
            "x-first-death-queue": "q",
            "x-first-death-reason": "rejected",
            "x-last-death-queue": "q",
        }));
        assert_eq!(first.digest_input(), quorum_redelivery.digest_input());
        assert_eq!(first.digest_input(), dead_lettered.digest_input());
        // What the publisher set still tells messages apart.
        assert_ne!(
            first.digest_input(),
            message(json!({"tenant": "b"})).digest_input()
        );
    }
}
