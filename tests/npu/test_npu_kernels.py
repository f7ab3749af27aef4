"""The NPU kernel set's ops (`kernels/npu.py`), each on "npu" tensors through torch_npu, against the
torch forms and, where they build, the fused CPU kernels, on the same host values. With
DSV4_TORCH_NPU=real on an Ascend node the same assertions check the real ops."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from dsv4_engine.kernels import CpuKernels, TorchKernels, available, choose_kernels

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _sets() -> list[object]:
    return [TorchKernels(), *([CpuKernels()] if available() else [])]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_an_npu_device_chooses_the_npu_set_and_its_decode_variant(torch_npu: ModuleType) -> None:
    from dsv4_engine.kernels.npu import NpuDecodeKernels, NpuKernels

    kernels = choose_kernels("npu")
    assert type(kernels) is NpuKernels
    assert type(kernels.for_decode(compiled=False)) is NpuDecodeKernels
    assert type(kernels.for_decode(compiled=True)) is NpuDecodeKernels  # no compiler on NPU here
    assert type(choose_kernels("npu", enabled=False)) is TorchKernels  # DSV4_KERNELS=0: torch forms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 64), (7, 4, 64)], ids=["rows", "heads"])
def test_rms_norm_equals_the_cpu_forms(
    torch_npu: ModuleType, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    from dsv4_engine.kernels.npu import NpuKernels

    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    got = NpuKernels().rms_norm(x.to("npu"), weight.to("npu"), 1e-6)
    assert got.device.type == "npu"
    for ref in _sets():
        _close(got.cpu(), ref.rms_norm(x, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
def test_rope_equals_the_cpu_forms_in_place_on_the_rope_channels(
    torch_npu: ModuleType, dtype: torch.dtype, inverse: bool
) -> None:
    """DSV4's interleaved RoPE on the last 64 of 96 channels of every head, at 6 positions, and its
    inverse (the attention output's): the other channels are untouched."""
    from dsv4_engine.kernels.npu import NpuKernels

    positions = torch.tensor([0, 1, 5, 127, 128, 4000], dtype=torch.float32)
    angles = positions[:, None] * 10000.0 ** (-torch.arange(0, 64, 2) / 64)[None, :]
    cos, sin = (
        angles.cos().repeat_interleave(2, -1),
        angles.sin().repeat_interleave(2, -1),
    )  # RopeTable's layout
    x = torch.randn(6, 4, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    dev = x.to("npu")
    out = NpuKernels().rope(dev, cos.to("npu"), sin.to("npu"), inverse=inverse)
    assert out is dev  # in place, as the torch form
    assert torch.equal(dev.cpu()[..., :32], x[..., :32])
    for ref in _sets():
        _close(dev.cpu(), ref.rope(x.clone(), cos, sin, inverse=inverse), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_shared_expert_equals_the_cpu_forms_with_its_clamps(
    torch_npu: ModuleType, dtype: torch.dtype
) -> None:
    """Inputs large enough that DSV4's clamp (limit 1.5) cuts both halves."""
    from dsv4_engine.kernels.npu import NpuKernels

    g = torch.Generator().manual_seed(2)
    x = (3 * torch.randn(5, 32, generator=g)).to(dtype)
    gate_up, down = (
        (torch.randn(2 * 24, 32, generator=g) / 4).to(dtype),
        (torch.randn(32, 24, generator=g) / 4).to(dtype),
    )
    assert (torch.nn.functional.linear(x, gate_up).abs() > 1.5).any()
    got = NpuKernels().shared_expert(x.to("npu"), gate_up.to("npu"), down.to("npu"), 1.5)
    for ref in _sets():
        _close(got.cpu(), ref.shared_expert(x, gate_up, down, 1.5), dtype)


def test_a_rope_table_that_does_not_broadcast_is_refused(reference_npu: ModuleType) -> None:
    """What the device rejects, the reference rejects: interleave tables must broadcast over heads."""
    x = torch.randn(6, 4, 1, 64).to("npu")
    table = torch.randn(6, 4, 1, 64).to("npu")
    with pytest.raises(RuntimeError, match="broadcast over B and N"):
        reference_npu.npu_rotary_mul(x, table, table, rotary_mode="interleave")
