//! The text-relevant part of a chat request, validated into typed values.

mod error;
mod messages;
mod tools;

use serde::Deserialize;
use serde_json::{Map, Value as Json};

pub use error::InvalidRequest;
pub use messages::{Content, HistoryToolCall, Message, Role, parse_messages};
pub use tools::{ToolChoice, ToolSet, ToolSpec, parse_tool_choice, parse_tools};

use crate::text::reasoning::ReasoningMode;

/// Fields of an OpenAI chat-completions body that the text pipeline reads; the HTTP layer can
/// `#[serde(flatten)]` this into its request type.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ChatText {
    /// The conversation, validated by [`parse_messages`].
    pub messages: Vec<Json>,
    /// Tool definitions.
    #[serde(default)]
    pub tools: Option<Json>,
    /// `auto`, `none`, `required` or `{"type":"function","function":{"name":..}}`.
    #[serde(default)]
    pub tool_choice: Option<Json>,
    /// `false` keeps only the first tool call.
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    /// Extra template variables.
    #[serde(default)]
    pub chat_template_kwargs: Option<Json>,
    /// `"none"`/`"raw"`: everything in `content`; anything else splits reasoning out.
    #[serde(default)]
    pub reasoning_format: Option<String>,
}

/// A [`ChatText`] after validation.
#[derive(Debug)]
pub struct ValidChat {
    /// Messages in order.
    pub messages: Vec<Message>,
    /// Tools (empty when none, or when `tool_choice` is `none`).
    pub tools: ToolSet,
    /// What the model may call.
    pub tool_choice: ToolChoice,
    /// Whether several calls may be returned.
    pub parallel_tool_calls: bool,
    /// Request template variables.
    pub template_kwargs: Map<String, Json>,
    /// Requested reasoning handling, if any.
    pub reasoning: Option<ReasoningMode>,
}

impl ChatText {
    /// Validates every field; the first problem found is returned.
    pub fn validate(&self) -> Result<ValidChat, InvalidRequest> {
        let messages = parse_messages(&self.messages)?;
        let tools = parse_tools(self.tools.as_ref())?;
        let tool_choice = parse_tool_choice(self.tool_choice.as_ref(), &tools)?;
        // `none`: the model must not see the tools at all.
        let tools = if tool_choice == ToolChoice::None {
            ToolSet::default()
        } else {
            tools
        };
        let template_kwargs = match &self.chat_template_kwargs {
            None | Some(Json::Null) => Map::new(),
            Some(Json::Object(m)) => {
                if let Some(k) = m
                    .keys()
                    .find(|k| crate::text::template::RESERVED_VARIABLES.contains(&k.as_str()))
                {
                    return Err(InvalidRequest::new(
                        format!("chat_template_kwargs.{k}"),
                        "is set by the server and cannot be overridden",
                    ));
                }
                m.clone()
            }
            Some(_) => {
                return Err(InvalidRequest::new(
                    "chat_template_kwargs",
                    "must be an object",
                ));
            }
        };
        let reasoning = self
            .reasoning_format
            .as_deref()
            .map(|s| {
                ReasoningMode::parse(s).ok_or_else(|| {
                    InvalidRequest::new(
                        "reasoning_format",
                        format!("unknown value `{s}`; expected `parsed` or `none`"),
                    )
                })
            })
            .transpose()?;
        Ok(ValidChat {
            messages,
            tools,
            tool_choice,
            parallel_tool_calls: self.parallel_tool_calls.unwrap_or(true),
            template_kwargs,
            reasoning,
        })
    }
}
