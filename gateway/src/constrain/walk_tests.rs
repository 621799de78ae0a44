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
        let ids: Vec<u32> = (0..idx.vocab() as u32).filter(|&t| allows(&m, t)).collect();
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
    let spec = Arc::new(ConstraintSpec { grammar: Grammar::from_schema(schema).unwrap(), index: index(), reasoning_close: None });
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
