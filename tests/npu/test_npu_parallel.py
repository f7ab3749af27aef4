"""Tensor parallelism on the NPU kernel set: `LLM(device="npu", tp_size=2)` puts each rank on its own
NPU and sums the forward's partial results over HCCL, after prewarming the process groups. On a CPU
the reference's "hccl" backend (`tests/npu/reference/torch_npu/_hccl.py`) runs gloo's all-reduce on
the "npu" tensors' host memory; with DSV4_TORCH_NPU=real the same test runs real HCCL on two NPUs.
The greedy tokens equal the CPU path's on one rank, the pools are whole afterwards, and every rank
exits 0.

The reference's graphs record the ops that run through it, and gloo does not, so a collective inside
an aclgraph capture is refused there (HCCL's would be captured): tensor-parallel NPU decode runs
eagerly on the reference."""

from __future__ import annotations

import contextlib
import datetime
import socket
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

PROMPTS = [list(range(3, 20)), list(range(5, 145))]  # the second prefills in two chunks
OPTIONS: dict[str, Any] = {"dtype": "float32", "chunked_prefill_size": 128, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dsv4_engine.make_tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("npu-parallel") / "tiny", seed=0)


def _greedy(llm: Any) -> list[list[int]]:
    from dsv4_engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


def test_two_ranks_on_npu_answer_as_one_cpu_rank(
    checkpoint: Path, importable_torch_npu: Callable[[], contextlib.AbstractContextManager[ModuleType]]
) -> None:
    from dsv4_engine import LLM

    cpu = LLM(str(checkpoint), device="cpu", kernels=False, enforce_eager=True, **OPTIONS)
    try:
        want = _greedy(cpu)
    finally:
        cpu.close()
    with importable_torch_npu():
        llm = LLM(str(checkpoint), device="npu", tp_size=2, enforce_eager=True, **OPTIONS)
        workers = llm.engine.workers
        try:
            assert llm.engine.prewarm_seconds > 0  # each group's first collective, before traffic
            assert next(llm.engine.model.parameters()).device == torch.device("npu", 0)
            got = _greedy(llm)
            m = llm.engine.metrics()
            assert all(
                m[f"pool_available/{f}"] == m[f"pool_total/{f}"] for f in ("full", "swa", "c4s", "c128s")
            )
        finally:
            llm.close()
    assert workers is not None and [p.exitcode for p in workers.processes] == [0]
    assert got == want


def test_the_reference_hccl_refuses_a_collective_in_a_capture(reference_npu: ModuleType) -> None:
    """One rank is enough to see it: an all-reduce on "npu" tensors runs (and sums in place) eagerly,
    and raises inside an aclgraph capture instead of being left out of the replays."""
    dist = torch.distributed
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "hccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )  # fmt: skip
    try:
        x = torch.full((4,), 2.0, device="npu")
        dist.all_reduce(x)
        assert x.device.type == "npu" and x.cpu().tolist() == [2.0] * 4
        with (
            pytest.raises(RuntimeError, match="cannot record a collective"),
            torch.npu.graph(torch.npu.NPUGraph()),
        ):
            dist.all_reduce(x)
        with pytest.raises(RuntimeError, match="contiguous"):
            dist.all_reduce(torch.zeros(4, 4, device="npu").t())
    finally:
        dist.destroy_process_group()
