//! AMQP headers and arguments come from `jsonb` values that a user wrote. PostgreSQL's `jsonb`
//! holds numbers of any size and nesting of any depth; AMQP field tables (and the JSON parser)
//! do not. Parsing them here, from the value's text, turns such a value into an error about
//! that one value instead of a failure of whatever reads it. Plain Rust: used by user backends
//! and by the worker.

use serde_json::{Map, Value};

/// Why a jsonb value cannot be sent as an AMQP field table.
#[derive(Debug, PartialEq, Eq)]
pub enum Unsendable {
    /// serde_json cannot hold it (its error says why: number out of range, recursion limit).
    Value(String),
    /// Valid JSON, but not an object (what it is instead).
    NotObject(&'static str),
}

impl std::fmt::Display for Unsendable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unsendable::Value(e) => write!(f, "cannot be sent as AMQP field values: {e}"),
            Unsendable::NotObject(kind) => write!(f, "are {kind}, not a JSON object"),
        }
    }
}

/// The JSON object in `text`, or why it cannot be sent.
pub fn parse_object(text: &str) -> Result<Map<String, Value>, Unsendable> {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(other) => Err(Unsendable::NotObject(json_kind(&other))),
        Err(e) => Err(Unsendable::Value(e.to_string())),
    }
}

/// The JSON object in `text` (`None`: an empty one), or why it cannot be sent, as text.
pub fn json_object(text: Option<&str>) -> Result<Map<String, Value>, String> {
    text.map_or(Ok(Map::new()), |t| {
        parse_object(t).map_err(|e| e.to_string())
    })
}

pub fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// W3C trace context, version 00 layout: `vv-<32 hex>-<16 hex>-<2 hex>`, lower case, version
/// not `ff`, trace and parent id not all zeros.
pub fn valid_traceparent(v: &str) -> bool {
    let parts: Vec<&str> = v.split('-').collect();
    let hex = |s: &str| {
        s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let zero = |s: &str| s.bytes().all(|b| b == b'0');
    parts.len() == 4
        && [2, 32, 16, 2]
            .iter()
            .zip(&parts)
            .all(|(n, p)| p.len() == *n && hex(p))
        && parts[0] != "ff"
        && !zero(parts[1])
        && !zero(parts[2])
}

#[cfg(test)]
mod tests {
    use super::{json_object, parse_object, valid_traceparent};

    #[test]
    fn traceparents_follow_w3c_trace_context() {
        assert!(valid_traceparent(
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        ));
        for bad in [
            "",
            "garbage",
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
            "00-0af7651916cd43dd8448eb211c80319-b7ad6b7169203331-01",
        ] {
            assert!(!valid_traceparent(bad), "{bad:?}");
        }
    }

    #[test]
    fn objects_parse_and_unsendable_values_are_refused() {
        assert_eq!(json_object(None).map(|m| m.len()), Ok(0));
        assert_eq!(
            json_object(Some(r#"{"a": 1, "b": [true]}"#)).map(|m| m.len()),
            Ok(2)
        );
        assert_eq!(
            parse_object("[1]").unwrap_err(),
            super::Unsendable::NotObject("an array")
        );
        let huge = format!(r#"{{"f": 1{}}}"#, "0".repeat(400));
        let e = json_object(Some(&huge)).unwrap_err();
        assert!(e.contains("number out of range"), "{e}");
        let deep = format!(r#"{{"d": {}1{}}}"#, "[".repeat(200), "]".repeat(200));
        let e = json_object(Some(&deep)).unwrap_err();
        assert!(e.contains("recursion limit"), "{e}");
    }
}
