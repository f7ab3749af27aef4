"""Fixtures for the batched-decode tests: the tiny checkpoint, and twin paged memories (one driven by
the reference SeqCache path, one by the graph runner) that allocate identically."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv4_engine.config import Dsv4Config
from dsv4_engine.graph_runner import DecodeGraphRunner
from dsv4_engine.loader import load_checkpoint
from dsv4_engine.make_tiny import make_tiny
from dsv4_engine.memory import (
    Dsv4MemoryLayout,
    ExtendSpec,
    PagedMemory,
    PoolSizes,
)
from dsv4_engine.memory.seq_cache import PagedSeqCache
from dsv4_engine.model import Dsv4ForCausalLM, ForwardBatch

MAX_CTX = 1024


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here runs torch on one thread (see dsv4_engine.testing.one_thread)."""


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("dsv4_decode") / "tiny", seed=0)


@pytest.fixture(scope="session")
def model(tiny_path: Path) -> Dsv4ForCausalLM:
    m = Dsv4ForCausalLM(Dsv4Config.from_pretrained(tiny_path), max_positions=MAX_CTX).float()
    load_checkpoint(m, tiny_path, dtype=None, progress=False)
    return m.eval()


class Mem:
    """One paged memory (pools, request rows, allocator) with a PagedSeqCache per live request."""

    def __init__(self, model: Dsv4ForCausalLM, max_reqs: int = 8) -> None:
        self.layout = Dsv4MemoryLayout.from_config(model.config, page_size=128, kv_dtype=torch.float32)
        self.sizes = PoolSizes(full_pages=64, swa_pages=48, c4_state_pages=24, c128_state_pages=24)
        mem = PagedMemory.build(self.layout, self.sizes, max_reqs, MAX_CTX)
        self.kv, self.req_pool, self.alloc = mem.kv, mem.req_pool, mem.allocator
        self.caches: dict[str, PagedSeqCache] = {}

    def join(self, model: Dsv4ForCausalLM, name: str, prompt: list[int]) -> torch.Tensor:
        """Prefill through the reference path; logits of the prompt's last token."""
        cache = self.caches[name] = PagedSeqCache(self.kv, self.alloc, self.alloc.alloc_request())
        self.alloc.alloc_extend([ExtendSpec(cache.req_idx, 0, len(prompt))])
        with torch.no_grad():
            hidden = model(ForwardBatch.build([(cache, prompt)]))
            return model.compute_logits(hidden[-1:])[0]

    def leave(self, name: str) -> None:
        self.caches.pop(name).free()

    def decode_reference(self, model: Dsv4ForCausalLM, names: list[str], tokens: list[int]) -> torch.Tensor:
        caches = [self.caches[n] for n in names]
        self.alloc.alloc_extend([ExtendSpec(c.req_idx, c.num_tokens, c.num_tokens + 1) for c in caches])
        with torch.no_grad():
            return model.compute_logits(
                model(ForwardBatch.build([(c, [t]) for c, t in zip(caches, tokens, strict=True)]))
            )

    def decode_batched(self, runner: DecodeGraphRunner, names: list[str], tokens: list[int]) -> torch.Tensor:
        caches = [self.caches[n] for n in names]
        reqs = [c.req_idx for c in caches]
        specs = [ExtendSpec(c.req_idx, c.num_tokens, c.num_tokens + 1) for c in caches]
        self.alloc.alloc_decode(reqs)
        logits = runner.run(specs, tokens)
        for c in caches:
            c.num_tokens += 1
        return logits

    def free_counts(self) -> dict[str, int]:
        return self.alloc.num_free()


@pytest.fixture
def make_mem(model: Dsv4ForCausalLM):  # type: ignore[no-untyped-def]
    """Mem factory: for the tiny model, or for the model passed as the first argument."""
    return lambda other=None, **kw: Mem(other or model, **kw)
