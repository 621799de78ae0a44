//! `minimax-rank inspect MODEL`: the summary users look at first on a new download.

use std::collections::BTreeMap;
use std::fmt::Write;

use minimax_shared::gguf::{GgufModel, MetaValue};
use minimax_shared::model::ModelConfig;
use minimax_shared::quant::GgmlType;

fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{b} B") } else { format!("{v:.2} {}", UNITS[u]) }
}

/// Renders the summary of a model: architecture, hyper-parameters, shards, tensor types,
/// tokenizer and context length. A config problem is reported in the summary, not hidden.
pub fn summary(m: &GgufModel) -> String {
    let mut s = String::new();
    let meta_str = |k: &str| m.meta(k).and_then(MetaValue::as_str).unwrap_or("?").to_string();
    let _ = writeln!(s, "model:         {}", meta_str("general.name"));
    let _ = writeln!(s, "architecture:  {}", meta_str("general.architecture"));
    match ModelConfig::from_gguf(m) {
        Ok(c) => {
            let _ = writeln!(s, "layers:        {}", c.n_layers);
            let _ = writeln!(s, "hidden:        {}", c.hidden);
            let _ = writeln!(s, "heads:         {} query / {} kv, head dim {} (v {}), rotary dim {}", c.n_heads, c.n_kv_heads, c.head_dim, c.v_head_dim, c.rotary_dim);
            let _ = writeln!(s, "experts:       {} (top {}), expert width {}, gating {:?}", c.n_experts, c.n_experts_used, c.expert_ff, c.gating);
            let _ = writeln!(s, "rope theta:    {}", c.rope_theta);
            let _ = writeln!(s, "rms eps:       {:e}", c.rms_eps);
            let _ = writeln!(s, "vocab:         {}", c.vocab_size);
            let _ = writeln!(s, "context:       {}", c.context_length);
            let _ = writeln!(s, "lm_head:       {}", if c.tied_embeddings { "tied to token_embd" } else { "output.weight" });
        }
        Err(e) => {
            let _ = writeln!(s, "config:        NOT RUNNABLE: {e}");
        }
    }
    let tok_model = meta_str("tokenizer.ggml.model");
    let tok_pre = meta_str("tokenizer.ggml.pre");
    let n_tokens = m.meta("tokenizer.ggml.tokens").and_then(MetaValue::as_array).map_or(0, |a| a.len());
    let _ = writeln!(s, "tokenizer:     {tok_model} (pre-tokenizer {tok_pre}), {n_tokens} tokens, chat template {}", if m.meta("tokenizer.chat_template").is_some() { "present" } else { "absent" });
    let _ = writeln!(s, "shards:        {}", m.shards().len());
    for sh in m.shards() {
        let _ = writeln!(s, "  {} ({}, {} tensors, GGUF v{})", sh.path().display(), human_bytes(sh.file_len()), sh.tensors().len(), sh.version());
    }
    let mut by_type: BTreeMap<GgmlType, (usize, u64)> = BTreeMap::new();
    for t in m.tensors() {
        let e = by_type.entry(t.ty).or_default();
        e.0 += 1;
        e.1 += t.n_bytes;
    }
    let total: u64 = by_type.values().map(|v| v.1).sum();
    let _ = writeln!(s, "tensors:       {} ({} of weights)", m.tensor_count(), human_bytes(total));
    for (ty, (n, b)) in by_type {
        let flag = if ty.is_supported() { "" } else { "  (not yet supported)" };
        let _ = writeln!(s, "  {:<8} {:>5} tensors {:>12}{flag}", ty.name(), n, human_bytes(b));
    }
    s
}
