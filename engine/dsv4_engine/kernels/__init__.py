"""Kernel sets: which implementation of each op a forward runs, chosen once per engine.

    choose_kernels(device, enabled)      the engine's set (ModelRunner, from EngineConfig.kernels)
          │                               CPU + enabled + built: CpuKernels; NPU: NpuKernels;
          │                               else TorchKernels
          ├─ extend steps                 ForwardBatch(kernels=set)
          └─ set.for_decode(compiled)     the batched decode step's variant: DecodeBatch(kernels=...)
    every module's forward               batch.kernels.<op>(tensors, its own parameters)

`base.KernelSet` lists the ops. `torch_forms.TorchKernels` is the reference torch code (what HF parity
is tested on, and every other set's fallback); `cpu.CpuKernels` the fused C++ kernels
(`build.available()`: built once a process on first use, never with `DSV4_KERNELS=0`); `npu.NpuKernels`
the torch set with torch_npu's fused ops where it has them (torch_npu imported only then).
Tools that must see every aten op (FLOP counting) run the torch set.
"""

from __future__ import annotations

import torch

from dsv4_engine.kernels.base import KernelSet
from dsv4_engine.kernels.build import KERNELS_ENV, available, cache_dir
from dsv4_engine.kernels.cpu import CpuKernels
from dsv4_engine.kernels.torch_forms import TorchKernels

__all__ = [
    "KERNELS_ENV",
    "CpuKernels",
    "KernelSet",
    "TorchKernels",
    "available",
    "cache_dir",
    "choose_kernels",
]


def choose_kernels(device: torch.device | str, enabled: bool = True) -> KernelSet:
    """The kernel set for a model on `device`: where `enabled` (an engine's `kernels` option;
    default: what an engine with default options runs), the fused CPU kernels on CPU if they build
    and torch_npu's ops on NPU; else the torch forms."""
    kind = torch.device(device).type
    if enabled and kind == "cpu" and available():
        return CpuKernels()
    if enabled and kind == "npu":
        from dsv4_engine.kernels.npu import NpuKernels  # imports torch_npu: only for an NPU

        return NpuKernels()
    return TorchKernels()
