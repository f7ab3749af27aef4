"""Sampling is per request inside a batch: seeds reproduce whatever the batch around them,
stop_token_ids and ignore_eos apply to their own request only."""

from __future__ import annotations

import pytest

from dsv4_engine.llm import LLM
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.testing import random_ids

PROMPT = random_ids(40, seed=5)
OTHERS = [random_ids(n, seed=n) for n in (3, 70, 200)]


@pytest.fixture(scope="module")
def llm(make_llm) -> LLM:
    return make_llm("A", chunked_prefill_size=128, max_num_batched_tokens=256)


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=seed, max_tokens=12, ignore_eos=True)


def test_seeded_sampling_independent_of_batch(llm: LLM, assert_released) -> None:
    alone = llm.generate([PROMPT], seeded(7))[0].token_ids
    mixed_params = [
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=1.3, top_k=5, max_tokens=9, ignore_eos=True),  # unseeded
        seeded(8),
        seeded(7),
    ]
    outs = llm.generate([*OTHERS, PROMPT], mixed_params)
    assert outs[3].token_ids == alone  # same seed, same tokens, whatever runs beside it
    assert outs[2].token_ids != alone  # another seed draws other tokens (same prompt family)
    again = llm.generate([PROMPT, PROMPT], [seeded(7), seeded(9)])
    assert again[0].token_ids == alone and again[1].token_ids != alone
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert alone != greedy.token_ids  # temperature really sampled
    assert_released(llm)


def test_stop_ids_and_ignore_eos_are_per_request(llm: LLM, assert_released) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (base,) = llm.generate([PROMPT], greedy)
    stop = base.token_ids[4]
    first = base.token_ids.index(stop)
    batch = [
        greedy,
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop]),
        SamplingParams(temperature=0.0, max_tokens=12),  # stops at EOS (set to `stop` below)
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
    ]
    engine = llm.engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = {stop}
    try:
        outs = llm.generate([PROMPT] * 4 + OTHERS[:1], [*batch, greedy])
    finally:
        engine.eos_token_ids = saved
    assert outs[0].token_ids == base.token_ids and outs[0].finish_reason == "length"  # ignore_eos
    assert outs[1].token_ids == base.token_ids[: first + 1] and outs[1].finish_reason == "stop"
    assert outs[2].token_ids == base.token_ids[: first + 1] and outs[2].finish_reason == "stop"
    assert outs[3].token_ids == base.token_ids[:3] and outs[3].finish_reason == "length"
    assert len(outs[4].token_ids) == 12
    assert_released(llm)
