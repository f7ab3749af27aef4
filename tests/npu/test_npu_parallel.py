"""Tensor parallelism on the NPU kernel set: `LLM(device="npu", tp_size=2)` puts each rank on its own
NPU and sums the forward's partial results over HCCL, after prewarming the process groups. On a CPU
the reference's "hccl" backend (`tests/npu/reference/torch_npu/_hccl.py`) runs gloo's all-reduce on
the "npu" tensors' host memory; with DSV4_TORCH_NPU=real the same test runs real HCCL on two NPUs.
The greedy tokens equal the CPU path's on one rank, the pools are whole afterwards, and every rank
exits 0.

Decode runs as aclgraphs, as on Ascend: each rank captures its buckets with the all-reduces inside
(the reference records its "hccl" all-reduce as a device op, so every replay sums again), and the
reference checks the all-reduce's order against the MoE's second stream as any op's."""

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
    with importable_torch_npu() as torch_npu:
        reference = getattr(torch_npu, "reference", None)
        llm = LLM(str(checkpoint), device="npu", tp_size=2, enforce_eager=False, **OPTIONS)
        workers = llm.engine.workers
        try:
            assert llm.engine.prewarm_seconds > 0  # each group's first collective, before traffic
            assert next(llm.engine.model.parameters()).device == torch.device("npu", 0)
            runner = llm.engine.runner.decode_runner()
            assert runner.mode == "graph" and runner.num_compiles == len(runner.buckets)
            replays = {bs: len(getattr(runner._graphs[bs], "replays", ())) for bs in runner.buckets}
            got = _greedy(llm)
            if reference is not None:  # the replays ran the captured all-reduces (each layer's, and more)
                for bs in runner.buckets:
                    graph = runner._graphs[bs]
                    layers = len(llm.engine.model.model.layers)
                    assert sum(e.name == "hccl::allreduce" for e in graph.tape) >= layers
                assert any(len(runner._graphs[bs].replays) > replays[bs] for bs in runner.buckets)
            m = llm.engine.metrics()
            assert all(
                m[f"pool_available/{f}"] == m[f"pool_total/{f}"] for f in ("full", "swa", "c4s", "c128s")
            )
        finally:
            llm.close()
    assert workers is not None and [p.exitcode for p in workers.processes] == [0]
    assert got == want


def test_the_reference_hccl_all_reduce_is_a_captured_device_op(reference_npu: ModuleType) -> None:
    """One rank is enough to see it: an all-reduce on "npu" tensors sums in place eagerly, and inside
    an aclgraph capture it is recorded as a task of the graph (so replays run it); a tensor HCCL would
    refuse is refused."""
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
        graph = torch.npu.NPUGraph()
        with torch.npu.graph(graph):
            dist.all_reduce(x)
        assert [e.name for e in graph.tape] == ["hccl::allreduce"]
        graph.replay()
        for bad, why in (
            (torch.zeros(4, 4, device="npu").t(), "contiguous"),
            (torch.zeros(4), "npu tensors"),
        ):
            with pytest.raises(RuntimeError, match=why):
                dist.all_reduce(bad)
    finally:
        dist.destroy_process_group()
