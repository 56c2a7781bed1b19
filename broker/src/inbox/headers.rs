//! AMQP headers → JSON, for deliveries. Never fails: every value is converted, none dropped.
//!
//! | AMQP field type                                  | JSON                                  |
//! |--------------------------------------------------|---------------------------------------|
//! | boolean                                          | `true` / `false`                      |
//! | signed and unsigned 8, 16, 32, 64-bit integers   | number                                |
//! | float, double                                    | number; NaN and ±infinity as the      |
//! |                                                  | strings `"NaN"`, `"Infinity"`,        |
//! |                                                  | `"-Infinity"`                         |
//! | decimal (scale, value)                           | string, e.g. `"123.45"`               |
//! | short string, long string (UTF-8, no NUL)        | string                                |
//! | string that is not UTF-8 or holds a NUL (U+0000, | `{"$bytes": "<base64, padded>"}`      |
//! | which PostgreSQL text and jsonb cannot hold),    |                                       |
//! | byte array                                       |                                       |
//! | timestamp                                        | number (seconds since the Unix epoch) |
//! | field array                                      | array                                 |
//! | field table                                      | object                                |
//! | void                                             | `null`                                |

//!
//! A header name with a NUL has each NUL replaced by U+FFFD (a name cannot be an object).

use base64::Engine;
use lapin::types::{AMQPValue, DecimalValue, FieldTable};
use serde_json::{Map, Number, Value};

/// The key of the object that stands for bytes.
pub(crate) const BYTES_KEY: &str = "$bytes";

pub(crate) fn table_to_json(table: &FieldTable) -> Map<String, Value> {
    table
        .inner()
        .iter()
        .map(|(k, v)| (without_nul(k.as_str()), to_json(v)))
        .collect()
}

/// `s` with each NUL (U+0000) replaced by U+FFFD: PostgreSQL text cannot hold a NUL. The same
/// input always gives the same output, so an id made this way still recognises a redelivery.
pub fn without_nul(s: &str) -> String {
    if s.contains('\0') {
        s.replace('\0', "\u{FFFD}")
    } else {
        s.to_string()
    }
}

/// A string as JSON: bytes when PostgreSQL could not store it as text.
fn string(s: &str) -> Value {
    if s.contains('\0') {
        bytes(s.as_bytes())
    } else {
        Value::String(s.to_string())
    }
}

fn to_json(value: &AMQPValue) -> Value {
    match value {
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::ShortShortInt(n) => Value::from(*n),
        AMQPValue::ShortShortUInt(n) => Value::from(*n),
        AMQPValue::ShortInt(n) => Value::from(*n),
        AMQPValue::ShortUInt(n) => Value::from(*n),
        AMQPValue::LongInt(n) => Value::from(*n),
        AMQPValue::LongUInt(n) => Value::from(*n),
        AMQPValue::LongLongInt(n) => Value::from(*n),
        AMQPValue::Float(f) => float(f64::from(*f)),
        AMQPValue::Double(f) => float(*f),
        AMQPValue::DecimalValue(d) => Value::String(decimal(d)),
        AMQPValue::ShortString(s) => string(s.as_str()),
        AMQPValue::LongString(s) => match std::str::from_utf8(s.as_bytes()) {
            Ok(text) => string(text),
            Err(_) => bytes(s.as_bytes()),
        },
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(to_json).collect()),
        AMQPValue::Timestamp(t) => Value::from(*t),
        AMQPValue::FieldTable(t) => Value::Object(table_to_json(t)),
        AMQPValue::ByteArray(b) => bytes(b.as_slice()),
        AMQPValue::Void => Value::Null,
    }
}

/// JSON has no NaN or infinity: those become strings.
fn float(f: f64) -> Value {
    match Number::from_f64(f) {
        Some(n) => Value::Number(n),
        None if f.is_nan() => Value::String("NaN".into()),
        None if f > 0.0 => Value::String("Infinity".into()),
        None => Value::String("-Infinity".into()),
    }
}

/// `value · 10^-scale` in decimal notation, exactly (a JSON number would round it).
fn decimal(d: &DecimalValue) -> String {
    let digits = d.value.to_string();
    let scale = usize::from(d.scale);
    if scale == 0 {
        return digits;
    }
    let padded = format!("{digits:0>width$}", width = scale + 1);
    let (int, frac) = padded.split_at(padded.len() - scale);
    format!("{int}.{frac}")
}

fn bytes(b: &[u8]) -> Value {
    let mut m = Map::new();
    m.insert(
        BYTES_KEY.into(),
        Value::String(base64::engine::general_purpose::STANDARD.encode(b)),
    );
    Value::Object(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{ByteArray, FieldArray, LongString, ShortString};
    use serde_json::json;

    fn one(v: AMQPValue) -> Value {
        let mut t = FieldTable::default();
        t.insert(ShortString::from("k"), v);
        table_to_json(&t).remove("k").unwrap()
    }

    #[test]
    fn every_amqp_value_kind() {
        assert_eq!(one(AMQPValue::Boolean(true)), json!(true));
        assert_eq!(one(AMQPValue::ShortShortInt(-8)), json!(-8));
        assert_eq!(one(AMQPValue::ShortShortUInt(255)), json!(255));
        assert_eq!(one(AMQPValue::ShortInt(-16)), json!(-16));
        assert_eq!(one(AMQPValue::ShortUInt(65535)), json!(65535));
        assert_eq!(one(AMQPValue::LongInt(i32::MIN)), json!(i32::MIN));
        assert_eq!(one(AMQPValue::LongUInt(u32::MAX)), json!(u32::MAX));
        assert_eq!(one(AMQPValue::LongLongInt(i64::MIN)), json!(i64::MIN));
        assert_eq!(one(AMQPValue::Float(1.5)), json!(1.5));
        assert_eq!(one(AMQPValue::Double(-0.25)), json!(-0.25));
        assert_eq!(
            one(AMQPValue::DecimalValue(DecimalValue {
                scale: 2,
                value: 12345
            })),
            json!("123.45")
        );
        assert_eq!(
            one(AMQPValue::ShortString(ShortString::from("short"))),
            json!("short")
        );
        assert_eq!(
            one(AMQPValue::LongString(LongString::from("héllo"))),
            json!("héllo")
        );
        assert_eq!(
            one(AMQPValue::Timestamp(1_700_000_000)),
            json!(1_700_000_000u64)
        );
        assert_eq!(
            one(AMQPValue::ByteArray(ByteArray::from(vec![0u8, 1, 2, 255]))),
            json!({"$bytes": "AAEC/w=="})
        );
        assert_eq!(one(AMQPValue::Void), json!(null));
    }

    #[test]
    fn odd_values_are_converted_not_dropped() {
        assert_eq!(one(AMQPValue::Double(f64::NAN)), json!("NaN"));
        assert_eq!(one(AMQPValue::Float(f32::INFINITY)), json!("Infinity"));
        assert_eq!(
            one(AMQPValue::Double(f64::NEG_INFINITY)),
            json!("-Infinity")
        );
        // A long string that is not UTF-8 keeps its bytes.
        assert_eq!(
            one(AMQPValue::LongString(LongString::from(vec![0xffu8, 0x00]))),
            json!({"$bytes": "/wA="})
        );
        assert_eq!(
            one(AMQPValue::ByteArray(ByteArray::from(Vec::new()))),
            json!({"$bytes": ""})
        );
    }

    #[test]
    fn nul_characters_never_reach_postgresql_text() {
        // PostgreSQL's jsonb refuses \u0000: such strings keep their bytes instead.
        assert_eq!(
            one(AMQPValue::LongString(LongString::from("a\0b"))),
            json!({"$bytes": "YQBi"})
        );
        assert_eq!(
            one(AMQPValue::ShortString(ShortString::from("a\0b"))),
            json!({"$bytes": "YQBi"})
        );
        let mut inner = FieldTable::default();
        inner.insert("n".into(), AMQPValue::LongString(LongString::from("\0")));
        let mut t = FieldTable::default();
        t.insert("k\0ey".into(), AMQPValue::FieldTable(inner));
        let json = Value::Object(table_to_json(&t));
        assert_eq!(json, json!({"k\u{FFFD}ey": {"n": {"$bytes": "AA=="}}}));
        assert!(!json.to_string().contains("\\u0000"), "{json}");
        assert_eq!(without_nul("id\0x"), "id\u{FFFD}x");
        assert_eq!(without_nul("plain"), "plain");
    }

    #[test]
    fn decimals_keep_every_digit() {
        let d = |scale, value| decimal(&DecimalValue { scale, value });
        assert_eq!(d(0, 42), "42");
        assert_eq!(d(1, 5), "0.5");
        assert_eq!(d(3, 5), "0.005");
        assert_eq!(d(2, 100), "1.00");
        assert_eq!(d(12, u32::MAX), "0.004294967295");
        assert_eq!(d(255, 1).len(), 257);
    }

    #[test]
    fn nested_tables_and_arrays() {
        let mut inner = FieldTable::default();
        inner.insert("b".into(), AMQPValue::LongLongInt(2));
        inner.insert(
            "raw".into(),
            AMQPValue::ByteArray(ByteArray::from(&b"hi"[..])),
        );
        let mut t = FieldTable::default();
        t.insert(
            "list".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![
                AMQPValue::LongString("x".into()),
                AMQPValue::Boolean(false),
                AMQPValue::Void,
                AMQPValue::FieldTable(inner),
                AMQPValue::FieldArray(FieldArray::default()),
            ])),
        );
        t.insert("empty".into(), AMQPValue::FieldTable(FieldTable::default()));
        assert_eq!(
            Value::Object(table_to_json(&t)),
            json!({
                "list": ["x", false, null, {"b": 2, "raw": {"$bytes": "aGk="}}, []],
                "empty": {},
            })
        );
    }

    #[test]
    fn json_headers_survive_the_round_trip() {
        // What the outbox publishes (JSON → AMQP) reads back as the same JSON.
        let original = json!({
            "s": "text", "i": -42, "f": 2.5, "t": true, "n": null,
            "obj": {"a": [1, "two", null, {"c": false}]},
        });
        let Value::Object(map) = original.clone() else {
            unreachable!()
        };
        let table = crate::amqp_values::to_field_table(&map).unwrap();
        assert_eq!(Value::Object(table_to_json(&table)), original);
    }
}
