"""The engine on `--device npu`, end to end on the reference torch_npu: weights, pools, request tables
and every step's metadata live on the "npu" device, prefill is chunked, decode is batched, and the
greedy tokens equal the CPU path's on the torch kernel set, token for token, with the NPU kernel set's
torch_npu ops in the forward. What it took: the request tables written through device tensors (an int32
table through its float32 view: Ascend's IndexPut refuses int32 values), extend metadata built on
the host and moved to the tables' device, and packed decode weights rebound with `set_`."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

PROMPTS = [[5, 6, 7, 8, 9], list(range(3, 143))]  # the second in two chunks: 128 tokens, then 12
OPTIONS: dict[str, Any] = {"dtype": "float32", "chunked_prefill_size": 128, "max_num_seqs": 4}
# torch_npu ops every forward runs (the MoE's in every layer, RMSNorm everywhere)
PER_FORWARD = (
    "npu_moe_gating_top_k",
    "npu_moe_init_routing_v2",
    "npu_grouped_matmul",
    "npu_moe_finalize_routing",
    "npu_rms_norm",
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dsv4_engine.make_tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("npu-engine") / "tiny", seed=0)


@pytest.fixture(scope="module")
def cpu_tokens(checkpoint: Path) -> list[list[int]]:
    """The CPU path on the torch kernel set, before any test makes torch_npu importable (HF
    transformers imports its own NPU integration when it sees torch_npu)."""
    from dsv4_engine import LLM, SamplingParams

    llm = LLM(str(checkpoint), device="cpu", kernels=False, **OPTIONS)
    try:
        return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6))]
    finally:
        llm.close()


def test_greedy_on_npu_equals_the_cpu_path(
    checkpoint: Path, cpu_tokens: list[list[int]], torch_npu: ModuleType
) -> None:
    from dsv4_engine import LLM, SamplingParams
    from dsv4_engine.kernels.npu import NpuDecodeKernels, NpuKernels

    llm = LLM(str(checkpoint), device="npu", enforce_eager=True, **OPTIONS)
    try:
        engine = llm.engine
        assert engine.engine_config.device.type == "npu"
        assert next(engine.model.parameters()).device.type == "npu"
        assert engine.req_pool.req_to_token.device.type == "npu"
        assert type(engine.runner.kernels) is NpuKernels
        assert type(engine.runner.decode_runner().kernels) is NpuDecodeKernels
        forwards = _count_op_calls_per_forward(engine.model, torch_npu)
        got = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6))]
        assert got == cpu_tokens
        if forwards is not None:  # the reference records calls; the real torch_npu does not
            assert len(forwards) >= 2 + 5  # two prefill chunks, then a decode step per new token
            for ran in forwards:
                assert all(ran[op] >= 1 for op in PER_FORWARD), ran
                assert ran["npu_grouped_matmul"] == 2 * ran["npu_moe_init_routing_v2"], ran
        m = engine.metrics()  # every page back
        assert all(
            m[f"pool_available/{f}"] == m[f"pool_total/{f}"] for f in ("full", "swa", "c4s", "c128s")
        ), m
    finally:
        llm.close()


def _count_op_calls_per_forward(model: torch.nn.Module, torch_npu: ModuleType) -> list[Counter[str]] | None:
    """The torch_npu op calls of each model forward from now on, from the reference's counts."""
    reference = getattr(torch_npu, "reference", None)
    if reference is None:
        return None
    forwards: list[Counter[str]] = []
    start: list[Counter[str]] = []

    def before(*_: object) -> None:
        start.append(Counter(reference.op_calls))

    def after(*_: object) -> None:
        forwards.append(Counter(reference.op_calls) - start.pop())

    model.register_forward_pre_hook(before)
    model.register_forward_hook(after)
    return forwards
