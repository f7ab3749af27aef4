"""The `torch.compile`d decode step: parity with the eager step and no recompiles after warm-up.

A two-layer model (one CSA, one HCA layer, 3 Sinkhorn iterations) keeps a cold compile short; the
artefacts land in the inductor cache outside the repository, so later runs mostly hit it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from dsv4_engine.config import Dsv4Config
from dsv4_engine.graph_runner import DecodeGraphRunner, default_inductor_cache
from dsv4_engine.kernels import choose_kernels
from dsv4_engine.loader import load_checkpoint
from dsv4_engine.make_tiny import make_tiny
from dsv4_engine.model import Dsv4ForCausalLM

MAX_CTX = 1024
SMALL = {"num_hidden_layers": 2, "compress_ratios": [4, 128], "num_hash_layers": 1, "hc_sinkhorn_iters": 3}
TOL = 1e-5


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Dsv4ForCausalLM:
    path = make_tiny(tmp_path_factory.mktemp("dsv4_decode_small") / "small", seed=3, overrides=SMALL)
    model = Dsv4ForCausalLM(Dsv4Config.from_pretrained(path), max_positions=MAX_CTX).float()
    load_checkpoint(model, path, dtype=None, progress=False)
    return model.eval()


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@pytest.mark.parametrize(
    "kernels",
    [True, False],
    ids=["the CPU kernels a compiler keeps", "torch forms only (other devices, DSV4_KERNELS=0)"],
)
def test_compiled_equals_eager_without_recompiles(small_model, make_mem, caplog, kernels: bool) -> None:
    eager_mem, comp_mem = make_mem(small_model), make_mem(small_model)
    eager = DecodeGraphRunner(small_model, eager_mem.kv, eager_mem.req_pool, MAX_CTX, buckets=(1, 2))
    comp = DecodeGraphRunner(
        small_model,
        comp_mem.kv,
        comp_mem.req_pool,
        MAX_CTX,
        buckets=(2,),
        mode="compiled",
        kernels=choose_kernels(small_model.device, kernels),
        skip_guards=False,  # full guards on every call, so a recompile would show
    )
    assert (comp.kernels.name == "cpu") == kernels
    with caplog.at_level(logging.INFO, logger="dsv4_engine.graph_runner"):
        comp.warmup()  # one bucket keeps a cold compile short; batches of 1 and 2 both replay it
    assert comp.num_compiles == 1
    assert [r.getMessage().split(" in ")[0] for r in caplog.records] == ["decode bucket 2: compiled"]
    graphs = _unique_graphs()
    ptrs = {k: t.data_ptr() for k, t in comp.static_tensors().items()}

    g = torch.Generator().manual_seed(5)
    next_token: dict[str, int] = {}

    def join(name: str, n: int) -> None:
        prompt = torch.randint(3, 500, (n,), generator=g).tolist()
        first = eager_mem.join(small_model, name, prompt)
        comp_mem.join(small_model, name, prompt)
        next_token[name] = int(first.argmax())

    join("a", 126)  # crosses 128 (an HCA row) and several ratio-4 rows
    for step in range(16):
        if step == 4:
            join("b", 2)
        if step == 11:
            eager_mem.leave("a")
            comp_mem.leave("a")
            del next_token["a"]
        names = list(next_token)
        tokens = [next_token[n] for n in names]
        want = eager_mem.decode_batched(eager, names, tokens)
        got = comp_mem.decode_batched(comp, names, tokens)
        diff = (got - want).abs().max().item()
        assert diff < TOL, f"step {step}: compiled vs eager max |logit diff| {diff:.3g}"
        for name, row in zip(names, want, strict=True):
            next_token[name] = int(row.argmax())
    assert comp.num_compiles == 1 and _unique_graphs() == graphs  # zero recompiles after warm-up
    assert {k: t.data_ptr() for k, t in comp.static_tensors().items()} == ptrs


def test_inductor_cache_is_outside_the_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere/cache")
    assert default_inductor_cache() == Path("/somewhere/cache/dsv4/inductor")
    repo = Path(__file__).resolve().parents[2]
    assert repo not in default_inductor_cache().parents


def test_engine_warms_its_buckets_before_traffic(tmp_path: Path) -> None:
    """`LLMEngine(enforce_eager=False)` compiles every decode bucket it can use (here max_num_seqs=1:
    bucket 1 only) at start-up; requests then decode without a compile, with eager's output."""
    from dsv4_engine.engine import LLMEngine
    from dsv4_engine.sampling_params import SamplingParams

    path = make_tiny(tmp_path / "small", seed=3, overrides=SMALL)
    kw = {"dtype": "float32", "device": "cpu", "max_model_len": 256, "max_num_seqs": 1}
    compiled = LLMEngine(path, enforce_eager=False, **kw)
    assert compiled.runner.decode_mode == "compiled"
    runner = compiled.runner.decode_runner()
    assert runner.buckets == (1,) and runner.num_compiles == 1
    graphs = _unique_graphs()
    eager = LLMEngine(path, **kw)
    assert eager.runner.warmup() == 0  # nothing to compile

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    g = torch.Generator().manual_seed(11)
    for n in (5, 40):
        prompt = torch.randint(3, 500, (n,), generator=g).tolist()
        outs = []
        for engine in (compiled, eager):
            rid = engine.add_request(prompt, params)
            tokens: list[int] = []
            while engine.has_unfinished():
                tokens += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
            outs.append(tokens)
        assert len(outs[0]) == 12 and outs[0] == outs[1]
    assert runner.num_compiles == 1 and _unique_graphs() == graphs  # no compile while serving
