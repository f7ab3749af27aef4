"""W8A8 on the NPU set: `quant_linear` as `npu_dynamic_quant` + `npu_quant_matmul`, against the torch
form (the same int8 arithmetic on the host) and the dequantised linear (within the bound per-token
int8 rounding allows); the calls the ops refuse; and a `--quant w8a8` checkpoint whose projections
run through `npu_quant_matmul` in a whole forward. With DSV4_TORCH_NPU=real the same assertions
check the real ops, except the refusals (their messages are the reference's)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from dsv4_engine import quant
from dsv4_engine.kernels import CpuKernels, TorchKernels, available

BF16 = torch.bfloat16


def npu(t: torch.Tensor) -> torch.Tensor:
    return t.to("npu")


def _weights(rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A W8A8 weight as the release stores it (int8 `[rows, cols]`) and its float32 scales `[rows]`."""
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) / cols**0.5
    q, scale, _ = quant.quant_w8a8(w)
    return q, scale.flatten()


def _calls(torch_npu: ModuleType) -> dict[str, int] | None:
    """The reference's op counts (None with the real torch_npu, which keeps none)."""
    reference = getattr(torch_npu, "reference", None)
    return None if reference is None else dict(reference.op_calls)


@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(5, 96), (2, 3, 96)], ids=["rows", "batched"])
def test_quant_linear_is_the_torch_form_and_within_the_int8_bound(
    torch_npu: ModuleType, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    """The NPU op pair equals the torch form's int8 arithmetic (to the output's last bit: the host
    rescales in fp32, the reference in fp64); against the dequantised linear it may differ by what
    per-token int8 rounding of x allows, |dx| <= max|x_t| / 254 per element, times sum_k |W[n, k]|, plus
    the output's rounding (and, for fp32 x, the bf16 the op quantises from)."""
    from dsv4_engine.kernels.npu import NpuKernels

    q, scale = _weights(40, shape[-1])
    x = (2 * torch.randn(shape, generator=torch.Generator().manual_seed(1))).to(dtype)
    before = _calls(torch_npu)
    got = NpuKernels().quant_linear(npu(x), npu(q), npu(scale))
    after = _calls(torch_npu)
    assert got.device.type == "npu" and got.dtype == dtype and got.shape == (*shape[:-1], 40)
    if before is not None and after is not None:
        assert after["npu_dynamic_quant"] - before.get("npu_dynamic_quant", 0) == 1
        assert after["npu_quant_matmul"] - before.get("npu_quant_matmul", 0) == 1
    half = dtype if dtype != torch.float32 else BF16  # the op quantises fp32 rows from bf16
    ulp = torch.finfo(half).eps
    for ref in [TorchKernels(), *([CpuKernels()] if available() else [])]:
        same = ref.quant_linear(x.to(half), q, scale).float()
        torch.testing.assert_close(got.cpu().float(), same, rtol=ulp, atol=1e-6)
    w = quant.dequant_w8a8(q, scale)
    want = F.linear(x.float(), w)
    row_max = x.float().abs().amax(-1, keepdim=True)
    step = row_max / 254 + (row_max * 2**-8 if dtype == torch.float32 else 0)
    bound = step * w.abs().sum(-1) + 2 * ulp * want.abs() + 1e-6
    assert ((got.cpu().float() - want).abs() <= bound).all()


def test_quant_linear_of_no_rows_calls_no_op(torch_npu: ModuleType) -> None:
    """The ops take no empty tensor (aclnn's CheckEmptyTensor): an empty step gets an empty result."""
    from dsv4_engine.kernels.npu import NpuKernels

    q, scale = _weights(40, 64)
    before = _calls(torch_npu)
    got = NpuKernels().quant_linear(npu(torch.zeros(0, 64, dtype=BF16)), npu(q), npu(scale))
    assert got.shape == (0, 40) and got.dtype == BF16
    assert _calls(torch_npu) == before


def test_the_decode_variant_captures_quant_linear_as_a_graph(torch_npu: ModuleType) -> None:
    """No host reads and static shapes: captured once, replayed on new inputs written into the
    static buffer, the eager values each time."""
    from dsv4_engine.kernels.npu import NpuDecodeKernels

    q, scale = _weights(40, 64)
    weight, scales = npu(q), npu(scale)
    x = npu(torch.randn(4, 64, generator=torch.Generator().manual_seed(2)).to(BF16))
    decode = NpuDecodeKernels()
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        out = decode.quant_linear(x, weight, scales)
    for shift in (0.0, 0.5):
        x.add_(shift)  # in place: the buffer the graph reads
        graph.replay()
        assert torch.equal(out.cpu(), decode.quant_linear(x, weight, scales).cpu())


def test_int8_has_no_k_alignment(torch_npu: ModuleType) -> None:
    """k = 100, a multiple of neither 16, 32 nor 64: int8 in the ND layout has no k rule (those are
    int4 packing's, fp8/fp4's and the NZ weight format's). On an A3 node this checks the op itself."""
    g = torch.Generator().manual_seed(3)
    a = torch.randint(-127, 128, (3, 100), generator=g, dtype=torch.int8)
    w = torch.randint(-127, 128, (24, 100), generator=g, dtype=torch.int8)  # stored [n, k]
    scale, tok = torch.rand(24, generator=g) / 100, torch.rand(3, generator=g) / 100
    got = torch_npu.npu_quant_matmul(
        npu(a), npu(w).t(), npu(scale), pertoken_scale=npu(tok), output_dtype=BF16
    )
    want = (a.long() @ w.long().t()).double() * scale.double() * tok.double()[:, None]
    torch.testing.assert_close(got.cpu().double(), want, rtol=2**-8, atol=0)


# --- what the ops refuse, as the device does (the messages are the reference's) ---------------------
def _call(torch_npu: ModuleType, x1: torch.Tensor, x2: torch.Tensor, **kw: object) -> torch.Tensor:
    scale = kw.pop("scale", torch.rand(x2.shape[-1]))
    args = {"pertoken_scale": npu(torch.rand(x1.shape[0])), "output_dtype": BF16} | kw
    return torch_npu.npu_quant_matmul(npu(x1), x2 if x2.device.type == "npu" else npu(x2), npu(scale), **args)


def test_int32_weights_are_refused(reference_npu: ModuleType) -> None:
    """An int32 x2 packs int4 (A8W4: another op mode, int64 scales): not W8A8's int8 weight."""
    a = torch.randint(-127, 128, (3, 64), dtype=torch.int8)
    with pytest.raises(RuntimeError, match=r"x2 dtype torch\.int32 must equal x1's torch\.int8"):
        _call(reference_npu, a, torch.randint(-127, 128, (64, 16), dtype=torch.int32))


def test_unquantised_activations_are_refused(reference_npu: ModuleType) -> None:
    with pytest.raises(RuntimeError, match=r"x1 has dtype torch\.bfloat16"):
        _call(
            reference_npu,
            torch.randn(3, 64, dtype=BF16),
            torch.randint(-127, 128, (64, 16), dtype=torch.int8),
        )


def test_scale_dtypes_the_output_does_not_take_are_refused(reference_npu: ModuleType) -> None:
    """float16 output with per-token scales needs a float32 scale (a bfloat16 one is refused); the
    per-token scales are float32 only."""
    a, w = (
        torch.randint(-127, 128, (3, 64), dtype=torch.int8),
        torch.randint(-127, 128, (64, 16), dtype=torch.int8),
    )
    with pytest.raises(RuntimeError, match="a bfloat16 scale needs a bfloat16 or int32 output"):
        _call(reference_npu, a, w, scale=torch.rand(16).to(BF16), output_dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"pertoken_scale has dtype torch\.bfloat16"):
        _call(reference_npu, a, w, pertoken_scale=npu(torch.rand(3).to(BF16)))
    with pytest.raises(RuntimeError, match=r"scale has dtype torch\.float16"):
        _call(reference_npu, a, w, scale=torch.rand(16).half())
    _call(reference_npu, a, w, output_dtype=torch.float16)  # a float32 scale is right for both outputs


def test_the_weight_goes_transposed(reference_npu: ModuleType) -> None:
    """x2 is [k, n]: a weight stored [n, k] goes as its `.t()` (the transposed layout, no copy).
    Untransposed, its k does not match; a strided slice is neither layout."""
    a = torch.randint(-127, 128, (3, 64), dtype=torch.int8)
    w = npu(torch.randint(-127, 128, (16, 64), dtype=torch.int8))  # stored [n, k]
    _call(reference_npu, a, w.t())
    with pytest.raises(RuntimeError, match=r"k of x1 \[\.\., 3, 64\] and x2 \[\.\., 16, 64\] differ"):
        _call(reference_npu, a, w, scale=torch.rand(64))
    wide = npu(torch.randint(-127, 128, (16, 128), dtype=torch.int8))
    with pytest.raises(RuntimeError, match="x2 must be contiguous or the transpose"):
        _call(reference_npu, a, wide[:, ::2].t())


def test_empty_inputs_are_refused(reference_npu: ModuleType) -> None:
    w = torch.randint(-127, 128, (64, 16), dtype=torch.int8)
    with pytest.raises(RuntimeError, match="x1 is empty"):
        _call(reference_npu, torch.zeros(0, 64, dtype=torch.int8), w)


# --- a whole forward of a W8A8 checkpoint -------------------------------------------------------------
def test_a_w8a8_checkpoint_runs_its_projections_through_npu_quant_matmul(
    torch_npu: ModuleType, tmp_path: Path
) -> None:
    """Loaded for the NPU set (keep_int8: the set's `native_w8a8`), the projections stay int8 on the
    device and a prefill forward calls npu_dynamic_quant and npu_quant_matmul once per int8
    projection. Its logits against the CPU path on the dequantised weights (both bf16): the difference's
    RMS at most 0.15 of the logits' spread, the argmax equal at >= 85% of positions (measured 0.06 and
    94%): per-token int8 rounding of the activations, bf16 op order, and routing or indexer picks near
    a tie. Per projection the bound is exact (test_quant_linear_is_the_torch_form_...)."""
    from dsv4_engine.config import Dsv4Config
    from dsv4_engine.kernels.npu import NpuKernels
    from dsv4_engine.loader import load_checkpoint
    from dsv4_engine.make_tiny import make_tiny
    from dsv4_engine.model import Dsv4ForCausalLM, ForwardBatch
    from dsv4_engine.testing import dense_cache, one_thread

    with one_thread():
        ckpt = make_tiny(tmp_path / "w8a8", seed=0, quant="w8a8")
    kernels = NpuKernels()
    assert kernels.native_w8a8 and not TorchKernels.native_w8a8

    def load(keep_int8: bool) -> Dsv4ForCausalLM:
        model = Dsv4ForCausalLM(Dsv4Config.from_pretrained(ckpt), max_positions=256).cast(BF16)
        load_checkpoint(model, ckpt, dtype=None, progress=False, keep_int8=keep_int8)
        return model.eval()

    on_npu = load(kernels.native_w8a8).to("npu")
    int8 = [
        m for m in on_npu.modules() if getattr(m, "weight", None) is not None and m.weight.dtype == torch.int8
    ]
    assert len(int8) == 30 and all(m.weight.device.type == m.weight_scale.device.type == "npu" for m in int8)
    on_cpu = load(False)
    ids = torch.randint(
        3, on_cpu.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    before = _calls(torch_npu)
    with torch.inference_mode():
        batch = ForwardBatch.build([(dense_cache(on_npu), ids)], device="npu", kernels=kernels)
        got = on_npu.compute_logits(on_npu(batch), kernels).cpu()
        after = _calls(torch_npu)
        want = on_cpu.compute_logits(
            on_cpu(ForwardBatch.build([(dense_cache(on_cpu), ids)], kernels=TorchKernels()))
        )
    if before is not None and after is not None:
        for op in ("npu_dynamic_quant", "npu_quant_matmul"):
            assert after[op] - before.get(op, 0) == len(int8), op
    assert (got - want).pow(2).mean().sqrt() <= 0.15 * want.std()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.85
