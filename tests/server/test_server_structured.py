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
END_THINK_ID = 6  # the tiny tokenizer's `</think>` (dsv4_engine.tokenizer.SPECIAL_TOKENS)


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
        model=NAME, messages=CHAT, response_format={"type": "json_object"}, max_tokens=MAX, seed=1
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)  # the whole reply


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
    pieces: dict[int, int] = {}  # argument deltas per call
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(d.index, {"name": "", "arguments": ""})
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
            pieces[d.index] = pieces.get(d.index, 0) + bool(d.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert all(n > 1 for n in pieces.values()), pieces  # arguments stream as written, as vLLM's and SGLang's
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


def test_thinking_then_constrained_output(client: openai.OpenAI) -> None:
    """With thinking on, a grammar constrains only what follows `</think>`: the model reasons freely
    first, then answers in shape (a JSON schema, a forced tool call). `logit_bias` on `</think>` makes
    the random model end its reasoning soon."""
    bias = {"logit_bias": {str(END_THINK_ID): 3.0}}
    kw: dict[str, Any] = dict(model=NAME, messages=CHAT, max_tokens=MAX, seed=9, reasoning_effort="high")
    r = client.chat.completions.create(**kw, response_format=_json_schema(PERSON), extra_body=bias)
    msg = r.choices[0].message
    assert getattr(msg, "reasoning_content", None), msg
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(msg.content), PERSON)
    r = client.chat.completions.create(**kw, tools=[WEATHER], tool_choice="required", extra_body=bias)
    msg = r.choices[0].message
    assert getattr(msg, "reasoning_content", None) and r.choices[0].finish_reason == "tool_calls"
    _check_calls(msg.tool_calls, {"get_weather"})
    r = client.chat.completions.create(**kw, extra_body={**bias, "guided_regex": r"[a-c]{2}-\d"})
    msg = r.choices[0].message
    assert getattr(msg, "reasoning_content", None) and re.fullmatch(r"[a-c]{2}-\d", msg.content), msg


def test_reasoning_effort_sets_the_thinking_level(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=NAME, messages=CHAT, max_tokens=4, seed=1)
    high = client.chat.completions.create(**kw, reasoning_effort="high")
    off = client.chat.completions.create(**kw, reasoning_effort="none")
    top = client.chat.completions.create(**kw, reasoning_effort="xhigh")
    default = client.chat.completions.create(**kw)
    assert getattr(high.choices[0].message, "reasoning_content", None)  # thinking on
    assert not getattr(off.choices[0].message, "reasoning_content", None)
    # the template: `<think>` (high), `</think>` (none), nothing (unset): one token each but unset;
    # max opens the prompt with the maximum-effort instruction
    assert high.usage.prompt_tokens == off.usage.prompt_tokens == default.usage.prompt_tokens + 1
    assert top.usage.prompt_tokens > high.usage.prompt_tokens + 10
    with pytest.raises(openai.BadRequestError) as clash:
        client.chat.completions.create(
            **kw, reasoning_effort="none", extra_body={"chat_template_kwargs": {"thinking": True}}
        )
    assert clash.value.body["param"] == "reasoning_effort"


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


@pytest.mark.parametrize(
    ("field", "check"),
    [
        ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
        ({"guided_json": json.dumps(PERSON)}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
        ({"guided_regex": r"[a-c]{2}-\d"}, lambda t: re.fullmatch(r"[a-c]{2}-\d", t) or pytest.fail(t)),
        ({"guided_choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe") or pytest.fail(t)),
        ({"structured_outputs": {"json": PERSON}}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
        ({"structured_outputs": {"regex": r"\d{3}"}}, lambda t: re.fullmatch(r"\d{3}", t) or pytest.fail(t)),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down") or pytest.fail(t)),
        (
            {"structured_outputs": {"json_object": True}},
            lambda t: isinstance(json.loads(t), dict) or pytest.fail(t),
        ),
    ],
)
def test_vllm_constraint_fields_are_honoured(
    client: openai.OpenAI, field: dict[str, Any], check: Any
) -> None:
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=MAX, seed=12, extra_body=field)
    assert r.choices[0].finish_reason == "stop"
    check(r.choices[0].message.content)
    c = client.completions.create(model=NAME, prompt="A:", max_tokens=MAX, seed=13, extra_body=field)
    check(c.choices[0].text)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"guided_json": PERSON, "guided_regex": "a"}, "guided_regex"),
        ({"regex": "a", "structured_outputs": {"choice": ["a"]}}, "structured_outputs.choice"),
        ({"guided_json": "{nope"}, "guided_json"),
        ({"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
        ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs.grammar"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
    ],
)
def test_vllm_fields_that_cannot_be_served_are_400(
    client: openai.OpenAI, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=4, extra_body=body)
    assert bad.value.body["param"] == param


def test_include_stop_str_in_output(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=NAME, prompt="The page", max_tokens=12, temperature=0)
    ref = client.completions.create(**kw).choices[0].text
    stop = next(ref[i : i + 2] for i in range(1, len(ref) - 1) if ref.find(ref[i : i + 2]) == i)
    cut = ref.find(stop)
    for stream in (False, True):
        got = client.completions.create(
            **kw, stop=stop, stream=stream, extra_body={"include_stop_str_in_output": True}
        )
        text = "".join(c.choices[0].text for c in got) if stream else got.choices[0].text
        assert text == ref[: cut + len(stop)], (stream, stop, ref)
    assert client.completions.create(**kw, stop=stop).choices[0].text == ref[:cut]


def test_bad_words_are_never_generated(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=NAME, prompt="The page", max_tokens=8, temperature=0, logprobs=0)
    ref = client.completions.create(**kw).choices[0].logprobs.tokens
    word = next(t for t in ref if t.strip().isalpha())  # a word the greedy answer writes
    got = client.completions.create(**kw, extra_body={"bad_words": [word.strip()]}).choices[0].logprobs.tokens
    assert word not in got and got != ref, (word, ref, got)


def test_allowed_token_ids_are_the_only_ones(client: openai.OpenAI, tokenizer: Any) -> None:
    allowed = [tokenizer.convert_tokens_to_ids(t) for t in ("a", "b", "c")]
    body = {"allowed_token_ids": allowed, "ignore_eos": True}
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=10, seed=2, extra_body=body)
    text = r.choices[0].message.content
    assert len(text) == 10 and set(text) <= {"a", "b", "c"}, text


def test_fields_real_clients_send_are_accepted(client: openai.OpenAI) -> None:
    """What LiteLLM, agent frameworks and the openai SDK's own message objects carry: harmless here
    (docs/server.md), so accepted, and the answer is the one without them."""
    history = [
        {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]},
        {
            "role": "assistant",
            "content": None,
            "audio": None,
            "function_call": None,
            "refusal": None,
            "tool_calls": [
                {
                    "index": 0,
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "noon", "cache_control": {"type": "ephemeral"}},
    ]
    kw: dict[str, Any] = dict(model=NAME, messages=history, tools=[TIME], max_tokens=6, temperature=0)
    plain = client.chat.completions.create(**kw)
    extras = dict(metadata={"team": "a"}, store=True, parallel_tool_calls=True, prompt_cache_key="k1")
    got = client.chat.completions.create(**kw, **extras)
    assert got.choices[0].message.content == plain.choices[0].message.content
    # The counts, not the cached tokens: the repeat resumes from the prefix cache
    assert got.usage is not None and plain.usage is not None
    tokens = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [getattr(got.usage, k) for k in tokens] == [getattr(plain.usage, k) for k in tokens]
