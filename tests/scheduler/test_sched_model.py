"""The scheduler driving the tiny DSV4 model on paged memory: requests batched together (with
chunked prefill and preemption by recompute) produce the greedy tokens each produces alone."""

from __future__ import annotations

import pytest
import torch

from dsv4_engine.attention.paged_extend import paged_extend_batch
from dsv4_engine.config import Dsv4Config
from dsv4_engine.make_tiny import build_config
from dsv4_engine.memory import (
    Dsv4MemoryLayout,
    PagedMemory,
    PoolSizes,
)
from dsv4_engine.model import Dsv4ForCausalLM
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.scheduler import Scheduler, SchedulerConfig, Sequence

MAX_CTX = 512


@pytest.fixture(scope="module")
def model() -> Dsv4ForCausalLM:
    torch.manual_seed(0)
    return Dsv4ForCausalLM(Dsv4Config.from_dict(build_config("tiny")), max_positions=MAX_CTX).float().eval()


def generate(
    model, prompts: list[list[int]], max_tokens: int, full_pages: int, budget: int
) -> tuple[list, dict]:
    layout = Dsv4MemoryLayout.from_config(model.config, page_size=128, kv_dtype=torch.float32)
    sizes = PoolSizes(full_pages=full_pages, swa_pages=32, c4_state_pages=24, c128_state_pages=24)
    mem = PagedMemory.build(layout, sizes, max_reqs=8, max_ctx=MAX_CTX)
    kv, alloc = mem.kv, mem.allocator
    config = SchedulerConfig(
        page_size=128, max_model_len=MAX_CTX, max_num_batched_tokens=budget, chunk_size=128
    )
    sched = Scheduler(config, alloc)
    seqs = [
        Sequence(f"r{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    for s in seqs:
        sched.add(s)
    while sched.has_unfinished():
        out = sched.schedule()
        chunks = [c.token_ids for c in out.chunks]
        batch = paged_extend_batch(kv, alloc.req_pool, out.specs, out.bundle, chunks, model.dtype)
        with torch.no_grad():
            hidden = model(batch)
        sampled = {}
        for c, sl in zip(out.chunks, batch.seqs, strict=True):
            if c.sample:
                sampled[c.seq.request_id] = int(
                    model.compute_logits(hidden[sl.offset + sl.length - 1]).argmax()
                )
        sched.postprocess(out, sampled)
    return [s.output_token_ids for s in seqs], sched.metrics()


@pytest.mark.slow
def test_batched_with_preemption_equals_alone(model) -> None:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (120, 7, 126, 140)]
    alone = [generate(model, [p], 10, full_pages=8, budget=256)[0][0] for p in prompts]
    together, metrics = generate(model, prompts, 10, full_pages=4, budget=256)
    assert metrics["num_preemptions"] > 0  # 4 pages for 4 requests that each grow into a 2nd page
    assert together == alone
    assert metrics["pool_usage/full"] == 0.0 and metrics["pool_usage/swa"] == 0.0
