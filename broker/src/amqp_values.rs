//! JSON headers → AMQP field tables.

use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use serde_json::{Map, Value};

/// Converts a JSON object into an AMQP header table. Fails (instead of panicking, as lapin's
/// `From<&str> for ShortString` would) when a key is longer than 255 bytes.
pub(crate) fn to_field_table(map: &Map<String, Value>) -> Result<FieldTable, String> {
    let mut table = FieldTable::default();
    for (key, value) in map {
        let k = ShortString::try_new(key.as_str()).map_err(|_| {
            format!(
                "header name longer than 255 bytes: {}...",
                truncate(key, 40)
            )
        })?;
        table.insert(k, to_value(value)?);
    }
    Ok(table)
}

/// The encoded size of `map` as an AMQP field table, or why it cannot be one: what `publish()`
/// checks before a message is stored, so that the worker never gets headers it cannot send.
pub fn header_table_size(map: &Map<String, Value>) -> Result<usize, String> {
    to_field_table(map).map(|t| table_size(&t))
}

/// Bytes of a field table on the wire: its 4-byte length, then name (1 + bytes), type tag and
/// value per entry.
pub(crate) fn table_size(table: &FieldTable) -> usize {
    4 + table
        .inner()
        .iter()
        .map(|(k, v)| 1 + k.as_str().len() + 1 + value_size(v))
        .sum::<usize>()
}

fn value_size(value: &AMQPValue) -> usize {
    match value {
        AMQPValue::Void => 0,
        AMQPValue::Boolean(_) | AMQPValue::ShortShortInt(_) | AMQPValue::ShortShortUInt(_) => 1,
        AMQPValue::ShortInt(_) | AMQPValue::ShortUInt(_) => 2,
        AMQPValue::LongInt(_) | AMQPValue::LongUInt(_) | AMQPValue::Float(_) => 4,
        AMQPValue::LongLongInt(_) | AMQPValue::Double(_) | AMQPValue::Timestamp(_) => 8,
        AMQPValue::DecimalValue(_) => 5,
        AMQPValue::ShortString(s) => 1 + s.as_str().len(),
        AMQPValue::LongString(s) => 4 + s.as_bytes().len(),
        AMQPValue::ByteArray(b) => 4 + b.as_slice().len(),
        AMQPValue::FieldArray(a) => {
            4 + a
                .as_slice()
                .iter()
                .map(|v| 1 + value_size(v))
                .sum::<usize>()
        }
        AMQPValue::FieldTable(t) => table_size(t),
    }
}

fn to_value(value: &Value) -> Result<AMQPValue, String> {
    Ok(match value {
        Value::Null => AMQPValue::Void,
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => AMQPValue::LongLongInt(i),
            // Floats, and integers above i64::MAX (AMQP has no unsigned 64-bit field type).
            None => AMQPValue::Double(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => AMQPValue::LongString(LongString::from(s.as_bytes())),
        Value::Array(items) => AMQPValue::FieldArray(FieldArray::from(
            items.iter().map(to_value).collect::<Result<Vec<_>, _>>()?,
        )),
        Value::Object(map) => AMQPValue::FieldTable(to_field_table(map)?),
    })
}

/// At most `max` bytes of `s`, cut on a character boundary.
pub(crate) fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn table(v: Value) -> FieldTable {
        match v {
            Value::Object(m) => to_field_table(&m).unwrap(),
            _ => panic!("not an object"),
        }
    }

    #[test]
    fn sizes_are_the_encoded_bytes() {
        let size = |v: Value| match v {
            Value::Object(m) => header_table_size(&m).unwrap(),
            _ => panic!("not an object"),
        };
        assert_eq!(size(json!({})), 4);
        // name "a": 1 + 1, tag 1, long long 8
        assert_eq!(size(json!({"a": 1})), 4 + 2 + 1 + 8);
        // long string: 4 + 3 bytes
        assert_eq!(size(json!({"s": "héx"})), 4 + 2 + 1 + 4 + 4);
        // array of a boolean and a void: 4 + (1 + 1) + (1 + 0)
        assert_eq!(size(json!({"l": [true, null]})), 4 + 2 + 1 + 4 + 2 + 1);
        // nested table
        assert_eq!(
            size(json!({"t": {"b": false}})),
            4 + 2 + 1 + (4 + 2 + 1 + 1)
        );
        let long_name = "n".repeat(256);
        let mut m = Map::new();
        m.insert(long_name, json!(1));
        assert!(header_table_size(&m).is_err());
    }

    #[test]
    fn scalars_map_to_the_documented_types() {
        let t = table(json!({
            "s": "héllo",
            "i": -42,
            "big": 9_007_199_254_740_993_i64,
            "f": 1.5,
            "t": true,
            "n": null,
        }));
        let m = t.inner();
        assert_eq!(m["s"], AMQPValue::LongString("héllo".into()));
        assert_eq!(m["i"], AMQPValue::LongLongInt(-42));
        assert_eq!(m["big"], AMQPValue::LongLongInt(9_007_199_254_740_993));
        assert_eq!(m["f"], AMQPValue::Double(1.5));
        assert_eq!(m["t"], AMQPValue::Boolean(true));
        assert_eq!(m["n"], AMQPValue::Void);
    }

    #[test]
    fn u64_above_i64_max_becomes_double() {
        let t = table(json!({ "u": u64::MAX }));
        assert_eq!(t.inner()["u"], AMQPValue::Double(u64::MAX as f64));
    }

    #[test]
    fn nested_objects_and_arrays() {
        let t = table(json!({
            "obj": { "a": 1, "b": ["x", 2, false, null, { "c": 2.5 }] },
            "empty": [],
        }));
        let mut inner_c = FieldTable::default();
        inner_c.insert("c".into(), AMQPValue::Double(2.5));
        let mut obj = FieldTable::default();
        obj.insert("a".into(), AMQPValue::LongLongInt(1));
        obj.insert(
            "b".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![
                AMQPValue::LongString("x".into()),
                AMQPValue::LongLongInt(2),
                AMQPValue::Boolean(false),
                AMQPValue::Void,
                AMQPValue::FieldTable(inner_c),
            ])),
        );
        assert_eq!(t.inner()["obj"], AMQPValue::FieldTable(obj));
        assert_eq!(
            t.inner()["empty"],
            AMQPValue::FieldArray(FieldArray::default())
        );
    }

    #[test]
    fn overlong_key_is_an_error_not_a_panic() {
        let mut m = Map::new();
        m.insert("k".repeat(256), json!(1));
        assert!(to_field_table(&m).is_err());
        let mut nested = Map::new();
        nested.insert("outer".into(), Value::Object(m));
        assert!(to_field_table(&nested).is_err());
        let mut ok = Map::new();
        ok.insert("k".repeat(255), json!(1));
        assert!(to_field_table(&ok).is_ok());
    }

    #[test]
    fn truncate_respects_char_boundaries() {
        assert_eq!(truncate("abc", 10), "abc");
        assert_eq!(truncate("ééé", 3), "é");
    }
}
