//! JSON Schema → [`Grammar`]: the subset of JSON Schema a structured-output request may use,
//! compiled into nodes the byte matcher ([`super::matcher`]) walks.
//!
//! Enforced: `type` (one or a list), `enum`, `const`, `properties`, `required`,
//! `additionalProperties` (bool or schema; JSON Schema's default `true`), `items`,
//! `prefixItems`, `minItems`, `maxItems`, `minLength`, `maxLength`, `anyOf` / `oneOf` (as
//! "any of"), `allOf` of one schema, `$ref` to `#`, `#/$defs/...` or `#/definitions/...`
//! (recursion allowed), `nullable` (OpenAPI), `pattern` and the `format`s `date-time`, `date`,
//! `time`, `uuid`, `email`, `hostname`, `ipv4`, `uri` (strings stepping an automaton,
//! [`super::regex`]), `minimum` / `maximum` / `exclusive*` on integers. Accepted and not
//! enforced (the value still has the right type): other formats, bounds on non-integer
//! numbers, `multipleOf`, `uniqueItems`, `minProperties` / `maxProperties`. Refused with an error naming the keyword
//! and its place: `not`, `if` / `then` / `else`, `patternProperties`, `allOf` of several,
//! `dependentSchemas`, `dependentRequired`, `unevaluatedProperties`, `propertyNames`, and
//! schemas no value satisfies (`false`, an empty `enum`).

use std::collections::HashMap;

use serde_json::Value as Json;

use super::regex::{self, Dfa};
use crate::text::toolcall::param_schema::{ParamForm, TextForm, resolve};
use crate::text::toolcall::writable_name;

/// Index of a node in [`Grammar::nodes`].
pub type NodeId = u32;

/// Most declared properties one object schema may have (the matcher keeps a 64-bit set).
pub const MAX_PROPERTIES: usize = 64;
/// Most nodes a compiled schema may have.
const MAX_NODES: usize = 20_000;
/// Deepest nesting of schemas while compiling (references included), well within a thread's
/// stack.
const MAX_NESTING: u32 = 128;
/// Keywords that constrain a value (not annotations).
const CONSTRAINING: &[&str] = &[
    "type", "enum", "const", "properties", "required", "additionalProperties", "items", "prefixItems",
    "minItems", "maxItems", "minLength", "maxLength", "nullable", "pattern", "format", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum",
];

/// A byte trie over a fixed set of strings (literal JSON texts, or object keys).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ByteTrie {
    pub nodes: Vec<TrieNode>,
}

/// One trie node: its edges, whether a string ends here (with that string's index), and the
/// set of string indices reachable from it (first 64; used to skip keys already written).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TrieNode {
    pub edges: Vec<(u8, u32)>,
    pub end: Option<u32>,
    pub below: u64,
}

impl ByteTrie {
    fn build(strings: &[Vec<u8>]) -> Self {
        let mut t = ByteTrie { nodes: vec![TrieNode::default()] };
        for (i, s) in strings.iter().enumerate() {
            let bit = if i < 64 { 1u64 << i } else { 0 };
            let mut at = 0usize;
            t.nodes[0].below |= bit;
            for &b in s {
                let next = match t.nodes[at].edges.iter().find(|e| e.0 == b) {
                    Some(&(_, n)) => n as usize,
                    None => {
                        t.nodes.push(TrieNode::default());
                        let n = t.nodes.len() - 1;
                        t.nodes[at].edges.push((b, n as u32));
                        n
                    }
                };
                at = next;
                t.nodes[at].below |= bit;
            }
            if t.nodes[at].end.is_none() {
                t.nodes[at].end = Some(i as u32);
            }
        }
        t
    }

    /// The node reached from `at` by byte `b`.
    pub fn next(&self, at: u32, b: u8) -> Option<u32> {
        self.nodes[at as usize].edges.iter().find(|e| e.0 == b).map(|e| e.1)
    }
}

/// What a value at some place of the document may be.
#[derive(Debug, Clone, PartialEq)]
pub enum Node {
    /// One of a fixed set of JSON texts (`enum`, `const`, `null`, `true` / `false`): a trie
    /// index into [`Grammar::lits`].
    Lit(u32),
    /// A JSON number with no bounds.
    Number,
    /// A JSON integer in `lo..=hi` (`minimum` / `maximum` / `exclusive*` on an integer;
    /// i64's range when it has none).
    Int { lo: i64, hi: i64 },
    /// A JSON number in `lo..=hi` units of 10^-15 (`minimum` / `maximum` / `exclusive*` on a
    /// number), written as a plain decimal of at most `matcher::DEC_DIGITS` digits.
    Decimal { lo: i128, hi: i128 },
    /// A JSON string of `min..=max` characters.
    String { min: u32, max: u32 },
    /// A JSON array: element `i` matches `prefix[i]`, later ones `items` (`None`: no more).
    Array { prefix: Vec<NodeId>, items: Option<NodeId>, min: u32, max: u32 },
    /// A JSON object: declared properties (key trie [`Grammar::keys`] index, their schemas in
    /// key order), the required ones as a bit set, the schema of other keys (`None`: none
    /// allowed), and the optional ones that can never be written (no finite value).
    Object { keys: u32, props: Vec<NodeId>, required: u64, additional: Option<NodeId>, banned: u64 },
    /// Any of these.
    AnyOf(Vec<NodeId>),
    /// These one after the other (`tight`: no whitespace before any of them).
    Chain { items: Vec<NodeId>, tight: bool },
    /// A string whose characters step an automaton ([`Grammar::dfas`]): `pattern`, `format`
    /// and length bounds together.
    Pattern(u32),
    /// Any text up to and including the first occurrence of [`Grammar::texts`]`[i]` (a tag whose
    /// first byte occurs nowhere else in it).
    Raw(u32),
    /// Raw text (a tool-call parameter's string, written verbatim) whose characters step an
    /// automaton ([`Grammar::dfas`]) that never takes `<`, so the closing tag after it is
    /// never part of it: a string parameter's `pattern` / `format`.
    RawPattern(u32),
    /// A tool-call block's body: invokes of the tools named in key trie `names` (bodies in name
    /// order), at most `max`, at least one; `tags` (a [`Grammar::tags`] index) holds the invoke's
    /// opening tag (string 0) and the block's closing tag (string 1).
    Calls { names: u32, bodies: Vec<NodeId>, tags: u32, max: u32 },
    /// An invoke's parameters: declared ones (key trie `keys`, value nodes in key order), the
    /// required ones, the value of other names (`None`: none allowed); `tags`: the parameter's
    /// opening tag (string 0) and the invoke's closing tag (string 1).
    Params { keys: u32, values: Vec<NodeId>, required: u64, free: Option<NodeId>, tags: u32 },
}

/// A compiled schema.
#[derive(Debug, Clone, PartialEq)]
pub struct Grammar {
    pub nodes: Vec<Node>,
    pub lits: Vec<ByteTrie>,
    pub keys: Vec<ByteTrie>,
    /// Tries of tag alternatives (tool calls).
    pub tags: Vec<ByteTrie>,
    /// Closing tags of raw text (tool calls).
    pub texts: Vec<Vec<u8>>,
    /// Automata of strings with a `pattern` or `format` ([`Node::Pattern`]).
    pub dfas: Vec<Dfa>,
    pub root: NodeId,
}

/// Why a schema cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{path}: {why}")]
pub struct SchemaError {
    /// JSON-pointer-like place in the schema (`#/properties/items/items`).
    pub path: String,
    pub why: String,
}

/// No upper bound.
pub const UNBOUNDED: u32 = u32::MAX;

const IGNORED: &[&str] = &[
    "$schema", "$id", "$comment", "title", "description", "default", "examples",
    "multipleOf", "uniqueItems",
    "minProperties", "maxProperties", "readOnly", "writeOnly", "deprecated", "contentEncoding",
    "contentMediaType", "discriminator", "strict", "name", "$defs", "definitions", "additionalItems",
    "contains", "minContains", "maxContains",
];
const REFUSED: &[&str] = &[
    "not", "if", "then", "else", "patternProperties", "dependentSchemas", "dependentRequired",
    "unevaluatedProperties", "unevaluatedItems", "propertyNames", "$dynamicRef", "$recursiveRef",
];
const KNOWN: &[&str] = &[
    "type", "enum", "const", "properties", "required", "additionalProperties", "items", "prefixItems",
    "minItems", "maxItems", "minLength", "maxLength", "anyOf", "oneOf", "allOf", "$ref", "nullable",
    "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
];

impl Grammar {
    /// Any JSON value at all (`{"type": "json_object"}` uses [`Grammar::any_object`]).
    pub fn any_value() -> Self {
        let mut c = Compiler::new(&Json::Null);
        let root = c.any();
        c.finish(root)
    }

    /// Any JSON object (OpenAI's `json_object` response format).
    pub fn any_object() -> Self {
        let mut c = Compiler::new(&Json::Null);
        let any = c.any();
        let keys = c.key_trie(&[]);
        let root = c.push(Node::Object { keys, props: vec![], required: 0, additional: Some(any), banned: 0 });
        c.finish(root)
    }

    /// Compiles a JSON Schema document.
    pub fn from_schema(schema: &Json) -> Result<Self, SchemaError> {
        let mut c = Compiler::new(schema);
        let root = c.compile(schema, "#")?;
        let mut g = c.finish(root);
        g.normalize()?;
        Ok(g)
    }

    /// Makes every state the matcher can reach completable, and its walks finite:
    /// - alternatives that lead back to themselves without writing anything (a `$ref` cycle
    ///   through `anyOf`) add nothing to the language but would loop the matcher: dropped;
    /// - what can never be completed (a schema that requires itself, an empty `anyOf`) is cut
    ///   from where it is optional (an alternative, an optional property, more array items);
    /// - a root that can never be completed is an error.
    fn normalize(&mut self) -> Result<(), SchemaError> {
        let n = self.nodes.len();
        // Back edges among alternatives, by an iterative depth-first search.
        let mut color = vec![0u8; n];
        for start in 0..n {
            if color[start] != 0 {
                continue;
            }
            color[start] = 1;
            let mut stack: Vec<(usize, usize)> = vec![(start, 0)];
            while let Some(&(v, i)) = stack.last() {
                let next = match &self.nodes[v] {
                    Node::AnyOf(a) => a.get(i).map(|&w| w as usize),
                    _ => None,
                };
                let Some(w) = next else {
                    color[v] = 2;
                    stack.pop();
                    continue;
                };
                match color[w] {
                    1 => {
                        if let Node::AnyOf(a) = &mut self.nodes[v] {
                            a.remove(i);
                        }
                    }
                    0 => {
                        stack.last_mut().expect("a frame").1 += 1;
                        color[w] = 1;
                        stack.push((w, 0));
                    }
                    _ => stack.last_mut().expect("a frame").1 += 1,
                }
            }
        }
        // Which nodes some finite value completes (a least fixed point).
        let mut ok = vec![false; n];
        loop {
            let mut changed = false;
            for i in 0..n {
                if ok[i] {
                    continue;
                }
                let sat = match &self.nodes[i] {
                    Node::Lit(_) | Node::Number | Node::Int { .. } | Node::Decimal { .. } | Node::String { .. } | Node::Pattern(_) | Node::Raw(_) | Node::RawPattern(_) => true,
                    Node::Array { prefix, items, min, .. } => {
                        let need = *min as usize;
                        prefix.iter().take(need).all(|&p| ok[p as usize]) && (need <= prefix.len() || items.is_some_and(|it| ok[it as usize]))
                    }
                    Node::Object { props, required, .. } => {
                        props.iter().enumerate().all(|(k, &p)| required & (1 << k) == 0 || ok[p as usize])
                    }
                    Node::AnyOf(alts) => alts.iter().any(|&a| ok[a as usize]),
                    Node::Chain { items, .. } => items.iter().all(|&a| ok[a as usize]),
                    Node::Calls { bodies, max, .. } => *max > 0 && bodies.iter().any(|&a| ok[a as usize]),
                    Node::Params { values, required, .. } => {
                        values.iter().enumerate().all(|(k, &p)| required & (1 << k) == 0 || ok[p as usize])
                    }
                };
                if sat {
                    ok[i] = true;
                    changed = true;
                }
            }
            if !changed {
                break;
            }
        }
        if !ok[self.root as usize] {
            return Err(SchemaError { path: "#".into(), why: "no finite JSON value satisfies this schema".into() });
        }
        // Cut what can never be completed from where it is optional.
        for node in &mut self.nodes {
            match node {
                Node::AnyOf(alts) => alts.retain(|&a| ok[a as usize]),
                Node::Object { props, additional, banned, .. } => {
                    for (k, &p) in props.iter().enumerate() {
                        if !ok[p as usize] {
                            *banned |= 1 << k;
                        }
                    }
                    if additional.is_some_and(|a| !ok[a as usize]) {
                        *additional = None;
                    }
                }
                Node::Array { prefix, items, max, .. } => {
                    if items.is_some_and(|it| !ok[it as usize]) {
                        *items = None;
                    }
                    if let Some(cut) = prefix.iter().position(|&p| !ok[p as usize]) {
                        prefix.truncate(cut);
                        *max = (*max).min(cut as u32);
                    }
                    if items.is_none() {
                        *max = (*max).min(prefix.len() as u32);
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }
}

struct Compiler<'a> {
    doc: &'a Json,
    nodes: Vec<Node>,
    lits: Vec<ByteTrie>,
    keys: Vec<ByteTrie>,
    tags: Vec<ByteTrie>,
    texts: Vec<Vec<u8>>,
    dfas: Vec<Dfa>,
    refs: HashMap<String, NodeId>,
    any: Option<NodeId>,
    /// Schemas being compiled, one inside the other (references included).
    depth: u32,
}

impl<'a> Compiler<'a> {
    fn new(doc: &'a Json) -> Self {
        Compiler { doc, nodes: Vec::new(), lits: Vec::new(), keys: Vec::new(), tags: Vec::new(), texts: Vec::new(), dfas: Vec::new(), refs: HashMap::new(), any: None, depth: 0 }
    }

    fn finish(self, root: NodeId) -> Grammar {
        Grammar { nodes: self.nodes, lits: self.lits, keys: self.keys, tags: self.tags, texts: self.texts, dfas: self.dfas, root }
    }

    fn push(&mut self, n: Node) -> NodeId {
        self.nodes.push(n);
        (self.nodes.len() - 1) as NodeId
    }

    fn lit(&mut self, texts: &[Vec<u8>]) -> NodeId {
        self.lits.push(ByteTrie::build(texts));
        let i = (self.lits.len() - 1) as u32;
        self.push(Node::Lit(i))
    }

    fn key_trie(&mut self, keys: &[Vec<u8>]) -> u32 {
        self.keys.push(ByteTrie::build(keys));
        (self.keys.len() - 1) as u32
    }

    /// The node of "any JSON value" (built once; it refers to itself).
    fn any(&mut self) -> NodeId {
        if let Some(a) = self.any {
            return a;
        }
        let any = self.push(Node::AnyOf(Vec::new()));
        self.any = Some(any);
        let lit = self.lit(&[b"null".to_vec(), b"true".to_vec(), b"false".to_vec()]);
        let num = self.push(Node::Number);
        let s = self.push(Node::String { min: 0, max: UNBOUNDED });
        let arr = self.push(Node::Array { prefix: vec![], items: Some(any), min: 0, max: UNBOUNDED });
        let keys = self.key_trie(&[]);
        let obj = self.push(Node::Object { keys, props: vec![], required: 0, additional: Some(any), banned: 0 });
        self.nodes[any as usize] = Node::AnyOf(vec![lit, num, s, arr, obj]);
        any
    }

    fn err(path: &str, why: impl Into<String>) -> SchemaError {
        SchemaError { path: path.to_string(), why: why.into() }
    }

    fn compile(&mut self, s: &Json, path: &str) -> Result<NodeId, SchemaError> {
        if self.nodes.len() > MAX_NODES {
            return Err(Self::err(path, format!("the schema is too large (more than {MAX_NODES} nodes)")));
        }
        if self.depth >= MAX_NESTING {
            return Err(Self::err(path, format!("schemas nest too deep (more than {MAX_NESTING} levels, references included)")));
        }
        self.depth += 1;
        let r = self.compile_nested(s, path);
        self.depth -= 1;
        r
    }

    fn compile_nested(&mut self, s: &Json, path: &str) -> Result<NodeId, SchemaError> {
        let obj = match s {
            Json::Bool(true) => return Ok(self.any()),
            Json::Bool(false) => return Err(Self::err(path, "the schema `false` admits no value")),
            Json::Object(o) => o,
            other => return Err(Self::err(path, format!("a schema must be an object or a boolean, got {other}"))),
        };
        for k in obj.keys() {
            if REFUSED.contains(&k.as_str()) {
                return Err(Self::err(&format!("{path}/{k}"), "this keyword is not supported in structured outputs"));
            }
            if !KNOWN.contains(&k.as_str()) && !IGNORED.contains(&k.as_str()) && !k.starts_with("x-") {
                tracing::debug!(keyword = %k, path, "structured outputs: unknown schema keyword ignored");
            }
        }
        let siblings: Vec<&str> = obj.keys().map(String::as_str).filter(|k| CONSTRAINING.contains(k)).collect();
        if let Some(r) = obj.get("$ref") {
            if !siblings.is_empty() {
                return Err(Self::err(&format!("{path}/$ref"), format!("keywords beside $ref ({}) are not supported; put them in the referenced schema", siblings.join(", "))));
            }
            let r = r.as_str().ok_or_else(|| Self::err(&format!("{path}/$ref"), "must be a string"))?;
            return self.reference(r, &format!("{path}/$ref"));
        }
        if let Some(all) = obj.get("allOf") {
            let list = all.as_array().ok_or_else(|| Self::err(&format!("{path}/allOf"), "must be an array"))?;
            if list.len() != 1 {
                return Err(Self::err(&format!("{path}/allOf"), "allOf is supported with exactly one schema"));
            }
            // Constraining keywords beside it hold too (annotations, pydantic's style, do not
            // matter).
            let inner = merged(obj, &list[0], &format!("{path}/allOf/0"))?;
            return self.compile(&inner, &format!("{path}/allOf/0"));
        }
        let base = self.compile_plain(obj, path)?;
        if obj.get("nullable").and_then(Json::as_bool) == Some(true) {
            let null = self.lit(&[b"null".to_vec()]);
            return Ok(self.push(Node::AnyOf(vec![base, null])));
        }
        Ok(base)
    }

    fn reference(&mut self, r: &str, path: &str) -> Result<NodeId, SchemaError> {
        if let Some(&n) = self.refs.get(r) {
            return Ok(n);
        }
        let target = if r == "#" {
            self.doc
        } else if let Some(ptr) = r.strip_prefix('#') {
            self.doc.pointer(ptr).ok_or_else(|| Self::err(path, format!("reference {r} does not resolve in this schema")))?
        } else {
            return Err(Self::err(path, format!("only local references (#/...) are supported, got {r}")));
        };
        // A placeholder first, so recursive references end here.
        let slot = self.push(Node::AnyOf(Vec::new()));
        self.refs.insert(r.to_string(), slot);
        let body = self.compile(target, r)?;
        self.nodes[slot as usize] = Node::AnyOf(vec![body]);
        Ok(slot)
    }

    fn compile_plain(&mut self, obj: &serde_json::Map<String, Json>, path: &str) -> Result<NodeId, SchemaError> {
        if let Some(c) = obj.get("const") {
            if members_fitting(obj, std::slice::from_ref(c), path)?.is_empty() {
                return Err(Self::err(&format!("{path}/const"), "the constant does not satisfy the schema's other keywords"));
            }
            return Ok(self.lit(&[compact(c)]));
        }
        if let Some(e) = obj.get("enum") {
            let list = e.as_array().ok_or_else(|| Self::err(&format!("{path}/enum"), "must be an array"))?;
            let list = members_fitting(obj, list, path)?;
            if list.is_empty() {
                return Err(Self::err(&format!("{path}/enum"), "no member of this enum satisfies the schema's other keywords"));
            }
            let texts: Vec<Vec<u8>> = list.iter().map(|v| compact(v)).collect();
            return Ok(self.lit(&texts));
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(a) = obj.get(key) {
                let list = a.as_array().ok_or_else(|| Self::err(&format!("{path}/{key}"), "must be an array"))?;
                if list.is_empty() {
                    return Err(Self::err(&format!("{path}/{key}"), "must not be empty"));
                }
                let mut alts = Vec::new();
                for (i, s) in list.iter().enumerate() {
                    // Constraining keywords beside anyOf hold in every alternative.
                    let p = format!("{path}/{key}/{i}");
                    let alt = merged(obj, s, &p)?;
                    alts.push(self.compile(&alt, &p)?);
                }
                return Ok(self.push(Node::AnyOf(alts)));
            }
        }
        let types: Vec<String> = match obj.get("type") {
            None => {
                // No type: infer from the keywords present, else any value.
                if obj.contains_key("properties") || obj.contains_key("additionalProperties") || obj.contains_key("required") {
                    vec!["object".into()]
                } else if obj.contains_key("items") || obj.contains_key("prefixItems") {
                    vec!["array".into()]
                } else if ["pattern", "format", "minLength", "maxLength"].iter().any(|k| obj.contains_key(*k)) {
                    // String keywords with no type: only strings (a subset of what the schema
                    // admits, so what is written always satisfies it).
                    vec!["string".into()]
                } else if ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"].iter().any(|k| obj.contains_key(*k)) {
                    // Likewise bounds: only numbers.
                    vec!["number".into()]
                } else {
                    return Ok(self.any());
                }
            }
            Some(Json::String(t)) => vec![t.clone()],
            Some(Json::Array(ts)) => {
                let mut v = Vec::new();
                for t in ts {
                    v.push(t.as_str().ok_or_else(|| Self::err(&format!("{path}/type"), "must be a string or an array of strings"))?.to_string());
                }
                if v.is_empty() {
                    return Err(Self::err(&format!("{path}/type"), "an empty list of types admits no value"));
                }
                v
            }
            Some(_) => return Err(Self::err(&format!("{path}/type"), "must be a string or an array of strings")),
        };
        let mut alts = Vec::new();
        for t in &types {
            alts.push(self.typed(t, obj, path)?);
        }
        Ok(if alts.len() == 1 { alts[0] } else { self.push(Node::AnyOf(alts)) })
    }

    fn typed(&mut self, t: &str, obj: &serde_json::Map<String, Json>, path: &str) -> Result<NodeId, SchemaError> {
        let count = |k: &str| -> Result<Option<u32>, SchemaError> {
            match obj.get(k) {
                None => Ok(None),
                Some(v) => v
                    .as_u64()
                    .map(|n| Some(n.min(UNBOUNDED as u64 - 1) as u32))
                    .ok_or_else(|| Self::err(&format!("{path}/{k}"), "must be a non-negative integer")),
            }
        };
        Ok(match t {
            "null" => self.lit(&[b"null".to_vec()]),
            "boolean" => self.lit(&[b"true".to_vec(), b"false".to_vec()]),
            "number" => match dec_bounds(obj, path)? {
                Some((lo, hi)) => self.push(Node::Decimal { lo, hi }),
                None => self.push(Node::Number),
            },
            // An integer with no bounds still stays within i64: a longer run of digits is
            // noise from the model, and clients would read it back as an inexact float.
            "integer" => {
                let (lo, hi) = int_bounds(obj, path)?.unwrap_or((i64::MIN, i64::MAX));
                self.push(Node::Int { lo, hi })
            }
            "string" => {
                let (min, max) = (count("minLength")?.unwrap_or(0), count("maxLength")?.unwrap_or(UNBOUNDED));
                if min > max {
                    return Err(Self::err(path, format!("minLength {min} > maxLength {max}")));
                }
                match Self::string_automaton(obj, min, max, path)? {
                    Some(d) => {
                        self.dfas.push(d);
                        let i = (self.dfas.len() - 1) as u32;
                        self.push(Node::Pattern(i))
                    }
                    None => self.push(Node::String { min, max }),
                }
            }
            "array" => {
                let (min, max) = (count("minItems")?.unwrap_or(0), count("maxItems")?.unwrap_or(UNBOUNDED));
                if min > max {
                    return Err(Self::err(path, format!("minItems {min} > maxItems {max}")));
                }
                let mut prefix = Vec::new();
                if let Some(p) = obj.get("prefixItems") {
                    let list = p.as_array().ok_or_else(|| Self::err(&format!("{path}/prefixItems"), "must be an array"))?;
                    for (i, s) in list.iter().enumerate() {
                        prefix.push(self.compile(s, &format!("{path}/prefixItems/{i}"))?);
                    }
                }
                let items = match obj.get("items") {
                    None => Some(self.any()),
                    Some(Json::Bool(false)) => None,
                    Some(s) => Some(self.compile(s, &format!("{path}/items"))?),
                };
                if items.is_none() && (min as usize) > prefix.len() {
                    return Err(Self::err(path, format!("minItems {min} needs more items than prefixItems allows")));
                }
                self.push(Node::Array { prefix, items, min, max })
            }
            "object" => self.object(obj, path)?,
            other => return Err(Self::err(&format!("{path}/type"), format!("unknown type {other:?}"))),
        })
    }

    /// The automaton of a string's `pattern`, known `format` and length bounds together, or
    /// `None` when it has neither (the plain string node counts lengths itself).
    fn string_automaton(obj: &serde_json::Map<String, Json>, min: u32, max: u32, path: &str) -> Result<Option<Dfa>, SchemaError> {
        let text = |k: &str| -> Result<Option<&str>, SchemaError> {
            obj.get(k).map(|v| v.as_str().ok_or_else(|| Self::err(&format!("{path}/{k}"), "must be a string"))).transpose()
        };
        let pattern = text("pattern")?;
        let format = text("format")?.and_then(regex::format_pattern);
        let mut parts = Vec::new();
        if let Some(p) = pattern {
            parts.push(Dfa::from_pattern(p).map_err(|e| Self::err(&format!("{path}/pattern"), e))?);
        }
        if let Some(f) = format {
            parts.push(Dfa::from_pattern(f).map_err(|e| Self::err(&format!("{path}/format"), e))?);
        }
        if parts.is_empty() {
            return Ok(None);
        }
        if min > 0 || max != UNBOUNDED {
            parts.push(Dfa::length(min, if max == UNBOUNDED { u32::MAX } else { max }).map_err(|e| Self::err(path, e))?);
        }
        let mut d = parts.remove(0);
        for p in &parts {
            d = d.intersect(p).map_err(|e| Self::err(path, e))?.ok_or_else(|| Self::err(path, "no string satisfies this pattern, format and length bounds together"))?;
        }
        Ok(Some(d))
    }

    fn object(&mut self, obj: &serde_json::Map<String, Json>, path: &str) -> Result<NodeId, SchemaError> {
        let mut names = Vec::new();
        let mut props = Vec::new();
        if let Some(p) = obj.get("properties") {
            let map = p.as_object().ok_or_else(|| Self::err(&format!("{path}/properties"), "must be an object"))?;
            if map.len() > MAX_PROPERTIES {
                return Err(Self::err(&format!("{path}/properties"), format!("at most {MAX_PROPERTIES} properties per object are supported, got {}", map.len())));
            }
            for (k, s) in map {
                names.push(k.clone());
                props.push(self.compile(s, &format!("{path}/properties/{k}"))?);
            }
        }
        let mut required = 0u64;
        if let Some(r) = obj.get("required") {
            let list = r.as_array().ok_or_else(|| Self::err(&format!("{path}/required"), "must be an array of property names"))?;
            for (i, k) in list.iter().enumerate() {
                let k = k.as_str().ok_or_else(|| Self::err(&format!("{path}/required/{i}"), "must be a string"))?;
                match names.iter().position(|n| n == k) {
                    Some(j) => required |= 1 << j,
                    None => {
                        return Err(Self::err(&format!("{path}/required/{i}"), format!("required property {k:?} is not in properties (declare its schema)")));
                    }
                }
            }
        }
        let additional = match obj.get("additionalProperties") {
            None | Some(Json::Bool(true)) => Some(self.any()),
            Some(Json::Bool(false)) => None,
            Some(s) => Some(self.compile(s, &format!("{path}/additionalProperties"))?),
        };
        // Keys are matched as the bytes a JSON encoder writes between the quotes.
        let texts: Vec<Vec<u8>> = names.iter().map(|k| {
            let s = serde_json::to_string(k).expect("a string serializes");
            s.as_bytes()[1..s.len() - 1].to_vec()
        }).collect();
        let keys = self.key_trie(&texts);
        Ok(self.push(Node::Object { keys, props, required, additional, banned: 0 }))
    }
}

/// The tags of a tool-call block (MiniMax-M2: `<minimax:tool_call>` … `</minimax:tool_call>`).
#[derive(Debug, Clone, Copy)]
pub struct CallTags<'a> {
    pub invoke_open: &'a str,
    pub invoke_close: &'a str,
    pub param_open: &'a str,
    pub param_close: &'a str,
    pub block_close: &'a str,
}

/// One tool as the call grammar needs it.
#[derive(Debug, Clone, Copy)]
pub struct CallTool<'a> {
    pub name: &'a str,
    /// Its `parameters` schema.
    pub parameters: &'a Json,
}

impl Grammar {
    /// The body of a tool-call block after its opening tag: 1..=`max` invokes of `tools`, each
    /// with its declared parameters (required ones present, none twice), then the block's
    /// closing tag. A parameter whose schema admits a string is raw text (the template writes
    /// strings verbatim); an enum of strings is one of them, verbatim; any other value is JSON
    /// its schema admits (any JSON value where the schema cannot be compiled). A tool that
    /// declares no properties and allows others takes any names with raw values.
    /// `None` when no call of any tool can be completed.
    pub fn tool_calls(tools: &[CallTool<'_>], tags: CallTags<'_>, max: u32) -> Option<Grammar> {
        let empty = Json::Null;
        let mut c = Compiler::new(&empty);
        c.texts.push(tags.param_close.as_bytes().to_vec());
        let raw = c.push(Node::Raw(0));
        let close_lit = c.lit(&[tags.param_close.as_bytes().to_vec()]);
        c.tags.push(ByteTrie::build(&[tags.param_open.as_bytes().to_vec(), tags.invoke_close.as_bytes().to_vec()]));
        let param_tags = (c.tags.len() - 1) as u32;
        c.tags.push(ByteTrie::build(&[tags.invoke_open.as_bytes().to_vec(), tags.block_close.as_bytes().to_vec()]));
        let call_tags = (c.tags.len() - 1) as u32;
        let mut bodies = Vec::new();
        let mut callable = Vec::new();
        'tools: for t in tools {
            c.doc = t.parameters;
            c.refs.clear();
            let props = t.parameters.get("properties").and_then(Json::as_object);
            let mut names = Vec::new();
            let mut values = Vec::new();
            for (k, ps) in props.into_iter().flatten().take(MAX_PROPERTIES) {
                if !writable_name(k) {
                    // The name cannot be written between the tag's quotes: a tool that
                    // requires it cannot be called, and an optional one is left out.
                    if required_names(t.parameters).any(|r| r == k) {
                        continue 'tools;
                    }
                    continue;
                }
                names.push(k.as_bytes().to_vec());
                let form = ParamForm::of(&resolve(ps, t.parameters), t.parameters);
                values.push(c.param_value(&form, raw, close_lit, tags.param_close));
            }
            let required = required_names(t.parameters).filter_map(|k| names.iter().position(|n| n == k.as_bytes())).fold(0u64, |m, i| m | (1 << i));
            let closed = t.parameters.get("additionalProperties") == Some(&Json::Bool(false));
            let free = (names.is_empty() && !closed).then_some(raw);
            let keys = c.key_trie(&names);
            bodies.push(c.push(Node::Params { keys, values, required, free, tags: param_tags }));
            callable.push(t.name.as_bytes().to_vec());
        }
        if callable.is_empty() {
            return None;
        }
        let names = c.key_trie(&callable);
        let root = c.push(Node::Calls { names, bodies, tags: call_tags, max: max.max(1) });
        let mut g = c.finish(root);
        g.normalize().ok()?;
        Some(g)
    }
}

impl Compiler<'_> {
    /// A parameter's value and its closing tag (`raw`: any text and the tag; `close`: the
    /// tag alone): the union of its form's text and JSON halves.
    fn param_value(&mut self, form: &ParamForm, raw: NodeId, close: NodeId, close_tag: &str) -> NodeId {
        let text = match &form.text {
            None => None,
            Some(TextForm::Any) => return raw,
            Some(TextForm::Literals(list)) => {
                let list: Vec<Vec<u8>> = list.iter().map(|t| t.as_bytes().to_vec()).collect();
                let lit = self.lit(&list);
                Some(self.push(Node::Chain { items: vec![lit, close], tight: true }))
            }
            Some(TextForm::String(o)) => match raw_automaton(o, close_tag) {
                Some(d) => {
                    self.dfas.push(d);
                    let t = self.push(Node::RawPattern((self.dfas.len() - 1) as u32));
                    Some(self.push(Node::Chain { items: vec![t, close], tight: true }))
                }
                None if form.json.is_none() => return raw,
                None => Some(raw),
            },
        };
        let json = form.json.as_ref().map(|j| {
            let n = self.compile(j, "#").unwrap_or_else(|_| self.any());
            self.push(Node::Chain { items: vec![n, close], tight: false })
        });
        match (text, json) {
            // Tight: verbatim text starts at the tag, so no whitespace before either half.
            (Some(a), Some(b)) => {
                let either = self.push(Node::AnyOf(vec![a, b]));
                self.push(Node::Chain { items: vec![either], tight: true })
            }
            (Some(a), None) | (None, Some(a)) => a,
            (None, None) => raw,
        }
    }
}

/// The automaton of a string parameter's raw text: its `pattern` / `format` / length bounds,
/// never holding the closing tag (the value ends at the first one). `None` (any text) when
/// it has none of them, when they do not compile, or when no string satisfies them.
fn raw_automaton(o: &serde_json::Map<String, Json>, close_tag: &str) -> Option<Dfa> {
    let count = |k: &str| o.get(k).and_then(Json::as_u64).map(|n| n.min(UNBOUNDED as u64 - 1) as u32);
    let (min, max) = (count("minLength").unwrap_or(0), count("maxLength").unwrap_or(UNBOUNDED));
    let d = match Compiler::string_automaton(o, min, max.max(min), "#").ok()? {
        Some(d) => d,
        None if min > 0 || max != UNBOUNDED => Dfa::length(min, if max == UNBOUNDED { u32::MAX } else { max.max(min) }).ok()?,
        None => return None,
    };
    d.intersect(&Dfa::without(close_tag)).ok()??.prune()
}

/// The names a tool's `parameters` lists as required.
fn required_names(parameters: &Json) -> impl Iterator<Item = &str> {
    parameters.get("required").and_then(Json::as_array).into_iter().flatten().filter_map(Json::as_str)
}

/// `alt` with the constraining keywords of `outer` (an `anyOf` / `allOf` schema) added; a
/// keyword in both is refused rather than intersected.
fn merged(outer: &serde_json::Map<String, Json>, alt: &Json, path: &str) -> Result<Json, SchemaError> {
    let extra: Vec<(&String, &Json)> = outer.iter().filter(|(k, _)| CONSTRAINING.contains(&k.as_str())).collect();
    if extra.is_empty() {
        return Ok(alt.clone());
    }
    let mut m = match alt {
        Json::Object(m) => m.clone(),
        Json::Bool(true) => serde_json::Map::new(),
        _ => return Err(Compiler::err(path, "must be a schema object to combine with the keywords beside it")),
    };
    for (k, v) in extra {
        if m.contains_key(k) {
            return Err(Compiler::err(path, format!("`{k}` both here and beside it is not supported; write it in one place")));
        }
        m.insert(k.clone(), v.clone());
    }
    Ok(Json::Object(m))
}

/// An integer's bounds from `minimum` / `maximum` / `exclusiveMinimum` / `exclusiveMaximum`
/// (numbers; draft 4's boolean `exclusive*` beside them too), as the integers they allow
/// (`None`: unbounded); an empty range (within what a 19-digit integer can be) is an error.
/// Integer bounds are read exactly (no trip through f64); all arithmetic is in i128.
fn int_bounds(obj: &serde_json::Map<String, Json>, path: &str) -> Result<Option<(i64, i64)>, SchemaError> {
    /// A bound as the integer it puts at the edge: `up` rounds a fraction up (a lower bound).
    fn edge(v: &Json, up: bool, k: &str, path: &str) -> Result<Option<i128>, SchemaError> {
        if let Some(i) = v.as_i64() {
            return Ok(Some(i as i128));
        }
        if let Some(u) = v.as_u64() {
            return Ok(Some(u as i128));
        }
        match v {
            Json::Bool(_) => Ok(None),
            _ => {
                let x = v.as_f64().filter(|x| x.is_finite()).ok_or_else(|| Compiler::err(&format!("{path}/{k}"), "must be a number"))?;
                // f64 → i128 saturates far outside i64, so the range checks below stay exact.
                Ok(Some(if up { x.ceil() as i128 } else { x.floor() as i128 }))
            }
        }
    }
    let Some((lo, hi)) = unit_range(obj, (i64::MIN as i128, i64::MAX as i128), |v, up, k| edge(v, up, k, path))? else { return Ok(None) };
    if lo > hi {
        return Err(Compiler::err(path, "no integer satisfies these minimum / maximum bounds"));
    }
    Ok(Some((lo as i64, hi as i64)))
}

/// The whole units `minimum` / `maximum` / `exclusiveMinimum` / `exclusiveMaximum` let through
/// (draft 4's boolean `exclusive*` beside `minimum` / `maximum` too), within `reach`, as an
/// inclusive range that may be empty; `None`: no bound at all. `edge(v, up, k)` reads bound
/// `v` of keyword `k` as a number of units, rounded up (`up`) or down (`None`: a boolean). An
/// exclusive bound moves one unit past the bound rounded the other way.
fn unit_range(
    obj: &serde_json::Map<String, Json>,
    reach: (i128, i128),
    edge: impl Fn(&Json, bool, &str) -> Result<Option<i128>, SchemaError>,
) -> Result<Option<(i128, i128)>, SchemaError> {
    let flag = |k: &str| obj.get(k) == Some(&Json::Bool(true));
    let lower = |k: &str, exclusive: bool| -> Result<Option<i128>, SchemaError> {
        Ok(obj.get(k).map(|v| edge(v, !exclusive, k)).transpose()?.flatten().map(|m| if exclusive { m + 1 } else { m }))
    };
    let upper = |k: &str, exclusive: bool| -> Result<Option<i128>, SchemaError> {
        Ok(obj.get(k).map(|v| edge(v, exclusive, k)).transpose()?.flatten().map(|m| if exclusive { m - 1 } else { m }))
    };
    let los = [lower("minimum", flag("exclusiveMinimum"))?, lower("exclusiveMinimum", true)?];
    let his = [upper("maximum", flag("exclusiveMaximum"))?, upper("exclusiveMaximum", true)?];
    if los.iter().chain(&his).all(Option::is_none) {
        return Ok(None);
    }
    let lo = los.into_iter().flatten().fold(reach.0, i128::max);
    let hi = his.into_iter().flatten().fold(reach.1, i128::min);
    Ok(Some((lo, hi)))
}

/// A number's bounds from `minimum` / `maximum` / `exclusive*` (draft 4's boolean flags too), as
/// the inclusive range of multiples of 10^-15 they allow (`None`: unbounded). A bound is read
/// as the decimal JSON writes it (the shortest text of its f64), exactly; an empty range
/// (within what `DEC_DIGITS` digits can write) is an error.
fn dec_bounds(obj: &serde_json::Map<String, Json>, path: &str) -> Result<Option<(i128, i128)>, SchemaError> {
    let d = super::matcher::DEC_DIGITS as i32;
    // Beyond what DEC_DIGITS digits can write (10^15 in units of 10^-15).
    let far = 10i128.pow(2 * d as u32) * 10;
    // A bound in units of 10^-15, rounded up (`up`) or down to a whole unit.
    let edge = |v: &Json, up: bool, k: &str| -> Result<Option<i128>, SchemaError> {
        let bad = || Compiler::err(&format!("{path}/{k}"), "must be a number");
        let n = match v {
            Json::Bool(_) => return Ok(None),
            Json::Number(n) => n.to_string(),
            _ => return Err(bad()),
        };
        let (neg, body) = match n.strip_prefix('-') {
            Some(b) => (true, b),
            None => (false, n.as_str()),
        };
        let (mant, exp) = match body.split_once(['e', 'E']) {
            Some((m, e)) => (m, e.parse::<i32>().map_err(|_| bad())?),
            None => (body, 0),
        };
        let (ip, fp) = mant.split_once('.').unwrap_or((mant, ""));
        let digits: String = format!("{ip}{fp}").trim_start_matches('0').to_string();
        if !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        // |value| = digits × 10^p units.
        let p = exp.saturating_sub(fp.len() as i32).saturating_add(d);
        let mag = if digits.is_empty() {
            0
        } else if p >= 0 {
            if digits.len() as i32 + p > 2 * d + 2 { far } else { digits.parse::<i128>().map_err(|_| bad())? * 10i128.pow(p as u32) }
        } else {
            let cut = (-p) as usize;
            let (keep, rest) = if cut >= digits.len() { ("", digits.as_str()) } else { digits.split_at(digits.len() - cut) };
            let q = if keep.is_empty() { 0 } else if keep.len() as i32 > 2 * d + 2 { far } else { keep.parse::<i128>().map_err(|_| bad())? };
            // Rounded away from zero when digits were cut: up for a positive value.
            let frac = rest.bytes().any(|b| b != b'0');
            q + i128::from(frac && (up != neg))
        };
        Ok(Some(if neg { -mag } else { mag }))
    };
    let reach = 10i128.pow(2 * d as u32) - 1;
    let Some((lo, hi)) = unit_range(obj, (-reach, reach), edge)? else { return Ok(None) };
    if lo > hi {
        return Err(Compiler::err(path, format!("no number of at most {d} digits satisfies these minimum / maximum bounds")));
    }
    Ok(Some((lo, hi)))
}

/// The `enum` / `const` members that satisfy the other constraining keywords beside them.
fn members_fitting<'v>(obj: &serde_json::Map<String, Json>, members: &'v [Json], path: &str) -> Result<Vec<&'v Json>, SchemaError> {
    let rest: serde_json::Map<String, Json> =
        obj.iter().filter(|(k, _)| CONSTRAINING.contains(&k.as_str()) && !matches!(k.as_str(), "enum" | "const")).map(|(k, v)| (k.clone(), v.clone())).collect();
    if rest.is_empty() {
        return Ok(members.iter().collect());
    }
    let v = jsonschema::options()
        .should_validate_formats(true)
        .build(&Json::Object(rest))
        .map_err(|e| Compiler::err(path, format!("the keywords beside enum/const: {e}")))?;
    Ok(members.iter().filter(|m| v.is_valid(m)).collect())
}

/// The compact JSON text of a value (what an `enum` / `const` member must be written as).
fn compact(v: &Json) -> Vec<u8> {
    serde_json::to_vec(v).expect("a JSON value serializes")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn err_path(s: Json) -> String {
        Grammar::from_schema(&s).unwrap_err().path
    }

    #[test]
    fn refuses_what_it_cannot_enforce_and_names_the_place() {
        assert_eq!(err_path(json!({"properties": {"a": {"not": {"type": "string"}}}})), "#/properties/a/not");
        assert_eq!(err_path(json!({"type": "object", "required": ["b"], "properties": {"a": {}}})), "#/required/0");
        assert_eq!(err_path(json!({"enum": []})), "#/enum");
        assert_eq!(err_path(json!({"$ref": "#/$defs/missing"})), "#/$ref");
        assert_eq!(err_path(json!({"type": "wat"})), "#/type");
        assert_eq!(err_path(json!({"allOf": [{}, {}]})), "#/allOf");
        assert_eq!(err_path(json!(false)), "#");
        assert_eq!(err_path(json!({"type": "string", "minLength": 3, "maxLength": 2})), "#");
    }

    #[test]
    fn a_schema_with_no_finite_value_is_refused() {
        // A node that requires itself can never be closed.
        let s = json!({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
                       "$ref": "#/$defs/n"});
        assert!(Grammar::from_schema(&s).unwrap_err().why.contains("no finite"));
        // The optional form is fine (a linked list).
        let s = json!({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"});
        assert!(Grammar::from_schema(&s).is_ok());
    }

    #[test]
    fn key_tries_hold_the_encoded_keys() {
        let g = Grammar::from_schema(&json!({"properties": {"a\"b": {}, "ab": {}}})).unwrap();
        let Node::Object { keys, .. } = &g.nodes[g.root as usize] else { panic!("{:?}", g.nodes[g.root as usize]) };
        let t = &g.keys[*keys as usize];
        let mut at = 0;
        for &b in br#"a\"b"# {
            at = t.next(at, b).expect("the escaped key is in the trie");
        }
        assert_eq!(t.nodes[at as usize].end, Some(0));
    }
}
