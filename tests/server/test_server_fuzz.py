"""Hypothesis fuzzing against the real engine: >= 500 requests, bad and good, some dropped mid-stream.

Invariants: the server never answers 5xx to input, every error has the OpenAI shape, valid requests
succeed, and afterwards no request is left in the engine, every pool is back where it started, and a
greedy request still returns exactly what `LLM.generate` returned before the fuzzing.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.server.app import create_app
from dsv4_engine.server.args import ServerSettings

NAME = "fuzz"
BATCH = 10
EXAMPLES = 52  # x BATCH requests
VOCAB = 512  # the tiny preset's vocabulary
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate", "/v1/responses")
# Fields given junk values by the "unsupported" mutation: ones the server refuses unless off, and
# honoured ones whose bad values must still be a 400 (not `n`: a junk n of 100 would be 100 sequences).
UNSUPPORTED = (
    "best_of",
    "tools",
    "response_format",
    "suffix",
    "return_logprob",
    "logprobs",
    "top_logprobs",
    "echo",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "min_p",
    "min_tokens",
    "repetition_penalty",
)
GET_PATHS = (
    "/health",
    "/v1/models",
    "/metrics",
    "/get_load",
    "/server_info",
    "/model_info",
    "/nope",
    "/v1/models/x",
)

SENT = {"count": 0}


@dataclass
class Case:
    method: str
    path: str
    body: bytes | None
    valid: bool  # the request is well-formed and must succeed
    disconnect: bool = False  # drop the connection after the first streamed event
    max_tokens: int = 0


junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.integers(-5, 2 * VOCAB), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(-3, 3), max_size=2),
)
small_text = st.text(alphabet="abc xyz你好🙂é\n<|>", min_size=1, max_size=24)
token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
sampling = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.sampled_from([0.0, 0.7, 1.0]),
        "top_p": st.sampled_from([0.5, 1.0]),
        "top_k": st.sampled_from([-1, 1, 5]),
        "seed": st.integers(0, 2**31),
        "stop": st.one_of(small_text, st.lists(small_text, min_size=1, max_size=2)),
        "presence_penalty": st.sampled_from([0.0, 1.5]),
        "frequency_penalty": st.sampled_from([-0.5, 0.0, 2.0]),
        "repetition_penalty": st.sampled_from([0.8, 1.0, 1.3]),
        "min_p": st.sampled_from([0.0, 0.2]),
        "logit_bias": st.dictionaries(
            st.integers(0, VOCAB - 1).map(str), st.sampled_from([-100, 5.5]), max_size=3
        ),
    },
)


@st.composite
def valid_request(draw: st.DrawFn) -> tuple[str, dict[str, Any], int]:
    path = draw(st.sampled_from(GENERATION_PATHS))
    max_tokens = draw(st.integers(1, 2))
    stream = draw(st.booleans())
    if path == "/generate":
        params = {"max_new_tokens": max_tokens, **{k: v for k, v in draw(sampling).items() if k != "seed"}}
        body: dict[str, Any] = {"sampling_params": params, "stream": stream}
        body.update({"text": draw(small_text)} if draw(st.booleans()) else {"input_ids": draw(token_ids)})
        return path, body, max_tokens
    if path == "/v1/responses":
        roles = st.sampled_from(["system", "user", "assistant", "developer"])
        items = st.lists(
            st.fixed_dictionaries({"role": roles, "content": small_text}), min_size=1, max_size=3
        )
        body = {"model": NAME, "max_output_tokens": max_tokens, "stream": stream, **draw(sampling)}
        body["input"] = draw(st.one_of(small_text, items))
        return path, body, max_tokens
    body = {"model": NAME, "max_tokens": max_tokens, "stream": stream, **draw(sampling)}
    if stream and draw(st.booleans()):
        body["stream_options"] = {"include_usage": True}
    if path == "/v1/completions":
        body["prompt"] = draw(st.one_of(small_text, token_ids))
    else:
        roles = st.sampled_from(["system", "user", "assistant", "developer"])
        body["messages"] = draw(
            st.lists(st.fixed_dictionaries({"role": roles, "content": small_text}), min_size=1, max_size=3)
        )
    return path, body, max_tokens


@st.composite
def case(draw: st.DrawFn) -> Case:
    kind = draw(st.sampled_from(["valid", "valid", "mutated", "mutated", "raw", "get"]))
    if kind == "get":
        return Case("GET", draw(st.sampled_from(GET_PATHS)), None, valid=False)
    if kind == "raw":
        raw = draw(
            st.one_of(
                st.binary(max_size=40),
                st.sampled_from([b"", b"{", b"[]", b"null", b"42", b'"x"', b'{"prompt": }', b"{}"]),
                junk.map(lambda v: json.dumps(v).encode()),
            )
        )
        return Case("POST", draw(st.sampled_from(GENERATION_PATHS)), raw, valid=False)
    path, body, max_tokens = draw(valid_request())
    if kind == "valid":
        disconnect = bool(body.get("stream")) and draw(st.booleans())
        return Case("POST", path, json.dumps(body).encode(), True, disconnect, max_tokens)
    mutation = draw(st.sampled_from(["replace", "unknown", "unsupported", "drop", "model"]))
    key = draw(st.sampled_from(sorted(body)))
    if mutation == "replace":
        body[key] = draw(junk)
    elif mutation == "unknown":
        body[draw(st.text(alphabet="qwxz_", min_size=3, max_size=8))] = draw(junk)
    elif mutation == "unsupported":
        field = draw(st.sampled_from(UNSUPPORTED))
        off_values = (None, 0, 1, False, []) if field == "tools" else (None, 0, 1, False)  # []: no tools
        body[field] = draw(junk.filter(lambda v: v not in off_values))
    elif mutation == "drop":
        body.pop(key)
    else:
        body["model"] = draw(st.text(max_size=8).filter(lambda m: m != NAME))
    return Case("POST", path, json.dumps(body).encode(), valid=False, max_tokens=max_tokens)


def _error_shaped(r: httpx.Response) -> bool:
    err = r.json().get("error")
    return isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err)


async def _send(client: httpx.AsyncClient, base: str, c: Case) -> None:
    SENT["count"] += 1
    headers = {"content-type": "application/json"}
    if c.method == "GET":
        r = await client.get(base + c.path)
        assert r.status_code in (200, 404), (c, r.text)
        if r.status_code == 404:
            assert _error_shaped(r)
        return
    async with client.stream("POST", base + c.path, content=c.body, headers=headers) as r:
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            assert r.status_code == 200
            events = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if c.disconnect:
                        return  # leaving the block closes the connection mid-stream
            if c.path == "/v1/responses":  # no [DONE]: the last event says how it ended
                last = json.loads(events[-1])["type"]
                assert last in ("response.completed", "response.incomplete"), (c, events[-3:])
                assert all('"type":"error"' not in e for e in events), (c, events)
                return
            assert events[-1] == "[DONE]", (c, events[-3:])
            assert all('"error"' not in e for e in events), (c, events)
            return
        await r.aread()
    assert r.status_code < 500, (c, r.status_code, r.text)
    if c.valid:
        assert r.status_code == 200, (c, r.text)
        body = r.json()
        usage = body["usage"] if "usage" in body else body["meta_info"]
        assert 1 <= usage.get("completion_tokens", usage.get("output_tokens", 0)) <= c.max_tokens
    elif r.status_code != 200:
        assert r.status_code in (400, 404, 405), (c, r.status_code, r.text)
        assert _error_shaped(r), r.text


@pytest.fixture(scope="module")
def served(llm: Any, tiny_checkpoint: Any, serve: Any) -> Iterator[dict[str, Any]]:
    reference = llm.generate(["The reference"], SamplingParams(temperature=0.0, max_tokens=6))[0]
    app = create_app(ServerSettings(model=str(tiny_checkpoint), served_model_name=NAME), lambda: llm.engine)
    with serve(app) as base:
        ctx = app.state.ctx
        yield {
            "base": base,
            "ctx": ctx,
            "engine": llm.engine,
            "before": dict(ctx.bridge.metrics()),
            "ref": reference,
        }


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(cases=st.lists(case(), min_size=BATCH, max_size=BATCH))
def test_fuzz_requests(served: dict[str, Any], cases: list[Case]) -> None:
    async def batch() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.gather(*(_send(client, served["base"], c) for c in cases))

    asyncio.run(batch())


def test_after_fuzz_nothing_leaked(served: dict[str, Any], until: Any) -> None:
    assert SENT["count"] >= 500, f"only {SENT['count']} fuzz requests were sent"
    ctx, engine = served["ctx"], served["engine"]

    def settled() -> bool:
        snap = ctx.bridge.metrics()
        return (
            ctx.inflight == 0
            and not ctx.bridge.open_handles()
            and snap["num_running"] == 0 == snap["num_waiting"]
        )

    until(settled, 60, "every fuzz request to leave the engine")
    assert not getattr(engine, "requests", {}), "the engine still tracks requests"
    after = ctx.bridge.metrics()
    free = sorted(k for k in served["before"] if k.startswith("pool_free/"))
    assert free, "engine.metrics() reports no pool_free/<pool> counts"
    for key in free:  # every pool back at its initial free page count
        assert after[key] == served["before"][key], key
    for key in (k for k in served["before"] if k.startswith("pool_usage/")):
        assert math.isclose(after[key], served["before"][key]), key
    ref = served["ref"]
    r = httpx.post(
        f"{served['base']}/v1/completions",
        json={"model": NAME, "prompt": "The reference", "max_tokens": 6, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == ref.text
    assert httpx.get(f"{served['base']}/health").status_code == 200
