//! Request validation: every rejection names the message index and field (HTTP 400 `param`).

use minimax_gateway::text::reasoning::ReasoningMode;
use minimax_gateway::text::request::{ChatText, Content, Role, ToolChoice};
use serde_json::{Value, json};

fn chat(v: Value) -> ChatText {
    serde_json::from_value(v).unwrap()
}

fn err_param(v: Value) -> (String, String) {
    let e = chat(v).validate().unwrap_err();
    (e.param, e.message)
}

fn call(args: Value) -> Value {
    json!({"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}})
}

#[test]
fn rejections_name_the_field() {
    let user = json!({"role": "user", "content": "hi"});
    let cases: Vec<(Value, &str, &str)> = vec![
        (json!({"messages": []}), "messages", "at least one"),
        (
            json!({"messages": [user, {"role": "robot", "content": "x"}]}),
            "messages[1].role",
            "unknown role `robot`",
        ),
        (
            json!({"messages": [{"content": "x"}]}),
            "messages[0].role",
            "required",
        ),
        (json!({"messages": [5]}), "messages[0]", "object"),
        (
            json!({"messages": [user, {"role": "tool", "tool_call_id": "c1", "content": "r"}]}),
            "messages[1]",
            "must follow an assistant message with tool_calls",
        ),
        (
            json!({"messages": [user, {"role": "assistant", "content": "no calls"}, {"role": "tool", "content": "r"}]}),
            "messages[2]",
            "tool_calls",
        ),
        (
            json!({"messages": [user, {"role": "assistant", "tool_calls": [call(json!("[1, 2]"))]}]}),
            "messages[1].tool_calls[0].function.arguments",
            "JSON object",
        ),
        (
            json!({"messages": [user, {"role": "assistant", "tool_calls": [call(json!("{bad json"))]}]}),
            "messages[1].tool_calls[0].function.arguments",
            "not valid JSON",
        ),
        (
            json!({"messages": [user, user, user, {"role": "assistant", "tool_calls": [call(json!(42))]}]}),
            "messages[3].tool_calls[0].function.arguments",
            "JSON object",
        ),
        (
            json!({"messages": [user, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}]}),
            "messages[1].tool_calls[0].function.name",
            "non-empty",
        ),
        (
            json!({"messages": [user, {"role": "assistant", "tool_calls": [{"type": "retrieval", "function": {"name": "f"}}]}]}),
            "messages[1].tool_calls[0].type",
            "function",
        ),
        (
            json!({"messages": [user, {"role": "assistant", "tool_calls": "f()"}]}),
            "messages[1].tool_calls",
            "array",
        ),
        (
            json!({"messages": [user, {"role": "assistant", "tool_calls": [call(json!("{}"))]}, {"role": "tool", "tool_call_id": "zz", "content": "r"}]}),
            "messages[2].tool_call_id",
            "`zz`",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            "messages[0].content[0].type",
            "text only",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
            "messages[0].content[0].text",
            "string",
        ),
        (
            json!({"messages": [{"role": "user", "content": null}]}),
            "messages[0].content",
            "required",
        ),
        (
            json!({"messages": [{"role": "user", "content": 3}]}),
            "messages[0].content",
            "string or an array",
        ),
        (
            json!({"messages": [user, {"role": "system", "content": "late"}]}),
            "messages[1].role",
            "first message",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x", "reasoning_content": "r"}]}),
            "messages[0].reasoning_content",
            "assistant",
        ),
        (json!({"messages": [user], "tools": {}}), "tools", "array"),
        (
            json!({"messages": [user], "tools": [{"type": "function", "function": {"name": "a b"}}]}),
            "tools[0].function.name",
            "whitespace",
        ),
        (
            json!({"messages": [user], "tools": [{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "a"}}]}),
            "tools[1].function.name",
            "duplicate",
        ),
        (
            json!({"messages": [user], "tools": [{"type": "function", "function": {"name": "a", "parameters": {"type": 7}}}]}),
            "tools[0].function.parameters",
            "JSON schema",
        ),
        (
            json!({"messages": [user], "tools": [{"type": "code_interpreter"}]}),
            "tools[0].type",
            "function",
        ),
        (
            json!({"messages": [user], "tool_choice": "required"}),
            "tool_choice",
            "at least one tool",
        ),
        (
            json!({"messages": [user], "tool_choice": "sometimes"}),
            "tool_choice",
            "unknown value",
        ),
        (
            json!({"messages": [user], "tools": [{"type": "function", "function": {"name": "a"}}],
                "tool_choice": {"type": "function", "function": {"name": "b"}}}),
            "tool_choice.function.name",
            "no tool named `b`",
        ),
        (
            json!({"messages": [user], "chat_template_kwargs": [1]}),
            "chat_template_kwargs",
            "object",
        ),
        (
            json!({"messages": [user], "reasoning_format": "weird"}),
            "reasoning_format",
            "unknown value",
        ),
    ];
    for (req, param, needle) in cases {
        let (p, m) = err_param(req.clone());
        assert_eq!(p, param, "{req}");
        assert!(m.contains(needle), "{param}: {m:?} lacks {needle:?}");
    }
}

#[test]
fn accepted_shapes_are_normalized() {
    let v = chat(json!({
        "messages": [
            {"role": "developer", "content": "rules", "current_date": "2025-01-01"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null, "reasoning": "thought",
             "tool_calls": [call(json!("{\"x\": [1, {\"y\": true}]}")), call(json!({"z": 1})), call(json!(""))]},
            {"role": "tool", "tool_call_id": "c1", "content": "r1"},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "r2"}]}
        ],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "reasoning_format": "none",
        "parallel_tool_calls": false
    }))
    .validate()
    .unwrap();
    assert_eq!(v.messages[0].role, Role::System);
    assert_eq!(
        v.messages[0].to_template_json()["current_date"],
        "2025-01-01"
    );
    assert_eq!(
        v.messages[1].content,
        Content::Parts(vec!["a".into(), "b".into()])
    );
    let a = &v.messages[2];
    assert_eq!(a.content, Content::Text(String::new()));
    assert_eq!(a.reasoning_content.as_deref(), Some("thought"));
    assert_eq!(
        Value::Object(a.tool_calls[0].arguments.clone()),
        json!({"x": [1, {"y": true}]})
    );
    assert_eq!(
        Value::Object(a.tool_calls[1].arguments.clone()),
        json!({"z": 1})
    );
    assert!(a.tool_calls[2].arguments.is_empty());
    assert_eq!(
        a.to_template_json()["tool_calls"][0]["function"]["arguments"],
        json!({"x": [1, {"y": true}]})
    );
    assert_eq!(v.tool_choice, ToolChoice::Auto);
    assert!(!v.parallel_tool_calls);
    assert_eq!(v.reasoning, Some(ReasoningMode::Raw));
}

#[test]
fn tool_choice_defaults_and_none_hides_tools() {
    let tools = json!([{"type": "function", "function": {"name": "f"}}]);
    let user = json!([{"role": "user", "content": "x"}]);
    let v = chat(json!({"messages": user})).validate().unwrap();
    assert_eq!(v.tool_choice, ToolChoice::None);
    let v = chat(json!({"messages": user, "tools": tools}))
        .validate()
        .unwrap();
    assert_eq!((v.tool_choice, v.tools.len()), (ToolChoice::Auto, 1));
    let v = chat(json!({"messages": user, "tools": tools, "tool_choice": "none"}))
        .validate()
        .unwrap();
    assert_eq!((v.tool_choice, v.tools.len()), (ToolChoice::None, 0));
    let v = chat(json!({"messages": user, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}}))
        .validate()
        .unwrap();
    assert_eq!(v.tool_choice, ToolChoice::Function("f".into()));
}
