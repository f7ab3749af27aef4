"""The NPU kernel set: `TorchKernels` with the ops torch_npu has a fused form of (the seed's Ascend
path), so the rest of the forward runs as torch forms on the device until each gets its op.

So far: RMSNorm (`npu_rms_norm`), the interleaved RoPE (`npu_rotary_mul`, rotary_mode 'interleave',
with the position's cos/sin rows broadcast over heads, as the seed's `Dsv4NpuRoPE` feeds it) and the
shared expert's SwiGLU (`npu_swiglu`, after DSV4's clamps). docs/npu.md lists each op's rules;
tests/npu compares every op here with the CPU kernels through the reference torch_npu. torch_npu is imported when the set is built, which happens only
for an `npu` device (`choose_kernels`).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn.functional as F

from dsv4_engine.kernels.base import KernelSet
from dsv4_engine.kernels.torch_forms import StaticTorchKernels, TorchKernels
from dsv4_engine.kernels.torch_ops import clamp_gate_up_

Tensor = torch.Tensor


class _NpuOps:
    """The torch_npu forms, shared by the extend and decode variants."""

    def __init__(self) -> None:
        self.npu: Any = importlib.import_module("torch_npu")

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        # The op wants gamma in x's dtype (it computes in fp32 either way).
        return self.npu.npu_rms_norm(x, weight.to(x.dtype), epsilon=eps)[0]

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
        """In place on x's last `cos.shape[-1]` channels, like the torch form. The op takes 4-D
        [S, N, 1, D] input with one [S, 1, 1, D] table per position (its S11D layout)."""
        width, rows = cos.shape[-1], cos.shape[0]
        part = x[..., -width:]
        table = (rows, 1, 1, width)
        r1 = cos.to(x.dtype).reshape(table)
        r2 = (-sin if inverse else sin).to(x.dtype).reshape(table)
        out = self.npu.npu_rotary_mul(part.reshape(rows, -1, 1, width), r1, r2, rotary_mode="interleave")
        part.copy_(out.view(part.shape))
        return x

    def shared_expert(self, x: Tensor, gate_up: Tensor, down: Tensor, limit: float) -> Tensor:
        h = F.linear(x, gate_up)
        clamp_gate_up_(h, limit)  # DSV4's clamps first: the op computes a plain SwiGLU
        return F.linear(self.npu.npu_swiglu(h, dim=-1), down)


class NpuKernels(_NpuOps, TorchKernels):
    """Extend steps' NPU set."""

    name = "npu"

    def for_decode(self, compiled: bool) -> KernelSet:
        # No compiler for NPU here: a decode step is eager or captured (aclgraph), one static form.
        return NpuDecodeKernels()


class NpuDecodeKernels(_NpuOps, StaticTorchKernels):
    """The batched decode step's NPU set (static shapes, no host reads: graph-capturable)."""

    name = "npu"
