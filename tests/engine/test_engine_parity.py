"""Greedy output of the paged engine equals HF's, with chunked prefill at 128 and 256 and unchunked.

Prompt lengths cross the sliding window, the ratio-4 and ratio-128 boundaries, are mostly not
multiples of them, and reach 1499 tokens; all prompts of a case run together in one engine.
HF is the reference (stable top-k patched in); a token may differ only where HF's top-2 margin is
below 1e-4 (counted and printed).
"""

from __future__ import annotations

import pytest

from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.testing import greedy_divergences, random_ids

LENGTHS = [1, 15, 17, 125, 130, 256, 383, 515, 1030, 1499]
CASES = [("A", 128), ("A", 256), ("A", None), ("B", 128), ("C", 256)]
_CHECKED: dict[tuple, int] = {}  # (config, prompt, tokens) -> excused divergences; HF runs once each


def max_tokens(length: int) -> int:
    return 8 if length <= 515 else 4  # short generations for the long prompts bound the HF time


@pytest.mark.parametrize(("name", "chunk"), CASES)
def test_greedy_matches_hf(make_llm, hf_models, record_chunks, assert_released, record_property, name, chunk):
    if chunk is None:  # the whole workload fits one step: every prompt is a single chunk (the prefix
        # cache would end one at the prompt's last page boundary, for a snapshot there)
        llm = make_llm(name, chunked_prefill_size=-1, max_num_batched_tokens=8192, disable_radix_cache=True)
    else:
        llm = make_llm(name, chunked_prefill_size=chunk, max_num_batched_tokens=1024)
    chunks = record_chunks(llm)
    prompts = [random_ids(n, seed=n) for n in LENGTHS]
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens(n), ignore_eos=True) for n in LENGTHS]
    outs = llm.generate(prompts, params)

    # The schedule really was chunked (or not) as asked.
    for out, n in zip(outs, LENGTHS, strict=True):
        prefill = [(s, e) for rid, s, e in chunks if rid == out.request_id and s < n]
        if chunk is None:
            assert prefill == [(0, n)]
        else:
            assert len(prefill) >= -(-n // chunk)
            assert all(e - s <= chunk for s, e in prefill)
            assert all(e % 128 == 0 for s, e in prefill[:-1])  # non-final chunks end on a page
            assert prefill[0][0] == 0 and prefill[-1][1] == n

    excused = 0
    for prompt, out, n in zip(prompts, outs, LENGTHS, strict=True):
        assert len(out.token_ids) == max_tokens(n) and out.finish_reason == "length"
        key = (name, tuple(prompt), tuple(out.token_ids))
        if key not in _CHECKED:
            _CHECKED[key] = len(greedy_divergences(hf_models(name), prompt, out.token_ids))
        excused += _CHECKED[key]
    print(f"config {name}, chunk {chunk}: {excused} excused divergence(s) over {len(LENGTHS)} prompts")
    record_property("divergences", excused)
    assert_released(llm)
