"""The fused CPU kernels (`dsv4_engine.kernels`) against the torch code each one mirrors."""

from __future__ import annotations

import copy
import dataclasses
import os
import platform
import subprocess
import sys

import pytest
import torch

from dsv4_engine import kernels
from dsv4_engine.model.decode_ops import KernelOps, TorchOps
from dsv4_engine.model.hyper import HyperConnection
from dsv4_engine.model.moe import Experts
from dsv4_engine.model.packed import pack_linears

DTYPES = [torch.float32, torch.bfloat16]
# fp32 routed experts take the kernel's own skinny GEMM where the CPU has AVX2 and FMA.
SKINNY = platform.machine() in ("x86_64", "AMD64") and torch.backends.cpu.get_cpu_capability() != "DEFAULT"


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    # CI has a compiler: the kernels must build there, or the eager decode silently loses them.
    assert kernels.available(), "the dsv4 CPU kernels did not build (see the log for the compiler error)"


def _randomised(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return module


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 64, 150])
def test_hc_pre_equals_hyper_connection(model, dtype: torch.dtype, tokens: int) -> None:
    """150 rows: two full blocks of 64 and a partial one."""
    hc = _randomised(HyperConnection(model.config), seed=tokens).float()
    g = torch.Generator().manual_seed(1)
    streams = torch.randn(tokens, hc.n, model.config.hidden_size, generator=g).to(dtype)
    with torch.no_grad():
        want = hc.reference(streams)
        got = torch.ops.dsv4.hc_pre(streams, hc.fn, hc.base, hc.scale, hc.iters, hc.hc_eps, hc.norm_eps)
        assert all(torch.equal(a, b) for a, b in zip(hc(streams), got, strict=True))  # forward is the kernel
    for name, w, o in zip(("post", "comb", "collapsed"), want, got, strict=True):
        assert o.dtype == w.dtype and o.shape == w.shape, name
        # Plain loops sum in another order than torch's reductions: fp32 within 1e-5, a bf16 output
        # within torch's bf16 tolerance (an ulp).
        tol = {"rtol": 1e-5, "atol": 1e-5} if o.dtype == torch.float32 else {}
        torch.testing.assert_close(o, w, **tol, msg=lambda m, name=name: f"{name}: {m}")
    # A real Sinkhorn ran (it ends on a column normalisation): every column of comb sums to ~1.
    torch.testing.assert_close(got[1].sum(-2), torch.ones(tokens, hc.n), rtol=0, atol=1e-3)


def _routed(
    config, tokens: int, dtype: torch.dtype, seed: int, hidden: int | None = None, inter: int | None = None
):
    """Randomised experts (optionally of another shape) and a routing of `tokens` random rows."""
    if hidden or inter:
        config = dataclasses.replace(config, hidden_size=hidden, moe_intermediate_size=inter)
    experts = _randomised(Experts(config), seed=seed).to(dtype)
    e, k, d = experts.num_experts, config.num_experts_per_tok, config.hidden_size
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, d, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    ids[0] = ids[0, 0]  # a hash table may route a token to one expert twice
    weights = torch.rand(tokens, k, generator=g)
    return experts, x, ids, weights


def _kernel(experts: Experts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return torch.ops.dsv4.moe_experts(x, experts.gate_up_proj, experts.down_proj, ids, weights, experts.limit)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 200])
def test_moe_experts_equals_the_expert_loop(model, dtype: torch.dtype, tokens: int) -> None:
    experts, x, ids, weights = _routed(model.config, tokens, dtype, seed=tokens)
    with torch.no_grad():
        want = experts.reference(x, weights, ids)
        got = _kernel(experts, x, ids, weights)
        assert torch.equal(experts(x, weights, ids), got)  # forward is the kernel
    assert got.dtype == want.dtype
    counts = torch.bincount(ids.flatten())
    if dtype == torch.float32 and SKINNY and counts[counts > 0].min() < 32:
        # Experts of a few rows take the kernel's own GEMM, which sums in another order than MKL's:
        # within fp32 rounding of the loop's outputs.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
        assert not torch.equal(got, torch.zeros_like(got))
    else:
        assert torch.equal(got, want)  # same experts, same order, same BLAS and aten ops


@pytest.mark.skipif(not SKINNY, reason="the skinny GEMM needs x86 with AVX2")
@pytest.mark.parametrize(("hidden", "inter"), [(None, None), (100, 37)])
def test_moe_experts_row_does_not_depend_on_its_batch(model, hidden: int | None, inter: int | None) -> None:
    """Every token's routed output is bit-equal whether it is decoded alone or among 40 others, also for
    sizes that leave partial tiles (100 = not a multiple of 8 lanes, 37 rows = not a multiple of 6)."""
    experts, x, ids, weights = _routed(model.config, 41, torch.float32, seed=7, hidden=hidden, inter=inter)
    with torch.no_grad():
        batch = _kernel(experts, x, ids, weights)
        want = experts.reference(x, weights, ids)
        torch.testing.assert_close(batch, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
        for t in (0, 17, 40):
            alone = _kernel(experts, x[t : t + 1], ids[t : t + 1], weights[t : t + 1])
            assert torch.equal(alone[0], batch[t]), t


def test_moe_experts_rejects_out_of_range_ids(model) -> None:
    experts = Experts(model.config)
    x = torch.zeros(2, model.config.hidden_size)
    ids = torch.tensor([[0, experts.num_experts], [1, 2]])
    with pytest.raises(RuntimeError, match="expert id out of range"):
        torch.ops.dsv4.moe_experts(x, experts.gate_up_proj, experts.down_proj, ids, torch.ones(2, 2), 1.0)


def test_kernels_can_be_switched_off() -> None:
    """DSV4_KERNELS=0: nothing is built or loaded and the runner takes the plain-torch ops."""
    code = (
        "import torch\n"
        "from dsv4_engine import kernels\n"
        "assert not kernels.available()\n"
        "assert not hasattr(torch.ops.dsv4, 'hc_pre')\n"
    )
    env = {**os.environ, "DSV4_KERNELS": "0", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 9])
def test_small_decode_kernels_equal_their_torch_forms(model, dtype: torch.dtype, rows: int) -> None:
    """The eager step's one-dispatch kernels run the torch forms' own aten ops: bit-equal results,
    and the same pool writes (masked rows write the sentinel into slot 0)."""
    torch_ops, kernel_ops = TorchOps(), KernelOps()
    g = torch.Generator().manual_seed(rows)
    layers = model.model.layers
    hc, d = layers[0].attn_hc, model.config.hidden_size

    streams = torch.randn(rows, hc.n, d, generator=g).to(dtype)
    with torch.no_grad():
        post, comb, _ = hc.reference(streams.float())
    out = torch.randn(rows, d, generator=g).to(dtype)
    assert torch.equal(
        kernel_ops.hc_post(post, comb, out, streams), torch_ops.hc_post(post, comb, out, streams)
    )

    comp = next(layer.self_attn.compressor for layer in layers if layer.self_attn.ratio == 4)
    width = comp.coff * comp.head_dim
    kv, gate = (torch.randn(rows, width, generator=g).to(dtype) for _ in range(2))
    positions = torch.randint(0, 1000, (rows,), generator=g)
    mask = torch.rand(rows, generator=g) < 0.7
    loc = torch.randperm(40, generator=g)[:rows] + 1
    states = [torch.randn(48, 2 * width, generator=g) for _ in range(2)]
    states[1].copy_(states[0])
    with torch.no_grad():
        want = torch_ops.compress_state(comp, kv, gate, positions, mask, loc, states[0])
        got = kernel_ops.compress_state(comp, kv, gate, positions, mask, loc, states[1])
    assert torch.equal(got, want) and torch.equal(states[1], states[0])
    if not mask.all():
        assert states[0][0, width:].eq(float("-inf")).all()  # the sentinel went to slot 0

    pools = [torch.randn(48, width, generator=g) for _ in range(2)]
    pools[1].copy_(pools[0])
    torch_ops.masked_put(pools[0], loc, kv, mask)
    kernel_ops.masked_put(pools[1], loc, kv, mask)
    assert torch.equal(pools[1], pools[0]) and torch.equal(pools[0][loc[mask]], kv[mask].float())

    x = torch.randn(rows, d, generator=g).to(dtype)
    input_ids = torch.randint(0, model.config.vocab_size, (rows,), generator=g)
    for layer in layers[:2]:  # a hash layer, then a score-routed one
        router = copy.deepcopy(layer.mlp.gate).to(dtype)
        with torch.no_grad():
            want_w, want_ids = torch_ops.route(router, x, input_ids)
            got_w, got_ids = kernel_ops.route(router, x, input_ids)
        assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w), router.is_hash

    moe = copy.deepcopy(layers[1].mlp).to(dtype)
    pack = pack_linears([moe.shared_experts.gate_proj, moe.shared_experts.up_proj])
    with torch.no_grad():
        assert torch.equal(kernel_ops.shared_expert(moe, x, pack), torch_ops.shared_expert(moe, x, pack))
        torch.testing.assert_close(kernel_ops.shared_expert(moe, x, pack), moe.shared_experts(x))


def test_disabled_runs_the_torch_code(model) -> None:
    """`kernels.disabled()` (FLOP counting in bench/throughput.py) sends per-call users to torch."""
    experts, x, ids, weights = _routed(model.config, 5, torch.float32, seed=3)
    with torch.no_grad(), kernels.disabled():
        assert not kernels.use_for(torch.device("cpu"))
        assert torch.equal(experts(x, weights, ids), experts.reference(x, weights, ids))
    assert kernels.use_for(torch.device("cpu"))
