//! Random walks through the masks over the fixture model's real vocabulary: at every step a
//! random allowed token is taken (as an adversarial model would), until end of generation is
//! drawn; the text must then parse and satisfy the schema as an independent validator (the
//! `jsonschema` crate) reads it. Any dead end (an empty mask) or invalid document fails.

use std::path::Path;
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use serde_json::{Value as Json, json};

use super::schema::Grammar;
use super::vocab::{TokenIndex, allows};
use super::{Constraint, ConstraintSpec, Rule};
use crate::text::format::ModelFormat;
use crate::text::tokenizer::Tokenizer;

fn index() -> Arc<TokenIndex> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/m2-small/q8_0.gguf");
    let tok = Tokenizer::from_gguf(path, &ModelFormat::minimax_m2()).unwrap();
    Arc::new(TokenIndex::new(&tok))
}

/// Walks one document; `eog_bias` is how much more likely than any one token ending is
/// whenever it is allowed (keeps free-form documents short).
fn walk(spec: &Arc<ConstraintSpec>, seed: u64, eog_bias: f64) -> String {
    let idx = &spec.index;
    let mut c = Constraint::new(spec.clone());
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    let mut out = Vec::new();
    for step in 0..5000 {
        let Rule::Only(m) = c.rule() else { panic!("no reasoning block here") };
        let ids: Vec<u32> = (0..idx.vocab() as u32).filter(|&t| allows(&m.mask, t)).collect();
        assert!(!ids.is_empty(), "dead end after {:?}", String::from_utf8_lossy(&out));
        let ends = ids.iter().any(|t| idx.eog().contains(t));
        if ends && rng.random_bool((eog_bias / ids.len() as f64).min(0.9)) {
            return String::from_utf8(out).expect("documents are UTF-8");
        }
        let pick = loop {
            let t = ids[rng.random_range(0..ids.len())];
            if !idx.eog().contains(&t) {
                break t;
            }
        };
        c.advance(pick).unwrap_or_else(|e| panic!("step {step}: {e}"));
        out.extend_from_slice(idx.token_bytes(pick));
    }
    panic!("no end after 5000 tokens: {}", String::from_utf8_lossy(&out));
}

fn check(schema: &Json, seeds: u64, eog_bias: f64) {
    let spec = Arc::new(ConstraintSpec { grammar: Grammar::from_schema(schema).unwrap(), index: index(), reasoning: None, starts_in_reasoning: false, mode: super::Mode::Document });
    let validator = jsonschema::validator_for(schema).unwrap();
    for seed in 0..seeds {
        let text = walk(&spec, seed, eog_bias);
        let doc: Json = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text}"));
        let errors: Vec<String> = validator.iter_errors(&doc).map(|e| e.to_string()).collect();
        assert!(errors.is_empty(), "seed {seed}: {errors:?} in {text}");
    }
}

#[test]
fn random_walks_give_valid_documents() {
    check(
        &json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 5},
                "n": {"type": "integer"},
                "x": {"type": "number"},
                "kind": {"enum": ["add", "remove", 3, null]},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 2}, "minItems": 1, "maxItems": 3},
                "maybe": {"anyOf": [{"type": "boolean"}, {"type": "object", "properties": {"k": {"const": "v"}}, "required": ["k"], "additionalProperties": false}]},
                "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 1}], "items": false, "minItems": 2}
            },
            "required": ["name", "n", "x", "kind", "tags", "maybe", "pair"],
            "additionalProperties": false
        }),
        40,
        50.0,
    );
}

#[test]
fn recursive_and_free_form_schemas_end_validly() {
    let tree = json!({
        "$defs": {"t": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/t"}, "maxItems": 2}}, "required": ["v"], "additionalProperties": false}},
        "$ref": "#/$defs/t"
    });
    check(&tree, 20, 200.0);
    check(&json!({"type": "object", "additionalProperties": {"type": "string", "maxLength": 3}}), 20, 200.0);
}

/// Random walks through guided tool-call blocks: every block the walk writes is read by the
/// real tool-call parser into calls that are valid for their tool (name, parameters, types,
/// the tool's whole schema as the `jsonschema` crate checks it). (No free-text parameters: a
/// uniform walk would almost never spell their closing tag; `tool_tests` covers those.)
#[test]
fn random_tool_call_blocks_parse_into_valid_calls() {
    use crate::constrain::schema::{CallTags, CallTool};
    use crate::text::format::ModelFormat;
    use crate::text::request::{ToolChoice, parse_tools};
    use crate::text::toolcall::{CallIds, ToolCallParser};

    let tools_json = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"enum": ["Paris", "Lyon", "Saint-Étienne"]}, "days": {"type": "integer"}, "unit": {"enum": ["celsius", "fahrenheit"]},
            "when": {"type": "object", "properties": {"hour": {"type": "integer"}, "exact": {"type": "boolean"}}, "required": ["hour"], "additionalProperties": false},
            "tags": {"type": "array", "items": {"type": "number"}, "maxItems": 2}
        }, "required": ["city", "unit"]}}},
        {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}, "additionalProperties": false}}}
    ]);
    let toolset = Arc::new(parse_tools(Some(&tools_json)).unwrap());
    let fmt = ModelFormat::minimax_m2();
    let t = &fmt.tool_calls;
    let tools: Vec<CallTool<'_>> = toolset.iter().map(|s| CallTool { name: &s.name, parameters: &s.parameters }).collect();
    let tags = CallTags { invoke_open: t.invoke_open, invoke_close: t.invoke_close, param_open: t.param_open, param_close: t.param_close, block_close: t.block_close };
    let g = Grammar::tool_calls(&tools, tags, 3).unwrap();
    let idx = index();
    let spec = Arc::new(ConstraintSpec { grammar: g, index: idx.clone(), reasoning: None, starts_in_reasoning: false, mode: super::Mode::Document });
    let mut calls = 0;
    for seed in 0..30 {
        let mut c = Constraint::new(spec.clone());
        let mut rng = ChaCha20Rng::seed_from_u64(seed);
        let mut out = t.block_open.as_bytes().to_vec();
        // The grammar ends at the block's closing tag (the matcher's end, where only
        // whitespace may follow): walk until then.
        for _ in 0..3000 {
            if c.state.at_end() {
                break;
            }
            let Rule::Only(m) = c.rule() else { unreachable!() };
            let ids: Vec<u32> = (0..idx.vocab() as u32).filter(|&t| allows(&m.mask, t) && !idx.eog().contains(&t)).collect();
            assert!(!ids.is_empty(), "dead end after {:?}", String::from_utf8_lossy(&out));
            let pick = ids[rng.random_range(0..ids.len())];
            c.advance(pick).unwrap();
            out.extend_from_slice(idx.token_bytes(pick));
        }
        assert!(c.state.at_end(), "seed {seed}: no end: {}", String::from_utf8_lossy(&out));
        let text = String::from_utf8_lossy(&out).into_owned();
        let mut p = ToolCallParser::new(t.clone(), toolset.clone(), ToolChoice::Auto, true, CallIds::default());
        p.push(&text);
        p.finish();
        assert!(!p.calls().is_empty(), "seed {seed}: {text}");
        for call in p.calls() {
            assert!(call.is_valid(), "seed {seed}: {:?} in {text}", call.problems);
        }
        calls += p.calls().len();
    }
    assert!(calls >= 30);
}

/// Strings with a `pattern` or a `format`, and bounded integers: every walk's values match (the
/// validator checks formats too), however the model spells the characters (escapes, UTF-8).
#[test]
fn patterned_and_formatted_strings_match_in_random_walks() {
    let schema = json!({
        "type": "object",
        "properties": {
            "id": {"type": "string", "format": "uuid"},
            "when": {"type": "string", "format": "date-time"},
            "day": {"type": "string", "format": "date"},
            "mail": {"type": "string", "format": "email", "maxLength": 40},
            "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3,5}$"},
            "word": {"type": "string", "pattern": "é|ß", "maxLength": 6},
            "ip": {"type": "string", "format": "ipv4"},
            "age": {"type": "integer", "minimum": 18, "maximum": 120},
            "neg": {"type": "integer", "minimum": -1000, "exclusiveMaximum": -5}
        },
        "required": ["id", "when", "day", "mail", "code", "word", "ip", "age", "neg"],
        "additionalProperties": false
    });
    let spec = Arc::new(ConstraintSpec { grammar: Grammar::from_schema(&schema).unwrap(), index: index(), reasoning: None, starts_in_reasoning: false, mode: super::Mode::Document });
    let validator = jsonschema::options().should_validate_formats(true).build(&schema).unwrap();
    for seed in 0..25 {
        let text = walk(&spec, seed, 50.0);
        let doc: Json = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text}"));
        let errors: Vec<String> = validator.iter_errors(&doc).map(|e| e.to_string()).collect();
        assert!(errors.is_empty(), "seed {seed}: {errors:?} in {text}");
    }
}
