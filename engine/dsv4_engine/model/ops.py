"""The model's base module and its two plainest layers, each running its op on the kernel set the
step hands it (`kernels.KernelSet`: the batch carries the engine's choice; modules never keep one).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.modules import module as _torch_module

from dsv4_engine.kernels import KernelSet


class Module(nn.Module):
    """`nn.Module` whose call runs `forward` directly while nothing needs torch's call machinery.

    `nn.Module.__call__` costs ~0.7 us a call (two frames and its hook and tracing checks); an eager
    decode step calls ~70 modules (four layers). Any hook on the module, a global hook,
    `Module.compile()` or the JIT tracer takes `nn.Module.__call__` as before, so hooks behave as in
    torch; a compiler inlines this like any function.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if (
            self._forward_pre_hooks
            or self._forward_hooks
            or self._backward_pre_hooks
            or self._backward_hooks
            or _torch_module._global_forward_pre_hooks
            or _torch_module._global_forward_hooks
            or _torch_module._global_backward_pre_hooks
            or _torch_module._global_backward_hooks
            or self._compiled_call_impl is not None
            or torch._C._get_tracing_state()
        ):
            return super().__call__(*args, **kwargs)
        return self.forward(*args, **kwargs)


class Linear(Module, nn.Linear):
    """`nn.Linear` without a bias (none of the model's projections has one), as the set's `linear`.
    A W8A8 checkpoint loaded for a set that runs int8 (`KernelSet.native_w8a8`) leaves the weight int8
    with its per-channel `weight_scale` buffer beside it (loader.py); the set's `quant_linear` runs it."""

    int8_weights: ClassVar[bool] = True  # the loader may keep this module's weight int8

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        if bias:
            raise ValueError("the model's projections have no bias")
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor, kernels: KernelSet) -> torch.Tensor:
        if self.weight.dtype == torch.int8:
            return kernels.quant_linear(x, self.weight, self.weight_scale)
        return kernels.linear(x, self.weight)


class RMSNorm(Module):
    """RMSNorm computed in fp32; the weight is kept in fp32 and the result cast to the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, kernels: KernelSet) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)
