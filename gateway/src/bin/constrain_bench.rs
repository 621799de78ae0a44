//! Structured outputs: what computing one token mask costs, over a real GGUF vocabulary
//! (`--gguf FILE`) or a synthetic one of MiniMax-M2's size (200,064 tokens), for the matcher
//! states a document passes through. Prints a table (docs/BENCHMARKS.md "Structured outputs").
//!
//! `cargo run --release -p minimax-gateway --bin minimax-constrain-bench [-- --gguf FILE]`

use std::sync::Arc;
use std::time::Instant;

use minimax_gateway::constrain::matcher::State;
use minimax_gateway::constrain::schema::{CallTags, CallTool, Grammar};
use minimax_gateway::constrain::vocab::TokenIndex;
use minimax_gateway::constrain::{Constraint, ConstraintSpec, Mode, Rule};
use minimax_shared::sampling::{SamplingSpec, reduce_row};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use serde_json::json;

/// A vocabulary shaped like a byte-level BPE one: every byte, then words with and without a
/// leading space, code punctuation runs, digits, indentation and some multi-byte UTF-8.
fn synthetic(n: usize) -> TokenIndex {
    let mut rng = ChaCha20Rng::seed_from_u64(1);
    let mut seen = std::collections::HashSet::new();
    let mut items: Vec<(u32, Vec<u8>)> = Vec::with_capacity(n);
    for b in 0..=255u8 {
        seen.insert(vec![b]);
        items.push((b as u32, vec![b]));
    }
    let letters = b"etaoinshrdlcumwfgypbvkjxqzETAOINSHRDLCUMWFGYPBVKJXQZ_";
    let punct = b"{}[]()<>.,:;\"'`=+-*/\\|&!?#@$%^~";
    while items.len() < n {
        let kind = rng.random_range(0..10);
        let mut t = Vec::new();
        match kind {
            0..=5 => {
                if rng.random_bool(0.6) {
                    t.push(b' ');
                }
                for _ in 0..rng.random_range(2..10) {
                    t.push(letters[rng.random_range(0..letters.len())]);
                }
            }
            6 => {
                for _ in 0..rng.random_range(1..4) {
                    t.push(punct[rng.random_range(0..punct.len())]);
                }
            }
            7 => {
                for _ in 0..rng.random_range(1..4) {
                    t.push(b'0' + rng.random_range(0..10u8));
                }
            }
            8 => {
                if rng.random_bool(0.5) {
                    t.push(b'\n');
                }
                t.extend(std::iter::repeat_n(b' ', rng.random_range(1..17)));
            }
            _ => {
                let c = char::from_u32(rng.random_range(0x4e00..0x9fff)).unwrap();
                let mut buf = [0u8; 4];
                t.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                if rng.random_bool(0.5) {
                    t.pop();
                }
            }
        }
        if seen.insert(t.clone()) {
            let id = items.len() as u32;
            items.push((id, t));
        }
    }
    let eog = n as u32;
    TokenIndex::from_tokens(n + 1, items, vec![eog])
}

/// Prints one table row: the mask of the state after `prefix`, its first time and the median
/// of five more.
fn mask_row(index: &TokenIndex, g: &Grammar, name: &str, prefix: &[u8]) {
    let mut s = State::start(g);
    assert!(s.feed(g, prefix), "{name}");
    let mut times = Vec::new();
    let mut allowed = 0;
    for _ in 0..6 {
        let t = Instant::now();
        let m = index.allowed(g, &s);
        times.push(t.elapsed().as_secs_f64() * 1e3);
        allowed = m.iter().map(|w| w.count_ones()).sum::<u32>();
    }
    let first = times.remove(0);
    times.sort_by(f64::total_cmp);
    println!("| {name} | {allowed} | {first:.2} | {:.2} |", times[2]);
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let gguf = args.iter().position(|a| a == "--gguf").and_then(|i| args.get(i + 1));
    let t0 = Instant::now();
    let (index, what) = match gguf {
        Some(path) => {
            let format = minimax_gateway::text::format::ModelFormat::minimax_m2();
            let tok = minimax_gateway::text::tokenizer::Tokenizer::from_gguf(path, &format).unwrap_or_else(|e| panic!("{path}: {e}"));
            (TokenIndex::new(&tok), format!("vocabulary of {path}"))
        }
        None => (synthetic(200_064), "synthetic byte-level vocabulary".to_string()),
    };
    let index = Arc::new(index);
    println!("{what}: {} tokens (made and indexed in {:.1} ms)\n", index.vocab(), t0.elapsed().as_secs_f64() * 1e3);

    let schema = json!({
        "type": "object",
        "properties": {
            "path": {"type": "string"},
            "line": {"type": "integer"},
            "kind": {"enum": ["add", "remove", "replace"]},
            "code": {"type": "string"},
            "title": {"type": "string", "maxLength": 80}
        },
        "required": ["path", "line", "kind", "code", "title"],
        "additionalProperties": false
    });
    let g = Grammar::from_schema(&schema).unwrap();
    let cases: [(&str, &[u8]); 8] = [
        ("document start", b""),
        ("object key", b"{\""),
        ("enum value", b"{\"kind\": \""),
        ("number", b"{\"line\": 12"),
        ("inside a free string", b"{\"code\": \"fn main() {"),
        ("inside a free string, after a backslash", b"{\"code\": \"a\\"),
        ("inside a string of at most 80 characters", b"{\"title\": \"Fix the parser"),
        ("after the document", b"{\"path\":\"a\",\"line\":1,\"kind\":\"add\",\"code\":\"x\",\"title\":\"t\"}"),
    ];
    println!("| matcher state | allowed tokens | mask ms (first) | mask ms (median of 5 more) |");
    println!("| --- | --- | --- | --- |");
    for (name, prefix) in cases {
        mask_row(&index, &g, name, prefix);
    }

    // An object that allows other keys (a non-strict schema), inside a new key.
    let open = Grammar::from_schema(&json!({"type": "object", "properties": {"path": {"type": "string"}}})).unwrap();
    mask_row(&index, &open, "object key, other keys allowed", b"{\"path\": \"a\", \"");

    // Patterned strings (`pattern`, `format`): no per-sub-state runs, the generic walk.
    let pat = Grammar::from_schema(&json!({"type": "object", "properties": {
        "when": {"type": "string", "format": "date-time"},
        "mail": {"type": "string", "format": "email"},
        "note": {"type": "string", "pattern": "^[^<>]*$"}
    }})).unwrap();
    mask_row(&index, &pat, "inside a date-time (format)", b"{\"when\": \"2024-0");
    mask_row(&index, &pat, "inside an email's local part (format)", b"{\"mail\": \"john.sm");
    mask_row(&index, &pat, "inside a permissive pattern (^[^<>]*$)", b"{\"note\": \"fn main() {");

    // Guided tool calls: inside a raw-text parameter value, and at the tags.
    let params = json!({"type": "object", "properties": {
        "path": {"type": "string"}, "line": {"type": "integer"},
        "since": {"type": "string", "format": "date"}, "note": {"type": "string", "pattern": "^[^{}]*$"}
    }, "required": ["path"]});
    let tags = CallTags { invoke_open: "<invoke name=\"", invoke_close: "</invoke>", param_open: "<parameter name=\"", param_close: "</parameter>", block_close: "</minimax:tool_call>" };
    let tg = Grammar::tool_calls(&[CallTool { name: "edit", parameters: &params }], tags, 8).expect("a completable call");
    let tool_cases: [(&str, &[u8]); 5] = [
        ("tool call: block start", b""),
        ("tool call: inside a raw-text value", b"\n<invoke name=\"edit\">\n<parameter name=\"path\">src/ma"),
        ("tool call: after a parameter", b"\n<invoke name=\"edit\">\n<parameter name=\"path\">a</parameter>"),
        ("tool call: inside a date parameter (format)", b"\n<invoke name=\"edit\">\n<parameter name=\"since\">2024-0"),
        ("tool call: inside a permissive patterned parameter", b"\n<invoke name=\"edit\">\n<parameter name=\"note\">fix the loop"),
    ];
    for (name, prefix) in tool_cases {
        mask_row(&index, &tg, name, prefix);
    }

    // A whole document written token by token as a sampler would (a random allowed token each
    // step, the state's mask from the per-request cache when the state repeats).
    let spec = Arc::new(ConstraintSpec { grammar: g, index: index.clone(), reasoning: None, starts_in_reasoning: false, mode: Mode::Document });
    let mut c = Constraint::new(spec);
    let mut rng = ChaCha20Rng::seed_from_u64(9);
    let (mut steps, mut total) = (0usize, 0.0f64);
    let mut worst: f64 = 0.0;
    for _ in 0..400 {
        let t = Instant::now();
        let Rule::Only(m) = c.rule() else { unreachable!() };
        let dt = t.elapsed().as_secs_f64() * 1e3;
        total += dt;
        worst = worst.max(dt);
        steps += 1;
        let ids: Vec<u32> = (0..index.vocab() as u32).filter(|&t| m.mask[(t / 64) as usize] >> (t % 64) & 1 == 1).collect();
        let pick = ids[rng.random_range(0..ids.len())];
        if index.eog().contains(&pick) {
            break;
        }
        c.advance(pick).unwrap();
    }
    println!("\nrandom walk through the schema: {steps} tokens, mask {:.3} ms a token on average, {worst:.2} ms at worst", total / steps as f64);

    // What the head rank then does with a masked row on the host (a CUDA rank downloads the
    // row first): the shared reduction at MiniMax's defaults, with and without a mask.
    let v = index.vocab();
    let mut rng = ChaCha20Rng::seed_from_u64(5);
    let row: Vec<f32> = (0..v).map(|_| rng.random_range(-8.0f32..8.0)).collect();
    let s_in = {
        let mut s = State::start(&spec_grammar(&c));
        assert!(s.feed(&spec_grammar(&c), b"{\"code\": \"x"));
        s
    };
    let m = index.allowed(&spec_grammar(&c), &s_in);
    let mut bytes: Vec<u8> = m.iter().flat_map(|w| w.to_le_bytes()).collect();
    bytes.truncate(v.div_ceil(8));
    let base = SamplingSpec { temperature: 1.0, top_k: 40, top_p: 0.95, ..Default::default() };
    let masked = SamplingSpec { allowed: Some(bytes.into()), ..base.clone() };
    for (name, spec) in [("no mask", &base), ("a mask", &masked)] {
        let mut times = Vec::new();
        for _ in 0..7 {
            let t = Instant::now();
            let r = reduce_row(&row, spec, None).unwrap();
            times.push(t.elapsed().as_secs_f64() * 1e3);
            assert!(!r.candidate_ids.is_empty());
        }
        times.sort_by(f64::total_cmp);
        println!("host reduction of a {v}-token row, top_k 40 / top_p 0.95, {name}: {:.2} ms (median of 7)", times[3]);
    }
}

fn spec_grammar(c: &Constraint) -> Grammar {
    c.grammar().clone()
}
