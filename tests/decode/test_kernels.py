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
from dsv4_engine.kernels import CpuKernels, TorchKernels
from dsv4_engine.kernels.torch_ops import expand
from dsv4_engine.model.hyper import HyperConnection
from dsv4_engine.model.moe import Experts, Router
from dsv4_engine.model.packed import pack_linears
from suite import skips

DTYPES = [torch.float32, torch.bfloat16]
# fp32 routed experts take the kernel's own skinny GEMM where the CPU has AVX2 and FMA.
SKINNY = platform.machine() in ("x86_64", "AMD64") and torch.backends.cpu.get_cpu_capability() != "DEFAULT"


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    # CI has a compiler: the kernels must build there, or the eager decode silently loses them.
    assert kernels.available(), "the dsv4 CPU kernels did not build (see the log for the compiler error)"


def _both(module: torch.nn.Module, fn):
    """fn(module, kernel set) with the CPU kernels (a decode step's set), then with the torch forms."""
    with torch.no_grad():
        return fn(module, CpuKernels().for_decode(compiled=False)), fn(module, TorchKernels())


def _randomised(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return module


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 32, 33, 64, 150])
def test_hc_pre_equals_hyper_connection(model, dtype: torch.dtype, tokens: int) -> None:
    """fp32 up to 32 rows: the map as dot-product loops, from 33 on as MKL's GEMM. 150 rows: two full
    blocks of 64 and a partial one."""
    hc = _randomised(HyperConnection(model.config), seed=tokens).float()
    g = torch.Generator().manual_seed(1)
    streams = torch.randn(tokens, hc.n, model.config.hidden_size, generator=g).to(dtype)
    with torch.no_grad():
        want = hc(streams, TorchKernels())
        got = torch.ops.dsv4.hc_pre(streams, hc.fn, hc.base, hc.scale, hc.iters, hc.hc_eps, hc.norm_eps)
        forward = hc(streams, CpuKernels())
        assert all(torch.equal(a, b) for a, b in zip(forward, got, strict=True))  # forward is the kernel
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
        want = experts(x, weights, ids, TorchKernels())
        got = _kernel(experts, x, ids, weights)
        assert torch.equal(experts(x, weights, ids, CpuKernels()), got)  # forward is the kernel
    assert got.dtype == want.dtype
    counts = torch.bincount(ids.flatten())
    if dtype == torch.float32 and SKINNY and counts[counts > 0].min() < 32:
        # Experts of a few rows take the kernel's own GEMM, which sums in another order than MKL's:
        # within fp32 rounding of the loop's outputs.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
        assert not torch.equal(got, torch.zeros_like(got))
    else:
        assert torch.equal(got, want)  # same experts, same order, same BLAS and aten ops


@pytest.mark.skipif(not SKINNY, reason=skips.hardware_reason("avx2", "the skinny GEMM needs x86 with AVX2"))
@pytest.mark.parametrize(("hidden", "inter"), [(None, None), (100, 37)])
def test_moe_experts_row_does_not_depend_on_its_batch(model, hidden: int | None, inter: int | None) -> None:
    """Every token's routed output is bit-equal whether it is decoded alone or among 40 others, also for
    sizes that leave partial tiles (100 = not a multiple of 8 lanes, 37 rows = not a multiple of 6)."""
    experts, x, ids, weights = _routed(model.config, 41, torch.float32, seed=7, hidden=hidden, inter=inter)
    with torch.no_grad():
        batch = _kernel(experts, x, ids, weights)
        want = experts(x, weights, ids, TorchKernels())
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


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within fp32 rounding of the torch form (the kernels' loops sum in their own order)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * max(want.abs().max().item(), 1.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 9])
def test_small_decode_kernels_equal_their_torch_forms(model, dtype: torch.dtype, rows: int) -> None:
    """The modules' one-dispatch kernels against their torch forms, as each module chooses them: bf16
    runs aten ops (bit-equal), fp32 plain loops (within rounding; ids and pool writes exact)."""

    def check(got: torch.Tensor, want: torch.Tensor) -> None:
        if dtype == torch.float32:
            _close(got, want)
        else:
            assert torch.equal(got, want)

    g = torch.Generator().manual_seed(rows)
    layers = model.model.layers
    hc, d = layers[0].attn_hc, model.config.hidden_size

    streams = torch.randn(rows, hc.n, d, generator=g).to(dtype)
    with torch.no_grad():
        post, comb, _ = hc(streams.float(), TorchKernels())
    out = torch.randn(rows, d, generator=g).to(dtype)
    check(*_both(hc, lambda m, k: k.hc_post(post, comb, out, streams, None)))

    width = 2 * model.config.head_dim  # a ratio-4 compressor's state half
    kv = torch.randn(rows, width, generator=g).to(dtype)
    mask = torch.rand(rows, generator=g) < 0.7
    loc = torch.randperm(40, generator=g)[:rows] + 1
    pools = [torch.randn(48, width, generator=g) for _ in range(2)]
    pools[1].copy_(pools[0])
    TorchKernels().masked_put(pools[0], loc, kv, mask)
    CpuKernels().masked_put(pools[1], loc, kv, mask)
    assert torch.equal(pools[1], pools[0]) and torch.equal(pools[0][loc[mask]], kv[mask].float())

    x = torch.randn(rows, d, generator=g).to(dtype)
    input_ids = torch.randint(0, model.config.vocab_size, (rows,), generator=g)
    for layer in layers[:2]:  # a hash layer, then a score-routed one
        router = copy.deepcopy(layer.mlp.gate).to(dtype)
        (got_w, got_ids), (want_w, want_ids) = _both(router, lambda m, k: m(x, input_ids, k))
        assert torch.equal(got_ids, want_ids), router.is_hash
        check(got_w, want_w)

    moe = copy.deepcopy(layers[1].mlp).to(dtype)
    pack = pack_linears([moe.shared_experts.gate_proj, moe.shared_experts.up_proj])
    got, want = _both(moe.shared_experts, lambda m, k: m(x, k, pack))
    check(got, want)
    with torch.no_grad():
        torch.testing.assert_close(got, moe.shared_experts(x, TorchKernels()))


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_hc_post_loop(rows: int) -> None:
    """fp32 hc_post as loops: comb is read as comb[j, k] (not transposed), post scales `out`, also
    from non-contiguous inputs."""
    g = torch.Generator().manual_seed(rows)
    n, d = 4, 96
    post, comb = torch.rand(rows, n, generator=g) * 2, torch.rand(rows, n, n, generator=g)
    out = torch.randn(d, rows, generator=g).t()  # a transposed view
    streams = torch.randn(rows, n, d, generator=g)
    got = torch.ops.dsv4.hc_post(post, comb, out, streams)
    _close(got, expand(post, comb, out, streams))
    _close(got, post[..., None] * out[:, None] + torch.einsum("tjk,tjd->tkd", comb, streams))


def _router(config, is_hash: bool, experts: int | None = None, seed: int = 0) -> Router:
    if experts:
        config = dataclasses.replace(config, n_routed_experts=experts)
    router = _randomised(Router(config, is_hash), seed)
    if is_hash:
        g = torch.Generator().manual_seed(seed)
        router.tid2eid.copy_(torch.randint(0, router.weight.shape[0], router.tid2eid.shape, generator=g))
    return router


def _route(router: Router, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    table = router.tid2eid if router.is_hash else router.e_score_correction_bias
    return torch.ops.dsv4.route(
        x, input_ids, router.weight, table, router.is_hash, router.top_k, router.scaling
    )


@pytest.mark.parametrize("is_hash", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_route_loop(model, is_hash: bool, rows: int) -> None:
    """fp32 routing as loops (40 rows: x W^T by at::linear): Router.forward's ids exactly, its weights
    within rounding. Row 0's logits reach ~100, where softplus must take its threshold (exp
    overflows fp32: an infinite score otherwise)."""
    router = _router(model.config, is_hash, seed=rows)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, model.config.hidden_size, generator=g)
    x[0] *= 100.0 / torch.nn.functional.linear(x[0], router.weight).abs().max()
    input_ids = torch.randint(0, model.config.vocab_size, (rows,), generator=g)
    with torch.no_grad():
        want_w, want_ids = router(x, input_ids, TorchKernels())
        got_w, got_ids = _route(router, x, input_ids)
    assert torch.equal(got_ids, want_ids)
    assert got_w.isfinite().all()
    _close(got_w, want_w)


@pytest.mark.parametrize("experts", [8, 128])
def test_route_ties_pick_as_torch_topk(model, experts: int) -> None:
    """Tied scores + bias: the same ids in the same order as torch.topk(sorted=False) on CPU (its
    nth_element, or from 64 * k experts on its partial_sort)."""
    router = _router(model.config, False, experts=experts)
    with torch.no_grad():
        router.weight.zero_()  # every score sqrt(log 2)
        router.e_score_correction_bias.copy_(
            torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 0.5, 1.0, 0.0]).repeat(experts // 8)
        )
    x = torch.randn(2, model.config.hidden_size)
    with torch.no_grad():
        want_w, want_ids = router(x, torch.zeros(2, dtype=torch.long), TorchKernels())
        got_w, got_ids = _route(router, x, torch.zeros(2, dtype=torch.long))
    assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w)


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_shared_expert_loop(model, rows: int) -> None:
    """fp32 shared expert (below 32 rows its own GEMMs) with a limit that clamps gate and up on both
    sides, against SharedExpert.forward."""
    moe = copy.deepcopy(model.model.layers[1].mlp)
    shared = _randomised(moe.shared_experts, seed=rows)
    shared.limit = 0.5
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, model.config.hidden_size, generator=g)
    pack = pack_linears([shared.gate_proj, shared.up_proj])
    with torch.no_grad():
        gate, up = shared.gate_proj(x, TorchKernels()), shared.up_proj(x, TorchKernels())
        assert (gate > 0.5).any() and (up > 0.5).any() and (up < -0.5).any()
        got = shared(x, CpuKernels(), pack)
        _close(got, shared(x, TorchKernels()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.long, torch.int32])
def test_masked_put_loop(dtype: torch.dtype, slot_dtype: torch.dtype) -> None:
    """Rows of the pool's dtype are copied in a loop: kept rows to their slots, masked ones as zeros
    into slot 0; also into a pool of strided rows (a column slice of a wider buffer), and (by aten)
    into a transposed one."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(4, 8, generator=g).to(dtype)
    slots = torch.tensor([5, 2, 9, 7]).to(slot_dtype)
    mask = torch.tensor([True, False, True, False])
    wide = torch.randn(20, 12, generator=g).to(dtype)
    for fresh in (
        lambda: wide[:, :8].clone(),
        lambda: wide.clone()[:, 4:],
        lambda: wide[:, :8].t().clone().t(),
    ):
        pool, want, got = fresh(), fresh(), fresh()
        TorchKernels().masked_put(want, slots.long(), rows, mask)
        torch.ops.dsv4.masked_put(got, slots, rows, mask)
        assert torch.equal(got, want)
        assert torch.equal(got[[5, 9]], rows[[0, 2]]) and not got[0].any()
        assert torch.equal(got[1:5], pool[1:5]) and torch.equal(got[6:9], pool[6:9])


def test_the_torch_set_runs_the_torch_code(model) -> None:
    """The torch set (FLOP counting in bench/throughput.py selects it) sends every op to torch, while
    the CPU set is what a CPU engine chooses by default."""
    experts, x, ids, weights = _routed(model.config, 5, torch.float32, seed=3)
    torch_set = kernels.choose_kernels(torch.device("cpu"), enabled=False)
    with torch.no_grad():
        assert not isinstance(torch_set, CpuKernels)
        assert torch.equal(
            experts(x, weights, ids, torch_set), _dispatched_by_expert(experts, x, weights, ids)
        )
    assert isinstance(kernels.choose_kernels(torch.device("cpu")), CpuKernels)


def _dispatched_by_expert(
    experts: Experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    return TorchKernels().routed_experts(
        x, experts.gate_up_proj, experts.down_proj, ids, weights, experts.limit
    )


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_projection_kernels_equal_torch(model, rows: int) -> None:
    """`dsv4::linear` and `dsv4::grouped_linear` (the decode step's projections, a skinny GEMM under 32
    rows, BLAS from there) against F.linear and GroupedLinear, on odd widths (a partial tile)."""
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(37, 100, generator=g), torch.randn(rows, 100, generator=g)
    _close(torch.ops.dsv4.linear(x, w), torch.nn.functional.linear(x, w))
    _close(
        torch.ops.dsv4.linear(x[:, None], w), torch.nn.functional.linear(x[:, None], w)
    )  # any leading dims
    o_a = model.model.layers[0].self_attn.o_a_proj
    grouped = torch.randn(rows, o_a.groups, o_a.in_features, generator=g)
    _close(*_both(o_a, lambda m, k: m(grouped, k)))


def test_the_direct_bindings_take_each_ops_schema_arguments_and_results() -> None:
    """`build.module()` (what the CPU set calls eagerly) binds the same C++ function as each registered
    op under the schema's argument names, and gives the op's result; under a dispatch mode the set calls
    the ops themselves, so the mode sees every call."""
    import re

    from torch.utils._python_dispatch import TorchDispatchMode

    from dsv4_engine.kernels import build

    module = build.module()
    names = [n for n in dir(module) if not n.startswith("_")]
    assert {"rms_norm", "linear", "moe_experts", "paged_attention", "compress_decode"} <= set(names)
    for name in names:
        schema = getattr(torch.ops.dsv4, name).default._schema
        doc = getattr(module, name).__doc__.splitlines()[0]  # pybind's "name(a: T, b: T) -> R"
        params = re.findall(r"(\w+): ", doc[: doc.rindex(") ->")])
        assert params == [a.name for a in schema.arguments], (name, doc, str(schema))
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    assert torch.equal(module.linear(x, w), torch.ops.dsv4.linear(x, w))

    seen: set[str] = set()

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.add(str(func))
            return func(*args, **(kwargs or {}))

    with Seen():
        CpuKernels().linear(x, w)
    assert "dsv4.linear.default" in seen
    torch_set = kernels.choose_kernels(torch.device("cpu"), enabled=False)
    assert not isinstance(torch_set, CpuKernels)  # what a caller that must not reach them runs
