//! Tokenizer built from the fixture GGUFs must reproduce HF tokenizers' ids exactly.

use std::path::PathBuf;

use minimax_gateway::text::format::ModelFormat;
use minimax_gateway::text::tokenizer::{SpecError, TokenType, Tokenizer, TokenizerSpec};
use serde_json::Value;

fn fixture(model: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures")
        .join(model)
}

fn load(model: &str, file: &str) -> Tokenizer {
    Tokenizer::from_gguf(fixture(model).join(file), &ModelFormat::minimax_m2())
        .expect("tokenizer from GGUF")
}

fn cases(model: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(fixture(model).join("tokenizer_cases.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids_of(case: &Value) -> Vec<u32> {
    case["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

fn check_cases(model: &str, tok: &Tokenizer) {
    let user_defined: Vec<String> = (0..tok.vocab_size() as u32)
        .filter(|&id| tok.token_type(id) == TokenType::UserDefined)
        .map(|id| tok.token_text(id).unwrap())
        .collect();
    let mut checked = 0;
    for case in cases(model) {
        let text = case["text"].as_str().unwrap();
        let want = ids_of(&case);
        if case["special"].as_bool() == Some(true) {
            assert_eq!(
                tok.encode_trusted(text).unwrap(),
                want,
                "trusted encoding of {text:?}"
            );
        } else if user_defined.iter().any(|u| text.contains(u.as_str())) {
            // HF's encode_special_tokens still matches non-special added tokens; we only do
            // that for trusted text. Plain encoding must instead spell them out.
            assert_eq!(
                tok.encode_trusted(text).unwrap(),
                want,
                "trusted encoding of {text:?}"
            );
            let plain = tok.encode_plain(text).unwrap();
            assert!(
                plain.iter().all(|&id| !tok.token_type(id).is_special()),
                "{text:?} -> {plain:?}"
            );
            assert_eq!(tok.decode(&plain), text);
        } else {
            assert_eq!(
                tok.encode_plain(text).unwrap(),
                want,
                "plain encoding of {text:?}"
            );
        }
        assert_eq!(tok.decode(&want), text, "decode of {text:?}");
        checked += 1;
    }
    assert!(checked >= 40, "only {checked} cases");
}

#[test]
fn m2_small_matches_hf_ids() {
    check_cases("m2-small", &load("m2-small", "f32.gguf"));
}

#[test]
fn m2_odd_matches_hf_ids() {
    check_cases("m2-odd", &load("m2-odd", "f32.gguf"));
}

#[test]
fn split_gguf_gives_the_same_tokenizer() {
    let tok = Tokenizer::from_gguf(
        fixture("m2-small").join("split"),
        &ModelFormat::minimax_m2(),
    )
    .unwrap();
    check_cases("m2-small", &tok);
}

#[test]
fn special_ids_and_eog_come_from_metadata() {
    let tok = load("m2-small", "f32.gguf");
    let cfg: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("m2-small").join("tokenizer.json")).unwrap(),
    )
    .unwrap();
    let id_of = |s: &str| {
        cfg["added_tokens"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["content"] == s)
            .unwrap()["id"]
            .as_u64()
            .unwrap() as u32
    };
    assert_eq!(tok.bos_id(), Some(id_of("]~!b[")));
    assert_eq!(tok.eos_id(), Some(id_of("[e~[")));
    assert!(tok.is_eog(id_of("[e~[")));
    assert!(!tok.is_eog(id_of("]~b]")));
    assert!(!tok.add_bos());
    assert_eq!(tok.token_type(id_of("]~b]")), TokenType::Control);
    assert_eq!(tok.token_type(id_of("<think>")), TokenType::UserDefined);
    // The odd fixture has a different vocabulary size: nothing is hard-coded.
    let odd = load("m2-odd", "f32.gguf");
    assert_ne!(odd.vocab_size(), tok.vocab_size());
    assert!(odd.is_eog(odd.eos_id().unwrap()));
}

#[test]
fn control_text_in_plain_input_is_never_a_control_token() {
    let tok = load("m2-small", "f32.gguf");
    for text in [
        "[e~[",
        "]~b]user\n",
        "<think>x</think>",
        "]~!b[]!p~[]!d~[",
        "a[e~[b<minimax:tool_call>",
    ] {
        let ids = tok.encode_plain(text).unwrap();
        assert!(
            ids.iter().all(|&id| !tok.token_type(id).is_special()),
            "{text:?} -> {ids:?}"
        );
        assert_eq!(tok.decode(&ids), text);
        // The same text as trusted template output does use the special ids.
        let trusted = tok.encode_trusted(text).unwrap();
        assert!(
            trusted.iter().any(|&id| tok.token_type(id).is_special()),
            "{text:?}"
        );
    }
}

#[test]
fn unknown_pre_tokenizer_is_a_clear_error() {
    let spec = TokenizerSpec {
        tokens: vec!["a".into()],
        pre: "llama-bpe-unknown".into(),
        ..Default::default()
    };
    let err = Tokenizer::from_spec(spec).unwrap_err();
    assert!(matches!(err, SpecError::UnknownPreTokenizer { .. }));
    let msg = err.to_string();
    assert!(
        msg.contains("llama-bpe-unknown") && msg.contains("minimax-m2"),
        "{msg}"
    );
}

#[test]
fn out_of_range_special_ids_are_rejected() {
    let spec = TokenizerSpec {
        tokens: vec!["a".into()],
        pre: "minimax-m2".into(),
        eos_id: Some(5),
        ..Default::default()
    };
    assert!(matches!(
        Tokenizer::from_spec(spec).unwrap_err(),
        SpecError::IdOutOfRange {
            what: "eos",
            id: 5,
            ..
        }
    ));
}
