//! The request side of the pipeline: validated chat → rendered prompt → token ids, and the
//! matching output parser for the response.

use std::sync::Arc;

use minimax_shared::gguf::Metadata;
use serde_json::{Map, Value as Json};

use crate::text::format::ModelFormat;
use crate::text::output::{OutputOptions, OutputParser};
use crate::text::reasoning::ReasoningMode;
use crate::text::request::{ChatText, InvalidRequest, Role, ValidChat};
use crate::text::sanitize::Sanitizer;
use crate::text::template::{ChatTemplate, TemplateError, TemplateInput};
use crate::text::tokenizer::{EncodeError, Piece, SpecError, Tokenizer};
use crate::text::toolcall::CallIds;

/// Server-wide text settings (CLI flags).
#[derive(Debug, Clone, Default)]
pub struct PipelineConfig {
    /// `--chat-template-file` contents, replacing the GGUF's template.
    pub chat_template: Option<String>,
    /// `--chat-template-kwargs`: variables for every request (requests may override them).
    pub template_kwargs: Map<String, Json>,
    /// Default reasoning handling (`--reasoning-format`).
    pub reasoning: ReasoningMode,
}

/// Why the pipeline could not be built at startup.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// The vocabulary is unusable.
    #[error(transparent)]
    Tokenizer(#[from] SpecError),
    /// The template does not compile.
    #[error(transparent)]
    Template(#[from] TemplateError),
    /// Neither the GGUF nor the config has a template.
    #[error("the GGUF has no `tokenizer.chat_template`; pass --chat-template-file")]
    NoTemplate,
}

/// Why a request could not become a prompt.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// The client's fault: HTTP 400 with `param`.
    #[error(transparent)]
    Invalid(#[from] InvalidRequest),
    /// The template failed for a reason other than `raise_exception`: HTTP 500.
    #[error(transparent)]
    Template(TemplateError),
    /// Tokenization failed: HTTP 500.
    #[error(transparent)]
    Encode(#[from] EncodeError),
}

/// A request turned into a prompt, plus what the response parser needs.
#[derive(Debug)]
pub struct PreparedChat {
    /// The rendered prompt, as Python jinja2 would render it.
    pub prompt: String,
    /// Prompt token ids.
    pub prompt_ids: Vec<u32>,
    /// Settings for [`TextPipeline::output_parser`].
    pub output: OutputOptions,
}

/// Tokenizer + template + model format: everything between JSON messages and token ids.
pub struct TextPipeline {
    tokenizer: Arc<Tokenizer>,
    template: ChatTemplate,
    format: ModelFormat,
    sanitizer: Sanitizer,
    config: PipelineConfig,
}

impl std::fmt::Debug for TextPipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextPipeline")
            .field("format", &self.format.name)
            .field("tokenizer", &self.tokenizer)
            .finish()
    }
}

impl TextPipeline {
    /// Assembles a pipeline from parts.
    pub fn new(
        tokenizer: Tokenizer,
        template: ChatTemplate,
        format: ModelFormat,
        config: PipelineConfig,
    ) -> Self {
        let sanitizer = Sanitizer::new(tokenizer.specials().texts());
        TextPipeline {
            tokenizer: Arc::new(tokenizer),
            template,
            format,
            sanitizer,
            config,
        }
    }

    /// Builds tokenizer, template and format from GGUF metadata and the server config.
    pub fn from_gguf_metadata(
        meta: &Metadata,
        config: PipelineConfig,
    ) -> Result<Self, PipelineError> {
        let format = ModelFormat::detect(meta.get("general.architecture").and_then(|v| v.as_str()));
        let tokenizer = Tokenizer::from_gguf_metadata(meta, &format)?;
        let source = match &config.chat_template {
            Some(t) => t.clone(),
            None => meta
                .get("tokenizer.chat_template")
                .and_then(|v| v.as_str())
                .ok_or(PipelineError::NoTemplate)?
                .to_string(),
        };
        let template = ChatTemplate::new(source)?;
        Ok(Self::new(tokenizer, template, format, config))
    }

    /// The tokenizer (shared with output parsers).
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// The model family's format.
    pub fn format(&self) -> &ModelFormat {
        &self.format
    }

    /// Validates a request and renders and tokenizes its prompt.
    pub fn prepare(&self, req: &ChatText) -> Result<PreparedChat, PrepareError> {
        let chat = req.validate()?;
        self.prepare_valid(chat)
    }

    /// Renders and tokenizes an already validated chat.
    pub fn prepare_valid(&self, chat: ValidChat) -> Result<PreparedChat, PrepareError> {
        let escaped = self.render_escaped(&chat)?;
        let prompt_ids = self.encode_escaped(&escaped)?;
        let starts_in_reasoning = escaped.trim_end().ends_with(self.format.reasoning.open);
        let prompt = Sanitizer::restore(&escaped).into_owned();
        Ok(PreparedChat {
            prompt,
            prompt_ids,
            output: OutputOptions {
                reasoning: chat.reasoning.unwrap_or(self.config.reasoning),
                starts_in_reasoning,
                tools: Arc::new(chat.tools),
                tool_choice: chat.tool_choice,
                parallel_tool_calls: chat.parallel_tool_calls,
                call_ids: CallIds::default(),
            },
        })
    }

    /// A parser for the response to `prepared`.
    pub fn output_parser(&self, prepared: &PreparedChat) -> OutputParser {
        OutputParser::new(
            self.tokenizer.clone(),
            self.format.clone(),
            prepared.output.clone(),
        )
    }

    /// Renders with every client string escaped (see `text::sanitize`).
    fn render_escaped(&self, chat: &ValidChat) -> Result<String, PrepareError> {
        let tags = self.format.meaningful_tags();
        let messages = chat
            .messages
            .iter()
            .map(|m| {
                // Assistant history may carry the model's own reasoning/tool-call tags.
                let exempt: &[&str] = if m.role == Role::Assistant {
                    &tags
                } else {
                    &[]
                };
                let mut v = self.sanitizer.escape_json(&m.to_template_json(), exempt);
                // The role is a validated name that templates compare: never escaped.
                v["role"] = Json::String(m.role.as_str().into());
                v
            })
            .collect();
        let tools = (!chat.tools.is_empty()).then(|| {
            chat.tools
                .raw()
                .iter()
                .map(|t| self.sanitizer.escape_json(t, &[]))
                .collect()
        });
        let mut extra = self.special_token_variables();
        // Operator kwargs are trusted; request kwargs are client text.
        extra.extend(self.config.template_kwargs.clone());
        for (k, v) in &chat.template_kwargs {
            extra.insert(k.clone(), self.sanitizer.escape_json(v, &[]));
        }
        let input = TemplateInput {
            messages,
            tools,
            add_generation_prompt: true,
            extra,
        };
        self.template.render(&input).map_err(|e| match e {
            TemplateError::Raised(msg) => {
                PrepareError::Invalid(InvalidRequest::new("messages", msg))
            }
            other => PrepareError::Template(other),
        })
    }

    /// Special tokens become ids only where the template wrote them; the rest is plain text.
    fn encode_escaped(&self, escaped: &str) -> Result<Vec<u32>, EncodeError> {
        let mut ids = Vec::new();
        for piece in self.tokenizer.specials().split(escaped) {
            match piece {
                Piece::Special(id) => ids.push(id),
                Piece::Text(t) => ids.extend(self.tokenizer.encode_plain(&Sanitizer::restore(t))?),
            }
        }
        Ok(self.tokenizer.with_bos(ids))
    }

    /// `bos_token` and `eos_token`, as HF passes its special-tokens map to templates.
    fn special_token_variables(&self) -> Map<String, Json> {
        let mut m = Map::new();
        for (name, id) in [
            ("bos_token", self.tokenizer.bos_id()),
            ("eos_token", self.tokenizer.eos_id()),
        ] {
            if let Some(text) = id.and_then(|id| self.tokenizer.token_text(id)) {
                m.insert(name.into(), Json::String(text));
            }
        }
        m
    }
}
