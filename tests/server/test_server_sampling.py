"""Sampling controls, n > 1 and logprobs through the official `openai` client against the real engine:
each equals what `LLM.generate` returns offline with the same SamplingParams, in OpenAI's shapes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.server.app import create_app
from dsv4_engine.server.errors import ApiError

NAME = "dsv4-tiny"
MAX = 8
SEED = 1234
TEXT = "The engine serves a model"
CHAT = [{"role": "user", "content": "What is a page?"}]
PENALTIES = {"presence_penalty": 1.0, "frequency_penalty": 0.5, "logit_bias": {"42": 4.0}}
EXTENSIONS = {"repetition_penalty": 1.3, "min_p": 0.05, "min_tokens": 6}


def chat_ids(tokenizer: Any) -> list[int]:
    enc = tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=True, sanitize_control_tokens=True
    )
    return list(enc["input_ids"])


def penalized(**kw: Any) -> SamplingParams:
    return SamplingParams(
        **{"max_tokens": MAX, "presence_penalty": 1.0, "frequency_penalty": 0.5, "logit_bias": {42: 4.0}}
        | {"repetition_penalty": 1.3, "min_p": 0.05, "min_tokens": 6}
        | kw
    )


@pytest.fixture(scope="module")
def refs(llm: Any) -> dict[str, Any]:
    """Offline outputs, computed before the server drives the engine."""
    tok = llm.tokenizer
    text_ids, chat = list(tok.encode(TEXT)), chat_ids(tok)
    ids2 = list(tok.encode("Hello there"))
    batch = [
        (text_ids, penalized(temperature=0.0)),
        (chat, penalized(temperature=0.8, seed=SEED)),
        *[(chat, SamplingParams(temperature=1.0, seed=SEED + j, max_tokens=MAX)) for j in range(3)],
        (chat, SamplingParams(temperature=0.0, max_tokens=MAX, logprobs=3)),
        (text_ids, SamplingParams(temperature=0.0, max_tokens=1, logprobs=2, prompt_logprobs=2)),
        (ids2, SamplingParams(temperature=0.0, max_tokens=1, logprobs=2, prompt_logprobs=2)),
        (ids2, SamplingParams(temperature=1.0, seed=SEED, max_tokens=MAX)),
        (ids2, SamplingParams(temperature=1.0, seed=SEED + 1, max_tokens=MAX)),
        (text_ids, SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=3)),
    ]
    outs = [llm.generate([p], sp)[0] for p, sp in batch]
    keys = [
        "penalized_text",
        "penalized_chat",
        "n0",
        "n1",
        "n2",
        "chat_logprobs",
        "echo",
        "echo2",
        "b0",
        "b1",
        "gen_lp",
    ]
    return {"text_ids": text_ids, "chat_ids": chat, "ids2": ids2, **dict(zip(keys, outs, strict=True))}


@pytest.fixture(scope="module")
def base(refs: dict[str, Any], llm: Any, tiny_checkpoint: Any, serve: Any) -> Iterator[str]:
    from dsv4_engine.server.args import ServerSettings

    settings = ServerSettings(model=str(tiny_checkpoint), served_model_name=NAME)
    with serve(create_app(settings, lambda: llm.engine)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


# ---- sampling controls ---------------------------------------------------------------------------
def test_penalties_bias_min_p_min_tokens_are_honoured(
    client: openai.OpenAI, refs: dict[str, Any], base: str
) -> None:
    ref = refs["penalized_text"]
    r = client.completions.create(
        model=NAME, prompt=TEXT, max_tokens=MAX, temperature=0, **PENALTIES, extra_body=EXTENSIONS
    )
    assert r.choices[0].text == ref.text and r.usage.completion_tokens == len(ref.token_ids)
    ref = refs["penalized_chat"]
    r = client.chat.completions.create(
        model=NAME,
        messages=CHAT,
        max_tokens=MAX,
        temperature=0.8,
        seed=SEED,
        **PENALTIES,
        extra_body=EXTENSIONS,
    )
    assert r.choices[0].message.content == ref.text
    sp = {"max_new_tokens": MAX, "temperature": 0.0, **PENALTIES, **EXTENSIONS}
    sp["min_new_tokens"] = sp.pop("min_tokens")
    out = httpx.post(
        f"{base}/generate", json={"input_ids": refs["text_ids"], "sampling_params": sp}, timeout=120
    )
    assert out.status_code == 200, out.text
    assert out.json()["output_ids"] == refs["penalized_text"].token_ids


def test_logit_bias_forces_a_token(client: openai.OpenAI, tokenizer: Any) -> None:
    r = client.completions.create(
        model=NAME, prompt=TEXT, max_tokens=4, temperature=0, logit_bias={"42": 100}, logprobs=0
    )
    assert r.choices[0].logprobs.tokens == [tokenizer.decode([42])] * 4


def test_min_tokens_holds_stop_strings_back(client: openai.OpenAI) -> None:
    kw = {"model": NAME, "prompt": TEXT, "max_tokens": MAX, "temperature": 0}
    full = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    stop = next(full[i : i + 2] for i in range(len(full) - 1) if "\ufffd" not in full[i : i + 2])
    cut = client.completions.create(**kw, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens < MAX
    held = client.completions.create(**kw, stop=[stop], extra_body={"ignore_eos": True, "min_tokens": MAX})
    assert (held.choices[0].text, held.choices[0].finish_reason) == (full, "length")


@pytest.mark.parametrize(
    ("kind", "kwargs", "param"),
    [
        ("completions", {"logit_bias": {"512": 1}}, "logit_bias"),  # past the tiny vocabulary
        ("completions", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("chat", {"logit_bias": {"x": 1}}, "logit_bias"),
        ("chat", {"presence_penalty": 2.5}, "presence_penalty"),
        ("chat", {"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ("chat", {"extra_body": {"min_tokens": 9}}, "min_tokens"),  # more than max_tokens
        ("chat", {"extra_body": {"min_p": 1.5}}, "min_p"),
        ("chat", {"n": 129}, "n"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ("completions", {"logprobs": 6}, "logprobs"),
        ("completions", {"max_tokens": 0}, "max_tokens"),  # without echo
        ("completions", {"max_tokens": 0, "echo": True, "extra_body": {"min_tokens": 1}}, "min_tokens"),
    ],
)
def test_bad_values_name_the_field(
    client: openai.OpenAI, kind: str, kwargs: dict[str, Any], param: str
) -> None:
    kwargs = {"max_tokens": MAX, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        if kind == "chat":
            client.chat.completions.create(model=NAME, messages=CHAT, **kwargs)
        else:
            client.completions.create(model=NAME, prompt=TEXT, **kwargs)
    assert info.value.body["param"] == param, info.value.body


# ---- n > 1 -----------------------------------------------------------------------------------------
def test_n_choices_are_reproducible_under_seed(client: openai.OpenAI, refs: dict[str, Any]) -> None:
    kw = {"model": NAME, "messages": CHAT, "max_tokens": MAX, "temperature": 1.0, "seed": SEED, "n": 3}
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [refs[f"n{j}"].text for j in range(3)]  # seed + j
    assert len({c.message.content for c in r.choices}) == 3
    assert r.usage.prompt_tokens == len(refs["chat_ids"])  # the prompt counted once
    assert r.usage.completion_tokens == sum(len(refs[f"n{j}"].token_ids) for j in range(3))
    again = client.chat.completions.create(**kw)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    # Several prompts: choice index = prompt * n + j.
    prompts = [refs["text_ids"], refs["ids2"]]
    r = client.completions.create(model=NAME, prompt=prompts, max_tokens=MAX, temperature=1.0, seed=SEED, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices[2:]] == [refs["b0"].text, refs["b1"].text]
    assert r.usage.prompt_tokens == len(prompts[0]) + len(prompts[1])


def test_n_streams_with_index(client: openai.OpenAI, refs: dict[str, Any]) -> None:
    stream = client.chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=MAX, temperature=1.0, seed=SEED, n=3, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = {0: "", 1: "", 2: ""}
    roles, reasons = [], []
    for c in chunks:
        for choice in c.choices:
            text[choice.index] += choice.delta.content or ""
            roles += [choice.index] if choice.delta.role else []
            reasons += [choice.index] if choice.finish_reason else []
    assert text == {j: refs[f"n{j}"].text for j in range(3)}
    assert sorted(roles) == sorted(reasons) == [0, 1, 2]
    assert chunks[-1].usage.prompt_tokens == len(refs["chat_ids"])
    assert chunks[-1].usage.completion_tokens == sum(len(refs[f"n{j}"].token_ids) for j in range(3))


# ---- logprobs --------------------------------------------------------------------------------------
def test_chat_logprobs(client: openai.OpenAI, refs: dict[str, Any], tokenizer: Any) -> None:
    ref = refs["chat_logprobs"]
    kw = {
        "model": NAME,
        "messages": CHAT,
        "max_tokens": MAX,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == len(ref.token_ids) == r.usage.completion_tokens
    for entry, want in zip(content, ref.logprobs, strict=True):
        assert entry.token == tokenizer.decode([want.token_id])
        assert entry.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([t]) for t, _ in want.top]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([lp for _, lp in want.top], abs=1e-5)
        assert entry.bytes is not None
        if "\ufffd" not in entry.token:
            assert bytes(entry.bytes).decode() == entry.token
    assert b"".join(bytes(e.bytes) for e in content).decode(errors="replace") == tokenizer.decode(
        ref.token_ids, skip_special_tokens=False
    )
    streamed = [
        e.model_dump()
        for c in client.chat.completions.create(**kw, stream=True)
        for choice in c.choices
        if choice.logprobs is not None
        for e in choice.logprobs.content
    ]
    assert streamed == [e.model_dump() for e in content]
    plain = client.chat.completions.create(**{**kw, "top_logprobs": None})
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    assert client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=2).choices[0].logprobs is None


def _check_prompt_part(lp: Any, ids: list[int], ref: Any, tokenizer: Any) -> None:
    n = len(ids)
    assert lp.tokens[:n] == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first
    assert lp.token_logprobs[1:n] == pytest.approx([e.logprob for e in ref.prompt_logprobs[1:]], abs=1e-5)
    for top, entry in zip(lp.top_logprobs[1:n], ref.prompt_logprobs[1:], strict=True):
        assert tokenizer.decode([entry.token_id]) in top  # the prompt's own token is always there
        assert len(top) <= 3 and max(top.values()) == pytest.approx(entry.top[0][1], abs=1e-5)
    offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.text_offset == offsets


def test_echo_logprobs_score_the_prompt(client: openai.OpenAI, refs: dict[str, Any], tokenizer: Any) -> None:
    ids, ref = refs["text_ids"], refs["echo"]
    kw = {"model": NAME, "prompt": TEXT, "echo": True, "logprobs": 2, "temperature": 0}
    r = client.completions.create(**kw, max_tokens=0)
    choice = r.choices[0]
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    assert len(choice.logprobs.tokens) == len(ids)
    _check_prompt_part(choice.logprobs, ids, ref, tokenizer)
    streamed = list(client.completions.create(**kw, max_tokens=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == TEXT
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == choice.logprobs.tokens
    # lm-eval's loglikelihood request: token-id prompts in a batch, echo, logprobs 1, one new token.
    prompts = [ids, refs["ids2"]]
    r = client.completions.create(
        model=NAME, prompt=prompts, echo=True, logprobs=2, max_tokens=1, temperature=0
    )
    for choice, p, want in zip(r.choices, prompts, (ref, refs["echo2"]), strict=True):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(p) + 1
        _check_prompt_part(lp, p, want, tokenizer)
        assert lp.tokens[-1] == tokenizer.decode(want.token_ids)
        assert lp.token_logprobs[-1] == pytest.approx(want.logprobs[0].logprob, abs=1e-5)
        assert max(lp.top_logprobs[-1].values()) == lp.token_logprobs[-1]  # greedy: the top one
    streamed = list(client.completions.create(model=NAME, prompt=prompts, echo=True, logprobs=2, max_tokens=1,
                                              temperature=0, stream=True))  # fmt: skip
    for i, choice in enumerate(r.choices):
        got = [v for c in streamed for ch in c.choices if ch.index == i and ch.logprobs
               for v in ch.logprobs.token_logprobs]  # fmt: skip
        want = choice.logprobs.token_logprobs
        assert got[0] is None and got[1:] == pytest.approx(want[1:], abs=1e-5)  # batched otherwise


def test_completion_logprobs_without_echo(client: openai.OpenAI, base: str) -> None:
    r = client.completions.create(model=NAME, prompt=TEXT, max_tokens=MAX, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert lp.text_offset[0] == 0 and all(len(t) <= 4 for t in lp.top_logprobs)  # 3 + the sampled one
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == value <= 0 and max(top.values()) == value  # greedy took the top one
    # JSON as sent (no infinities): parseable by a strict parser
    raw = httpx.post(
        f"{base}/v1/completions", json={"prompt": TEXT, "max_tokens": 2, "logprobs": 5}, timeout=60
    )
    json.loads(raw.text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


# ---- /generate: SGLang's logprobs and n ------------------------------------------------------------
def _sglang_lists(entries: list[Any], ids: list[int]) -> tuple[list[Any], list[Any]]:
    """What SGLang's /generate returns for engine entries (tiny's tokenizer decodes every id)."""
    tokens = [
        [None if e is None else pytest.approx(e.logprob, abs=1e-5), t]
        for e, t in zip(entries, ids, strict=True)
    ]
    tops = [None if e is None else [[pytest.approx(lp, abs=1e-5), t] for t, lp in e.top] for e in entries]
    return tokens, tops


def test_generate_return_logprob_in_sglang_shapes(base: str, refs: dict[str, Any], tokenizer: Any) -> None:
    ref, ids = refs["gen_lp"], refs["text_ids"]
    body = {
        "input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 1,
        "return_text_in_logprobs": True,
    }  # fmt: skip
    r = httpx.post(f"{base}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert out["output_ids"] == ref.token_ids
    tokens, tops = _sglang_lists(ref.logprobs, ref.token_ids)
    assert [e[:2] for e in meta["output_token_logprobs"]] == tokens
    assert [[x[:2] for x in top] for top in meta["output_top_logprobs"]] == tops
    assert [e[2] for e in meta["output_token_logprobs"]] == [tokenizer.decode([t]) for t in ref.token_ids]
    # the prompt from position 1 (position 0 has no logprob, so start 0 would begin with None)
    tokens, tops = _sglang_lists(ref.prompt_logprobs[1:], ids[1:])
    assert [e[:2] for e in meta["input_token_logprobs"]] == tokens
    assert [[x[:2] for x in top] for top in meta["input_top_logprobs"]] == tops
    # streamed: every chunk cumulative, the last one the whole response's lists
    r = httpx.post(f"{base}/generate", json={**body, "stream": True}, timeout=120)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    varying = {"id": None, "e2e_latency": None}
    assert len(chunks) > 1 and chunks[-1]["meta_info"] | varying == meta | varying
    assert [len(c["meta_info"]["output_token_logprobs"]) for c in chunks] == [
        len(c["output_ids"]) for c in chunks
    ]
    # SGLang's default logprob_start_len (-1): output only; without return_logprob: no lists at all
    r = httpx.post(f"{base}/generate", json={**body, "logprob_start_len": -1, "stream": True}, timeout=120)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    last = chunks[-1]["meta_info"]
    assert last["input_token_logprobs"] == [] and len(last["output_token_logprobs"]) == len(ref.token_ids)
    assert [e[0] for e in last["output_token_logprobs"]] == [
        pytest.approx(e.logprob, abs=1e-5) for e in ref.logprobs
    ]
    plain = httpx.post(f"{base}/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})
    assert "output_token_logprobs" not in plain.json()["meta_info"]


def test_generate_n_gives_seeded_choices_streamed_and_not(base: str, refs: dict[str, Any]) -> None:
    sp = {"max_new_tokens": MAX, "temperature": 1.0, "sampling_seed": SEED, "n": 2}
    body = {"input_ids": refs["ids2"], "sampling_params": sp}
    r = httpx.post(f"{base}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    want = [refs["b0"].token_ids, refs["b1"].token_ids]
    assert want[0] != want[1] and [c["output_ids"] for c in r.json()] == want
    r = httpx.post(f"{base}/generate", json={**body, "stream": True}, timeout=120)
    last: dict[int, list[int]] = {}
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            last[chunk["index"]] = chunk["output_ids"]  # cumulative per choice
    assert [last[0], last[1]] == want


# ---- PD ---------------------------------------------------------------------------------------------
def test_pd_servers_take_n_as_one_room_per_choice() -> None:
    """`n > 1` on a PD server: a room per choice (what sglang-router sends for chat) gives one target
    per sequence, prompt-major; a room per prompt (what it sends for completions) is a 400 naming n."""
    from dsv4_engine.server import pd

    def req(room: Any) -> Any:
        many = isinstance(room, list)
        return SimpleNamespace(
            bootstrap_room=room,
            bootstrap_host=["h"] * len(room) if many else "h",
            bootstrap_port=[7] * len(room) if many else 7,
        )

    for mode in ("prefill", "decode"):
        ctx = SimpleNamespace(settings=SimpleNamespace(disaggregation_mode=mode, bootstrap_port=None))
        got = pd.targets(ctx, req([1, 2, 3, 4]), 2, 2)  # type: ignore[arg-type]
        assert [t.room for t in got or []] == [1, 2, 3, 4]
        for rooms, prompts in ((5, 1), ([5, 6], 2)):
            with pytest.raises(ApiError) as info:
                pd.targets(ctx, req(rooms), prompts, 2)  # type: ignore[arg-type]
            assert (info.value.status, info.value.param, info.value.code) == (
                400,
                "n",
                "unsupported_parameter",
            )
            assert mode in info.value.message and "one bootstrap room per choice" in info.value.message
    colocated = SimpleNamespace(settings=SimpleNamespace(disaggregation_mode="null"))
    assert pd.targets(colocated, req(5), 1, 2) is None  # type: ignore[arg-type]
