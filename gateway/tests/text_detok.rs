//! Streaming detokenization: deltas never split a character and always add up to the
//! one-shot decode.

use std::path::PathBuf;

use minimax_gateway::text::detok::IncrementalDecoder;
use minimax_gateway::text::format::ModelFormat;
use minimax_gateway::text::tokenizer::Tokenizer;
use proptest::prelude::*;

fn tokenizer() -> &'static Tokenizer {
    static TOK: std::sync::OnceLock<Tokenizer> = std::sync::OnceLock::new();
    TOK.get_or_init(|| {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/m2-small/f32.gguf");
        Tokenizer::from_gguf(path, &ModelFormat::minimax_m2()).unwrap()
    })
}

fn stream(tok: &Tokenizer, ids: &[u32]) -> Vec<String> {
    let mut d = IncrementalDecoder::new();
    let mut out: Vec<String> = ids.iter().map(|&id| d.push(tok.token_bytes(id))).collect();
    out.push(d.finish());
    out
}

fn text_strategy() -> impl Strategy<Value = String> {
    let pieces = prop::sample::select(vec![
        "a",
        " the",
        "é",
        "ß",
        "中文",
        "日本語",
        "😀",
        "🚀",
        "👨\u{200d}👩\u{200d}👧",
        "🇫🇷",
        "👍🏽",
        "\n",
        "\t",
        "  ",
        "[e~[",
        "<think>",
        "Привет",
        "ع",
        "\u{10FFFD}",
        "€",
        "x=1;",
    ]);
    prop_oneof![
        prop::collection::vec(pieces, 0..40).prop_map(|v| v.concat()),
        any::<String>(),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn valid_text_streams_back_exactly(text in text_strategy()) {
        let tok = tokenizer();
        let ids = tok.encode_plain(&text).unwrap();
        let deltas = stream(tok, &ids);
        for d in &deltas {
            prop_assert!(!d.contains('\u{FFFD}') || text.contains('\u{FFFD}'), "broken delta {:?}", d);
        }
        prop_assert_eq!(deltas.concat(), text);
    }

    #[test]
    fn random_token_streams_equal_one_shot_decode(ids in prop::collection::vec(0u32..1000, 0..60)) {
        let tok = tokenizer();
        prop_assert_eq!(stream(tok, &ids).concat(), tok.decode(&ids));
    }
}

#[test]
fn emoji_split_across_byte_tokens_is_held_back() {
    let tok = tokenizer();
    let ids = tok.encode_plain("🚀").unwrap();
    assert!(
        ids.len() > 1,
        "the small vocab spells the emoji with several tokens: {ids:?}"
    );
    let deltas = stream(tok, &ids);
    assert!(
        deltas[..deltas.len() - 2].iter().all(String::is_empty),
        "{deltas:?}"
    );
    assert_eq!(deltas.concat(), "🚀");
}
