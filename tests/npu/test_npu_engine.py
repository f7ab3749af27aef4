"""The engine on `--device npu`, end to end on the reference torch_npu: weights, pools, request tables
and every step's metadata live on the "npu" device, prefill is chunked, decode is batched, and the
greedy tokens equal the CPU path's on the torch kernel set, token for token, with the NPU kernel set's
torch_npu ops in the forward, both eagerly and as aclgraphs (one capture per decode bucket at start,
replayed on the same static buffers). Seeded sampling draws from `torch.Generator(device="npu")`
and is reproducible. What it took: the request tables written through device tensors (an int32 table
through its float32 view: Ascend's IndexPut refuses int32 values), extend metadata built on the host
and moved to the tables' device, packed decode weights rebound with `set_`."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

# Two greedy requests (the second prompt prefills in two chunks: 128 tokens, then 12), then seeded
# temperature-1 requests: seed 7 twice in one batch, and seed 8. Five requests on four running slots
# with these lengths make decode batches of 3, 4, 4, 4, 3, 2, 1, 1 requests: every bucket (4, 2, 1).
PROMPTS = [[5, 6, 7, 8, 9], list(range(3, 143)), [11, 12, 13], [11, 12, 13], [11, 12, 13]]
# (temperature, max_tokens, seed)
REQUESTS = [(0.0, 7, None), (0.0, 4, None), (1.0, 6, 7), (1.0, 6, 7), (1.0, 4, 8)]
GREEDY = 2  # the first two
OPTIONS: dict[str, Any] = {"dtype": "float32", "chunked_prefill_size": 128, "max_num_seqs": 4}
# torch_npu ops every forward runs (the MoE's in every layer, RMSNorm everywhere)
PER_FORWARD = (
    "npu_moe_gating_top_k",
    "npu_moe_init_routing_v2",
    "npu_grouped_matmul",
    "npu_moe_finalize_routing",
    "npu_rms_norm",
)


@dataclass
class Run:
    """One engine's answers to REQUESTS, and what it ran on."""

    tokens: list[list[int]]
    alone: list[int]  # the first seeded request again, alone, on the same engine
    forwards: list[Counter[str]] | None  # torch_npu op calls per model forward (the reference's count)
    kernels: tuple[str, str]  # the extend and decode kernel sets' class names
    on_npu: dict[str, bool]
    pages_back: bool


def _params(temperature: float, max_tokens: int, seed: int | None) -> Any:
    from dsv4_engine import SamplingParams

    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)


def _run(llm: Any, forwards: list[Counter[str]] | None = None) -> Run:
    engine = llm.engine
    got = [o.token_ids for o in llm.generate(PROMPTS, [_params(*r) for r in REQUESTS])]
    alone = llm.generate([PROMPTS[2]], _params(*REQUESTS[2]))[0].token_ids
    m = engine.metrics()
    generator = engine._generator(_params(1.0, 1, 7))
    return Run(
        tokens=got,
        alone=alone,
        forwards=forwards,
        kernels=(type(engine.runner.kernels).__name__, type(engine.runner.decode_runner().kernels).__name__),
        on_npu={
            "config": engine.engine_config.device.type == "npu",
            "weights": next(engine.model.parameters()).device.type == "npu",
            "tables": engine.req_pool.req_to_token.device.type == "npu",
            "generator": generator.device.type == "npu",
        },
        pages_back=all(
            m[f"pool_available/{f}"] == m[f"pool_total/{f}"] for f in ("full", "swa", "c4s", "c128s")
        ),
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dsv4_engine.make_tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("npu-engine") / "tiny", seed=0)


@pytest.fixture(scope="module")
def cpu_tokens(checkpoint: Path) -> list[list[int]]:
    """The greedy requests on the CPU path with the torch kernel set (eager decode: the same
    forward, without torch.compile's start-up)."""
    from dsv4_engine import LLM

    llm = LLM(str(checkpoint), device="cpu", kernels=False, enforce_eager=True, **OPTIONS)
    try:
        return [o.token_ids for o in llm.generate(PROMPTS[:GREEDY], [_params(*r) for r in REQUESTS[:GREEDY]])]
    finally:
        llm.close()


@pytest.fixture(scope="module")
def npu_eager(
    checkpoint: Path, importable_torch_npu: Callable[[], contextlib.AbstractContextManager[ModuleType]]
) -> Run:
    """REQUESTS on `--device npu` with eager decode (module-wide: the graph test compares with it)."""
    from dsv4_engine import LLM

    with importable_torch_npu() as torch_npu:
        llm = LLM(str(checkpoint), device="npu", enforce_eager=True, **OPTIONS)
        try:
            return _run(llm, _count_op_calls_per_forward(llm.engine.model, torch_npu))
        finally:
            llm.close()


def test_greedy_on_npu_equals_the_cpu_path(npu_eager: Run, cpu_tokens: list[list[int]]) -> None:
    assert npu_eager.on_npu == dict.fromkeys(npu_eager.on_npu, True)
    assert npu_eager.kernels == ("NpuKernels", "NpuDecodeKernels")
    assert npu_eager.tokens[:GREEDY] == cpu_tokens
    if npu_eager.forwards is not None:  # the reference records calls; the real torch_npu does not
        assert len(npu_eager.forwards) >= 2 + 5  # two prefill chunks, then a decode step per new token
        for ran in npu_eager.forwards:
            assert all(ran[op] >= 1 for op in PER_FORWARD), ran
            assert ran["npu_grouped_matmul"] == 2 * ran["npu_moe_init_routing_v2"], ran
    assert npu_eager.pages_back


def test_seeded_sampling_on_npu_is_reproducible(npu_eager: Run) -> None:
    """A seeded request draws from its own device generator: the same seed gives the same tokens
    beside another of the same seed, and alone in a later batch; another seed gives others."""
    seven, again, eight = npu_eager.tokens[2:]
    assert len(seven) == 6 and len(eight) == 4
    assert seven == again == npu_eager.alone
    assert eight != seven[:4]


def test_decode_graphs_on_npu(
    checkpoint: Path, cpu_tokens: list[list[int]], npu_eager: Run, torch_npu: ModuleType
) -> None:
    """`enforce_eager=False` on npu: each decode bucket is captured once as an aclgraph at start and
    replayed; the host refreshes the static step inputs in place, the graph refreshes the metadata
    from them, and every token (greedy and seeded) is the eager path's."""
    from dsv4_engine import LLM

    reference = getattr(torch_npu, "reference", None)
    llm = LLM(str(checkpoint), device="npu", enforce_eager=False, **OPTIONS)
    try:
        runner = llm.engine.runner.decode_runner()
        buckets = runner.buckets
        assert runner.mode == "graph" and type(runner.kernels).__name__ == "NpuDecodeKernels"
        assert runner.num_compiles == len(buckets)  # every bucket captured before traffic
        ptrs = {name: t.data_ptr() for name, t in runner.static_tensors().items()}
        captures = len(reference.captures) if reference is not None else 0
        replays = {bs: len(getattr(runner._graphs[bs], "replays", ())) for bs in buckets}

        got = _run(llm)

        assert got.tokens[:GREEDY] == cpu_tokens
        assert got.tokens == npu_eager.tokens and got.alone == npu_eager.alone
        assert runner.num_compiles == len(buckets)  # no capture during traffic
        assert {name: t.data_ptr() for name, t in runner.static_tensors().items()} == ptrs
        if reference is None:
            return
        assert len(reference.captures) == captures
        known = _storages([*llm.engine.model.parameters(), *llm.engine.model.buffers()])
        known += _storages(runner.static_tensors().values())
        for bs in buckets:
            graph = runner._graphs[bs]
            assert graph in reference.captures
            assert len(graph.replays) > replays[bs]  # the traffic ran through every bucket
            # The graph reads only buffers that live as long as the runner (weights, pools, tables,
            # metadata, step inputs), and every replay reads the step inputs the host wrote.
            assert all(any(a <= p < b for a, b in known) for p in graph.input_ptrs)
            inputs = (
                runner.input_ids[bs],
                runner.req[bs],
                runner.pos[bs],
                runner.valid[bs],
                runner.locs[bs].slots,
            )
            for replay in graph.replays:
                for a, b in _storages(inputs):
                    assert any(a <= p < b for p in replay), (bs, a)
    finally:
        llm.close()


def _storages(tensors: Any) -> list[tuple[int, int]]:
    """[start, end) of each tensor's storage."""
    return [
        (t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
        for t in tensors
    ]


def _count_op_calls_per_forward(model: torch.nn.Module, torch_npu: ModuleType) -> list[Counter[str]] | None:
    """The torch_npu op calls of each model forward from now on, from the reference's counts: from
    the first layer's start to the final norm's end."""
    reference = getattr(torch_npu, "reference", None)
    if reference is None:
        return None
    forwards: list[Counter[str]] = []
    start: list[Counter[str]] = []

    def before(*_: object) -> None:
        start.append(Counter(reference.op_calls))

    def after(*_: object) -> None:
        forwards.append(Counter(reference.op_calls) - start.pop())

    model.model.layers[0].register_forward_pre_hook(before)
    model.model.norm.register_forward_hook(after)
    return forwards
