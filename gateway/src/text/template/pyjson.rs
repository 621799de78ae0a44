//! Python's `json.dumps`, which HF's `tojson` filter calls: `", "`/`": "` separators, key order
//! kept, no HTML escaping, `ensure_ascii=False` by default.

use serde_json::Value;

use super::pyfloat::python_float_repr;

/// The keyword arguments of `json.dumps` that HF's `tojson` exposes.
#[derive(Debug, Clone, Default)]
pub struct DumpsOptions {
    /// Escape non-ASCII as `\uXXXX`.
    pub ensure_ascii: bool,
    /// Pretty-print with this indent string per level.
    pub indent: Option<String>,
    /// `(item_separator, key_separator)`; `None` picks Python's default for the indent.
    pub separators: Option<(String, String)>,
    /// Sort object keys.
    pub sort_keys: bool,
}

/// Serializes `value` as Python's `json.dumps(value, **opts)` would.
pub fn dumps(value: &Value, opts: &DumpsOptions) -> String {
    let (item_sep, key_sep) = match &opts.separators {
        Some((i, k)) => (i.clone(), k.clone()),
        None if opts.indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let mut out = String::new();
    let w = Writer {
        opts,
        item_sep: &item_sep,
        key_sep: &key_sep,
    };
    w.value(value, 0, &mut out);
    out
}

struct Writer<'a> {
    opts: &'a DumpsOptions,
    item_sep: &'a str,
    key_sep: &'a str,
}

impl Writer<'_> {
    fn value(&self, v: &Value, depth: usize, out: &mut String) {
        match v {
            Value::Null => out.push_str("null"),
            Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Value::Number(n) => {
                if let Some(i) = n.as_i64() {
                    out.push_str(&i.to_string());
                } else if let Some(u) = n.as_u64() {
                    out.push_str(&u.to_string());
                } else {
                    out.push_str(&python_float_repr(n.as_f64().unwrap_or(f64::NAN)));
                }
            }
            Value::String(s) => self.string(s, out),
            Value::Array(items) => {
                if items.is_empty() {
                    out.push_str("[]");
                    return;
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    self.separator(i, depth + 1, out);
                    self.value(item, depth + 1, out);
                }
                self.close(depth, out);
                out.push(']');
            }
            Value::Object(map) => {
                if map.is_empty() {
                    out.push_str("{}");
                    return;
                }
                let mut entries: Vec<(&String, &Value)> = map.iter().collect();
                if self.opts.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, item)) in entries.into_iter().enumerate() {
                    self.separator(i, depth + 1, out);
                    self.string(k, out);
                    out.push_str(self.key_sep);
                    self.value(item, depth + 1, out);
                }
                self.close(depth, out);
                out.push('}');
            }
        }
    }

    fn separator(&self, index: usize, depth: usize, out: &mut String) {
        if index > 0 {
            out.push_str(self.item_sep);
        }
        if let Some(indent) = &self.opts.indent {
            out.push('\n');
            out.push_str(&indent.repeat(depth));
        }
    }

    fn close(&self, depth: usize, out: &mut String) {
        if let Some(indent) = &self.opts.indent {
            out.push('\n');
            out.push_str(&indent.repeat(depth));
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{08}' => out.push_str("\\b"),
                '\u{0c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c if self.opts.ensure_ascii && !c.is_ascii() => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn default_is_python_spacing_without_html_escaping() {
        let v = json!({"b": 1, "a": [1.0, true, null, "x<y>&'\"é\n\u{1}"], "c": {}});
        assert_eq!(
            dumps(&v, &DumpsOptions::default()),
            r#"{"b": 1, "a": [1.0, true, null, "x<y>&'\"é\n\u0001"], "c": {}}"#
        );
    }

    #[test]
    fn options_follow_python() {
        let v = json!({"b": [1, 2], "a": "é😀"});
        let o = DumpsOptions {
            ensure_ascii: true,
            sort_keys: true,
            ..Default::default()
        };
        assert_eq!(dumps(&v, &o), r#"{"a": "\u00e9\ud83d\ude00", "b": [1, 2]}"#);
        let o = DumpsOptions {
            indent: Some("  ".into()),
            ..Default::default()
        };
        assert_eq!(
            dumps(&v, &o),
            "{\n  \"b\": [\n    1,\n    2\n  ],\n  \"a\": \"é😀\"\n}"
        );
        let o = DumpsOptions {
            separators: Some((",".into(), ":".into())),
            ..Default::default()
        };
        assert_eq!(dumps(&v, &o), r#"{"b":[1,2],"a":"é😀"}"#);
    }
}
