"""A scheduler over a real allocator and a fake model: the 'forward' samples a token that depends
only on the request and the position, so any correct schedule yields the same outputs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from dsv4_engine.memory import Dsv4Allocator, Dsv4MemoryLayout, Dsv4ReqToTokenPool, PoolSizes
from dsv4_engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

VOCAB = 50


def fake_token(request_id: str, position: int) -> int:
    return (hash((request_id, position)) % (VOCAB - 3)) + 3  # never 0..2 (EOS is 1); VOCAB - 3 = 47


@dataclass
class Harness:
    sched: Scheduler
    alloc: Dsv4Allocator
    req_pool: Dsv4ReqToTokenPool
    page_size: int
    steps: list[SchedulerOutput]

    def step(self) -> list:
        out = self.sched.schedule()
        if out is None:
            return []
        self.alloc.take_state_copies()  # what the model runner does before the forward
        self.steps.append(out)
        sampled = {c.seq.request_id: fake_token(c.seq.request_id, c.end) for c in out.chunks if c.sample}
        finished = self.sched.postprocess(out, sampled)
        self.alloc.take_state_copies()  # and after the step (the snapshots it took)
        return finished

    def run(self, max_steps: int = 10_000) -> None:
        n = 0
        while self.sched.has_unfinished():
            self.step()
            n += 1
            assert n < max_steps, "scheduler made no progress"


@pytest.fixture
def make_harness() -> Callable[..., Harness]:
    def make(
        *,
        page_size: int = 128,
        full_pages: int = 64,
        swa_pages: int = 64,
        state_pages: int = 32,
        max_reqs: int = 8,
        max_ctx: int = 4096,
        max_num_batched_tokens: int = 512,
        chunk_size: int | None = None,
        max_num_seqs: int = 8,
        prefix_cache: bool = False,
        snapshot_slots: int = 8,
    ) -> Harness:
        layout = Dsv4MemoryLayout((0, 4, 128, 0), head_dim=8, index_head_dim=4, window=16, page_size=page_size,
                                  kv_dtype=torch.float32)  # fmt: skip
        sizes = PoolSizes(full_pages, swa_pages, state_pages, state_pages, snapshot_slots)
        req_pool = Dsv4ReqToTokenPool(max_reqs, max_ctx)
        alloc = Dsv4Allocator(layout, sizes, req_pool, prefix_cache=prefix_cache)
        config = SchedulerConfig(
            page_size=page_size, max_model_len=max_ctx, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, chunk_size=chunk_size, eos_token_ids=(1,),
        )  # fmt: skip
        return Harness(Scheduler(config, alloc), alloc, req_pool, page_size, [])

    return make
