//! `minimax-rank inspect` on the fixtures: the summary users run first on a new download.

use std::process::Command;

fn inspect(path: &str) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_minimax-rank"))
        .args(["inspect", &format!("{}/../fixtures/{path}", env!("CARGO_MANIFEST_DIR"))])
        .output()
        .unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

#[test]
fn summary_of_a_split_quant_mix() {
    let (ok, out, err) = inspect("m2-small/split");
    assert!(ok, "{err}");
    for want in [
        "architecture:  minimax-m2",
        "layers:        4",
        "heads:         4 query / 2 kv, head dim 64 (v 64), rotary dim 32",
        "experts:       16 (top 4), expert width 32",
        "context:       4096",
        "shards:        3",
        "m2-small-kmix-00003-of-00003.gguf",
        "tokenizer:     gpt2 (pre-tokenizer minimax-m2), 1000 tokens, chat template present",
        "IQ4_XS",
        "Q6_K",
    ] {
        assert!(out.contains(want), "missing {want:?} in:\n{out}");
    }
}

#[test]
fn broken_paths_fail_with_a_message() {
    let (ok, _, err) = inspect("does-not-exist.gguf");
    assert!(!ok);
    assert!(err.contains("does-not-exist.gguf"), "{err}");
    let (ok, _, err) = inspect("m2-small/tokenizer.json");
    assert!(!ok);
    assert!(err.contains("not a GGUF file"), "{err}");
}
