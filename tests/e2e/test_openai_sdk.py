"""The official OpenAI Python SDK against the real gateway + CPU ranks."""

import json

import openai
import pytest

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["m2-small"]
    assert models.data[0].model_extra["context_length"] == 4096


def test_chat(client):
    r = client.chat.completions.create(
        model="m2-small", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, seed=1
    )
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert c.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 8
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_with_usage_equals_non_stream(client):
    kw = dict(model="m2-small", messages=[{"role": "user", "content": "Stream please"}], max_tokens=12, seed=3)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    reasoning = "".join((ch.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for ch in chunks if ch.choices)
    assert content == (full.choices[0].message.content or "")
    assert reasoning == ((full.choices[0].message.model_extra or {}).get("reasoning_content") or "")
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_string_and_tokens(client):
    r = client.completions.create(model="m2-small", prompt="Once upon a time", max_tokens=6, seed=2, temperature=0)
    assert r.object == "text_completion"
    assert r.usage.completion_tokens <= 6
    ids = [10, 20, 30, 40]
    r2 = client.completions.create(model="m2-small", prompt=ids, max_tokens=4, temperature=0)
    assert r2.usage.prompt_tokens == len(ids)
    assert isinstance(r2.choices[0].text, str)


def test_tools_passed_through_and_parsed(client):
    msgs = [{"role": "user", "content": "REPLAY:tools What is the weather in Paris?"}]
    r = client.chat.completions.create(model="m2-small", messages=msgs, tools=TOOLS)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    assert call.id.startswith("call_")
    assert c.message.model_extra["reasoning_content"] == "The user wants the weather in Paris."
    assert "<minimax:tool_call>" not in (c.message.content or "")

    # Streaming: the SDK's deltas rebuild the same call.
    calls = {}
    finish = None
    for ch in client.chat.completions.create(model="m2-small", messages=msgs, tools=TOOLS, stream=True):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            slot["id"] = slot["id"] or tc.id
            if tc.function and tc.function.name:
                slot["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                slot["arguments"] += tc.function.arguments
        finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 3}

    # The call and its result go back in the next turn (history with reasoning).
    follow = msgs + [
        {"role": "assistant", "content": c.message.content, "tool_calls": [call.model_dump()],
         "reasoning_content": c.message.model_extra["reasoning_content"]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 25 C"},
    ]
    r2 = client.chat.completions.create(model="m2-small", messages=follow, tools=TOOLS, max_tokens=4)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_reasoning_split(client):
    r = client.chat.completions.create(model="m2-small", messages=[{"role": "user", "content": "REPLAY:reason 2+2?"}])
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] == "Two plus two is four.\nNo doubt."
    assert m.content == "The answer is 4. Ünïcödé 🎉 done."
    assert r.choices[0].finish_reason == "stop"


def test_logprobs(client):
    r = client.chat.completions.create(
        model="m2-small", messages=[{"role": "user", "content": "x"}], max_tokens=5, logprobs=True, top_logprobs=3, seed=9
    )
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens
    for e in lp:
        assert e.logprob <= 0.0
        assert 1 <= len(e.top_logprobs) <= 3
        assert e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
    rc = client.completions.create(model="m2-small", prompt="abc", max_tokens=4, logprobs=2, seed=9)
    assert len(rc.choices[0].logprobs.token_logprobs) == rc.usage.completion_tokens


def test_errors_are_sdk_exceptions(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m2-small", messages=[{"role": "user", "content": "x"}], temperature=5)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m2-small", messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="m2-small", messages=[{"role": "user", "content": "x"}], response_format={"type": "xml"}
        )
    assert e.value.body["param"] == "response_format.type"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    bad = openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m2-small", prompt=[1] * 5000, max_tokens=1)
    assert e.value.code == "context_length_exceeded"
