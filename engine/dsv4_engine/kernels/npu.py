"""The NPU kernel set: `TorchKernels` with the ops torch_npu has a fused form of (the seed's Ascend
path), so the rest of the forward runs as torch forms on the device until each gets its op.

So far: RMSNorm (`npu_rms_norm`), the interleaved RoPE (`npu_rotary_mul`, rotary_mode 'interleave',
with the position's cos/sin rows broadcast over heads, as the seed's `Dsv4NpuRoPE` feeds it), the
shared expert's SwiGLU (`npu_swiglu`, after DSV4's clamps) and the MoE: routing through
`npu_moe_gating_top_k`, the routed experts as `npu_moe_init_routing_v2`, `npu_grouped_matmul` (gate/up),
the clamped `npu_swiglu`, `npu_grouped_matmul` (down) and `npu_moe_finalize_routing`. Every one has
static shapes and reads nothing on the host, so the decode variant captures as it is. docs/npu.md
lists each op's rules; tests/npu compares every op here with the CPU kernels through the reference
torch_npu. torch_npu is imported when the set is built, which happens only for an `npu` device
(`choose_kernels`).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn.functional as F

from dsv4_engine.kernels.base import KernelSet
from dsv4_engine.kernels.torch_forms import StaticTorchKernels, TorchKernels
from dsv4_engine.kernels.torch_ops import clamp_gate_up_, dense_ids

Tensor = torch.Tensor
_TINY = torch.finfo(torch.float32).tiny


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

    def route(
        self,
        x: Tensor,
        input_ids: Tensor,
        weight: Tensor,
        table: Tensor,
        is_hash: bool,
        top_k: int,
        scaling: float,
    ) -> tuple[Tensor, Tensor]:
        """`npu_moe_gating_top_k` on DSV4's scores; ids come back int32 (what init_routing takes).

        The op normalises its input by softmax or sigmoid only (torch_npu 2.14.0), and DSV4 scores
        are s = sqrt(softplus(logits)) in (0, inf). So s is computed here in fp32 and handed over as
        logit(s / c) with c = 2 * max(s) (a device scalar: no host read): the op's sigmoid gives back
        s / c, its selection adds bias / c (the same order as s + bias), and its renormalised picks
        (s / c)_i / sum (s / c) are DSV4's weights; it then applies routed_scaling_factor. Hash
        layers go through the op's tid2eid mode (ids = table[input_ids], no bias)."""
        scores = F.softplus(F.linear(x, weight).float()).sqrt()
        c = scores.amax().clamp(min=_TINY) * 2  # s / c <= 1/2: logit finite and well conditioned
        shrunk = (scores / c).clamp_(min=_TINY)  # an underflowed score stays a finite logit
        logits = torch.log(shrunk) - torch.log1p(-shrunk)  # sigmoid^-1
        picks: dict[str, Tensor] = (
            {"input_ids": input_ids, "tid2eid": table} if is_hash else {"bias": table.float() / c}
        )
        weights, ids, _ = self.npu.npu_moe_gating_top_k(
            logits, top_k, k_group=1, group_count=1, group_select_mode=0, renorm=0, norm_type=1,
            routed_scaling_factor=scaling, eps=1e-20, **picks,
        )  # fmt: skip
        return weights.to(x.dtype), ids

    def routed_experts(
        self, x: Tensor, gate_up: Tensor, down: Tensor, ids: Tensor, weights: Tensor, limit: float
    ) -> Tensor:
        """Dropless dispatch: `npu_moe_init_routing_v2` sorts the (token, expert) pairs by expert
        (rows [T*k, D] and the per-expert counts, on the device), two `npu_grouped_matmul` run each
        expert on its rows with DSV4's clamped SwiGLU between them, and `npu_moe_finalize_routing`
        sums each token's rows by its weights. Another rank's pairs (-1) run on local expert 0 at
        weight 0, keeping the shapes static (a multi-rank NPU server belongs to dispatch/combine
        ops)."""
        if x.shape[0] == 0:  # the ops take no empty tensors
            return torch.zeros_like(x)
        num_experts, k = gate_up.shape[0], ids.shape[1]
        ids, weights = dense_ids(ids, weights)
        rows, row_idx, counts, _ = self.npu.npu_moe_init_routing_v2(
            x,
            ids.to(torch.int32),
            active_num=x.shape[0] * k,
            expert_num=num_experts,
            expert_tokens_num_type=1,  # per-expert counts (int64), the grouped matmul's group_list
            expert_tokens_num_flag=True,
            active_expert_range=[0, num_experts],
        )
        # The op refuses a list of counts of length 1; one expert's count is also its cumsum.
        groups: dict[str, Any] = {
            "group_list": counts,
            "split_item": 2,
            "group_type": 0,
            "group_list_type": int(num_experts > 1),
        }
        # Weights as stored ([E, out, in]) are the op's transposed layout: no copy.
        (h,) = self.npu.npu_grouped_matmul([rows], [gate_up.transpose(1, 2)], **groups)
        clamp_gate_up_(h, limit)  # DSV4's clamps first: the op computes a plain SwiGLU
        (y,) = self.npu.npu_grouped_matmul([self.npu.npu_swiglu(h, dim=-1)], [down.transpose(1, 2)], **groups)
        # drop_pad_mode 2: init_routing_v2's map is row-major (token * k + slot)
        return self.npu.npu_moe_finalize_routing(
            y, None, None, None, weights.to(y.dtype), row_idx, None, drop_pad_mode=2
        )


class NpuKernels(_NpuOps, TorchKernels):
    """Extend steps' NPU set."""

    name = "npu"

    def for_decode(self, compiled: bool) -> KernelSet:
        # No compiler for NPU here: a decode step is eager or captured (aclgraph), one static form.
        return NpuDecodeKernels()


class NpuDecodeKernels(_NpuOps, StaticTorchKernels):
    """The batched decode step's NPU set (static shapes, no host reads: graph-capturable)."""

    name = "npu"
