"""Kernel sets: which implementation of each op a forward runs, chosen once per engine.

    choose_kernels(device, enabled)      the engine's set (ModelRunner, from EngineConfig.kernels)
          │                               CPU + enabled + built: CpuKernels; else TorchKernels
          ├─ extend steps                 ForwardBatch(kernels=set)
          └─ set.for_decode(compiled)     the batched decode step's variant: DecodeBatch(kernels=...)
    every module's forward               batch.kernels.<op>(tensors, its own parameters)

`base.KernelSet` lists the ops. `torch_forms.TorchKernels` is the reference torch code (what HF parity
is tested on, and every other set's fallback); `cpu.CpuKernels` the fused C++ kernels
(`build.available()`: built once a process on first use, never with `DSV4_KERNELS=0`). An NPU set
(issue 39) subclasses `TorchKernels` with torch_npu's ops and is chosen here for `npu` devices.
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
    """The kernel set for a model on `device`: the fused CPU kernels on CPU where `enabled` (an
    engine's `kernels` option; default: what an engine with default options runs) and they build,
    else the torch forms."""
    if enabled and torch.device(device).type == "cpu" and available():
        return CpuKernels()
    return TorchKernels()
