"""DSV4 MoE: sqrtsoftplus scoring, routed experts with SwiGLU limits, one shared expert.

Routing: scores `s = sqrt(softplus(x @ W_gate.T))`. Score-based layers pick the top-k of
`s + e_score_correction_bias` (the bias steers selection only); hash layers pick
`tid2eid[token_id]`. Either way the weights are the picked unbiased scores, normalised to
sum to 1, times `routed_scaling_factor`. Every expert, the shared one included (as HF's
`DeepseekV4MLP` does), clamps gate to <= limit and up to [-limit, limit] before
`silu(gate) * up`.

On several ranks (parallel/groups.py) the router is replicated, each rank holds its expert group's
routed experts with its slice of their intermediate size, and its slice of the shared expert's;
the routed and shared partial sums go through one all-reduce.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from dsv4_engine import kernels
from dsv4_engine.config import HASH_MOE, Dsv4Config
from dsv4_engine.parallel.groups import SINGLE, Parallel

if TYPE_CHECKING:
    from dsv4_engine.model.batch import StepBatch


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class Router(nn.Module):
    """Score-based (`e_score_correction_bias`) or hash (`tid2eid`) routing; names as HF's."""

    def __init__(self, config: Dsv4Config, is_hash: bool) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.scaling = config.routed_scaling_factor
        self.is_hash = is_hash
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k])."""
        scores = F.softplus(F.linear(x, self.weight)).sqrt()
        if self.is_hash:
            ids = self.tid2eid.index_select(0, input_ids).long()
        else:
            ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class Experts(nn.Module):
    """Routed experts as 3-D tensors: `gate_up_proj [E, 2I, D]` (gate rows first), `down_proj [E, D, I]`;
    on several ranks E and I are this rank's (`first_expert` the global id of local expert 0)."""

    def __init__(self, config: Dsv4Config, parallel: Parallel = SINGLE) -> None:
        super().__init__()
        total = config.n_routed_experts
        if total % parallel.ep_size:
            raise ValueError(f"n_routed_experts {total} is not divisible by ep_size {parallel.ep_size}")
        if config.moe_intermediate_size % parallel.moe_tp_size:
            raise ValueError(
                f"moe_intermediate_size {config.moe_intermediate_size} is not divisible by "
                f"tp_size / ep_size = {parallel.moe_tp_size}"
            )
        self.num_experts = total // parallel.ep_size
        self.first_expert = parallel.ep_rank * self.num_experts
        self.all_local = parallel.ep_size == 1
        self.limit = config.swiglu_limit
        inter, hidden = config.moe_intermediate_size // parallel.moe_tp_size, config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.zeros(self.num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.zeros(self.num_experts, hidden, inter))

    def localise(
        self, ids: torch.Tensor, weights: torch.Tensor, dense: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Global expert ids as this rank's: -1 for another rank's pair (which `reference` and
        `dsv4::moe_experts` skip), or with `dense` (forms that index every pair) local expert 0 at
        weight 0. The identity while every expert is local."""
        if self.all_local:
            return ids, weights
        local = ids - self.first_expert
        here = (local >= 0) & (local < self.num_experts)
        if dense:
            return torch.where(here, local, 0), weights * here
        return torch.where(here, local, -1), weights

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Routed experts' weighted sum `[T, D]` (over this rank's experts) for global `ids`. On CPU
        `dsv4::moe_experts` runs `reference` without its gather and scatter passes (a tenth of a
        prefill's expert time), and with its own GEMM for experts of a few rows (a decode step's);
        tests/decode/test_kernels.py holds it to `reference`."""
        ids, weights = self.localise(ids, weights)
        if kernels.use_for(x.device):
            return torch.ops.dsv4.moe_experts(x, self.gate_up_proj, self.down_proj, ids, weights, self.limit)
        return self._reference(x, weights, ids)

    def reference(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`forward` in torch: dispatch by expert, the (token, expert) pairs sorted by expert and
        gathered once; per expert in use, two matmuls on its contiguous slice and one weighted
        scatter-add."""
        ids, weights = self.localise(ids, weights)
        return self._reference(x, weights, ids)

    def _reference(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        flat_ids = ids.flatten()
        order = torch.argsort(flat_ids, stable=True)
        if not self.all_local:  # another rank's pairs (id -1) sort first: drop them
            order = order[flat_ids.index_select(0, order) >= 0]
            flat_ids = flat_ids[flat_ids >= 0]
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        tokens = order // ids.shape[1]
        xs = x.index_select(0, tokens)
        flat_weights = weights.flatten().index_select(0, order)[:, None]
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                end = start + count
                h = F.linear(xs[start:end], self.gate_up_proj[expert])
                y = F.linear(_swiglu_(h, self.limit), self.down_proj[expert])
                out.index_add_(0, tokens[start:end], y.mul_(flat_weights[start:end]).to(out.dtype))
                start = end
        return out


def _swiglu_(h: torch.Tensor, limit: float) -> torch.Tensor:
    """`swiglu` of `h = [gate | up]`, computed in h's own storage (returns a view of it)."""
    inter = h.shape[-1] // 2
    gate, up = h[..., :inter], h[..., inter:]
    return F.silu(gate.clamp_(max=limit), inplace=True).mul_(up.clamp_(min=-limit, max=limit))


class SharedExpert(nn.Module):
    def __init__(self, config: Dsv4Config, parallel: Parallel = SINGLE) -> None:
        super().__init__()
        self.limit = config.swiglu_limit
        inter = parallel.split(config.moe_intermediate_size, "moe_intermediate_size")
        hidden = config.hidden_size
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.combine(self.gate_proj(x), self.up_proj(x))

    def combine(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The expert's output from its gate and up projections (the decode step packs those two)."""
        return self.down_proj(swiglu(gate, up, self.limit))


class MoE(nn.Module):
    def __init__(self, config: Dsv4Config, layer: int, parallel: Parallel = SINGLE) -> None:
        super().__init__()
        self.layer = layer
        self.parallel = parallel
        self.gate = Router(config, is_hash=config.mlp_layer_types[layer] == HASH_MOE)
        self.experts = Experts(config, parallel)
        self.shared_experts = SharedExpert(config, parallel)

    def forward(self, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """Routed plus shared experts `[T, D]`, in the batch's form: the modules' own (extend) or a
        static-shape decode form (`decode_ops.TorchOps.moe`); summed over the ranks."""
        return self.parallel.all_reduce(
            batch.ops.moe(self, x, batch.input_ids, batch.shared_pack(self.layer))
        )
