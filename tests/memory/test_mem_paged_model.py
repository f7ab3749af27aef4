"""The tiny DSV4 model on the paged pools (PagedSeqCache) against its dense reference cache.

Same chunking on both sides must give bit-identical logits (the paged cache only relocates rows);
chunked and unchunked prefill on the paged side must agree on every greedy token.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_engine.attention.paged_extend import paged_extend_batch
from dsv4_engine.config import Dsv4Config
from dsv4_engine.make_tiny import build_config
from dsv4_engine.memory import (
    Dsv4MemoryLayout,
    ExtendSpec,
    PagedMemory,
    PoolSizes,
)
from dsv4_engine.model import Dsv4ForCausalLM, ForwardBatch
from dsv4_engine.testing import dense_cache

MAX_CTX = 1024


@pytest.fixture(scope="module")
def model() -> Dsv4ForCausalLM:
    torch.manual_seed(0)
    config = Dsv4Config.from_dict(build_config("tiny"))
    return Dsv4ForCausalLM(config, max_positions=MAX_CTX).float().eval()


class Paged:
    def __init__(self, model: Dsv4ForCausalLM) -> None:
        layout = Dsv4MemoryLayout.from_config(model.config, page_size=128, kv_dtype=torch.float32)
        self.sizes = PoolSizes(full_pages=24, swa_pages=24, c4_state_pages=12, c128_state_pages=12)
        mem = PagedMemory.build(layout, self.sizes, max_reqs=4, max_ctx=MAX_CTX)
        self.kv, self.req_pool, self.alloc = mem.kv, mem.req_pool, mem.allocator

    def new_request(self) -> int:
        return self.alloc.alloc_request()


def run(model, caches, prompts: list[list[int]], chunk: int | None, steps: int, paged: Paged | None):
    """Prefill every prompt (in chunks), then greedy-decode all together; logits of each step.
    caches: dense caches, or with `paged` request rows of its pools."""
    lens = [0] * len(prompts)
    done = [0] * len(prompts)
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]

    def forward(items: list[tuple[int, list[int]]]) -> None:
        if paged is not None:
            specs = [ExtendSpec(caches[i], lens[i], lens[i] + len(t)) for i, t in items]
            bundle = paged.alloc.alloc_extend(specs)
            chunks = [t for _, t in items]
            batch = paged_extend_batch(paged.kv, paged.req_pool, specs, bundle, chunks, model.dtype)
        else:
            batch = ForwardBatch.build([(caches[i], t) for i, t in items])
        for i, t in items:
            lens[i] += len(t)
        with torch.no_grad():
            hidden = model(batch)
        for (i, _), seq in zip(items, batch.seqs, strict=True):
            if seq.end == len(prompts[i]) + len(tokens[i]):  # last token of what we have: sample
                out = model.compute_logits(hidden[seq.offset + seq.length - 1])
                logits[i].append(out)
                tokens[i].append(int(out.argmax()))

    while any(d < len(p) for d, p in zip(done, prompts, strict=True)):
        items = []
        for i, p in enumerate(prompts):
            if done[i] < len(p):
                n = len(p) - done[i] if chunk is None else min(chunk, len(p) - done[i])
                items.append((i, p[done[i] : done[i] + n]))
                done[i] += n
        forward(items)
    for _ in range(steps):
        forward([(i, [tokens[i][-1]]) for i in range(len(prompts))])
    return tokens, logits


def test_paged_equals_dense_bitwise(model) -> None:
    chunk = 128  # chunked: exercises state carried across chunk boundaries through the pools
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (150, 37)]
    dense_tokens, dense_logits = run(model, [dense_cache(model) for _ in prompts], prompts, chunk, 6, None)
    paged = Paged(model)
    free0 = paged.alloc.num_free()
    rows = [paged.new_request() for _ in prompts]
    paged_tokens, paged_logits = run(model, rows, prompts, chunk, 6, paged)
    assert paged_tokens == dense_tokens
    for a, b in zip(dense_logits, paged_logits, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)
    for row in rows:
        paged.alloc.free(row)
    assert paged.alloc.num_free() == free0


@pytest.mark.slow
def test_paged_chunked_matches_unchunked_tokens(model) -> None:
    g = torch.Generator().manual_seed(2)
    prompt = [torch.randint(3, 512, (260,), generator=g).tolist()]
    outs = []
    for chunk in (None, 128):
        paged = Paged(model)
        outs.append(run(model, [paged.new_request()], prompt, chunk, 6, paged))
    for tokens, logits in outs[1:]:
        assert tokens == outs[0][0]
        for x, y in zip(logits[0], outs[0][1][0], strict=True):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [256, None])
def test_paged_equals_dense_bitwise_long(model, chunk: int | None) -> None:
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (517, 1, 258)]
    dense_tokens, dense_logits = run(model, [dense_cache(model) for _ in prompts], prompts, chunk, 4, None)
    paged = Paged(model)
    paged_tokens, paged_logits = run(model, [paged.new_request() for _ in prompts], prompts, chunk, 4, paged)
    assert paged_tokens == dense_tokens
    for a, b in zip(dense_logits, paged_logits, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
