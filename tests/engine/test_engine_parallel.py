"""Parallel engines on CPU with gloo: 2 and 4 ranks, and 2 expert groups of 2, give the greedy
output of one rank and of HF (all-reduces reorder fp32 sums, so a token may differ only where HF's
top-2 margin is below 1e-4: counted and printed), leave every pool whole and every rank exited."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dsv4_engine.llm import LLM
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.testing import greedy_divergences, random_ids

LENGTHS = [17, 130, 515]  # across the window, ratio-4 and ratio-128 boundaries, chunked at 128
TOKENS = 8


def _generate(path: Path, **kwargs: object) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, dtype="float32", max_model_len=1024, max_num_seqs=8, num_pages=64,
              chunked_prefill_size=128, **kwargs)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    outs = llm.generate([random_ids(n, seed=n) for n in LENGTHS], params)
    return [o.token_ids for o in outs], llm


@pytest.fixture(scope="module")
def one_rank(checkpoints: dict[str, Path]) -> list[list[int]]:
    tokens, llm = _generate(checkpoints["A"])
    llm.close()
    return tokens


@pytest.mark.parametrize(("tp", "ep"), [(2, 1), (4, 1), (2, 2)])
def test_parallel_greedy_equals_one_rank_and_hf(
    checkpoints: dict[str, Path], hf_models: Callable[[str], torch.nn.Module], one_rank: list[list[int]],
    tp: int, ep: int,
) -> None:  # fmt: skip
    tokens, llm = _generate(checkpoints["A"], tp_size=tp, ep_size=ep)
    try:
        assert llm.engine.prewarm_seconds > 0
        llm.engine.flush_cache()  # the prefix cache's pages (the other ranks' follow with their journal)
        m = llm.engine.metrics()
        for fam in ("full", "swa", "c4s", "c128s"):
            assert m[f"pool_free/{fam}"] == m[f"pool_total/{fam}"], fam
        workers = llm.engine.workers
        assert workers is not None and all(p.is_alive() for p in workers.processes)
    finally:
        llm.close()
    assert not any(p.is_alive() for p in workers.processes)
    assert all(p.exitcode == 0 for p in workers.processes), [p.exitcode for p in workers.processes]
    excused = 0
    for n, ours in zip(LENGTHS, tokens, strict=True):
        excused += len(greedy_divergences(hf_models("A"), random_ids(n, seed=n), ours))
    same = sum(a == b for a, b in zip(tokens, one_rank, strict=True))
    print(f"tp {tp} ep {ep}: {same}/{len(LENGTHS)} outputs equal to one rank's, {excused} excused vs HF")
    assert same == len(LENGTHS) or excused
