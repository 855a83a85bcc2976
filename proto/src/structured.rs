//! Structured outputs: `response_format` (`text`, `json_object`,
//! `json_schema`) as the entry stage validates it, and the size limits a
//! client's schema must keep. The exit stage compiles what is validated here
//! into a grammar and samples under it; this module is free of I/O and of
//! the grammar engine, so its rules are unit-tested on their own.
//!
//! The schema travels inside the sealed request, so the receipt binds it
//! through the request digest like every other field.

use crate::openai::{invalid, ApiError};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Most bytes of one schema (as compact JSON), a tool's `parameters` included.
pub const MAX_SCHEMA_BYTES: usize = 64 * 1024;
/// Deepest nesting of arrays and objects in one schema document.
pub const MAX_SCHEMA_DEPTH: usize = 32;
/// Most `enum` values in one schema, summed over all its `enum`s.
pub const MAX_ENUM_VALUES: usize = 1000;

/// What the answer's text must be (`response_format` other than `text`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ResponseFormat {
    /// Any JSON object (`json_object`).
    JsonObject,
    /// JSON valid against `schema` (`json_schema`), kept as compact JSON
    /// text so that it crosses the stage channel unchanged.
    JsonSchema {
        /// The format's `name`.
        name: String,
        /// The schema, as JSON text.
        schema: String,
    },
}

impl ResponseFormat {
    /// The JSON schema the answer must satisfy.
    pub fn schema(&self) -> Value {
        match self {
            ResponseFormat::JsonObject => serde_json::json!({"type": "object"}),
            ResponseFormat::JsonSchema { schema, .. } => {
                serde_json::from_str(schema).unwrap_or(Value::Bool(true))
            }
        }
    }
}

/// `true` when `s` is a name OpenAI accepts for a schema or function:
/// 1 to 64 of `a-z A-Z 0-9 _ -`.
pub fn valid_name(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Checks a client's schema against the limits ([`MAX_SCHEMA_BYTES`],
/// [`MAX_SCHEMA_DEPTH`], [`MAX_ENUM_VALUES`]) and returns it as compact
/// JSON. `param` names the field in the error.
pub fn checked_schema(param: &str, schema: &Value) -> Result<String, ApiError> {
    match schema {
        Value::Object(_) | Value::Bool(true) => {}
        Value::Bool(false) => return invalid(param, "The schema `false` admits no answer."),
        _ => return invalid(param, "A JSON schema must be an object (or `true`)."),
    }
    let text = serde_json::to_string(schema).expect("a Value serializes");
    if text.len() > MAX_SCHEMA_BYTES {
        return invalid(
            param,
            format!(
                "The schema is {} bytes; at most {MAX_SCHEMA_BYTES} are accepted.",
                text.len()
            ),
        );
    }
    let (depth, enums) = measure(schema);
    if depth > MAX_SCHEMA_DEPTH {
        return invalid(
            param,
            format!(
                "The schema nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are accepted."
            ),
        );
    }
    if enums > MAX_ENUM_VALUES {
        return invalid(
            param,
            format!("The schema has {enums} enum values; at most {MAX_ENUM_VALUES} are accepted."),
        );
    }
    Ok(text)
}

/// Nesting depth of `v` and the number of values in its `enum` arrays.
/// Iterative: the body parser already bounds depth, but this must not
/// recurse on a client's document either way.
fn measure(v: &Value) -> (usize, usize) {
    let mut stack = vec![(v, 1usize)];
    let (mut depth, mut enums) = (0, 0);
    while let Some((v, d)) = stack.pop() {
        match v {
            Value::Object(m) => {
                depth = depth.max(d);
                if let Some(Value::Array(e)) = m.get("enum") {
                    enums += e.len();
                }
                stack.extend(m.values().map(|c| (c, d + 1)));
            }
            Value::Array(a) => {
                depth = depth.max(d);
                stack.extend(a.iter().map(|c| (c, d + 1)));
            }
            _ => {}
        }
    }
    (depth, enums)
}

/// Parses `response_format`: `None` for free text (absent, null or
/// `{"type":"text"}`).
pub fn parse_response_format(obj: &Map<String, Value>) -> Result<Option<ResponseFormat>, ApiError> {
    const P: &str = "response_format";
    let f = match obj.get(P) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(f)) => f,
        Some(_) => return invalid(P, "`response_format` must be an object with a `type`."),
    };
    match f.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(ResponseFormat::JsonObject)),
        Some("json_schema") => {
            let Some(Value::Object(js)) = f.get("json_schema") else {
                return invalid(
                    P,
                    "`response_format` of type `json_schema` needs a `json_schema` object \
                     with a `name` and a `schema`.",
                );
            };
            let name = match js.get("name") {
                Some(Value::String(n)) if valid_name(n) => n.clone(),
                _ => {
                    return invalid(
                        P,
                        "`response_format.json_schema.name` must be 1 to 64 letters, digits, \
                         underscores or dashes.",
                    )
                }
            };
            match js.get("strict") {
                None | Some(Value::Null) | Some(Value::Bool(_)) => {}
                Some(_) => {
                    return invalid(P, "`response_format.json_schema.strict` must be a boolean.")
                }
            }
            match js.get("description") {
                None | Some(Value::Null) | Some(Value::String(_)) => {}
                Some(_) => {
                    return invalid(
                        P,
                        "`response_format.json_schema.description` must be a string.",
                    )
                }
            }
            // No schema: any JSON value, as vLLM and llama.cpp read it.
            let schema = match js.get("schema") {
                None | Some(Value::Null) => "true".to_string(),
                Some(s) => checked_schema(P, s)?,
            };
            Ok(Some(ResponseFormat::JsonSchema { name, schema }))
        }
        Some(other) => invalid(
            P,
            format!(
                "`response_format.type` `{}` is not supported; use `text`, `json_object` \
                 or `json_schema`.",
                other.chars().take(32).collect::<String>()
            ),
        ),
        None => invalid(P, "`response_format` needs a string `type`."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<Option<ResponseFormat>, ApiError> {
        let obj = json!({ "response_format": v });
        parse_response_format(obj.as_object().unwrap())
    }

    #[test]
    fn the_three_types() {
        assert_eq!(parse(json!({"type": "text"})).unwrap(), None);
        assert_eq!(parse(Value::Null).unwrap(), None);
        assert_eq!(
            parse(json!({"type": "json_object"})).unwrap(),
            Some(ResponseFormat::JsonObject)
        );
        let f = parse(json!({"type": "json_schema", "json_schema": {
            "name": "p", "strict": true,
            "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}))
        .unwrap()
        .unwrap();
        assert_eq!(f.schema()["properties"]["a"]["type"], "integer");
        let f = parse(json!({"type": "json_schema", "json_schema": {"name": "any"}}))
            .unwrap()
            .unwrap();
        assert_eq!(f.schema(), Value::Bool(true));
    }

    #[test]
    fn bad_formats_name_the_field() {
        for v in [
            json!("json_object"),
            json!({"type": "xml"}),
            json!({}),
            json!({"type": "json_schema"}),
            json!({"type": "json_schema", "json_schema": {"schema": {}}}),
            json!({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}),
            json!({"type": "json_schema", "json_schema": {"name": "a", "schema": 5}}),
            json!({"type": "json_schema", "json_schema": {"name": "a", "strict": "yes"}}),
        ] {
            let e = parse(v.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("response_format"), "{v}");
            assert_eq!(e.status, 400);
        }
    }

    #[test]
    fn limits() {
        let mut deep = json!({"type": "string"});
        for _ in 0..MAX_SCHEMA_DEPTH {
            deep = json!({"type": "array", "items": deep});
        }
        let e = checked_schema("p", &deep).unwrap_err();
        assert!(e.message.contains("levels deep"), "{}", e.message);
        let e = checked_schema(
            "p",
            &json!({"enum": (0..=MAX_ENUM_VALUES).collect::<Vec<_>>()}),
        )
        .unwrap_err();
        assert!(e.message.contains("enum values"), "{}", e.message);
        let big = "x".repeat(MAX_SCHEMA_BYTES);
        let e = checked_schema("p", &json!({ "description": big })).unwrap_err();
        assert!(e.message.contains("bytes"), "{}", e.message);
        assert!(checked_schema("p", &json!({"type": "object"})).is_ok());
        assert!(checked_schema("p", &json!(true)).is_ok());
        assert!(checked_schema("p", &json!(false)).is_err());
        assert!(valid_name("get_weather-2") && !valid_name("") && !valid_name("a.b"));
        assert!(!valid_name(&"a".repeat(65)));
    }
}
