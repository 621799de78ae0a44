//! Tensor names as llama.cpp's converter writes them for `minimax-m2`.

pub const TOKEN_EMBD: &str = "token_embd.weight";
pub const OUTPUT_NORM: &str = "output_norm.weight";
pub const OUTPUT: &str = "output.weight";

pub const ATTN_NORM: &str = "attn_norm.weight";
pub const ATTN_Q: &str = "attn_q.weight";
pub const ATTN_K: &str = "attn_k.weight";
pub const ATTN_V: &str = "attn_v.weight";
pub const ATTN_OUTPUT: &str = "attn_output.weight";
pub const ATTN_Q_NORM: &str = "attn_q_norm.weight";
pub const ATTN_K_NORM: &str = "attn_k_norm.weight";
pub const FFN_NORM: &str = "ffn_norm.weight";
pub const FFN_GATE_INP: &str = "ffn_gate_inp.weight";
pub const EXP_PROBS_B: &str = "exp_probs_b.bias";
pub const FFN_GATE_EXPS: &str = "ffn_gate_exps.weight";
pub const FFN_UP_EXPS: &str = "ffn_up_exps.weight";
pub const FFN_DOWN_EXPS: &str = "ffn_down_exps.weight";

/// The full name of a per-block tensor, e.g. `blk.3.attn_q.weight`.
pub fn block(layer: usize, name: &str) -> String {
    format!("blk.{layer}.{name}")
}
