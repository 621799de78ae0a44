//! Guided tool calls, the grammar against the parser's typing: a block the tool-call grammar
//! admits reaches the client as arguments that parse, keep what the model wrote, and satisfy
//! the tool's schema (each case here once failed one of those).

use std::sync::Arc;

use serde_json::{Value as Json, json};

use super::matcher::State;
use super::matcher::tool_tests::TAGS;
use super::schema::{CallTool, Grammar};
use crate::text::format::ModelFormat;
use crate::text::request::{ToolChoice, ToolSet, parse_tools};
use crate::text::toolcall::{CallIds, ParsedCall, ToolCallParser, ToolEvent};

struct Case {
    g: Grammar,
    tools: Arc<ToolSet>,
}

fn case(params: Json) -> Case {
    let tools_json = json!([{"type": "function", "function": {"name": "f", "parameters": params}}]);
    let tools = Arc::new(parse_tools(Some(&tools_json)).unwrap());
    let specs: Vec<CallTool<'_>> = tools.iter().map(|s| CallTool { name: &s.name, parameters: &s.parameters }).collect();
    let g = Grammar::tool_calls(&specs, TAGS, 1).unwrap();
    Case { g, tools }
}

/// The block's body (after `<minimax:tool_call>`) for one call of `f` with `x` = `value`.
fn body(value: &str) -> String {
    format!("<invoke name=\"f\"><parameter name=\"x\">{value}</parameter></invoke></minimax:tool_call>")
}

impl Case {
    /// Whether the guided grammar lets the model write this whole block.
    fn admits(&self, body: &str) -> bool {
        let mut s = State::start(&self.g);
        s.feed(&self.g, body.as_bytes()) && s.at_end()
    }

    /// What the parser makes of the block: the calls and the content text.
    fn parse(&self, body: &str) -> (Vec<ParsedCall>, String) {
        let fmt = ModelFormat::minimax_m2();
        let mut p = ToolCallParser::new(fmt.tool_calls.clone(), self.tools.clone(), ToolChoice::Required, true, CallIds::default());
        let mut ev = p.push(&format!("{}{body}", fmt.tool_calls.block_open));
        ev.extend(p.finish());
        let content: String = ev.iter().filter_map(|e| if let ToolEvent::Content(c) = e { Some(c.as_str()) } else { None }).collect();
        (p.calls().to_vec(), content)
    }

    /// Asserts the grammar admits `value` and that the client gets `want` as `x`, in a valid call.
    fn check(&self, value: &str, want: Json) {
        let b = body(value);
        assert!(self.admits(&b), "the grammar refuses {b}");
        let (calls, content) = self.parse(&b);
        assert_eq!(calls.len(), 1, "calls {calls:?}, content {content:?}");
        let args: Json = serde_json::from_str(&calls[0].arguments).expect("arguments parse");
        assert_eq!(args, json!({"x": want}), "arguments text {}", calls[0].arguments);
        assert_eq!(calls[0].arguments, serde_json::to_string(&json!({"x": want})).unwrap(), "arguments text as sent");
        assert!(calls[0].is_valid(), "problems: {:?}", calls[0].problems);
    }
}

// 1. An enum / const with a non-string member (or a string enum inside anyOf next to a
//    non-string type): string members are written verbatim, as the template writes them,
//    the others as JSON; a quoted member would reach the client with its quotes.

#[test]
fn optional_string_enum_is_written_verbatim() {
    // pydantic's Optional[Literal["a", "b"]].
    let c = case(json!({"type": "object", "properties": {"x": {"anyOf": [{"enum": ["a", "b"], "type": "string"}, {"type": "null"}]}}, "required": ["x"]}));
    c.check("a", json!("a"));
    c.check("null", json!(null));
    assert!(!c.admits(&body("\"a\"")) && !c.admits(&body("c")));
    // Verbatim text starts at the tag: whitespace first would be part of the string.
    assert!(!c.admits(&body(" a")) && !c.admits(&body("\na")) && !c.admits(&body(" null")));
}

#[test]
fn mixed_enum_members_are_written_as_the_template_writes_them() {
    let c = case(json!({"type": "object", "properties": {"x": {"enum": ["auto", 1, null]}}, "required": ["x"]}));
    c.check("1", json!(1));
    c.check("auto", json!("auto"));
    c.check("null", json!(null));
    assert!(!c.admits(&body("\"auto\"")) && !c.admits(&body("2")) && !c.admits(&body(" auto")));
}

// 2. `-0` for an integer: the grammar admits it (it is JSON), and the client gets the integer
//    0, not the float -0.0 serde_json reads.

#[test]
fn minus_zero_integer_arrives_as_an_integer() {
    let c = case(json!({"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}));
    c.check("0", json!(0));
    c.check("-0", json!(0));
}

// 3. `</parameter>` inside a JSON string of an object / array parameter: the grammar lets it be
//    part of the string, and the parser reads on past it.

#[test]
fn closing_tag_inside_a_json_string_parameter() {
    let c = case(json!({"type": "object", "properties": {"x": {"type": "array", "items": {"type": "string"}}}, "required": ["x"]}));
    c.check("[\"a\"]", json!(["a"]));
    c.check("[\"</parameter>\"]", json!(["</parameter>"]));
}

// 4. OpenAPI `nullable`: the grammar admits `null`, and the typing and the validator read it
//    as null too.

#[test]
fn nullable_integer_null_arrives_as_null() {
    let c = case(json!({"type": "object", "properties": {"x": {"type": "integer", "nullable": true}}, "required": ["x"]}));
    c.check("5", json!(5));
    c.check("null", json!(null));
}

// 5. `$ref` / `allOf` parameters (pydantic's enums and nested models) are held to what they
//    refer to.

#[test]
fn referenced_enum_parameter_is_held_to_the_enum() {
    let c = case(json!({
        "type": "object",
        "$defs": {"Color": {"enum": ["red", "green"], "type": "string"}},
        "properties": {"x": {"$ref": "#/$defs/Color"}},
        "required": ["x"]
    }));
    c.check("red", json!("red"));
    assert!(!c.admits(&body("purple")), "a $ref'd enum admits any text: {:?}", c.parse(&body("purple")).0[0].problems);
}

#[test]
fn all_of_integer_parameter_is_held_to_integers() {
    let c = case(json!({"type": "object", "properties": {"x": {"allOf": [{"type": "integer"}], "description": "n"}}, "required": ["x"]}));
    c.check("7", json!(7));
    assert!(!c.admits(&body("seven")), "allOf admits any text: {:?}", c.parse(&body("seven")).0[0].problems);
}

// 6. A string parameter's minLength / maxLength (without a pattern) are enforced, in
//    characters; the text may hold `<` (only the closing tag ends it).

#[test]
fn string_parameter_length_is_enforced() {
    let c = case(json!({"type": "object", "properties": {"x": {"type": "string", "minLength": 2, "maxLength": 3}}, "required": ["x"]}));
    c.check("abc", json!("abc"));
    c.check("a<b", json!("a<b"));
    c.check("éé", json!("éé"));
    assert!(!c.admits(&body("abcdef")), "maxLength not enforced: {:?}", c.parse(&body("abcdef")).0[0].problems);
    assert!(!c.admits(&body("a")), "minLength not enforced");
    // A pattern's text may hold `<` too, never the closing tag.
    let p = case(json!({"type": "object", "properties": {"x": {"type": "string", "pattern": "^<[a-z]+>$"}}, "required": ["x"]}));
    p.check("<div>", json!("<div>"));
}

// 7. A parameter whose name holds `"` can never be written between the tag's quotes: a tool
//    that requires one is left out of the grammar (no guided call of it; none at all when no
//    tool is left), an optional one is left out of its tool.

#[test]
fn unwritable_parameter_names_leave_no_dead_end() {
    let tags = TAGS;
    let required = json!({"type": "object", "properties": {"a\"b": {"type": "integer"}}, "required": ["a\"b"]});
    assert!(Grammar::tool_calls(&[CallTool { name: "f", parameters: &required }], tags, 1).is_none());
    let g = Grammar::tool_calls(&[CallTool { name: "f", parameters: &required }, CallTool { name: "h", parameters: &json!({}) }], tags, 1).unwrap();
    let mut s = State::start(&g);
    assert!(!s.feed(&g, b"<invoke name=\"f\""), "f cannot be called");
    let optional = json!({"type": "object", "properties": {"a\"b": {"type": "integer"}, "n": {"type": "integer"}}, "required": ["n"]});
    let g = Grammar::tool_calls(&[CallTool { name: "f", parameters: &optional }], tags, 1).unwrap();
    let mut s = State::start(&g);
    assert!(s.feed(&g, b"<invoke name=\"f\">"), "the call opens");
    assert_eq!(super::review_tests::completable(&g, &s, 200_000), Some(true), "no way to finish the call");
}

// 8. A reasoning block the model opens itself (the prompt did not): the constraint reads it
//    as the output parser does, so a block inside it is reasoning to both.

#[test]
fn a_block_inside_a_self_opened_think_is_seen_by_both_or_neither() {
    use super::vocab::{TokenIndex, allows};
    use super::{Constraint, ConstraintSpec, Mode, Rule};
    use crate::text::reasoning::{ReasoningMode, ReasoningSplitter};

    const EOG: u32 = 256;
    let items: Vec<(u32, Vec<u8>)> = (0..=255u8).map(|b| (b as u32, vec![b])).collect();
    let index = Arc::new(TokenIndex::from_tokens(257, items, vec![EOG]));
    let params = json!({"type": "object", "properties": {}});
    let fmt = ModelFormat::minimax_m2();
    let grammar = Grammar::tool_calls(&[CallTool { name: "f", parameters: &params }], TAGS, 1).unwrap();
    let open = fmt.tool_calls.block_open;
    let reasoning = Some((fmt.reasoning.open.as_bytes().to_vec(), fmt.reasoning.close.as_bytes().to_vec()));
    let spec = Arc::new(ConstraintSpec { grammar, index, reasoning, starts_in_reasoning: false, mode: Mode::ToolCalls { open: open.as_bytes().to_vec(), must_call: false } });
    let mut c = Constraint::new(spec);
    let text = format!("<think>\nMaybe {open}<invoke name=\"f\"></invoke></minimax:tool_call>");
    for b in text.bytes() {
        c.advance(b as u32).unwrap();
    }
    let may_close_reasoning = match c.rule() {
        Rule::Free | Rule::NoEnd => true,
        Rule::Only(m) => allows(&m.mask, b'<' as u32),
    };
    let mut split = ReasoningSplitter::new(fmt.reasoning.clone(), ReasoningMode::Parsed, false);
    let a = split.push(&text);
    let b = split.finish();
    let content = a.content + &b.content;
    assert!(
        may_close_reasoning || content.contains(open),
        "the constraint counted the block as the answer's call and allows only the end, but the parser sees it as reasoning (content {content:?}, reasoning {:?})",
        a.reasoning + &b.reasoning
    );
}
