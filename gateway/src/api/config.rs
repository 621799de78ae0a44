//! HTTP-layer flags. `main.rs` flattens [`ApiArgs`] into the gateway's CLI
//! (`#[command(flatten)] api: ApiArgs`). Every flag also reads an environment variable.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use serde_json::{Map, Value as Json};

use crate::engine::SamplingParams;
use crate::text::reasoning::ReasoningMode;

/// Flags of the OpenAI-compatible HTTP server.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "HTTP API")]
pub struct ApiArgs {
    /// Address to bind; use 0.0.0.0 to listen on every interface.
    #[arg(long, env = "MINIMAX_HOST", default_value = "127.0.0.1")]
    pub host: String,

    /// TCP port to listen on.
    #[arg(long, env = "MINIMAX_PORT", default_value_t = 8000)]
    pub port: u16,

    /// Require `Authorization: Bearer <key>` on /v1/* routes.
    #[arg(long, env = "MINIMAX_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,

    /// Model id reported by /v1/models and accepted in `model` (default: the GGUF's
    /// `general.name`).
    #[arg(long, env = "MINIMAX_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,

    /// Largest accepted request body in bytes (larger: 413).
    #[arg(long, env = "MINIMAX_MAX_BODY_BYTES", default_value_t = 16 * 1024 * 1024)]
    pub max_body_bytes: usize,

    /// Seconds a request may take from arrival to its last token (0 = no limit). A request
    /// that runs out is cancelled and answered 504 (or an error event when streaming).
    #[arg(long, env = "MINIMAX_REQUEST_TIMEOUT", default_value_t = 600.0)]
    pub request_timeout: f64,

    /// Default reasoning handling: `parsed` puts reasoning into `reasoning_content`, `none`
    /// leaves the model's text (with `<think>` tags) in `content`. Requests may override it
    /// with `reasoning_format`.
    #[arg(long, env = "MINIMAX_REASONING_FORMAT", default_value = "parsed", value_parser = parse_reasoning)]
    pub reasoning_format: ReasoningMode,

    /// Jinja chat template to use instead of the GGUF's `tokenizer.chat_template`.
    #[arg(long, env = "MINIMAX_CHAT_TEMPLATE_FILE")]
    pub chat_template_file: Option<PathBuf>,

    /// JSON object of extra chat-template variables for every request (requests may override
    /// them with `chat_template_kwargs`).
    #[arg(long, env = "MINIMAX_CHAT_TEMPLATE_KWARGS", value_parser = parse_kwargs)]
    pub chat_template_kwargs: Option<Map<String, Json>>,

    /// Default sampling temperature (0 = greedy) when a request sets none.
    #[arg(long = "default-temperature", env = "MINIMAX_DEFAULT_TEMPERATURE", default_value_t = 1.0)]
    pub temperature: f32,

    /// Default nucleus top_p (1 = off).
    #[arg(long = "default-top-p", env = "MINIMAX_DEFAULT_TOP_P", default_value_t = 0.95)]
    pub top_p: f32,

    /// Default top_k (0 = off).
    #[arg(long = "default-top-k", env = "MINIMAX_DEFAULT_TOP_K", default_value_t = 40)]
    pub top_k: u32,

    /// Default min_p (0 = off).
    #[arg(long = "default-min-p", env = "MINIMAX_DEFAULT_MIN_P", default_value_t = 0.0)]
    pub min_p: f32,

    /// Default repetition penalty (1 = off).
    #[arg(long = "default-repetition-penalty", env = "MINIMAX_DEFAULT_REPETITION_PENALTY", default_value_t = 1.0)]
    pub repetition_penalty: f32,

    /// Largest accepted `n` (choices per prompt).
    #[arg(long, env = "MINIMAX_MAX_N", default_value_t = 16)]
    pub max_n: u32,

    /// Which requests' tool-call blocks are held to the tools' grammar (names, declared
    /// parameters, required ones, value types) by constrained decoding: `required` (when
    /// `tool_choice` demands a call: `required` or a named function), `always` (every request
    /// with tools), `off`.
    #[arg(long, env = "MINIMAX_GUIDED_TOOL_CALLS", default_value = "required", value_parser = ["required", "always", "off"])]
    pub guided_tool_calls: String,
}

fn parse_reasoning(s: &str) -> Result<ReasoningMode, String> {
    ReasoningMode::parse(s).ok_or_else(|| format!("unknown reasoning format `{s}`: expected `parsed` or `none`"))
}

fn parse_kwargs(s: &str) -> Result<Map<String, Json>, String> {
    match serde_json::from_str::<Json>(s) {
        Ok(Json::Object(m)) => Ok(m),
        Ok(_) => Err("must be a JSON object, e.g. '{\"enable_thinking\": true}'".into()),
        Err(e) => Err(format!("not valid JSON: {e}")),
    }
}

impl Default for ApiArgs {
    fn default() -> Self {
        use clap::Parser;
        #[derive(Parser)]
        struct Wrap {
            #[command(flatten)]
            api: ApiArgs,
        }
        Wrap::parse_from(["minimax-gateway"]).api
    }
}

impl ApiArgs {
    pub fn bind_addr(&self) -> anyhow::Result<SocketAddr> {
        let host = self.host.trim_start_matches('[').trim_end_matches(']');
        let ip: std::net::IpAddr = host.parse().map_err(|e| anyhow::anyhow!("--host `{}`: {e}", self.host))?;
        Ok(SocketAddr::new(ip, self.port))
    }

    pub fn timeout(&self) -> Option<Duration> {
        (self.request_timeout > 0.0 && self.request_timeout.is_finite()).then(|| Duration::from_secs_f64(self.request_timeout))
    }

    /// Sampling defaults for requests that leave fields unset.
    pub fn sampling_defaults(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            ..SamplingParams::default()
        }
    }

    /// Reads `--chat-template-file`.
    pub fn chat_template(&self) -> anyhow::Result<Option<String>> {
        match &self.chat_template_file {
            None => Ok(None),
            Some(p) => std::fs::read_to_string(p)
                .map(Some)
                .map_err(|e| anyhow::anyhow!("--chat-template-file {}: {e}", p.display())),
        }
    }

    /// The text pipeline's settings from these flags.
    pub fn pipeline_config(&self) -> anyhow::Result<crate::text::prompt::PipelineConfig> {
        Ok(crate::text::prompt::PipelineConfig {
            chat_template: self.chat_template()?,
            template_kwargs: self.chat_template_kwargs.clone().unwrap_or_default(),
            reasoning: self.reasoning_format,
        })
    }
}
