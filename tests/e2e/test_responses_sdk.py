"""The official OpenAI Python SDK's Responses API (what Codex CLI speaks) against the real
gateway + CPU ranks (`/v1/responses`)."""

import json

import openai
import pytest

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather forecast",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
        "strict": False,
    }
]


def test_text_response_and_usage(client):
    r = client.responses.create(model="m2-small", input="Hello", max_output_tokens=8)
    assert r.object == "response" and r.model == "m2-small"
    assert r.status in ("completed", "incomplete")
    assert r.usage.output_tokens <= 8 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_reasoning_and_message_items(client):
    r = client.responses.create(model="m2-small", input="REPLAY:reason 2+2?", instructions="Answer briefly.")
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Two plus two is four.\nNo doubt."
    assert r.output_text == "The answer is 4. Ünïcödé 🎉 done."
    assert r.status == "completed" and r.instructions == "Answer briefly."


def test_stream_rebuilds_the_response(client):
    kw = dict(model="m2-small", input=[{"role": "user", "content": "REPLAY:reason 2+2?"}])
    full = client.responses.create(**kw)
    with client.responses.stream(**kw) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    # The deltas, per item, add up to the finished items' text, and those to the non-streamed output.
    text = {}
    for e in events:
        if e.type in ("response.reasoning_text.delta", "response.output_text.delta"):
            text[e.item_id] = text.get(e.item_id, "") + e.delta
    done = {e.item.id: e.item for e in events if e.type == "response.output_item.done"}
    assert {i: done[i].content[0].text for i in text} == text
    assert sorted(text.values()) == sorted([full.output[0].content[0].text, full.output_text])
    seqs = [e.sequence_number for e in events]
    assert seqs == list(range(len(seqs)))
    def strip(items):
        # Item ids differ between two responses; the stream helper adds `parsed` to text parts.
        def clean(v):
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items() if k not in ("id", "parsed")}
            if isinstance(v, list):
                return [clean(x) for x in v]
            return v
        return [clean(i.model_dump()) for i in items]
    assert strip(final.output) == strip(full.output)
    assert final.usage.output_tokens == full.usage.output_tokens
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 2


def test_function_call_round_trip(client):
    inp = [{"role": "user", "content": "REPLAY:tools What is the weather in Paris?"}]
    r = client.responses.create(model="m2-small", input=inp, tools=TOOLS)
    calls = [i for i in r.output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 3}
    assert [i.type for i in r.output] == ["reasoning", "message", "function_call"]

    # Streaming: the argument deltas add up to the finished call.
    with client.responses.stream(model="m2-small", input=inp, tools=TOOLS) as s:
        events = list(s)
        final = s.get_final_response()
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    sc = [i for i in final.output if i.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in sc] == [("get_weather", {"city": "Paris", "days": 3})]
    assert args == sc[0].arguments

    # Codex's next request: the whole input, the model's items included, and the output.
    follow = inp + [i.model_dump(exclude_none=True) for i in r.output] + [
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 25 C"}
    ]
    r2 = client.responses.create(model="m2-small", input=follow, tools=TOOLS, max_output_tokens=4)
    assert r2.status in ("completed", "incomplete")
    # The reasoning item reaches the prompt (the template keeps the turn in progress's).
    no_reasoning = [i for i in follow if i.get("type") != "reasoning"]
    r3 = client.responses.create(model="m2-small", input=no_reasoning, tools=TOOLS, max_output_tokens=1)
    assert r.usage.input_tokens < r3.usage.input_tokens < r2.usage.input_tokens


def test_a_codex_shaped_turn(client):
    # What Codex sends: instructions, a developer item, two user items, the model's reasoning,
    # a call of an MCP server's function (a namespace tool) and its output, a developer item
    # when settings change, the next user message; every tool kind it lists.
    tools = TOOLS + [
        {"type": "namespace", "name": "mcp__docs", "description": "Docs", "tools": [
            {"type": "function", "name": "search", "description": "Search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}]},
        {"type": "web_search"},
        APPLY_PATCH,
    ]
    inp = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<permissions>workspace-write</permissions>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<environment_context>cwd=/repo</environment_context>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Find the docs."}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Search the docs server."}], "encrypted_content": None},
        {"type": "function_call", "call_id": "call_9", "namespace": "mcp__docs", "name": "search", "arguments": "{\"q\": \"install\"}"},
        {"type": "function_call_output", "call_id": "call_9", "output": "See INSTALL.md"},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<permissions>read-only</permissions>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "REPLAY:tools and the weather?"}]},
    ]
    with client.responses.stream(model="gpt-5-codex", instructions="You are Codex.", input=inp, tools=tools,
                                 store=False, include=["reasoning.encrypted_content"], reasoning={"effort": "medium", "summary": "auto"},
                                 extra_body={"text": {"verbosity": "low"}, "prompt_cache_key": "t1"}) as s:
        kinds = [e.type for e in s]
        r = s.get_final_response()
    assert r.model == "m2-small" and r.status == "completed"
    assert [i.type for i in r.output] == ["reasoning", "message", "function_call"]
    # A summary was asked for (Codex shows summaries by default): the reasoning streams as one.
    assert "response.reasoning_summary_text.delta" in kinds and "response.reasoning_text.delta" not in kinds
    assert r.output[0].summary[0].text == r.output[0].content[0].text == "The user wants the weather in Paris."


APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Use the `apply_patch` tool to edit files. This is a FREEFORM tool, so do not wrap the patch in JSON.",
    "format": {"type": "grammar", "syntax": "lark", "definition": "start: begin_patch hunk+ end_patch\nbegin_patch: \"*** Begin Patch\" LF"},
}


def test_custom_tool_call_round_trip(client):
    # Codex's freeform apply_patch: the call comes back as a custom_tool_call with the raw patch;
    # hosted tools in the same list are left out.
    inp = [{"role": "user", "content": "REPLAY:patch create hello.txt"}]
    tools = [APPLY_PATCH, {"type": "web_search"}]
    r = client.responses.create(model="m2-small", input=inp, tools=tools)
    calls = [i for i in r.output if i.type == "custom_tool_call"]
    assert [(c.name, c.input) for c in calls] == [("apply_patch", "*** Begin Patch\n*** Add File: hello.txt\n+hello\n*** End Patch\n")]
    with client.responses.stream(model="m2-small", input=inp, tools=tools) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert [(i.type, getattr(i, "input", None)) for i in final.output if i.type == "custom_tool_call"] == [("custom_tool_call", calls[0].input)]
    assert "response.custom_tool_call_input.done" in kinds
    follow = inp + [i.model_dump(exclude_none=True) for i in r.output] + [
        {"type": "custom_tool_call_output", "call_id": calls[0].call_id, "output": "Success. Updated: A hello.txt"}
    ]
    r2 = client.responses.create(model="m2-small", input=follow, tools=tools, max_output_tokens=4)
    assert r2.usage.input_tokens > r.usage.input_tokens


def test_incomplete_at_max_output_tokens(client):
    r = client.responses.create(model="m2-small", input="REPLAY:reason 2+2?", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_errors_are_sdk_exceptions(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m2-small", input="x", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m2-small", input="x", text={"format": {"type": "json_schema", "name": "s", "schema": {"enum": []}}})
    assert e.value.body["param"] == "text.format.schema.enum"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m2-small", input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}])
    assert e.value.body["param"] == "input[0].content[0].type"
    # The server still serves.
    assert client.responses.create(model="m2-small", input="x", max_output_tokens=2).usage.output_tokens <= 2
