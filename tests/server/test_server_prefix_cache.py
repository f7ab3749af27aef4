"""The prefix cache as a client sees it, on the real tiny engine: `cached_tokens` in every usage body
(chat, completions, streamed, /v1/responses, SGLang's /generate), the `prefix_cache` series of
/metrics, and /flush_cache giving every cached page back. Outputs equal a server started with
--disable-radix-cache, which reports nothing cached.

Every test builds its prompts on a fresh random prefix, so none depends on what another left in the
shared engine's cache.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from dsv4_engine.server.app import create_app
from dsv4_engine.server.args import ServerSettings
from prometheus_util import openai_client, scrape  # tests/ is on sys.path (tests/conftest.py)

NAME = "dsv4-tiny"
MAX = 6
PAGES = 5  # the shared prefix spans at least this many pages
VLLM = (("model_name", NAME), ("role", "colocated"))


def long_text() -> str:
    """A prefix no other request has sent, several pages long once tokenised."""
    words = " ".join(f"{w}{i}" for i in range(120) for w in ("alpha", "page"))
    return f"{uuid.uuid4().hex} {words}"


def conversation(prefix: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": prefix}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def page_size(llm: Any) -> int:
    return int(llm.engine.engine_config.page_size)


@pytest.fixture(scope="module")
def base(llm: Any, tiny_checkpoint: Any, serve: Any) -> Iterator[str]:
    assert llm.engine.engine_config.prefix_cache, "the shared engine should keep a prefix cache"
    settings = ServerSettings(model=str(tiny_checkpoint), served_model_name=NAME)
    with serve(create_app(settings, lambda: llm.engine)) as url:
        yield url


@pytest.fixture(scope="module")
def uncached_base(tiny_checkpoint: Any, serve: Any) -> Iterator[str]:
    """Its own engine, built from the settings as `dsv4 serve --disable-radix-cache` builds it."""
    settings = ServerSettings(model=str(tiny_checkpoint), served_model_name=NAME, disable_radix_cache=True)
    with serve(create_app(settings)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai_client(base)


def chat(client: openai.OpenAI, messages: list[dict[str, str]], **kw: Any) -> Any:
    return client.chat.completions.create(model=NAME, messages=messages, max_tokens=MAX, temperature=0, **kw)


def cached(r: Any) -> int:
    return r.usage.prompt_tokens_details.cached_tokens


def flush(base: str) -> None:
    r = httpx.post(f"{base}/flush_cache", timeout=60)
    assert (r.status_code, r.text) == (200, "Cache flushed.\n")


def test_a_shared_prefix_is_resumed_and_changes_no_output(
    base: str, client: openai.OpenAI, uncached_base: str, page_size: int
) -> None:
    prefix = long_text()
    first, second = conversation(prefix, "What is a page?"), conversation(prefix, "Name two colours.")
    before = scrape(base)
    a, b = chat(client, first), chat(client, second)
    after = scrape(base)

    assert a.usage.prompt_tokens > PAGES * page_size
    assert cached(a) == 0  # nothing of a fresh prefix is cached
    assert 0 < cached(b) < b.usage.prompt_tokens
    assert cached(b) % page_size == 0  # the cache resumes whole pages

    # The counters rose by exactly these requests' prompt tokens and cached tokens; vLLM's names agree.
    def rise(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return after[(name, labels)] - before[(name, labels)]

    assert rise("dsv4_prefix_cache_queries_total") == a.usage.prompt_tokens + b.usage.prompt_tokens
    assert rise("dsv4_prefix_cache_hits_total") == cached(b)
    assert rise("vllm:prefix_cache_queries_total", VLLM) == a.usage.prompt_tokens + b.usage.prompt_tokens
    assert rise("vllm:prefix_cache_hits_total", VLLM) == cached(b)
    hits, queries = (
        after[("dsv4_prefix_cache_hits_total", ())],
        after[("dsv4_prefix_cache_queries_total", ())],
    )
    assert after[("dsv4_prefix_cache_hit_rate", ())] == pytest.approx(hits / queries)
    assert 0 < after[("dsv4_prefix_cache_hit_rate", ())] < 1

    # The same requests without a prefix cache: the same greedy outputs, nothing reported cached,
    # not even for a prompt sent twice.
    uncached = openai_client(uncached_base)
    for messages, got in ((first, a), (second, b), (second, b)):
        want = chat(uncached, messages)
        assert want.choices[0].message.content == got.choices[0].message.content
        assert want.usage.completion_tokens == got.usage.completion_tokens
        assert want.usage.prompt_tokens == got.usage.prompt_tokens
        assert cached(want) == 0
    after_uncached = scrape(uncached_base)
    assert after_uncached[("vllm:prefix_cache_hits_total", VLLM)] == 0
    assert after_uncached[("vllm:prefix_cache_queries_total", VLLM)] >= 3 * a.usage.prompt_tokens
    assert after_uncached[("dsv4_prefix_cache_hit_rate", ())] == 0


def test_streamed_usage_carries_cached_tokens(base: str, client: openai.OpenAI) -> None:
    messages = conversation(long_text(), "What is a page?")
    assert cached(chat(client, messages)) == 0
    repeat = chat(client, messages)
    assert cached(repeat) > 0

    stream = chat(client, messages, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert cached(chunks[-1]) == cached(repeat)
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == repeat.choices[0].message.content

    # vLLM's continuous_usage_stats: every chunk's usage, the cached figure from the first token on.
    body = {"model": NAME, "messages": messages, "max_tokens": MAX, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usages = [json.loads(e)["usage"] for e in events[:-1]]
    assert all(u["prompt_tokens_details"]["cached_tokens"] in (0, cached(repeat)) for u in usages)
    assert usages[-1]["prompt_tokens_details"]["cached_tokens"] == cached(repeat)
    assert usages[-2]["prompt_tokens_details"]["cached_tokens"] == cached(repeat)  # the finishing chunk


def test_n_choices_count_the_prompt_once(client: openai.OpenAI) -> None:
    messages = conversation(long_text(), "What is a page?")
    chat(client, messages)
    one = chat(client, messages)
    assert cached(one) > 0
    both = chat(client, messages, n=2)
    # Like prompt_tokens: the prompt once, however many choices (not twice the figure).
    assert both.usage.prompt_tokens == one.usage.prompt_tokens
    assert cached(both) == cached(one)
    streamed = list(chat(client, messages, n=2, stream=True, stream_options={"include_usage": True}))
    assert cached(streamed[-1]) == cached(one)


def test_every_usage_body_carries_cached_tokens(base: str, client: openai.OpenAI) -> None:
    prefix = long_text()
    # /v1/completions, plain and streamed
    first = client.completions.create(model=NAME, prompt=prefix, max_tokens=MAX, temperature=0)
    again = client.completions.create(model=NAME, prompt=prefix, max_tokens=MAX, temperature=0)
    assert cached(first) == 0 and 0 < cached(again) < again.usage.prompt_tokens
    assert again.choices[0].text == first.choices[0].text
    stream = client.completions.create(
        model=NAME, prompt=prefix, max_tokens=MAX, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    assert cached(list(stream)[-1]) == cached(again)

    # SGLang's /generate: meta_info.cached_tokens, plain and in every streamed chunk
    body = {"text": prefix, "sampling_params": {"max_new_tokens": MAX, "temperature": 0.0}}
    meta = httpx.post(f"{base}/generate", json=body, timeout=120).json()["meta_info"]
    assert meta["cached_tokens"] == cached(again)
    with httpx.stream("POST", f"{base}/generate", json={**body, "stream": True}, timeout=120) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert {json.loads(e)["meta_info"]["cached_tokens"] for e in events[:-1]} == {cached(again)}

    # /v1/responses: input_tokens_details.cached_tokens, after a chat request with the same messages
    question = "What is a page?"
    chatted = chat(client, conversation(prefix, question))
    assert chatted.usage.prompt_tokens_details is not None
    resp = client.responses.create(
        model=NAME, instructions=prefix, input=question, max_output_tokens=MAX, temperature=0
    )
    assert resp.usage is not None and resp.usage.input_tokens == chatted.usage.prompt_tokens
    assert 0 < resp.usage.input_tokens_details.cached_tokens < resp.usage.input_tokens
    events = list(
        client.responses.create(
            model=NAME, instructions=prefix, input=question, max_output_tokens=MAX, temperature=0, stream=True
        )
    )
    done = events[-1].response
    assert done.usage.input_tokens_details.cached_tokens == resp.usage.input_tokens_details.cached_tokens


def test_flush_cache_gives_every_cached_page_back(base: str, client: openai.OpenAI) -> None:
    messages = conversation(long_text(), "What is a page?")
    chat(client, messages)
    warm = chat(client, messages)
    assert cached(warm) > 0
    held = scrape(base)
    pools = [labels for (name, labels) in held if name == "dsv4_pool_total_pages"]
    assert pools, "no pool series"
    # Nothing runs now; the pages not free are the cache's.
    assert held[("dsv4_num_requests_running", ())] == 0
    assert any(held[("dsv4_pool_free_pages", p)] < held[("dsv4_pool_total_pages", p)] for p in pools)
    assert held[("dsv4_prefix_cache_nodes", ())] > 0

    flush(base)
    freed = scrape(base)
    for p in pools:
        assert freed[("dsv4_pool_free_pages", p)] == freed[("dsv4_pool_total_pages", p)], p
    assert freed[("dsv4_prefix_cache_snapshots", ())] == 0

    # The cache is empty: the same request prefills its whole prompt again, to the same output.
    cold = chat(client, messages)
    assert cached(cold) == 0
    assert cold.choices[0].message.content == warm.choices[0].message.content
    r = httpx.get(f"{base}/flush_cache", timeout=60)  # SGLang answers GET too
    assert (r.status_code, r.text) == (200, "Cache flushed.\n")
    assert cached(chat(client, messages)) == 0
