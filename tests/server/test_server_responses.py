"""OpenAI's Responses API (`/v1/responses`) on the real tiny engine, through the official `openai`
client and the `openai-agents` SDK: the same output as the chat request it amounts to, the documented
stream events in order, tool calls and their outputs, reasoning items, stored responses continued by
`previous_response_id`, and a two-tool agent run to its structured final answer.

The tiny model is random and picks no tool by itself: as the chat tool tests do, requests force calls
with `tool_choice` (a grammar), and the agent's turns follow a plan of `tool_choice`s (agent_task.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from dsv4_engine.server.app import create_app

NAME = "dsv4-tiny"
CITY = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Rome"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
MAX = 160


@pytest.fixture(scope="module")
def base(llm: Any, tiny_checkpoint: Any, serve: Any) -> Iterator[str]:
    from dsv4_engine.server.args import ServerSettings

    settings = ServerSettings(model=str(tiny_checkpoint), served_model_name=NAME)
    with serve(create_app(settings, lambda: llm.engine)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)


def _count(base: str, messages: list[dict[str, Any]], **extra: Any) -> int:
    """The prompt tokens /v1/chat/completions would feed for `messages` (vLLM's /tokenize)."""
    r = httpx.post(f"{base}/tokenize", json={"messages": messages, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_text_equals_the_chat_answer_streamed_and_not(client: openai.OpenAI, base: str) -> None:
    kw: dict[str, Any] = {"model": NAME, "max_output_tokens": 8, "temperature": 0}
    r = client.responses.create(input="What is a page?", instructions="Be brief.", **kw)
    chat = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a page?"}],
        max_tokens=8,
        temperature=0,
    )
    assert r.id.startswith("resp_") and r.object == "response" and r.model == NAME
    assert [item.type for item in r.output] == ["message"]
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")

    events = list(
        client.responses.create(input="What is a page?", instructions="Be brief.", stream=True, **kw)
    )
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == r.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == r.usage.output_tokens


def test_forced_tool_calls_stream_their_arguments(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": NAME,
        "input": "Weather?",
        "tools": [CITY],
        "max_output_tokens": MAX,
        "extra_body": {"seed": 3},
    }
    r = client.responses.create(**kw, tool_choice="required", parallel_tool_calls=False)
    (call,) = r.output
    assert (call.type, call.name, r.status) == ("function_call", "get_weather", "completed")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), CITY["parameters"])
    events = list(
        client.responses.create(
            **kw,
            tool_choice={"type": "function", "name": "get_weather"},
            parallel_tool_calls=False,
            stream=True,
        )
    )
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(deltas) > 1 and "".join(deltas) == done.arguments
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].arguments == done.arguments


def test_function_call_output_items_become_the_conversation(client: openai.OpenAI, base: str) -> None:
    args = '{"city": "Rome", "days": 2}'
    items = [
        {"role": "user", "content": "Weather in Rome?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": args},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 24 C"},
    ]
    r = client.responses.create(
        model=NAME, input=items, tools=[CITY], max_output_tokens=4, instructions="Be kind."
    )
    chat = [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
    ]
    tool = {"type": "function", "function": {k: CITY[k] for k in ("name", "description", "parameters")}}
    assert r.usage.input_tokens == _count(base, chat, tools=[tool])


def test_reasoning_items_then_constrained_output(client: openai.OpenAI) -> None:
    """Thinking (reasoning.effort) comes back as a reasoning item; a JSON format constrains only what
    follows it. `logit_bias` on `</think>` makes the random model close its thinking soon."""
    end_think = 6  # the tiny tokenizer's `</think>`
    kw: dict[str, Any] = {"model": NAME, "input": "Describe a person.", "max_output_tokens": MAX}
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    bias = {"logit_bias": {str(end_think): 4.0}, "seed": 5}
    r = client.responses.create(**kw, reasoning={"effort": "high"}, text=fmt, extra_body=bias)
    assert [item.type for item in r.output] == ["reasoning", "message"], r.output
    reasoning = r.output[0].content[0].text
    assert reasoning and r.usage.output_tokens_details.reasoning_tokens > 0
    jsonschema.validate(json.loads(r.output_text), PERSON)
    plain = client.responses.create(**kw, reasoning={"effort": "none"}, text=fmt, extra_body=bias)
    assert [item.type for item in plain.output] == ["message"]
    assert plain.usage.output_tokens_details.reasoning_tokens == 0
    events = list(
        client.responses.create(**kw, reasoning={"effort": "high"}, text=fmt, stream=True, extra_body=bias)
    )
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == reasoning  # seeded: the same reasoning, streamed
    assert [e.item.type for e in events if e.type == "response.output_item.done"] == ["reasoning", "message"]


def test_stored_responses_continue_and_can_be_read_back(client: openai.OpenAI, base: str) -> None:
    first = client.responses.create(model=NAME, input="Name a city.", max_output_tokens=4, temperature=0)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(
        model=NAME, input="And another?", previous_response_id=first.id, max_output_tokens=4, temperature=0
    )
    conversation = [
        {"role": "user", "content": "Name a city."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And another?"},
    ]
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == _count(base, conversation)
    unstored = client.responses.create(model=NAME, input="x", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=NAME, input="x", previous_response_id=unstored.id)
    assert missing.value.body["param"] == "previous_response_id"
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_the_store_is_bounded_by_count_and_bytes() -> None:
    from dsv4_engine.server.errors import ApiError
    from dsv4_engine.server.responses import ResponseStore, _Stored

    store = ResponseStore(limit=2, max_bytes=10**6)
    for rid in "abc":
        store.put(rid, _Stored({"id": rid}, []))
    with pytest.raises(ApiError):
        store.get("a")  # the oldest went first
    assert store.get("c").body == {"id": "c"}
    big = ResponseStore(limit=100, max_bytes=3000)
    for rid in "abc":
        big.put(rid, _Stored({"id": rid}, [{"role": "user", "content": "x" * 1200}]))
    with pytest.raises(ApiError):
        big.get("a")
    assert big.get("b") and big.get("c") and big.bytes <= 3000
    big.delete("b")
    assert big.bytes == big.get("c").size


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"reasoning": {"summary": "detailed"}}, "reasoning.summary"),
        ({"include": ["message.output_text.logprobs"]}, "include[0]"),
        ({"background": True}, "background"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [CITY]}, "tool_choice"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ],
)
def test_what_is_not_served_is_a_400_naming_it(base: str, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{base}/v1/responses", json={"model": NAME, "input": "x", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ---- the Agents SDK --------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_agents_sdk_runs_a_two_tool_task(base: str, agent_task: Any, stream: bool) -> None:
    result, called = agent_task.run_agent(f"{base}/v1", NAME, stream=stream)
    agent_task.check_run(result, called)
    assert [r.response_id[:5] for r in result.raw_responses] == ["resp_"] * 3  # over /v1/responses
