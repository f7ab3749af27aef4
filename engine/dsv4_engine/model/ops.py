"""Small numeric helpers shared by the model's modules, and how a module picks its kernel.

Every module that has a fused `dsv4::` CPU kernel (`dsv4_engine.kernels`) decides itself, per call,
whether to run it (`KernelChoice.kernel_for`): by device (CPU only), by shape and dtype (the
single-threaded fp32 loops only up to `LOOP_ROWS` tokens; the kernels with a GEMM inside pick BLAS
for many rows themselves) and by context. Under a compiler only the kernels that do less work than anything it
generates stay (projections, experts, compressors: `opaque=True`); the rest are its to fuse. The
model's one switch, `Dsv4ForCausalLM.use_kernels`, sets every module's `use_kernels`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.compiler import is_compiling
from torch.nn.modules import module as _torch_module

from dsv4_engine import kernels

_FP32 = torch.float32

# The largest decode batch (attention.decode_buffers.DEFAULT_BUCKETS): up to it the one-dispatch loops
# win (a step pays ~5-10 us per dispatched op); past it, a prefill's rows, the multi-threaded aten forms.
LOOP_ROWS = 256


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


class KernelChoice:
    """Mixin of modules that may run a `dsv4::` kernel. `use_kernels` None: whenever the kernels are
    built and the tensor is on CPU (decided per call); True / False: fixed for the model (the engine's
    `EngineConfig.kernels`, through `Dsv4ForCausalLM.use_kernels`), so traced code reads a constant."""

    use_kernels: bool | None = None

    def kernel_for(self, x: torch.Tensor, *, opaque: bool = False, loops: bool = True) -> Any:
        """The kernels this call on `x` (tokens first) runs, or None for the torch code: `kernels.ops()`
        (`torch.ops.dsv4` under a compiler, else the direct bindings). opaque: the kernel stays under
        a compiler too. loops: the kernel is fp32 loops on one thread, for fp32 `x` of at most
        `LOOP_ROWS` tokens (other dtypes keep torch's op order, which HF's bf16 rounding follows);
        False: the kernel picks BLAS and the op order for other sizes and dtypes itself. Called a few
        hundred times a decode step: the cheap tests first."""
        use = self.use_kernels
        if use is False:
            return None
        if loops and (x.dtype is not _FP32 or x.shape[0] > LOOP_ROWS):
            return None
        if is_compiling():  # a fixed choice: nothing of the build state is traced
            return torch.ops.dsv4 if opaque and (x.is_cpu if use else kernels.use_for(x.device)) else None
        if not x.is_cpu or (use is None and not kernels.available()):
            return None
        return kernels.bound()  # None inside `kernels.disabled()` (FLOP counting), fixed choice or not


class Linear(Module, nn.Linear, KernelChoice):
    """`nn.Linear` that runs `dsv4::linear` on CPU (a skinny GEMM streaming the weight once below
    32 rows, where MKL runs at about half the bandwidth; `at::linear` from there on)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None and (k := self.kernel_for(x, opaque=True, loops=False)):
            return k.linear(x, self.weight)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(Module, KernelChoice):
    """RMSNorm computed in fp32; the weight is kept in fp32 and the result cast to the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if k := self.kernel_for(x):
            return k.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.mul_(self.weight).to(x.dtype)  # in place on the fresh product: one buffer fewer


def unweighted_rms_norm(x: torch.Tensor, eps: float, kernels: Any = None) -> torch.Tensor:
    """RMS normalisation without a weight; the scale is computed in fp32, applied in x's dtype.
    kernels: as their `rms_norm` (the caller's `KernelChoice.kernel_for`)."""
    if kernels is not None:
        return kernels.rms_norm(x, None, eps)
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def unweighted_rms_norm_(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`unweighted_rms_norm` in place, for a tensor nothing else reads."""
    return x.mul_(torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype))


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries along the last dim; ties go to the lower index.

    Exact ties are common in the indexer (ReLU zeros); an unstable top-k would make the
    selected set depend on memory layout.
    """
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[..., :k]
