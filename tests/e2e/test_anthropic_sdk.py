"""The official Anthropic Python SDK against the real gateway + CPU ranks (`/v1/messages`)."""

import json
import urllib.error
import urllib.request

import anthropic
import pytest

TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather forecast",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    }
]


@pytest.fixture(scope="session")
def claude(server):
    # The SDK sends the key as `x-api-key`.
    return anthropic.Anthropic(base_url=server.base, api_key=server.api_key, max_retries=0, timeout=120)


def test_message_and_usage(claude):
    m = claude.messages.create(model="m2-small", max_tokens=8, messages=[{"role": "user", "content": "Hello"}])
    assert m.type == "message" and m.role == "assistant" and m.model == "m2-small"
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.output_tokens <= 8
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 0
    assert all(b.type in ("thinking", "text") for b in m.content)


def test_reasoning_becomes_a_thinking_block(claude):
    m = claude.messages.create(model="m2-small", max_tokens=200, messages=[{"role": "user", "content": "REPLAY:reason 2+2?"}])
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "Two plus two is four.\nNo doubt."
    assert m.content[0].signature  # never empty: clients drop unsigned thinking
    assert m.content[1].text == "The answer is 4. Ünïcödé 🎉 done."
    assert m.stop_reason == "end_turn"


def test_any_model_name_is_served(claude):
    # Anthropic clients name their own models (background tasks, subagents).
    m = claude.messages.create(model="claude-haiku-4-5", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert m.model == "m2-small"


def test_stream_rebuilds_the_message(claude):
    kw = dict(model="m2-small", max_tokens=200, messages=[{"role": "user", "content": "REPLAY:reason 2+2?"}])
    full = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in full.content]
    assert final.stop_reason == full.stop_reason
    assert final.usage.output_tokens == full.usage.output_tokens
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert events.count("content_block_start") == events.count("content_block_stop") == 2


def test_tool_use_round_trip(claude):
    msgs = [{"role": "user", "content": "REPLAY:tools What is the weather in Paris?"}]
    m = claude.messages.create(model="m2-small", max_tokens=300, tools=TOOLS, messages=msgs)
    assert m.stop_reason == "tool_use"
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    call = m.content[2]
    assert call.name == "get_weather" and call.input == {"city": "Paris", "days": 3}
    assert m.content[0].thinking == "The user wants the weather in Paris."

    # Streaming: the SDK accumulates the input_json deltas into the same input.
    with claude.messages.stream(model="m2-small", max_tokens=300, tools=TOOLS, messages=msgs) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [("get_weather", {"city": "Paris", "days": 3})]

    # The call and its result go back in the next turn, thinking included.
    follow = msgs + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 25 C"}]},
    ]
    r2 = claude.messages.create(model="m2-small", max_tokens=4, tools=TOOLS, messages=follow)
    assert r2.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # The whole history counts, the thinking sent back included (MiniMax-M2's template keeps
    # the reasoning of the turn in progress).
    n1 = claude.messages.count_tokens(model="m2-small", tools=TOOLS, messages=msgs).input_tokens
    n2 = claude.messages.count_tokens(model="m2-small", tools=TOOLS, messages=follow).input_tokens
    no_thinking = [follow[0], {"role": "assistant", "content": [b for b in follow[1]["content"] if b["type"] != "thinking"]}, follow[2]]
    n3 = claude.messages.count_tokens(model="m2-small", tools=TOOLS, messages=no_thinking).input_tokens
    assert 0 < n1 < n3 < n2

    # An image a tool returned stands as a placeholder; the turn still runs.
    with_image = msgs + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
    ]
    assert claude.messages.create(model="m2-small", max_tokens=2, tools=TOOLS, messages=with_image).usage.output_tokens <= 2


def test_stop_sequence_is_reported(claude):
    kw = dict(model="m2-small", max_tokens=100, stop_sequences=["STOP"], messages=[{"role": "user", "content": "REPLAY:stop go"}])
    m = claude.messages.create(**kw)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "STOP"
    assert m.content[-1].type == "text" and m.content[-1].text == "alpha beta "
    with claude.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "STOP")
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in m.content]


def test_errors_are_sdk_exceptions(server, claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        # Sampling fields older clients send (this SDK has none): through extra_body.
        claude.messages.create(model="m2-small", max_tokens=8, messages=[{"role": "user", "content": "x"}], extra_body={"temperature": 1.5})
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model="m2-small", max_tokens=8,
            messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}],
        )
    assert "messages[0].content[0].type" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="m2-small", max_tokens=8, messages=[{"role": "user", "content": "x"}],
                               output_config={"format": {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"not": {}}}}}})
    assert "output_config.format.schema.properties.a.not" in e.value.body["error"]["message"]
    bad = anthropic.Anthropic(base_url=server.base, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="m2-small", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    # The server still serves.
    assert claude.messages.create(model="m2-small", max_tokens=2, messages=[{"role": "user", "content": "x"}]).usage.output_tokens <= 2


def test_raw_event_framing(server):
    body = json.dumps({"model": "m2-small", "max_tokens": 200, "stream": True,
                       "messages": [{"role": "user", "content": "REPLAY:reason 2+2?"}]}).encode()
    req = urllib.request.Request(server.base + "/v1/messages", data=body,
                                 headers={"content-type": "application/json", "x-api-key": server.api_key})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    frames = [f for f in raw.split("\n\n") if f]
    for f in frames:
        ev, data = f.split("\n", 1)
        assert ev.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == ev[7:]
    assert "[DONE]" not in raw
    # Without a key: 401 in Anthropic's shape.
    req = urllib.request.Request(server.base + "/v1/messages", data=body, headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 401
    assert json.loads(e.value.read())["error"]["type"] == "authentication_error"
