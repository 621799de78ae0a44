"""Structured outputs (constrained decoding) through the official OpenAI and Anthropic SDKs,
against the real gateway + CPU ranks. The fixture model's weights are random, so without the
token masks its output would be noise: every document below parses and satisfies its schema
only because the gateway masks every token that would leave the schema. The replay script
`REPLAY:json` ends the reasoning block (`ok</think>\\n\\n`) and then lets the model sample."""

import datetime
import enum
import json
import re
import typing
import uuid

import anthropic
import openai
import pydantic
import pytest

PROMPT = "REPLAY:json give me the record"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "nested": {
            "type": "object",
            "properties": {"x": {"type": "number"}, "y": {"type": ["null", "boolean"]}},
            "required": ["x", "y"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "ok", "color", "count", "tags", "nested"],
    "additionalProperties": False,
}


def check_record(doc):
    """SCHEMA's every enforced keyword, checked by hand."""
    assert isinstance(doc, dict) and set(doc) == set(SCHEMA["properties"]), doc
    assert isinstance(doc["name"], str) and 1 <= len(doc["name"]) <= 6, doc
    assert isinstance(doc["ok"], bool), doc
    assert doc["color"] in ("red", "green", "blue"), doc
    assert isinstance(doc["count"], int) and not isinstance(doc["count"], bool), doc
    assert isinstance(doc["tags"], list) and len(doc["tags"]) <= 2, doc
    assert all(isinstance(t, str) and len(t) <= 3 for t in doc["tags"]), doc
    n = doc["nested"]
    assert set(n) == {"x", "y"} and isinstance(n["x"], (int, float)) and not isinstance(n["x"], bool), doc
    assert n["y"] is None or isinstance(n["y"], bool), doc


def fmt(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "record", "strict": True, "schema": schema}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_documents_parse_and_conform(client, temperature):
    r = client.chat.completions.create(
        model="m2-small", messages=[{"role": "user", "content": PROMPT}], response_format=fmt(),
        temperature=temperature, seed=7, n=3, max_tokens=1500,
    )
    for c in r.choices:
        assert c.finish_reason == "stop", c
        assert c.message.model_extra["reasoning_content"] == "ok"
        check_record(json.loads(c.message.content))


def test_without_the_mask_the_model_writes_noise(client):
    # The same request without response_format: the random model's text is not a document.
    r = client.chat.completions.create(
        model="m2-small", messages=[{"role": "user", "content": PROMPT}], temperature=1.0, seed=7, max_tokens=60,
    )
    with pytest.raises((ValueError, AssertionError)):
        check_record(json.loads(r.choices[0].message.content or ""))


def test_streamed_document_is_the_same_as_the_whole_one(client):
    kw = dict(model="m2-small", messages=[{"role": "user", "content": PROMPT}], response_format=fmt(), seed=11, max_tokens=1500)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    parts = []
    for ch in client.chat.completions.create(stream=True, **kw):
        if ch.choices and ch.choices[0].delta.content:
            parts.append(ch.choices[0].delta.content)
    assert "".join(parts) == whole
    check_record(json.loads(whole))


class Step(pydantic.BaseModel):
    explanation: str = pydantic.Field(max_length=5)
    output: int


class Plan(pydantic.BaseModel):
    steps: list[Step] = pydantic.Field(max_length=2)
    final: bool


def test_sdk_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(
        model="m2-small", messages=[{"role": "user", "content": PROMPT}], response_format=Plan, seed=3, max_tokens=1500,
    )
    plan = r.choices[0].message.parsed
    assert isinstance(plan, Plan) and len(plan.steps) <= 2


class Stamped(pydantic.BaseModel):
    when: datetime.datetime
    day: datetime.date
    at: datetime.time
    id: uuid.UUID
    code: str = pydantic.Field(pattern=r"^[A-Z]{2}-\d{3}$")
    url: pydantic.AnyUrl
    ip: pydantic.IPvAnyAddress


def parsed_three(client, model):
    """`chat.completions.parse` with `model` at three seeds, sampled: the parsed values
    (parse() raises where pydantic refuses the document)."""
    out = []
    for seed in (1, 2, 3):
        r = client.chat.completions.parse(
            model="m2-small", messages=[{"role": "user", "content": PROMPT}], response_format=model, seed=seed,
            temperature=1.0, max_tokens=1500,
        )
        c = r.choices[0]
        assert c.finish_reason == "stop", c
        assert isinstance(c.message.parsed, model), c.message.content
        out.append(c.message.parsed)
    return out


def test_sdk_parse_with_formats_and_patterns(client):
    # pydantic writes `format` (date-time, date, time, uuid, uri, ipvanyaddress) and `pattern`;
    # the random model can only write values pydantic then accepts.
    for v in parsed_three(client, Stamped):
        assert re.fullmatch(r"[A-Z]{2}-\d{3}", v.code), v.code


class Measured(pydantic.BaseModel):
    confidence: float = pydantic.Field(ge=0, le=1)
    celsius: float = pydantic.Field(gt=-273.15, lt=100)
    share: float = pydantic.Field(gt=0, le=0.5)
    count: int = pydantic.Field(ge=1, le=12)


def test_sdk_parse_with_bounded_numbers(client):
    # pydantic writes minimum / maximum / exclusive* on float and int fields; the random
    # model can only write numbers inside them (parse() would raise otherwise).
    for v in parsed_three(client, Measured):
        assert 0 <= v.confidence <= 1 and -273.15 < v.celsius < 100 and 0 < v.share <= 0.5 and 1 <= v.count <= 12, v


def test_json_object_mode(client):
    r = client.chat.completions.create(
        model="m2-small", messages=[{"role": "user", "content": PROMPT}], response_format={"type": "json_object"},
        seed=5, max_tokens=400,
    )
    c = r.choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    else:
        # Free-form objects may run long; what was written is still a valid prefix.
        assert c.message.content.lstrip().startswith("{")


def test_bad_schemas_are_400s_naming_the_place(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="m2-small", messages=[{"role": "user", "content": "x"}],
            response_format=fmt({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}),
        )
    assert e.value.body["param"] == "response_format.json_schema.schema.properties.a.not"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="m2-small", messages=[{"role": "user", "content": "x"}], response_format=fmt(),
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], tool_choice="required",
        )
    assert e.value.body["param"] == "response_format"


def test_responses_api_text_format(client):
    r = client.responses.create(
        model="m2-small", input=PROMPT, max_output_tokens=1500,
        text={"format": {"type": "json_schema", "name": "record", "schema": SCHEMA, "strict": True}},
    )
    assert r.status == "completed"
    check_record(json.loads(r.output_text))
    p = client.responses.parse(model="m2-small", input=PROMPT, text_format=Plan, max_output_tokens=1500)
    assert isinstance(p.output_parsed, Plan)


def test_anthropic_output_format(server):
    c = anthropic.Anthropic(base_url=server.base, api_key=server.api_key)
    m = c.messages.create(
        model="claude-sonnet-4-5", max_tokens=1500, messages=[{"role": "user", "content": PROMPT}],
        output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
    )
    text = "".join(b.text for b in m.content if b.type == "text")
    assert m.stop_reason == "end_turn"
    check_record(json.loads(text))


CALL_TOOLS = [
    {"type": "function", "function": {"name": "set_alarm", "parameters": {
        "type": "object",
        "properties": {
            "hour": {"type": "integer"},
            "days": {"type": "array", "items": {"enum": ["mon", "tue"]}, "maxItems": 2},
            "loud": {"type": "boolean"},
            "mode": {"enum": ["fast", "slow"]},
            "on": {"type": "string", "format": "date"},
            "label": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        },
        "required": ["hour", "loud", "on"],
        "additionalProperties": False,
    }}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}},
]


def check_call(name, args):
    if name == "ping":
        assert args == {}
        return
    assert name == "set_alarm", name
    assert set(args) <= {"hour", "days", "loud", "mode", "on", "label"} and {"hour", "loud", "on"} <= set(args), args
    # String parameters are raw text in the call; their format and pattern hold it.
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", args["on"]) and datetime.date.fromisoformat(args["on"]), args
    assert re.fullmatch(r"[a-z]{1,8}", args.get("label", "x")), args
    assert isinstance(args["hour"], int) and not isinstance(args["hour"], bool), args
    assert isinstance(args["loud"], bool), args
    assert all(d in ("mon", "tue") for d in args.get("days", [])) and len(args.get("days", [])) <= 2, args
    assert args.get("mode", "fast") in ("fast", "slow"), args


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_alarm"}}])
def test_required_tool_calls_are_held_to_the_tools(client, choice):
    # The script opens a call block; the random model writes its inside under the masks, then
    # may only end. Without them it writes noise there and the answer is a 502 `tool_choice_unmet`.
    for seed in range(2):
        r = client.chat.completions.create(
            model="m2-small", messages=[{"role": "user", "content": "REPLAY:call wake me"}], tools=CALL_TOOLS,
            tool_choice=choice, seed=seed, max_tokens=2000,
        )
        assert r.choices[0].finish_reason == "tool_calls", r
        calls = r.choices[0].message.tool_calls
        assert calls, r
        for c in calls:
            check_call(c.function.name, json.loads(c.function.arguments))
            if isinstance(choice, dict):
                assert c.function.name == "set_alarm"


def test_anthropic_tool_choice_any_and_responses_required_give_valid_calls(server, client):
    # Anthropic `tool_choice: any` and the Responses API's `required` map to a demanded call:
    # the block the script opens is held to the tools.
    claude = anthropic.Anthropic(base_url=server.base, api_key=server.api_key, max_retries=0, timeout=120)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in CALL_TOOLS]
    m = claude.messages.create(
        model="m2-small", max_tokens=2000, messages=[{"role": "user", "content": "REPLAY:call wake me"}], tools=tools,
        tool_choice={"type": "any"},
    )
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses, m
    for u in uses:
        check_call(u.name, u.input)
    rtools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]} for t in CALL_TOOLS]
    r = client.responses.create(model="m2-small", input="REPLAY:call wake me", tools=rtools, tool_choice="required", max_output_tokens=2000)
    calls = [i for i in r.output if i.type == "function_call"]
    assert calls, r
    for c in calls:
        check_call(c.name, json.loads(c.arguments))


class Color(str, enum.Enum):
    red = "red"
    green = "green"


class Order(pydantic.BaseModel):
    """A pydantic tool as the SDK writes it: an enum behind `$ref`, an optional literal (an
    `anyOf` of strings and null), a nullable integer, a bounded string and a list of bounded
    strings (bounded so the random model's call fits `max_tokens`)."""
    color: Color
    size: typing.Optional[typing.Literal["s", "m"]]
    count: typing.Optional[int]
    title: str = pydantic.Field(min_length=1, max_length=5)
    notes: typing.List[typing.Annotated[str, pydantic.Field(max_length=8)]] = pydantic.Field(max_length=2)


def test_pydantic_function_tool_calls_validate_as_the_model(client):
    # `openai.pydantic_function_tool` writes the strict schema; the call block the script opens
    # is held to it, and every call's arguments validate back into the pydantic model: strings
    # verbatim (no JSON quotes around the enum members), null where null is allowed, lengths.
    tool = openai.pydantic_function_tool(Order)
    assert "$ref" in json.dumps(tool)
    for seed in range(3):
        r = client.chat.completions.create(
            model="m2-small", messages=[{"role": "user", "content": "REPLAY:call order"}], tools=[tool],
            tool_choice="required", seed=seed, max_tokens=2000,
        )
        assert r.choices[0].finish_reason == "tool_calls", r
        calls = r.choices[0].message.tool_calls
        assert calls, r
        for c in calls:
            assert c.function.name == "Order"
            order = Order.model_validate_json(c.function.arguments)
            assert 1 <= len(order.title) <= 5 and len(order.notes) <= 2, c.function.arguments
            assert all(len(n) <= 8 for n in order.notes), c.function.arguments


def test_completions_response_format_starts_the_document_at_the_first_token(client):
    # A raw prompt: no reasoning block, the document is the whole completion.
    r = client.completions.create(
        model="m2-small", prompt="Give me the record:", max_tokens=1500, seed=4,
        extra_body={"response_format": fmt()},
    )
    assert r.choices[0].finish_reason == "stop", r
    check_record(json.loads(r.choices[0].text))
