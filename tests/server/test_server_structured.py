"""Structured output, tool calls and reasoning content through the official `openai` client, on the
real (random) tiny engine: grammars make even a random model answer in shape."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest

from dsv4_engine.server.app import create_app

NAME = "dsv4-tiny"
CHAT = [{"role": "user", "content": "Describe a person."}]
# Bounded: every string, number and array has a limit, so the grammar ends and EOS is forced.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
MAX = 160


@pytest.fixture(scope="module")
def client(llm: Any, tiny_checkpoint: Any, serve: Any) -> Iterator[openai.OpenAI]:
    from dsv4_engine.server.args import ServerSettings

    settings = ServerSettings(model=str(tiny_checkpoint), served_model_name=NAME)
    with serve(create_app(settings, lambda: llm.engine)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def _json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_json_schema_output_validates_streamed_and_not(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=NAME, messages=CHAT, response_format=_json_schema(PERSON), max_tokens=MAX, n=3, seed=1
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    stream = client.chat.completions.create(
        model=NAME, messages=CHAT, response_format=_json_schema(PERSON), max_tokens=MAX, seed=2, stream=True
    )
    chunks = [c for c in stream if c.choices]
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks)), PERSON)


def test_sdk_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    class Point(pydantic.BaseModel):
        x: int = pydantic.Field(ge=0, le=9)
        label: str = pydantic.Field(max_length=4)

    r = client.chat.completions.parse(
        model=NAME, messages=CHAT, response_format=Point, max_tokens=MAX, seed=3
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Point) and 0 <= parsed.x <= 9


def test_json_object_is_an_object(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=NAME, messages=CHAT, response_format={"type": "json_object"}, max_tokens=24, seed=4
    )
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_bad_schema_and_tool_choice_are_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=NAME, messages=CHAT, response_format=_json_schema({"type": "nonsense"}), max_tokens=4
        )
    assert bad.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as unknown:
        client.chat.completions.create(
            model=NAME,
            messages=CHAT,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "missing"}},
            max_tokens=4,
        )
    assert unknown.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as both:
        client.chat.completions.create(
            model=NAME,
            messages=CHAT,
            response_format={"type": "json_object"},
            max_tokens=4,
            extra_body={"min_tokens": 2},
        )
    assert both.value.body["param"] == "min_tokens"


def _check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])


def test_tool_choice_required_returns_valid_calls(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=NAME, messages=CHAT, tools=[WEATHER, TIME], tool_choice="required", max_tokens=1000, seed=5
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
    one = client.chat.completions.create(
        model=NAME,
        messages=CHAT,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        max_tokens=MAX,
        seed=6,
    )
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["get_time"]


def test_tool_calls_stream_as_deltas(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        model=NAME, messages=CHAT, tools=[WEATHER], tool_choice="required", max_tokens=1000, seed=7
    )
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(d.index, {"name": "", "arguments": ""})
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in whole
    ]


def test_two_turn_tool_conversation(client: openai.OpenAI, tokenizer: Any) -> None:
    first = client.chat.completions.create(
        model=NAME,
        messages=CHAT,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX,
        seed=8,
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *CHAT,
        first.choices[0].message.model_dump(exclude_unset=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"},
    ]
    second = client.chat.completions.create(model=NAME, messages=history, tools=[WEATHER], max_tokens=8)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The server rendered the call and its result through the template, as the tokenizer does.
    rendered = [
        CHAT[0],
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": json.loads(call.function.arguments),
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"},
    ]
    text = tokenizer.apply_chat_template(
        rendered, tools=[WEATHER], tokenize=False, add_generation_prompt=True
    )
    assert "<tool_result>sunny, 21 degrees</tool_result>" in text and call.function.name in text
    ids = tokenizer.apply_chat_template(
        rendered, tools=[WEATHER], tokenize=True, return_dict=True, add_generation_prompt=True
    )["input_ids"]
    assert second.usage.prompt_tokens == len(ids)
    # vLLM's /tokenize renders the same conversation, tools included.
    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    counted = httpx.post(f"{base}/tokenize", json={"messages": history, "tools": [WEATHER]}, timeout=60)
    assert counted.json()["count"] == len(ids)


def test_reasoning_content_is_separated(client: openai.OpenAI) -> None:
    thinking = {"chat_template_kwargs": {"thinking": True}}
    kw: dict[str, Any] = dict(model=NAME, messages=CHAT, max_tokens=12, seed=9)
    raw = client.chat.completions.create(**kw, extra_body={**thinking, "separate_reasoning": False})
    split = client.chat.completions.create(**kw, extra_body=thinking)
    text = raw.choices[0].message.content
    msg = split.choices[0].message
    reasoning = getattr(msg, "reasoning_content", None) or ""
    assert text == reasoning + ("</think>" + msg.content if msg.content else "")
    streamed = list(client.chat.completions.create(**kw, extra_body=thinking, stream=True))
    assert (
        "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in streamed) == reasoning
    )
    # With a grammar, the thinking block is closed first and the constrained answer is the content.
    r = client.chat.completions.create(
        **{**kw, "max_tokens": MAX}, response_format=_json_schema(PERSON), extra_body=thinking
    )
    assert not getattr(r.choices[0].message, "reasoning_content", None)
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_sglang_json_schema_and_regex_on_every_endpoint(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=NAME,
        prompt="A person:",
        max_tokens=MAX,
        seed=10,
        extra_body={"json_schema": json.dumps(PERSON)},
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    pattern = r"[a-c]{1,3}-\d\d"
    r = client.chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=MAX, seed=11, extra_body={"regex": pattern}
    )
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(pattern, r.choices[0].message.content)
    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    body = {"text": "Code:", "sampling_params": {"regex": pattern, "max_new_tokens": 32, "sampling_seed": 12}}
    out = httpx.post(f"{base}/generate", json=body, timeout=120).json()
    assert re.fullmatch(pattern, out["text"]), out
    bad = httpx.post(f"{base}/generate", json={"text": "x", "sampling_params": {"regex": "[a-"}}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling_params.regex"
