//! Streaming tool-call and reasoning parsing of model output, including every split of the
//! text across stream chunks and round trips through the chat template.

use std::path::PathBuf;
use std::sync::Arc;

use minimax_gateway::text::format::ModelFormat;
use minimax_gateway::text::output::{
    Delta, FinishReason, Finished, OutputOptions, OutputParser, StopCause,
};
use minimax_gateway::text::prompt::{PipelineConfig, TextPipeline};
use minimax_gateway::text::reasoning::ReasoningMode;
use minimax_gateway::text::request::{ChatText, ToolChoice, parse_tools};
use minimax_gateway::text::tokenizer::Tokenizer;
use minimax_gateway::text::toolcall::CallIds;
use serde_json::{Value, json};

fn tokenizer() -> Arc<Tokenizer> {
    static TOK: std::sync::OnceLock<Arc<Tokenizer>> = std::sync::OnceLock::new();
    TOK.get_or_init(|| {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/m2-small/f32.gguf");
        Arc::new(Tokenizer::from_gguf(path, &ModelFormat::minimax_m2()).unwrap())
    })
    .clone()
}

fn tools_json() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
            "properties": {"location": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
                           "opts": {"type": "object"}, "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["location"]}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    ])
}

fn options(choice: ToolChoice, parallel: bool, in_reasoning: bool) -> OutputOptions {
    OutputOptions {
        reasoning: ReasoningMode::Parsed,
        starts_in_reasoning: in_reasoning,
        tools: Arc::new(parse_tools(Some(&tools_json())).unwrap()),
        tool_choice: choice,
        parallel_tool_calls: parallel,
        call_ids: CallIds::Sequential {
            prefix: "call_".into(),
            next: 0,
        },
    }
}

/// What a client reconstructs from the deltas.
#[derive(Debug, Default, PartialEq)]
struct Assembled {
    reasoning: String,
    content: String,
    calls: Vec<(String, String, String)>,
}

fn assemble(deltas: &[Delta], into: &mut Assembled) {
    for d in deltas {
        match d {
            Delta::Reasoning(r) => into.reasoning.push_str(r),
            Delta::Content(c) => into.content.push_str(c),
            Delta::ToolCallStart { index, id, name } => {
                assert_eq!(*index, into.calls.len(), "calls start in order");
                into.calls.push((id.clone(), name.clone(), String::new()));
            }
            Delta::ToolCallArguments { index, chunk } => {
                assert!(!into.calls[*index].1.is_empty(), "name precedes arguments");
                into.calls[*index].2.push_str(chunk)
            }
        }
    }
}

fn run(chunks: &[&str], opts: OutputOptions, cause: StopCause) -> (Assembled, Finished) {
    let mut p = OutputParser::new(tokenizer(), ModelFormat::minimax_m2(), opts);
    let mut a = Assembled::default();
    for c in chunks {
        assemble(&p.push_text(c), &mut a);
    }
    let fin = p.finish(cause);
    assemble(&fin.deltas, &mut a);
    (a, fin)
}

fn auto() -> OutputOptions {
    options(ToolChoice::Auto, true, true)
}

const ANSWER: &str = "Need weather.\n</think>\n\nLet me check.<minimax:tool_call>\n<invoke name=\"get_weather\">\n\
<parameter name=\"location\">Paris, <France></parameter>\n<parameter name=\"days\">3</parameter>\n\
<parameter name=\"metric\">true</parameter>\n<parameter name=\"opts\">{\"a\": [1, {\"b\": null}]}</parameter>\n\
<parameter name=\"tags\">[\"x\", \"é\"]</parameter>\n</invoke>\n<invoke name=\"get_time\">\n</invoke>\n\
</minimax:tool_call>";

fn expected_answer() -> Assembled {
    Assembled {
        reasoning: "Need weather.".into(),
        content: "Let me check.".into(),
        calls: vec![
            (
                "call_0".into(),
                "get_weather".into(),
                r#"{"location":"Paris, <France>","days":3,"metric":true,"opts":{"a":[1,{"b":null}]},"tags":["x","é"]}"#.into(),
            ),
            ("call_1".into(), "get_time".into(), "{}".into()),
        ],
    }
}

#[test]
fn parses_a_full_answer() {
    let (a, fin) = run(&[ANSWER], auto(), StopCause::EndOfGeneration);
    assert_eq!(a, expected_answer());
    assert_eq!(fin.finish_reason, FinishReason::ToolCalls);
    assert!(
        fin.tool_calls.iter().all(|c| c.is_valid()),
        "{:?}",
        fin.tool_calls
    );
    assert_eq!(fin.content, "Let me check.");
    assert_eq!(fin.reasoning_content, "Need weather.");
    assert_eq!(fin.tool_calls[0].arguments, expected_answer().calls[0].2);
    assert!(fin.tool_choice_error.is_none());
}

#[test]
fn every_two_way_split_gives_the_same_answer() {
    let want = expected_answer();
    let idx: Vec<usize> = (0..=ANSWER.len())
        .filter(|&i| ANSWER.is_char_boundary(i))
        .collect();
    for &i in &idx {
        let (a, _) = run(
            &[&ANSWER[..i], &ANSWER[i..]],
            auto(),
            StopCause::EndOfGeneration,
        );
        assert_eq!(a, want, "split at {i}");
    }
}

#[test]
fn every_three_way_split_of_the_tags_gives_the_same_answer() {
    // All pairs of split points inside a shorter answer (covers every tag boundary).
    let text = "r</think>\n\nA<minimax:tool_call>\n<invoke name=\"get_time\">\n</invoke>\n</minimax:tool_call>B";
    let want = Assembled {
        reasoning: "r".into(),
        content: "AB".into(),
        calls: vec![("call_0".into(), "get_time".into(), "{}".into())],
    };
    let idx: Vec<usize> = (0..=text.len()).collect();
    for &i in &idx {
        for &j in idx.iter().filter(|&&j| j >= i) {
            let (a, _) = run(
                &[&text[..i], &text[i..j], &text[j..]],
                auto(),
                StopCause::EndOfGeneration,
            );
            assert_eq!(a, want, "split at {i},{j}");
        }
    }
}

#[test]
fn one_character_at_a_time() {
    let chunks: Vec<String> = ANSWER.chars().map(String::from).collect();
    let refs: Vec<&str> = chunks.iter().map(String::as_str).collect();
    let (a, _) = run(&refs, auto(), StopCause::EndOfGeneration);
    assert_eq!(a, expected_answer());
}

#[test]
fn arguments_stream_per_parameter_after_the_name() {
    let mut p = OutputParser::new(
        tokenizer(),
        ModelFormat::minimax_m2(),
        options(ToolChoice::Auto, true, false),
    );
    let d = p.push_text("<minimax:tool_call>\n<invoke name=\"get_weather\">\n");
    assert_eq!(
        d,
        vec![Delta::ToolCallStart {
            index: 0,
            id: "call_0".into(),
            name: "get_weather".into()
        }]
    );
    assert_eq!(p.push_text("<parameter name=\"location\">Ro"), vec![]);
    assert_eq!(
        p.push_text("me</parameter>"),
        vec![Delta::ToolCallArguments {
            index: 0,
            chunk: r#"{"location":"Rome""#.into()
        }]
    );
    assert_eq!(
        p.push_text("\n</invoke>"),
        vec![Delta::ToolCallArguments {
            index: 0,
            chunk: "}".into()
        }]
    );
}

#[test]
fn several_blocks_and_text_around_them() {
    let text = "A<minimax:tool_call><invoke name=\"get_time\"></invoke></minimax:tool_call>B\n\
<minimax:tool_call>\n<invoke name=\"get_weather\"><parameter name=\"location\">X</parameter></invoke>\n</minimax:tool_call>C";
    let (a, fin) = run(
        &[text],
        options(ToolChoice::Auto, true, false),
        StopCause::EndOfGeneration,
    );
    assert_eq!(a.content, "AB\nC");
    assert_eq!(
        a.calls.iter().map(|c| c.1.as_str()).collect::<Vec<_>>(),
        ["get_time", "get_weather"]
    );
    assert_eq!(fin.finish_reason, FinishReason::ToolCalls);
}

#[test]
fn values_that_do_not_fit_the_schema_stay_strings_and_flag_the_call() {
    let text = "<minimax:tool_call><invoke name=\"get_weather\"><parameter name=\"location\">P</parameter>\
<parameter name=\"days\">three</parameter></invoke></minimax:tool_call>";
    let (a, fin) = run(
        &[text],
        options(ToolChoice::Auto, true, false),
        StopCause::EndOfGeneration,
    );
    assert_eq!(a.calls[0].2, r#"{"location":"P","days":"three"}"#);
    assert!(!fin.tool_calls[0].is_valid());
    assert!(
        fin.tool_calls[0]
            .problems
            .iter()
            .any(|p| p.contains("days")),
        "{:?}",
        fin.tool_calls[0].problems
    );
}

#[test]
fn schema_violations_and_unknown_tools_are_flagged() {
    let text = "<minimax:tool_call><invoke name=\"get_weather\"><parameter name=\"days\">2</parameter></invoke>\
<invoke name=\"nope\"></invoke></minimax:tool_call>";
    let (_, fin) = run(
        &[text],
        options(ToolChoice::Auto, true, false),
        StopCause::EndOfGeneration,
    );
    assert!(
        fin.tool_calls[0]
            .problems
            .iter()
            .any(|p| p.contains("location")),
        "{:?}",
        fin.tool_calls[0]
    );
    assert!(
        fin.tool_calls[1]
            .problems
            .iter()
            .any(|p| p.contains("no tool named `nope`"))
    );
}

#[test]
fn malformed_xml_degrades_to_content() {
    for text in [
        "<minimax:tool_call>\nhello there",
        "<minimax:tool_call><invoke nam=\"x\"></invoke></minimax:tool_call>",
        "<minimax:tool_call><invoke name=\"get_time\"",
    ] {
        let (a, fin) = run(
            &[text],
            options(ToolChoice::Auto, true, false),
            StopCause::EndOfGeneration,
        );
        assert_eq!(a.content, text, "{text}");
        assert!(a.calls.is_empty());
        assert_eq!(fin.finish_reason, FinishReason::Stop);
    }
    // Garbage after a good block keeps the good call and returns the rest as content.
    let text = "<minimax:tool_call><invoke name=\"get_time\"></invoke>oops</minimax:tool_call>";
    let (a, _) = run(
        &[text],
        options(ToolChoice::Auto, true, false),
        StopCause::EndOfGeneration,
    );
    assert_eq!(a.calls.len(), 1);
    assert_eq!(a.content, "oops</minimax:tool_call>");
}

#[test]
fn truncation_inside_a_call_closes_it_and_says_length() {
    let text = "<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"location\">Oslo</parameter>\n<parameter name=\"days\">4";
    let (a, fin) = run(
        &[text],
        options(ToolChoice::Auto, true, false),
        StopCause::Length,
    );
    assert_eq!(a.calls.len(), 1);
    assert_eq!(
        a.calls[0].2, r#"{"location":"Oslo"}"#,
        "arguments are closed, valid JSON"
    );
    serde_json::from_str::<Value>(&a.calls[0].2).unwrap();
    assert!(!fin.tool_calls[0].is_valid());
    assert_eq!(fin.finish_reason, FinishReason::Length);
    assert_eq!(a.content, "\n<parameter name=\"days\">4");
}

#[test]
fn tool_choice_none_keeps_call_text_as_content() {
    let text = "<minimax:tool_call><invoke name=\"get_time\"></invoke></minimax:tool_call>";
    let (a, fin) = run(
        &[text],
        options(ToolChoice::None, true, false),
        StopCause::EndOfGeneration,
    );
    assert_eq!(a.content, text);
    assert!(a.calls.is_empty());
    assert_eq!(fin.finish_reason, FinishReason::Stop);
}

#[test]
fn required_and_named_choices_report_unmet_demands() {
    let (_, fin) = run(
        &["just text"],
        options(ToolChoice::Required, true, false),
        StopCause::EndOfGeneration,
    );
    assert!(fin.tool_choice_error.unwrap().0.contains("required"));
    let call = "<minimax:tool_call><invoke name=\"get_time\"></invoke></minimax:tool_call>";
    let (_, fin) = run(
        &[call],
        options(ToolChoice::Required, true, false),
        StopCause::EndOfGeneration,
    );
    assert!(fin.tool_choice_error.is_none());
    let (_, fin) = run(
        &[call],
        options(ToolChoice::Function("get_weather".into()), true, false),
        StopCause::EndOfGeneration,
    );
    let err = fin.tool_choice_error.unwrap().0;
    assert!(
        err.contains("get_weather") && err.contains("get_time"),
        "{err}"
    );
    assert!(!fin.tool_calls[0].is_valid());
}

#[test]
fn parallel_false_keeps_only_the_first_call() {
    let text = "<minimax:tool_call><invoke name=\"get_time\"></invoke><invoke name=\"get_weather\">\
<parameter name=\"location\">A</parameter></invoke></minimax:tool_call><minimax:tool_call><invoke name=\"get_time\"></invoke></minimax:tool_call>";
    let (a, fin) = run(
        &[text],
        options(ToolChoice::Auto, false, false),
        StopCause::EndOfGeneration,
    );
    assert_eq!(a.calls.len(), 1);
    assert_eq!(a.calls[0].1, "get_time");
    assert_eq!(fin.dropped_tool_calls, 2);
    assert_eq!(a.content, "");
}

#[test]
fn random_ids_are_unique_within_a_response() {
    let mut opts = options(ToolChoice::Auto, true, false);
    opts.call_ids = CallIds::default();
    let text = "<minimax:tool_call>".to_string()
        + &"<invoke name=\"get_time\"></invoke>".repeat(20)
        + "</minimax:tool_call>";
    let (a, _) = run(&[&text], opts, StopCause::EndOfGeneration);
    let ids: std::collections::HashSet<_> = a.calls.iter().map(|c| c.0.clone()).collect();
    assert_eq!(ids.len(), 20);
    assert!(ids.iter().all(|id| id.starts_with("call_")));
}

#[test]
fn tool_call_text_inside_reasoning_is_reasoning() {
    let text = "maybe <minimax:tool_call><invoke name=\"get_time\"></invoke></minimax:tool_call></think>\n\nno call";
    let (a, _) = run(&[text], auto(), StopCause::EndOfGeneration);
    assert!(a.calls.is_empty());
    assert!(a.reasoning.contains("<minimax:tool_call>"));
    assert_eq!(a.content, "no call");
}

#[test]
fn raw_reasoning_mode_returns_everything_as_content() {
    let mut opts = options(ToolChoice::None, true, true);
    opts.reasoning = ReasoningMode::Raw;
    let (a, _) = run(&["r\n</think>\n\nc"], opts, StopCause::EndOfGeneration);
    assert_eq!(
        (a.reasoning.as_str(), a.content.as_str()),
        ("", "r\n</think>\n\nc")
    );
}

#[test]
fn token_ids_give_the_same_result_as_text_and_eog_is_silent() {
    let tok = tokenizer();
    let mut ids = tok.encode_trusted(ANSWER).unwrap();
    ids.push(tok.eos_id().unwrap());
    let mut p = OutputParser::new(tok.clone(), ModelFormat::minimax_m2(), auto());
    let mut a = Assembled::default();
    for id in ids {
        assemble(&p.push_token(id), &mut a);
    }
    let fin = p.finish(StopCause::EndOfGeneration);
    assemble(&fin.deltas, &mut a);
    assert_eq!(a, expected_answer());
}

/// Renders an assistant turn through the real template and parses it back.
#[test]
fn calls_round_trip_through_the_chat_template() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/m2-small/f32.gguf");
    let model = minimax_shared::gguf::GgufModel::open(path).unwrap();
    let pipeline =
        TextPipeline::from_gguf_metadata(model.metadata(), PipelineConfig::default()).unwrap();
    let args = [
        json!({"location": "Zürich \"HQ\" <main>", "days": 7, "metric": false,
               "opts": {"nested": {"deep": [1, 2.5, "x"]}, "n": null}, "tags": ["a", "b c", "ü"]}),
        json!({"location": "multi\nline\nvalue", "tags": []}),
    ];
    let calls: Vec<Value> = args
        .iter()
        .enumerate()
        .map(|(i, a)| {
            json!({"id": format!("c{i}"), "type": "function",
                             "function": {"name": "get_weather", "arguments": a.to_string()}})
        })
        .collect();
    let req: ChatText = serde_json::from_value(json!({
        "messages": [{"role": "user", "content": "go"},
                     {"role": "assistant", "content": "Calling.", "reasoning_content": "Plan it.", "tool_calls": calls},
                     {"role": "tool", "tool_call_id": "c0", "content": "ok"},
                     {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
        "tools": tools_json()
    }))
    .unwrap();
    let prompt = pipeline.prepare(&req).unwrap().prompt;
    // The assistant turn as the model would have generated it after "]~b]ai\n<think>\n".
    let turn = prompt
        .split("]~b]ai\n")
        .nth(1)
        .unwrap()
        .split("[e~[")
        .next()
        .unwrap();
    let generated = turn
        .strip_prefix("<think>\n")
        .expect("reasoning rendered after the last user turn");
    let (a, fin) = run(&[generated], auto(), StopCause::EndOfGeneration);
    assert_eq!(a.reasoning, "Plan it.");
    assert_eq!(a.content, "Calling.");
    assert_eq!(a.calls.len(), 2);
    for (call, want) in a.calls.iter().zip(&args) {
        assert_eq!(call.1, "get_weather");
        assert_eq!(&serde_json::from_str::<Value>(&call.2).unwrap(), want);
    }
    assert!(
        fin.tool_calls.iter().all(|c| c.is_valid()),
        "{:?}",
        fin.tool_calls
    );
    // And chunked at every point, the same.
    for i in (0..=generated.len()).filter(|&i| generated.is_char_boundary(i)) {
        let (b, _) = run(
            &[&generated[..i], &generated[i..]],
            auto(),
            StopCause::EndOfGeneration,
        );
        assert_eq!(
            b.calls.iter().map(|c| &c.2).collect::<Vec<_>>(),
            a.calls.iter().map(|c| &c.2).collect::<Vec<_>>()
        );
    }
}
