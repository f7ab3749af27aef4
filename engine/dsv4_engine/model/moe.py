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

from dsv4_engine.config import HASH_MOE, Dsv4Config
from dsv4_engine.model.ops import KernelChoice, Linear, Module
from dsv4_engine.parallel.groups import SINGLE, Parallel

if TYPE_CHECKING:
    from dsv4_engine.model.batch import StepBatch
    from dsv4_engine.model.packed import Packed


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class Router(Module, KernelChoice):
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
        """(weights [T, k], expert ids [T, k]); on CPU, for up to `LOOP_ROWS` fp32 rows, as `dsv4::route`."""
        if k := self.kernel_for(x):
            table = self.tid2eid if self.is_hash else self.e_score_correction_bias
            return k.route(x, input_ids, self.weight, table, self.is_hash, self.top_k, self.scaling)
        scores = F.softplus(F.linear(x, self.weight)).sqrt()
        if self.is_hash:
            ids = self.tid2eid.index_select(0, input_ids).long()
        else:
            ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class Experts(Module, KernelChoice):
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

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, static: bool = False
    ) -> torch.Tensor:
        """Routed experts' weighted sum `[T, D]` (over this rank's experts) for global `ids`. On CPU
        `dsv4::moe_experts` runs `reference` without its gather and scatter passes (a tenth of a
        prefill's expert time), and with its own GEMM for experts of a few rows (a decode step's);
        tests/decode/test_kernels.py holds it to `reference`. It stays under a compiler: it reads
        only the picked experts' weights, which nothing the compiler makes of the gathers does.
        static: no host reads and a fixed output shape (a compiled or captured step): `static_forms`."""
        if k := self.kernel_for(x, opaque=True, loops=False):
            ids, weights = self.localise(ids, weights)
            return k.moe_experts(x, self.gate_up_proj, self.down_proj, ids, weights, self.limit)
        if static:
            return self.static_forms(x, weights, ids)
        return self.reference(x, weights, ids)

    def static_forms(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`reference` with a static output shape and no host reads: gathered expert weights while
        B*k < E (one batched GEMV per slot under a compiler, its best form there), else every expert
        densely."""
        bsz, k = ids.shape
        ids, weights = self.localise(ids, weights, dense=True)
        if bsz * k < self.num_experts and torch.compiler.is_compiling():
            routed = x.new_zeros(())
            for slot in range(k):
                picked = ids[:, slot]
                h = torch.bmm(self.gate_up_proj[picked], x[:, :, None]).squeeze(-1)  # [B, 2I]
                gate, up = h.chunk(2, dim=-1)
                y = torch.bmm(self.down_proj[picked], swiglu(gate, up, self.limit)[:, :, None]).squeeze(-1)
                routed = routed + y * weights[:, slot, None].to(y.dtype)
        elif bsz * k < self.num_experts:  # read only the picked experts' weights
            h = torch.matmul(self.gate_up_proj[ids], x[:, None, :, None]).squeeze(-1)  # [B, k, 2I]
            gate, up = h.chunk(2, dim=-1)
            y = torch.matmul(self.down_proj[ids], swiglu(gate, up, self.limit)[..., None]).squeeze(-1)
            routed = (y * weights[..., None].to(y.dtype)).sum(dim=1)
        else:  # many rows: one GEMM for every expert's gate/up, one batched GEMM down
            h = F.linear(x, self.gate_up_proj.flatten(0, 1)).view(bsz, self.num_experts, -1)  # [B, E, 2I]
            gate, up = h.chunk(2, dim=-1)
            act = swiglu(gate, up, self.limit).transpose(0, 1)  # [E, B, I]
            y = torch.bmm(act, self.down_proj.transpose(1, 2))  # [E, B, D]
            dense = torch.zeros(bsz, self.num_experts, dtype=y.dtype, device=y.device)
            dense = dense.scatter_add(1, ids, weights.to(y.dtype))
            routed = torch.einsum("be,ebd->bd", dense, y)
        return routed.to(x.dtype)

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


class SharedExpert(Module, KernelChoice):
    def __init__(self, config: Dsv4Config, parallel: Parallel = SINGLE) -> None:
        super().__init__()
        self.limit = config.swiglu_limit
        inter = parallel.split(config.moe_intermediate_size, "moe_intermediate_size")
        hidden = config.hidden_size
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor, pack: Packed | None = None) -> torch.Tensor:
        """pack: the gate and up projections as one GEMM (`model.packed`, the decode step's); on CPU
        then the whole expert as `dsv4::shared_expert`, which stays under a compiler too."""
        if pack is None:
            return self.combine(self.gate_proj(x), self.up_proj(x))
        if k := self.kernel_for(x, opaque=True, loops=False):
            return k.shared_expert(x, pack.weight, self.down_proj.weight, self.limit)
        return self.combine(*pack(x))

    def combine(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The expert's output from its gate and up projections (the decode step packs those two)."""
        return self.down_proj(swiglu(gate, up, self.limit))


class MoE(Module):
    def __init__(self, config: Dsv4Config, layer: int, parallel: Parallel = SINGLE) -> None:
        super().__init__()
        self.layer = layer
        self.parallel = parallel
        self.gate = Router(config, is_hash=config.mlp_layer_types[layer] == HASH_MOE)
        self.experts = Experts(config, parallel)
        self.shared_experts = SharedExpert(config, parallel)

    def forward(self, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """Routed plus shared experts `[T, D]` (static-shape forms for a decode batch, whose step may
        be compiled or captured); summed over the ranks."""
        weights, ids = self.gate(x, batch.input_ids)
        routed = self.experts(x, weights, ids, static=batch.static)
        return self.parallel.all_reduce(routed.add_(self.shared_experts(x, batch.shared_pack(self.layer))))
