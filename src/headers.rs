//! AMQP headers and arguments come from `jsonb` values that a user wrote. PostgreSQL's `jsonb`
//! holds numbers of any size and nesting of any depth; AMQP field tables (and the JSON parser)
//! do not. Parsing them here, from the value's text, turns such a value into an error about
//! that one value instead of a failure of whatever reads it. Plain Rust: used by user backends
//! and by the worker.

use serde_json::{Map, Value};

/// The JSON object in `text` (`None`: an empty one), or why it cannot be sent.
pub fn json_object(text: Option<&str>) -> Result<Map<String, Value>, String> {
    let Some(text) = text else {
        return Ok(Map::new());
    };
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err("are not a JSON object".into()),
        Err(e) => Err(format!("cannot be sent as AMQP field values: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::json_object;

    #[test]
    fn objects_parse_and_unsendable_values_are_refused() {
        assert_eq!(json_object(None).map(|m| m.len()), Ok(0));
        assert_eq!(
            json_object(Some(r#"{"a": 1, "b": [true]}"#)).map(|m| m.len()),
            Ok(2)
        );
        assert!(json_object(Some("[1]")).is_err());
        let huge = format!(r#"{{"f": 1{}}}"#, "0".repeat(400));
        let e = json_object(Some(&huge)).unwrap_err();
        assert!(e.contains("number out of range"), "{e}");
        let deep = format!(r#"{{"d": {}1{}}}"#, "[".repeat(200), "]".repeat(200));
        let e = json_object(Some(&deep)).unwrap_err();
        assert!(e.contains("recursion limit"), "{e}");
    }
}
