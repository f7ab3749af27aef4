"""The official `openai` client against the real engine on 127.0.0.1: outputs equal `LLM.generate`."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.server.app import create_app

NAME = "dsv4-tiny"
MAX = 8
PROMPTS = ["Hello there", "你好，世界 🙂"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a page?"}]


def chat_ids(tokenizer: Any) -> list[int]:
    enc = tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=True, sanitize_control_tokens=True
    )
    return list(enc["input_ids"])


@pytest.fixture(scope="module")
def refs(llm: Any) -> dict[str, Any]:
    """Offline greedy outputs, computed before any server drives the engine."""
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX)
    outs = llm.generate([*PROMPTS, chat_ids(llm.tokenizer)], greedy)
    return {"completions": outs[:2], "chat": outs[2]}


@pytest.fixture(scope="module")
def base(refs: dict[str, Any], llm: Any, tiny_checkpoint: Any, serve: Any) -> Iterator[str]:
    from dsv4_engine.server.args import ServerSettings

    settings = ServerSettings(model=str(tiny_checkpoint), served_model_name=NAME)
    with serve(create_app(settings, lambda: llm.engine)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def test_completions_equal_offline_generate(client: openai.OpenAI, refs: dict[str, Any]) -> None:
    for prompt, ref in zip(PROMPTS, refs["completions"], strict=True):
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX, temperature=0)
        choice = r.choices[0]
        assert choice.text == ref.text
        assert choice.finish_reason == ref.finish_reason
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_completion_joins_to_the_same_text(client: openai.OpenAI, refs: dict[str, Any]) -> None:
    ref = refs["completions"][1]  # multibyte prompt
    stream = client.completions.create(
        model=NAME,
        prompt=PROMPTS[1],
        max_tokens=MAX,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [ref.finish_reason]
    assert chunks[-1].usage is not None and not chunks[-1].choices
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)


def test_chat_equals_offline_generate_streamed_and_not(client: openai.OpenAI, refs: dict[str, Any]) -> None:
    ref = refs["chat"]
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=MAX, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.token_ids)
    stream = client.chat.completions.create(
        model=NAME,
        messages=CHAT,
        max_completion_tokens=MAX,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def _stop_inside(text: str) -> str:
    """A 2-character stop string whose first occurrence is past the start of `text`."""
    for i in range(1, len(text) - 1):
        stop = text[i : i + 2]
        if "\ufffd" not in stop and text.find(stop) == i:
            return stop
    raise AssertionError(f"reference text too short for a stop string: {text!r}")


def test_stop_sequences_cut_the_text(client: openai.OpenAI, refs: dict[str, Any]) -> None:
    ref = refs["completions"][0]
    stop = _stop_inside(ref.text)
    want = ref.text[: ref.text.find(stop)]
    r = client.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=MAX, temperature=0, stop=[stop, "never"]
    )
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    assert 1 <= r.usage.completion_tokens <= len(ref.token_ids)
    stream = client.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=MAX, temperature=0, stop=stop, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_max_tokens_is_respected(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=NAME, prompt="abc", max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 3
    assert r.choices[0].finish_reason == "length"


def test_token_id_prompt_and_batch(client: openai.OpenAI, refs: dict[str, Any]) -> None:
    ids = [list(ref.prompt_token_ids) for ref in refs["completions"]]
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=MAX, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [ref.text for ref in refs["completions"]]
    assert r.usage.completion_tokens == sum(len(ref.token_ids) for ref in refs["completions"])


def test_models_and_errors(client: openai.OpenAI, llm: Any) -> None:
    assert [m.id for m in client.models.list()] == [NAME]
    with pytest.raises(openai.NotFoundError) as nf:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert nf.value.body["code"] == "model_not_found"
    too_long = [5] * llm.engine.max_model_len
    with pytest.raises(openai.BadRequestError) as big:
        client.completions.create(model=NAME, prompt=too_long, max_tokens=1)
    assert big.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as over:
        client.completions.create(model=NAME, prompt="x", max_tokens=llm.engine.max_model_len)
    assert over.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as n:
        client.chat.completions.create(model=NAME, messages=CHAT, n=129)  # OpenAI's limit is 128
    assert n.value.body["param"] == "n"


def test_sglang_worker_endpoints(base: str, refs: dict[str, Any]) -> None:
    ref = refs["completions"][0]
    body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": MAX, "temperature": 0.0}}
    r = httpx.post(f"{base}/generate", json=body, timeout=120).json()
    assert r["text"] == ref.text and r["output_ids"] == ref.token_ids
    assert r["meta_info"]["completion_tokens"] == len(ref.token_ids)
    assert r["meta_info"]["finish_reason"]["type"] == ref.finish_reason
    with httpx.stream("POST", f"{base}/generate", json={**body, "stream": True}, timeout=120) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = httpx.Response(200, content=events[-2]).json()
    assert last["text"] == ref.text  # SGLang streams cumulative text
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(base + path).json()
        assert info["served_model_name"] == NAME and info["dp_size"] == 1
    for path in ("/model_info", "/get_model_info"):
        assert httpx.get(base + path).json()["is_generation"] is True
    load = httpx.get(f"{base}/get_load").json()
    assert load[0]["num_reqs"] == 0 and load[0]["num_tokens"] == 0
    assert httpx.post(f"{base}/flush_cache").status_code == 200
    assert httpx.get(f"{base}/health_generate", timeout=120).status_code == 200


def test_metrics_count_what_was_served(base: str) -> None:
    text = httpx.get(f"{base}/metrics").text
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#") and "{" not in line
    }
    assert values["dsv4_time_to_first_token_seconds_count"] >= 5
    assert values["dsv4_inter_token_latency_seconds_count"] >= 5 * (MAX - 1)
    assert values["dsv4_generation_tokens_total"] >= 5 * MAX
    assert values["dsv4_prompt_tokens_total"] > 0
    assert values["dsv4_num_requests_running"] == 0
    assert values["dsv4_server_ready"] == 1
    # vLLM's names for the same data, labelled with the served model and the role (docs/observability.md)
    served = re.findall(
        r'^vllm:request_success_total\{finished_reason="length",model_name="([^"]+)",role="colocated"\} (\S+)$',
        text,
        flags=re.MULTILINE,
    )
    assert served and float(served[0][1]) >= 5
    assert re.search(
        r'^vllm:kv_cache_usage_perc\{model_name="[^"]+",role="colocated"\} 0\.0$', text, re.MULTILINE
    )
