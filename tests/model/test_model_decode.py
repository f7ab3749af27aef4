"""Cached incremental forward: any split of a prompt into chunks, token-by-token decode, and
batched decode of requests at different positions all equal one full forward."""

from __future__ import annotations

import pytest
import torch

from dsv4_engine.model import ForwardBatch
from dsv4_engine.testing import dense_cache

TOL = 1e-4
SPLITS = {
    "decode": [100] + [1] * 200,  # prefill then token-by-token across both 128 boundaries
    "ragged": [5, 3, 120, 1, 1, 1, 169],  # chunks that start and end mid-block
    "aligned": [4, 124, 128, 44],
    "long_chunks": [37] * 8 + [4],
}


@pytest.mark.parametrize("name", ["A", "B"])
@pytest.mark.parametrize("split", sorted(SPLITS))
def test_chunked_forward_equals_full(models, name: str, split: str) -> None:
    model = models.ours(name)
    ids = models.random_ids(300, seed=3)
    full = models.logits(model, ids)
    cache, outs, start = dense_cache(model), [], 0
    with torch.inference_mode():
        for n in SPLITS[split]:
            outs.append(model.compute_logits(model(ForwardBatch.build([(cache, ids[start : start + n])]))))
            start += n
    assert start == len(ids) == cache.num_tokens
    diff = (torch.cat(outs) - full).abs().max().item()
    assert diff < TOL, f"{split}: max abs diff {diff:.3g}"


def test_batched_decode_equals_single(models) -> None:
    model = models.ours("A")
    ids = models.random_ids(200, seed=5)
    full = models.logits(model, ids)
    short, long = dense_cache(model), dense_cache(model)
    rows_short, rows_long = [], []
    with torch.inference_mode():
        model(ForwardBatch.build([(long, ids[:125]), (short, ids[:30])]))  # a batched prefill too
        for k in range(12):  # `long` crosses position 127 (an HCA row) on the way
            out = model.compute_logits(
                model(ForwardBatch.build([(long, [ids[125 + k]]), (short, [ids[30 + k]])]))
            )
            rows_long.append(out[0])
            rows_short.append(out[1])
    assert (torch.stack(rows_long) - full[125:137]).abs().max().item() < TOL
    assert (torch.stack(rows_short) - full[30:42]).abs().max().item() < TOL


def test_cache_free_releases_state(models) -> None:
    model = models.ours("A")
    cache = dense_cache(model)
    with torch.inference_mode():
        model(ForwardBatch.build([(cache, models.random_ids(20, seed=1))]))
    assert cache.num_tokens == 20
    cache.free()
    assert cache.num_tokens == 0
    assert not cache._swa and not cache._state and not cache._rows
