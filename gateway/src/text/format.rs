//! The model family's output grammar: reasoning tags, tool-call tags and end-of-turn markers.
//!
//! Everything that differs between MiniMax-M2 and the next family (M3: `<mm:think>` and
//! namespaced tool-call tags) lives in one [`ModelFormat`] value, so the parsers stay generic.

/// Tags that delimit the model's reasoning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReasoningTags {
    /// Opens a reasoning block (`<think>` for M2).
    pub open: &'static str,
    /// Closes a reasoning block (`</think>` for M2).
    pub close: &'static str,
}

/// Tags of the XML tool-call grammar: block → invoke → parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCallTags {
    /// Opens a block of one or more invokes (`<minimax:tool_call>`).
    pub block_open: &'static str,
    /// Closes the block (`</minimax:tool_call>`).
    pub block_close: &'static str,
    /// Start of an invoke tag, followed by the function name and `">"` (`<invoke name="`).
    pub invoke_open: &'static str,
    /// Closes an invoke (`</invoke>`).
    pub invoke_close: &'static str,
    /// Start of a parameter tag, followed by the key and `">"` (`<parameter name="`).
    pub param_open: &'static str,
    /// Closes a parameter (`</parameter>`).
    pub param_close: &'static str,
}

/// One model family's text conventions; pick with [`ModelFormat::detect`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelFormat {
    /// Human-readable family name, for logs and errors.
    pub name: &'static str,
    /// Reasoning delimiters.
    pub reasoning: ReasoningTags,
    /// Tool-call grammar.
    pub tool_calls: ToolCallTags,
    /// Token texts that end generation besides the GGUF's eos/eot/eom ids.
    pub end_of_generation: &'static [&'static str],
}

impl ModelFormat {
    /// MiniMax-M2 (and M2.1/M2.5, which share the grammar).
    pub fn minimax_m2() -> Self {
        ModelFormat {
            name: "minimax-m2",
            reasoning: ReasoningTags {
                open: "<think>",
                close: "</think>",
            },
            tool_calls: ToolCallTags {
                block_open: "<minimax:tool_call>",
                block_close: "</minimax:tool_call>",
                invoke_open: "<invoke name=\"",
                invoke_close: "</invoke>",
                param_open: "<parameter name=\"",
                param_close: "</parameter>",
            },
            end_of_generation: &["[e~["],
        }
    }

    /// Chooses the family from the GGUF's architecture name; M2 is the default because it is
    /// the only family this server runs today. Add new families here.
    pub fn detect(_architecture: Option<&str>) -> Self {
        Self::minimax_m2()
    }

    /// Tag texts that carry meaning in model output: they are decoded even when their token is
    /// a control token, because the reasoning and tool-call parsers need to see them.
    pub fn meaningful_tags(&self) -> [&'static str; 4] {
        [
            self.reasoning.open,
            self.reasoning.close,
            self.tool_calls.block_open,
            self.tool_calls.block_close,
        ]
    }
}
