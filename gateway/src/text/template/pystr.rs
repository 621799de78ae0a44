//! Python's `str()` of template values, which is what jinja2 prints for `{{ value }}`:
//! `None`, `True`, `1.0`, `['a', 1]`, `{'k': 'v'}` instead of minijinja's own spellings.

use minijinja::value::{Value, ValueKind};

use super::pyfloat::python_float_repr;

/// `str(value)` as CPython prints it; undefined prints nothing, as in jinja2.
pub fn python_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => value.as_str().unwrap_or_default().to_string(),
        _ => python_repr(value),
    }
}

/// `repr(value)`: strings quoted, containers recursive.
fn python_repr(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::None => "None".to_string(),
        ValueKind::Bool => if value.is_true() { "True" } else { "False" }.to_string(),
        ValueKind::Number => {
            if value.is_integer() {
                value.to_string()
            } else {
                match f64::try_from(value.clone()) {
                    Ok(f) => python_float_repr(f),
                    Err(_) => value.to_string(),
                }
            }
        }
        ValueKind::String => quote(value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<String> = match value.try_iter() {
                Ok(iter) => iter.map(|v| python_repr(&v)).collect(),
                Err(_) => return value.to_string(),
            };
            format!("[{}]", items.join(", "))
        }
        ValueKind::Map => {
            let Ok(keys) = value.try_iter() else {
                return value.to_string();
            };
            let items: Vec<String> = keys
                .map(|k| {
                    let v = value.get_item(&k).unwrap_or(Value::UNDEFINED);
                    format!("{}: {}", python_repr(&k), python_repr(&v))
                })
                .collect();
            format!("{{{}}}", items.join(", "))
        }
        // Namespaces, macros and other objects: minijinja's own text.
        _ => value.to_string(),
    }
}

/// Python's string repr: single quotes unless the text has `'` and no `"`.
fn quote(s: &str) -> String {
    let q = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(q);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == q => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c => out.push(c),
        }
    }
    out.push(q);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prints_like_python() {
        let v = Value::from(minijinja::value::Serde(
            serde_json::json!({"a": [1, 2.0, true, null, "it's"], "b": "x\n"}),
        ));
        assert_eq!(
            python_str(&v),
            r#"{'a': [1, 2.0, True, None, "it's"], 'b': 'x\n'}"#
        );
        assert_eq!(python_str(&Value::from(())), "None");
        assert_eq!(python_str(&Value::UNDEFINED), "");
        assert_eq!(python_str(&Value::from(0.5)), "0.5");
        assert_eq!(python_str(&Value::from("plain")), "plain");
    }
}
