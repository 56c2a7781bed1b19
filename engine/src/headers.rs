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
    if let Some(why) = inexact_number(text) {
        return Err(Unsendable::Value(why));
    }
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

/// A number in the JSON `text` that would reach AMQP as another value: an integer beyond 64
/// bits (it would go as an inexact double), or a non-zero number too small for a double (it
/// would go as 0). `1e400` and the like are refused by the parser itself.
fn inexact_number(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                // Skip the string, escapes included.
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            b'-' | b'0'..=b'9' => {
                let start = i;
                while i < bytes.len()
                    && matches!(bytes[i], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9')
                {
                    i += 1;
                }
                let token = &text[start..i];
                if let Some(why) = inexact_literal(token) {
                    return Some(why);
                }
            }
            _ => i += 1,
        }
    }
    None
}

fn inexact_literal(token: &str) -> Option<String> {
    let integer = !token.contains(['.', 'e', 'E']);
    // Past a double's range the parser itself refuses it ("number out of range").
    let shown = |t: &str| {
        if t.len() > 40 {
            format!("{}...", &t[..40])
        } else {
            t.to_string()
        }
    };
    if integer {
        let fits = token.parse::<i64>().is_ok() || token.parse::<u64>().is_ok();
        let finite = token.parse::<f64>().is_ok_and(f64::is_finite);
        return (!fits && finite).then(|| {
            format!(
                "number {} is an integer beyond 64 bits (AMQP would get an inexact double)",
                shown(token)
            )
        });
    }
    let mantissa_zero = token
        .split(['e', 'E'])
        .next()
        .is_some_and(|m| m.bytes().all(|b| matches!(b, b'0' | b'.' | b'-' | b'+')));
    match token.parse::<f64>() {
        Ok(f) if f == 0.0 && !mantissa_zero => Some(format!(
            "number {} is too small for a double (AMQP would get 0)",
            shown(token)
        )),
        _ => None,
    }
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
        // Values AMQP would get as something else are refused too, in strings they are text.
        for (value, why) in [
            ("1e-400", "too small for a double"),
            ("-2.5E-999", "too small for a double"),
            ("12345678901234567890123", "beyond 64 bits"),
            ("-9223372036854775809", "beyond 64 bits"),
        ] {
            let e = json_object(Some(&format!(r#"{{"n": [1, {value}]}}"#))).unwrap_err();
            assert!(e.contains(why) && e.contains(value), "{value}: {e}");
        }
        for fine in [
            r#"{"a": 0, "b": 0.0, "c": -0e5, "d": 1e-300, "e": 18446744073709551615}"#,
            r#"{"s": "12345678901234567890123 and 1e-400", "k\"12345678901234567890123": 1}"#,
        ] {
            assert!(json_object(Some(fine)).is_ok(), "{fine}");
        }
        let deep = format!(r#"{{"d": {}1{}}}"#, "[".repeat(200), "]".repeat(200));
        let e = json_object(Some(&deep)).unwrap_err();
        assert!(e.contains("recursion limit"), "{e}");
    }
}
