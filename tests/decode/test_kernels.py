"""The fused CPU kernels (`dsv4_engine.kernels`) against the torch code each one mirrors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dsv4_engine import kernels
from dsv4_engine.model.hyper import HyperConnection, expand
from dsv4_engine.model.moe import Experts

DTYPES = [torch.float32, torch.bfloat16]


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
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_hc_pre_and_post_equal_hyper_connection(model, dtype: torch.dtype, tokens: int) -> None:
    hc = _randomised(HyperConnection(model.config), seed=tokens).float()
    n, d = hc.n, model.config.hidden_size
    g = torch.Generator().manual_seed(1)
    streams = torch.randn(tokens, n, d, generator=g).to(dtype)
    with torch.no_grad():
        want = hc(streams)
        got = torch.ops.dsv4.hc_pre(streams, hc.fn, hc.base, hc.scale, hc.iters, hc.hc_eps, hc.norm_eps)
    for name, w, o in zip(("post", "comb", "collapsed"), want, got, strict=True):
        assert o.dtype == w.dtype and o.shape == w.shape, name
        # Plain loops sum in another order than torch's reductions: fp32 within 1e-5, a bf16 output
        # within torch's bf16 tolerance (an ulp).
        tol = {"rtol": 1e-5, "atol": 1e-5} if o.dtype == torch.float32 else {}
        torch.testing.assert_close(o, w, **tol, msg=lambda m, name=name: f"{name}: {m}")
    # A real Sinkhorn ran (it ends on a column normalisation): every column of comb sums to ~1.
    torch.testing.assert_close(got[1].sum(-2), torch.ones(tokens, n), rtol=0, atol=1e-3)
    out = torch.randn(tokens, d, generator=g).to(dtype)
    post, comb, _ = want
    assert torch.equal(torch.ops.dsv4.hc_post(post, comb, out, streams), expand(post, comb, out, streams))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 200])
def test_moe_experts_equals_the_expert_loop(model, dtype: torch.dtype, tokens: int) -> None:
    experts = _randomised(Experts(model.config), seed=tokens).to(dtype)
    e, k, d = experts.num_experts, model.config.num_experts_per_tok, model.config.hidden_size
    g = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, d, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    ids[0] = ids[0, 0]  # a hash table may route a token to one expert twice
    weights = torch.rand(tokens, k, generator=g)
    with torch.no_grad():
        want = experts(x, weights, ids)
        got = torch.ops.dsv4.moe_experts(
            x, experts.gate_up_proj, experts.down_proj, ids, weights, experts.limit
        )
    assert got.dtype == want.dtype
    assert torch.equal(got, want)  # same experts, same order, same aten ops


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
