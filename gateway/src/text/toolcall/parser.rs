//! Streaming parser for the XML tool-call grammar (block → invoke → parameter).
//!
//! Text outside blocks is content. A call's id and name are emitted as soon as its invoke tag
//! is complete, and its arguments grow one parameter at a time as JSON text. Anything that
//! does not fit the grammar, and a block cut off by the end of the stream, is given back as
//! content; a call that had already started is closed (its arguments stay valid JSON) and
//! flagged, so a client never sees a half-open call.

use std::sync::Arc;

use serde_json::{Map, Value as Json};

use super::ids::CallIds;
use super::param_schema::ends_inside_json_string;
use super::typing::type_value;
use crate::text::format::ToolCallTags;
use crate::text::request::{ToolChoice, ToolSet};
use crate::text::tagscan::{could_become, partial_tag_len};

/// Longest accepted function or parameter name inside a tag; longer means garbage.
const MAX_NAME_LEN: usize = 256;

/// One parser output, in stream order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolEvent {
    /// Plain text.
    Content(String),
    /// A call begins: OpenAI's first tool-call delta.
    Start {
        /// Position among the returned calls.
        index: usize,
        /// Unique call id.
        id: String,
        /// Function name.
        name: String,
    },
    /// More of a call's `arguments` JSON text.
    Args {
        /// The call's index.
        index: usize,
        /// Text to append.
        chunk: String,
    },
}

/// A finished call, as returned in the non-streaming response.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedCall {
    /// Position among the returned calls.
    pub index: usize,
    /// Unique call id.
    pub id: String,
    /// Function name.
    pub name: String,
    /// Arguments as the JSON text that was streamed.
    pub arguments: String,
    /// Why the call is not valid for its tool (empty when valid).
    pub problems: Vec<String>,
}

impl ParsedCall {
    /// Whether the call names an allowed tool and its arguments fit the schema.
    pub fn is_valid(&self) -> bool {
        self.problems.is_empty()
    }
}

#[derive(Debug)]
struct OpenCall {
    emitted: bool,
    index: usize,
    id: String,
    name: String,
    args: Map<String, Json>,
    arguments: String,
    problems: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Text,
    Block,
    Invoke,
}

/// Result of trying to read one element at the front of the buffer.
enum Step {
    /// Consumed this many bytes.
    Took(usize),
    /// Need more text.
    Wait,
    /// Does not fit the grammar.
    Bad(&'static str),
}

/// Streaming tool-call parser for one response.
#[derive(Debug)]
pub struct ToolCallParser {
    tags: ToolCallTags,
    tools: Arc<ToolSet>,
    choice: ToolChoice,
    parallel: bool,
    ids: CallIds,
    state: State,
    buf: String,
    pending_raw: String,
    open: Option<OpenCall>,
    calls: Vec<ParsedCall>,
    dropped: usize,
}

impl ToolCallParser {
    /// A parser for the given tools and policy.
    pub fn new(
        tags: ToolCallTags,
        tools: Arc<ToolSet>,
        choice: ToolChoice,
        parallel: bool,
        ids: CallIds,
    ) -> Self {
        ToolCallParser {
            tags,
            tools,
            choice,
            parallel,
            ids,
            state: State::Text,
            buf: String::new(),
            pending_raw: String::new(),
            open: None,
            calls: Vec::new(),
            dropped: 0,
        }
    }

    /// Feeds content text.
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        self.drain(&mut out, false);
        out
    }

    /// Ends the stream: unfinished XML becomes content, an open call is closed and flagged.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let mut out = Vec::new();
        self.drain(&mut out, true);
        out
    }

    /// Calls returned so far (dropped ones excluded).
    pub fn calls(&self) -> &[ParsedCall] {
        &self.calls
    }

    /// Calls left out because `parallel_tool_calls` is false.
    pub fn dropped(&self) -> usize {
        self.dropped
    }

    fn drain(&mut self, out: &mut Vec<ToolEvent>, end: bool) {
        loop {
            let step = match self.state {
                State::Text => {
                    if let Some(pos) = self.buf.find(self.tags.block_open) {
                        content(out, &self.buf[..pos]);
                        self.pending_raw = self.tags.block_open.to_string();
                        self.buf.drain(..pos + self.tags.block_open.len());
                        self.state = State::Block;
                        continue;
                    }
                    let hold = if end {
                        0
                    } else {
                        partial_tag_len(&self.buf, self.tags.block_open)
                    };
                    let release = self.buf.len() - hold;
                    content(out, &self.buf[..release]);
                    self.buf.drain(..release);
                    return;
                }
                State::Block => self.block_step(out),
                State::Invoke => self.invoke_step(out),
            };
            match step {
                Step::Took(n) => {
                    let taken: String = self.buf.drain(..n).collect();
                    self.pending_raw.push_str(&taken);
                }
                Step::Wait if !end => return,
                Step::Wait => self.degrade(out, "the stream ended inside a tool call"),
                Step::Bad(why) => self.degrade(out, why),
            }
        }
    }

    fn block_step(&mut self, out: &mut Vec<ToolEvent>) -> Step {
        let ws = leading_ws(&self.buf);
        let rest = &self.buf[ws..];
        if rest.starts_with(self.tags.block_close) {
            let n = ws + self.tags.block_close.len();
            self.buf.drain(..n);
            self.pending_raw.clear();
            self.state = State::Text;
            return Step::Took(0);
        }
        if rest.starts_with(self.tags.invoke_open) {
            let after = ws + self.tags.invoke_open.len();
            return match read_name(&self.buf[after..]) {
                NameRead::Done(name, len) => {
                    self.start_call(out, name);
                    self.state = State::Invoke;
                    Step::Took(after + len)
                }
                NameRead::Wait => Step::Wait,
                NameRead::Bad => Step::Bad("malformed invoke tag"),
            };
        }
        if rest.is_empty()
            || could_become(rest, self.tags.invoke_open)
            || could_become(rest, self.tags.block_close)
        {
            return Step::Wait;
        }
        Step::Bad("unexpected text inside a tool-call block")
    }

    fn invoke_step(&mut self, out: &mut Vec<ToolEvent>) -> Step {
        let ws = leading_ws(&self.buf);
        let rest = &self.buf[ws..];
        if rest.starts_with(self.tags.invoke_close) {
            let n = ws + self.tags.invoke_close.len();
            self.close_call(out, None);
            self.buf.drain(..n);
            self.pending_raw.clear();
            self.state = State::Block;
            return Step::Took(0);
        }
        if rest.starts_with(self.tags.param_open) {
            let after = ws + self.tags.param_open.len();
            let (key, name_len) = match read_name(&self.buf[after..]) {
                NameRead::Done(k, len) => (k, len),
                NameRead::Wait => return Step::Wait,
                NameRead::Bad => return Step::Bad("malformed parameter tag"),
            };
            let value_start = after + name_len;
            let Some(vlen) = self.value_len(&key, &self.buf[value_start..]) else {
                return Step::Wait;
            };
            let raw = self.buf[value_start..value_start + vlen].to_string();
            self.add_param(out, key, &raw);
            return Step::Took(value_start + vlen + self.tags.param_close.len());
        }
        if rest.is_empty()
            || could_become(rest, self.tags.param_open)
            || could_become(rest, self.tags.invoke_close)
        {
            return Step::Wait;
        }
        Step::Bad("unexpected text inside an invoke")
    }

    /// Where parameter `key`'s value ends in `text`: at the first closing tag, except that a
    /// value written only as JSON goes on past a tag inside one of its strings (the guided
    /// grammar lets a JSON string hold the tag).
    fn value_len(&self, key: &str, text: &str) -> Option<usize> {
        let json_only = self
            .open
            .as_ref()
            .and_then(|c| self.tools.get(&c.name))
            .is_some_and(|t| t.param_json_only(key));
        let close = self.tags.param_close;
        let mut from = 0;
        loop {
            let at = from + text[from..].find(close)?;
            if !(json_only && ends_inside_json_string(&text[..at])) {
                return Some(at);
            }
            from = at + close.len();
        }
    }

    fn start_call(&mut self, out: &mut Vec<ToolEvent>, name: String) {
        let mut problems = Vec::new();
        match (&self.choice, self.tools.get(&name)) {
            (_, None) => problems.push(format!("no tool named `{name}`")),
            (ToolChoice::Function(f), Some(_)) if *f != name => problems.push(format!(
                "tool_choice requires `{f}`, the model called `{name}`"
            )),
            _ => {}
        }
        let emitted = self.parallel || self.calls.is_empty();
        let index = self.calls.len();
        let id = if emitted {
            self.ids.next_id()
        } else {
            String::new()
        };
        if emitted {
            out.push(ToolEvent::Start {
                index,
                id: id.clone(),
                name: name.clone(),
            });
        }
        self.open = Some(OpenCall {
            emitted,
            index,
            id,
            name,
            args: Map::new(),
            arguments: String::new(),
            problems,
        });
    }

    fn add_param(&mut self, out: &mut Vec<ToolEvent>, key: String, raw: &str) {
        let Some(call) = self.open.as_mut() else {
            return;
        };
        let schema = self
            .tools
            .get(&call.name)
            .and_then(|t| t.param_schema(&key));
        let (value, fits) = type_value(raw, schema);
        if !fits {
            call.problems.push(format!(
                "parameter `{key}`: `{raw}` does not match its schema type"
            ));
        }
        if call.args.contains_key(&key) {
            call.problems.push(format!("parameter `{key}` given twice"));
        }
        let chunk = format!(
            "{}{}:{}",
            if call.arguments.is_empty() { "{" } else { "," },
            serde_json::to_string(&key).expect("string serializes"),
            serde_json::to_string(&value).expect("JSON value serializes"),
        );
        call.args.insert(key, value);
        call.arguments.push_str(&chunk);
        if call.emitted {
            out.push(ToolEvent::Args {
                index: call.index,
                chunk,
            });
        }
    }

    fn close_call(&mut self, out: &mut Vec<ToolEvent>, failure: Option<&str>) {
        let Some(mut call) = self.open.take() else {
            return;
        };
        let chunk = if call.arguments.is_empty() { "{}" } else { "}" };
        call.arguments.push_str(chunk);
        if call.emitted {
            out.push(ToolEvent::Args {
                index: call.index,
                chunk: chunk.to_string(),
            });
        }
        if let Some(why) = failure {
            call.problems.push(why.to_string());
        } else if let Some(tool) = self.tools.get(&call.name)
            && let Err(errors) = tool.validate(&Json::Object(call.args.clone()))
        {
            call.problems.extend(
                errors
                    .into_iter()
                    .map(|e| format!("arguments do not match the schema: {e}")),
            );
        }
        if call.emitted {
            self.calls.push(ParsedCall {
                index: call.index,
                id: call.id,
                name: call.name,
                arguments: call.arguments,
                problems: call.problems,
            });
        } else {
            self.dropped += 1;
        }
    }

    /// Gives unparsable XML back as content; closes a started call.
    fn degrade(&mut self, out: &mut Vec<ToolEvent>, why: &str) {
        if self.open.is_some() {
            self.close_call(out, Some(why));
        } else {
            let raw = std::mem::take(&mut self.pending_raw);
            content(out, &raw);
        }
        self.pending_raw.clear();
        // Leftover text goes back through the text state, which may find a later block;
        // progress is certain because the broken block's opening was consumed above.
        self.state = State::Text;
    }
}

enum NameRead {
    Done(String, usize),
    Wait,
    Bad,
}

/// Whether `name` can stand between the quotes of a name tag as this parser reads them (the
/// guided call grammar leaves out the parameters whose names cannot).
pub fn writable_name(name: &str) -> bool {
    name.len() <= MAX_NAME_LEN && !name.contains(['"', '<', '>', '\n'])
}

/// Reads `NAME">` after an opening `... name="`.
fn read_name(s: &str) -> NameRead {
    match s.find('"') {
        Some(q) if !writable_name(&s[..q]) => NameRead::Bad,
        Some(q) => match s[q + 1..].chars().next() {
            Some('>') => NameRead::Done(s[..q].to_string(), q + 2),
            Some(_) => NameRead::Bad,
            None => NameRead::Wait,
        },
        None if !writable_name(s) => NameRead::Bad,
        None => NameRead::Wait,
    }
}

fn leading_ws(s: &str) -> usize {
    s.len() - s.trim_start().len()
}

fn content(out: &mut Vec<ToolEvent>, text: &str) {
    if text.is_empty() {
        return;
    }
    if let Some(ToolEvent::Content(c)) = out.last_mut() {
        c.push_str(text);
    } else {
        out.push(ToolEvent::Content(text.to_string()));
    }
}
