"""Speculative decoding as a client and a scraper see it: `dsv4 serve --speculative-num-steps 2` on a
checkpoint with an MTP layer (the demo's, else the demo with a random one: tests/speculative_util.py)
answers greedy chat completions, plain and streamed, exactly as a server without the flag does, and its
/metrics carries vLLM's `spec_decode` counters, equal to what the engine reports and to the dsv4 twins,
with the acceptance gauges derived from them; without the flag every one of them stays 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from dsv4_engine.server.app import create_app, default_engine_factory
from dsv4_engine.server.args import parse
from prometheus_util import Samples, openai_client, scrape  # tests/ is on sys.path (tests/conftest.py)
from speculative_util import mtp_checkpoint

NAME = "dsv4-demo-mtp"
STEPS = 2
MAX = 24
VLLM = (("model_name", NAME), ("role", "colocated"))
COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
GAUGES = ("dsv4_spec_decode_acceptance_rate", "dsv4_spec_decode_mean_acceptance_length")
PROMPTS = (
    "What does the with statement do?",
    "Explain how a for loop works.",
    "What is a class?",
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mtp_checkpoint(tmp_path_factory.mktemp("spec-ckpt") / "demo-mtp")


def start(serve: Any, checkpoint: Path, *flags: str) -> Iterator[tuple[str, Any]]:
    """A server from `dsv4 serve`'s command line, in a thread; yields (base URL, its engine)."""
    settings = parse(["--model", str(checkpoint), "--served-model-name", NAME, *flags])
    engine = default_engine_factory(settings)()
    with serve(create_app(settings, lambda: engine)) as url:
        yield url, engine


@pytest.fixture(scope="module")
def speculative(serve: Any, checkpoint: Path) -> Iterator[tuple[str, Any]]:
    yield from start(serve, checkpoint, "--speculative-num-steps", str(STEPS))


@pytest.fixture(scope="module")
def plain(serve: Any, checkpoint: Path) -> Iterator[tuple[str, Any]]:
    yield from start(serve, checkpoint)


def chat(client: openai.OpenAI, prompt: str) -> Any:
    return client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=MAX, temperature=0
    )


def spec_series(got: Samples) -> dict[str, float]:
    """The three counters (dsv4's names, after checking vLLM's agree) and the two gauges."""
    out = {}
    for key in COUNTERS:
        ours, theirs = got[(f"dsv4_{key}_total", ())], got[(f"vllm:{key}_total", VLLM)]
        assert ours == theirs, key
        out[key] = ours
    return out | {g: got[(g, ())] for g in GAUGES}


def test_speculation_changes_no_output_and_its_counters_add_up(
    speculative: tuple[str, Any], plain: tuple[str, Any]
) -> None:
    (spec_url, engine), (plain_url, _) = speculative, plain
    spec_client, plain_client = openai_client(spec_url), openai_client(plain_url)
    scraped = scrape(spec_url)
    before, generated_before = spec_series(scraped), scraped[("dsv4_generation_tokens_total", ())]
    got = [chat(spec_client, p) for p in PROMPTS]
    streamed = spec_client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=MAX, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(streamed)
    scraped = scrape(spec_url)
    after, generated = spec_series(scraped), scraped[("dsv4_generation_tokens_total", ())] - generated_before

    # Greedy: the same text and token counts as without speculation, streamed or not.
    want = [chat(plain_client, p) for p in PROMPTS]
    for g, w in zip(got, want, strict=True):
        assert g.choices[0].message.content == w.choices[0].message.content
        assert g.usage.completion_tokens == w.usage.completion_tokens
        assert g.choices[0].finish_reason == w.choices[0].finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        want[0].choices[0].message.content
    )
    assert (
        chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == want[0].usage.completion_tokens
    )

    # What /metrics says is what the engine counted (the engine is idle: nothing moves meanwhile).
    engine_now = engine.metrics()
    for key in COUNTERS:
        assert after[key] == engine_now[key], key
    drafts, drafted, accepted = (after[k] - before[k] for k in COUNTERS)
    # Every verify step carries 1..STEPS drafts and keeps at most those; each step yields at least the
    # target's own token, and a request's first token comes from its prefill, not a verify.
    assert 0 < drafts <= drafted <= STEPS * drafts
    assert 0 <= accepted <= drafted
    assert drafts <= generated - (len(PROMPTS) + 1)
    total_drafts, total_drafted, total_accepted = (after[k] for k in COUNTERS)
    assert after["dsv4_spec_decode_acceptance_rate"] == pytest.approx(total_accepted / total_drafted)
    assert after["dsv4_spec_decode_mean_acceptance_length"] == pytest.approx(
        1 + total_accepted / total_drafts
    )
    assert 1 <= after["dsv4_spec_decode_mean_acceptance_length"] <= 1 + STEPS

    # Without the flag: nothing drafted, every series at 0, after the same requests.
    assert all(v == 0 for v in spec_series(scrape(plain_url)).values())
