//! A tool parameter's schema as the call's typing and the guided call grammar both read it.
//!
//! The M2 template writes a string value verbatim and any other value as JSON, so a
//! parameter's raw text has two possible forms: text (the string members of its schema) and
//! JSON (the rest). [`ParamForm`] splits a schema into those two parts; the grammar admits
//! exactly their union and [`super::typing`] reads the text back the same way. Schemas are
//! read after [`resolve`] (a `$ref` into the tool's own document, a one-schema `allOf`) and
//! [`fold_nullable`] (OpenAPI's `nullable`, which JSON Schema validators do not know).

use serde_json::{Map, Value as Json};

/// Deepest chain of `$ref` / `allOf` a parameter's schema is followed through.
const MAX_RESOLVE: usize = 16;

/// Most schemas [`ParamForm::of`] reads for one parameter (its `anyOf` alternatives, nested).
const MAX_FORM_SCHEMAS: usize = 256;

/// Rewrites OpenAPI's `nullable: true` everywhere in `schema` as the JSON Schema it means
/// (`null` added to `type`, or to `enum`), so validators and the grammar agree on it.
pub fn fold_nullable(schema: &mut Json) {
    match schema {
        Json::Object(o) => {
            if o.get("nullable") == Some(&Json::Bool(true)) {
                o.remove("nullable");
                match o.get_mut("type") {
                    Some(Json::String(t)) => {
                        let t = std::mem::take(t);
                        o.insert("type".into(), Json::Array(vec![Json::String(t), "null".into()]));
                    }
                    Some(Json::Array(ts)) if !ts.iter().any(|t| t == "null") => ts.push("null".into()),
                    _ => {}
                }
                if let Some(Json::Array(members)) = o.get_mut("enum")
                    && !members.contains(&Json::Null)
                {
                    members.push(Json::Null);
                }
            }
            o.values_mut().for_each(fold_nullable);
        }
        Json::Array(a) => a.iter_mut().for_each(fold_nullable),
        _ => {}
    }
}

/// `schema` with a top-level `$ref` into `root` (a JSON pointer such as `#/$defs/Color`) or a
/// one-schema `allOf` replaced by what it stands for (the keywords beside an `allOf` kept).
/// Left as it is where a reference does not resolve.
pub fn resolve(schema: &Json, root: &Json) -> Json {
    let mut budget = MAX_RESOLVE;
    resolve_within(schema, root, &mut budget)
}

/// [`resolve`] with the steps left to take, shared with the `allOf`s it resolves inside (a
/// fresh budget for each would let `{"allOf": [{"$ref": <itself>}]}` recurse for ever).
fn resolve_within(schema: &Json, root: &Json, budget: &mut usize) -> Json {
    let mut s = schema.clone();
    while *budget > 0 {
        *budget -= 1;
        let Some(o) = s.as_object() else { return s };
        if let Some(r) = o.get("$ref").and_then(Json::as_str) {
            match r.strip_prefix('#').and_then(|p| if p.is_empty() { Some(root) } else { root.pointer(p) }) {
                Some(target) => s = target.clone(),
                None => return s,
            }
        } else if let Some(Json::Array(all)) = o.get("allOf")
            && all.len() == 1
        {
            let mut merged: Map<String, Json> = o.iter().filter(|(k, _)| *k != "allOf").map(|(k, v)| (k.clone(), v.clone())).collect();
            let inner = resolve_within(&all[0], root, budget);
            if let Json::Object(i) = inner {
                for (k, v) in i {
                    merged.entry(k).or_insert(v);
                }
            }
            s = Json::Object(merged);
        } else {
            return s;
        }
    }
    s
}

/// The text half of a parameter's form.
#[derive(Debug, Clone, PartialEq)]
pub enum TextForm {
    /// Any text.
    Any,
    /// One of these texts, verbatim (an `enum` / `const`: strings as they are, other members
    /// as their JSON).
    Literals(Vec<String>),
    /// A string of this schema (its `pattern`, `format`, `minLength`, `maxLength`).
    String(Map<String, Json>),
}

/// How a parameter's raw text may be written: verbatim text, JSON, or either.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamForm {
    /// Text read as a string (or, for literals, as the member it spells).
    pub text: Option<TextForm>,
    /// A schema of the values written as JSON: the parameter's schema without its strings.
    pub json: Option<Json>,
}

impl ParamForm {
    /// Reads a resolved parameter schema (see [`resolve`]; `root` resolves the alternatives
    /// of an `anyOf`).
    pub fn of(schema: &Json, root: &Json) -> ParamForm {
        let mut budget = MAX_FORM_SCHEMAS;
        Self::of_within(schema, root, &mut budget)
    }

    /// [`ParamForm::of`] reading at most `budget` schemas in all: an `anyOf` may refer back to
    /// itself (`{"anyOf": [{"$ref": <itself>}]}`) or fan out; past the budget, any text.
    fn of_within(schema: &Json, root: &Json, budget: &mut usize) -> ParamForm {
        let any = ParamForm { text: Some(TextForm::Any), json: None };
        if *budget == 0 {
            return any;
        }
        *budget -= 1;
        let Some(o) = schema.as_object() else { return any };
        let members: Option<Vec<&Json>> = match (o.get("enum"), o.get("const")) {
            (Some(Json::Array(a)), _) => Some(a.iter().collect()),
            (None, Some(v)) => Some(vec![v]),
            _ => None,
        };
        if let Some(m) = members {
            let texts: Vec<String> = m.iter().map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_string)).collect();
            return ParamForm { text: (!texts.is_empty()).then_some(TextForm::Literals(texts)), json: None };
        }
        match o.get("type") {
            Some(Json::String(t)) if t == "string" => ParamForm { text: Some(TextForm::String(o.clone())), json: None },
            Some(Json::Array(ts)) if ts.iter().any(|t| t == "string") => {
                let rest: Vec<Json> = ts.iter().filter(|t| *t != "string").cloned().collect();
                let json = (!rest.is_empty()).then(|| {
                    let mut j = o.clone();
                    j.insert("type".into(), Json::Array(rest));
                    Json::Object(j)
                });
                ParamForm { text: Some(TextForm::String(o.clone())), json }
            }
            Some(_) => ParamForm { text: None, json: Some(schema.clone()) },
            None if o.contains_key("properties") || o.contains_key("items") => ParamForm { text: None, json: Some(schema.clone()) },
            None => match o.get("anyOf").or_else(|| o.get("oneOf")).and_then(Json::as_array) {
                Some(alts) => Self::union(alts.iter().map(|a| Self::of_within(&resolve(a, root), root, budget))),
                None => any,
            },
        }
    }

    /// The form of "any of" several: literals stay literals; any other mix of texts is any
    /// text (typing and validation then judge it); the JSON halves become one `anyOf`.
    fn union(forms: impl Iterator<Item = ParamForm>) -> ParamForm {
        let mut text: Option<TextForm> = None;
        let mut json = Vec::new();
        for f in forms {
            text = match (text, f.text) {
                (t, None) => t,
                (None, t) => t,
                (Some(TextForm::Literals(mut a)), Some(TextForm::Literals(b))) => {
                    a.extend(b.into_iter());
                    Some(TextForm::Literals(a))
                }
                _ => Some(TextForm::Any),
            };
            json.extend(f.json);
        }
        let json = match json.len() {
            0 => None,
            1 => json.pop(),
            _ => Some(serde_json::json!({ "anyOf": json })),
        };
        ParamForm { text, json }
    }

    /// Whether the raw text is only ever JSON (no verbatim text), so a closing tag inside one
    /// of its JSON strings belongs to the value.
    pub fn json_only(&self) -> bool {
        self.text.is_none()
    }
}

/// Whether `text`, read as the start of a JSON value, ends inside a string literal.
pub fn ends_inside_json_string(text: &str) -> bool {
    let mut inside = false;
    let mut escaped = false;
    for b in text.bytes() {
        if inside {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => inside = false,
                _ => {}
            }
        } else if b == b'"' {
            inside = true;
        }
    }
    inside
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn nullable_folds_into_type_and_enum_everywhere() {
        let mut s = json!({"type": "object", "properties": {
            "a": {"type": "integer", "nullable": true},
            "b": {"type": ["string", "integer"], "nullable": true},
            "c": {"enum": ["x"], "nullable": true},
            "d": {"type": "integer", "nullable": false},
        }, "$defs": {"e": {"type": "boolean", "nullable": true}}});
        fold_nullable(&mut s);
        assert_eq!(s["properties"]["a"], json!({"type": ["integer", "null"]}));
        assert_eq!(s["properties"]["b"], json!({"type": ["string", "integer", "null"]}));
        assert_eq!(s["properties"]["c"], json!({"enum": ["x", null]}));
        assert_eq!(s["properties"]["d"], json!({"type": "integer", "nullable": false}));
        assert_eq!(s["$defs"]["e"], json!({"type": ["boolean", "null"]}));
    }

    #[test]
    fn references_and_single_all_of_resolve() {
        let root = json!({"$defs": {"Color": {"enum": ["red", "green"]}, "Alias": {"$ref": "#/$defs/Color"}}});
        assert_eq!(resolve(&json!({"$ref": "#/$defs/Alias"}), &root), json!({"enum": ["red", "green"]}));
        assert_eq!(
            resolve(&json!({"allOf": [{"$ref": "#/$defs/Color"}], "description": "d"}), &root),
            json!({"enum": ["red", "green"], "description": "d"})
        );
        // Unresolvable and self-referencing ones stop without looping.
        assert_eq!(resolve(&json!({"$ref": "#/$defs/Nope"}), &root), json!({"$ref": "#/$defs/Nope"}));
        let looped = json!({"$defs": {"a": {"$ref": "#/$defs/a"}}});
        assert_eq!(resolve(&json!({"$ref": "#/$defs/a"}), &looped), json!({"$ref": "#/$defs/a"}));
    }

    /// A one-schema `allOf` that refers back to itself, and an `anyOf` that does: both stop
    /// (they recursed until the stack overflowed, aborting the server, on a client's tool).
    #[test]
    fn self_referring_all_of_and_any_of_stop() {
        let root = json!({"type": "object", "properties": {"x": {"allOf": [{"$ref": "#/properties/x"}]}}});
        let _ = resolve(&root["properties"]["x"], &root);
        let root = json!({"type": "object", "properties": {"x": {"anyOf": [{"$ref": "#/properties/x"}, {"$ref": "#/properties/x"}]}}});
        let form = ParamForm::of(&resolve(&root["properties"]["x"], &root), &root);
        assert_eq!(form.text, Some(TextForm::Any));
    }

    #[test]
    fn forms_split_text_from_json() {
        let r = json!({});
        let f = |s: Json| ParamForm::of(&s, &r);
        assert_eq!(f(json!({"type": "string"})).text, Some(TextForm::String(json!({"type": "string"}).as_object().unwrap().clone())));
        assert_eq!(f(json!({"type": "integer"})), ParamForm { text: None, json: Some(json!({"type": "integer"})) });
        assert_eq!(f(json!({"enum": ["auto", 1, null]})), ParamForm { text: Some(TextForm::Literals(vec!["auto".into(), "1".into(), "null".into()])), json: None });
        let opt = f(json!({"anyOf": [{"enum": ["a", "b"], "type": "string"}, {"type": "null"}]}));
        assert_eq!(opt, ParamForm { text: Some(TextForm::Literals(vec!["a".into(), "b".into()])), json: Some(json!({"type": "null"})) });
        let mixed = f(json!({"type": ["string", "array"], "items": {"type": "integer"}}));
        assert_eq!(mixed.json, Some(json!({"type": ["array"], "items": {"type": "integer"}})));
        assert!(!mixed.json_only() && f(json!({"type": "array"})).json_only());
        assert_eq!(f(json!({"description": "anything"})).text, Some(TextForm::Any));
    }

    #[test]
    fn json_string_ends_are_found_past_escapes() {
        assert!(ends_inside_json_string(r#"["a"#));
        assert!(!ends_inside_json_string(r#"["a"]"#));
        assert!(ends_inside_json_string(r#"["a\"b"#));
        assert!(ends_inside_json_string(r#"["a\\"#));
        assert!(!ends_inside_json_string(r#"["a\\"]"#));
        assert!(!ends_inside_json_string(r#"{"k": 1"#));
    }
}
