//! Turning a parameter's raw XML text into a JSON value, guided by the tool's JSON schema.
//!
//! The M2 template writes string values verbatim and everything else as JSON, so the schema
//! decides: a declared string stays text; a number/boolean/object/array is parsed as JSON. A
//! value that does not parse as its declared type is kept as a string and reported.

use serde_json::Value as Json;

/// JSON types a schema allows; `None` means anything.
fn allowed_types(schema: &Json) -> Option<Vec<&'static str>> {
    let mut out = Vec::new();
    if !collect_types(schema, &mut out) {
        return None;
    }
    if out.is_empty() { None } else { Some(out) }
}

/// Adds the types `schema` allows; returns false when it allows anything.
fn collect_types(schema: &Json, out: &mut Vec<&'static str>) -> bool {
    let Some(obj) = schema.as_object() else {
        return false;
    };
    let before = out.len();
    match obj.get("type") {
        Some(Json::String(t)) => push_type(t, out),
        Some(Json::Array(ts)) => ts
            .iter()
            .filter_map(Json::as_str)
            .for_each(|t| push_type(t, out)),
        _ => {}
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(Json::Array(alts)) = obj.get(key) {
            for alt in alts {
                if !collect_types(alt, out) {
                    return false;
                }
            }
        }
    }
    let mut values: Vec<&Json> = obj
        .get("enum")
        .and_then(Json::as_array)
        .map(|a| a.iter().collect())
        .unwrap_or_default();
    values.extend(obj.get("const"));
    for v in values {
        push_type(json_type(v), out);
    }
    if out.len() == before {
        if obj.contains_key("properties") {
            out.push("object");
        } else if obj.contains_key("items") {
            out.push("array");
        } else {
            return false;
        }
    }
    true
}

fn push_type(t: &str, out: &mut Vec<&'static str>) {
    let t = match t {
        "string" => "string",
        "number" => "number",
        "integer" => "integer",
        "boolean" => "boolean",
        "object" => "object",
        "array" => "array",
        "null" => "null",
        _ => return,
    };
    if !out.contains(&t) {
        out.push(t);
    }
}

fn json_type(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "boolean",
        Json::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Json::Number(_) => "number",
        Json::String(_) => "string",
        Json::Array(_) => "array",
        Json::Object(_) => "object",
    }
}

/// Largest magnitude below which every integer has an exact double (2^53).
const MAX_EXACT_FLOAT_INT: f64 = 9_007_199_254_740_992.0;

fn type_matches(v: &Json, allowed: &[&str]) -> bool {
    let t = json_type(v);
    allowed.contains(&t)
        || (t == "integer" && allowed.contains(&"number"))
        // A whole float ("3.0") is an integer only while a double holds it exactly: digits
        // past i64 parse as a rounded float, and passing that on would change the value.
        || (t == "number"
            && allowed.contains(&"integer")
            && v.as_f64().is_some_and(|f| f.fract() == 0.0 && f.abs() <= MAX_EXACT_FLOAT_INT))
}

/// A whole float (`3.0`, `-0`) where only integers are allowed, written as the integer, so
/// strict clients (Go's `int`, serde's `i64`) read it.
fn whole_as_integer(v: Json, allowed: &[&str]) -> Json {
    match v.as_f64() {
        Some(f) if !v.is_i64() && !v.is_u64() && allowed.contains(&"integer") && !allowed.contains(&"number") => {
            // type_matches let it through only when it is whole and within 2^53.
            Json::from(f as i64)
        }
        _ => v,
    }
}

/// Types `raw` by `schema`; the flag is false when the value did not fit its declared type.
pub fn type_value(raw: &str, schema: Option<&Json>) -> (Json, bool) {
    let parsed = serde_json::from_str::<Json>(raw).ok();
    match schema.and_then(allowed_types) {
        // Undeclared: JSON when it is JSON (but never re-quote a string), else text.
        None => match parsed {
            Some(v) if !v.is_string() => (v, true),
            _ => (Json::String(raw.to_string()), true),
        },
        Some(allowed) => {
            if allowed == ["string"] {
                return (Json::String(raw.to_string()), true);
            }
            if let Some(v) = parsed.filter(|v| !v.is_string() && type_matches(v, &allowed)) {
                return (whole_as_integer(v, &allowed), true);
            }
            (Json::String(raw.to_string()), allowed.contains(&"string"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn schema_decides_the_type() {
        let t = |raw: &str, schema: Json| type_value(raw, Some(&schema));
        assert_eq!(t("42", json!({"type": "string"})).0, json!("42"));
        assert_eq!(t("42", json!({"type": "integer"})), (json!(42), true));
        assert_eq!(t("4.5", json!({"type": "number"})), (json!(4.5), true));
        assert_eq!(t("4.5", json!({"type": "integer"})), (json!("4.5"), false));
        assert_eq!(t("3.0", json!({"type": "integer"})), (json!(3), true));
        assert_eq!(t("-0", json!({"type": "integer"})).0.to_string(), "0");
        assert_eq!(t("3.0", json!({"type": ["integer", "number"]})), (json!(3.0), true));
        // Past 2^53 a double rounds: the digits stay as written, as text, and are reported.
        let big = "1321032101233210212345";
        assert_eq!(t(big, json!({"type": "integer"})), (json!(big), false));
        assert_eq!(t(big, json!({"type": "number"})).1, true);
        assert_eq!(t("9223372036854775807", json!({"type": "integer"})), (json!(i64::MAX), true));
        assert_eq!(t("true", json!({"type": "boolean"})), (json!(true), true));
        assert_eq!(t("yes", json!({"type": "boolean"})), (json!("yes"), false));
        assert_eq!(
            t("{\"a\": [1]}", json!({"type": "object"})),
            (json!({"a": [1]}), true)
        );
        assert_eq!(
            t("[1, \"x\"]", json!({"type": "array"})),
            (json!([1, "x"]), true)
        );
        assert_eq!(t("[1", json!({"type": "array"})), (json!("[1"), false));
        assert_eq!(
            t("null", json!({"type": ["string", "null"]})),
            (json!(null), true)
        );
        assert_eq!(
            t(
                "5",
                json!({"anyOf": [{"type": "integer"}, {"type": "string"}]})
            ),
            (json!(5), true)
        );
        assert_eq!(
            t(
                "abc",
                json!({"anyOf": [{"type": "integer"}, {"type": "string"}]})
            ),
            (json!("abc"), true)
        );
        assert_eq!(t("2", json!({"enum": [1, 2, 3]})), (json!(2), true));
        assert_eq!(
            t("{\"k\": 1}", json!({"properties": {}})),
            (json!({"k": 1}), true)
        );
    }

    #[test]
    fn undeclared_parameters_are_json_when_possible() {
        assert_eq!(type_value("12", None), (json!(12), true));
        assert_eq!(
            type_value("hello world", None),
            (json!("hello world"), true)
        );
        assert_eq!(type_value("\"quoted\"", None), (json!("\"quoted\""), true));
        assert_eq!(
            type_value("3", Some(&json!({"description": "no type"}))),
            (json!(3), true)
        );
    }
}
