"""DSV4 MoE: sqrtsoftplus scoring, routed experts with SwiGLU limits, one shared expert.

Routing: scores `s = sqrt(softplus(x @ W_gate.T))`. Score-based layers pick the top-k of
`s + e_score_correction_bias` (the bias steers selection only); hash layers pick
`tid2eid[token_id]`. Either way the weights are the picked unbiased scores, normalised to
sum to 1, times `routed_scaling_factor`. Every expert, the shared one included (as HF's
`DeepseekV4MLP` does), clamps gate to <= limit and up to [-limit, limit] before
`silu(gate) * up`.

On several ranks (parallel/groups.py) the router is replicated, each rank holds its expert group's
routed experts with its slice of their intermediate size, and its slice of the shared expert's;
the routed and shared partial sums go through one all-reduce. Each module runs its op on the step's
kernel set (`KernelSet.route`, `routed_experts` or, int8, `quant_routed_experts`, `shared_expert`),
and the set's `routed_and_shared` runs the two halves (one after the other, or overlapped).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from dsv4_engine.config import HASH_MOE, Dsv4Config
from dsv4_engine.kernels import KernelSet
from dsv4_engine.kernels.torch_ops import swiglu
from dsv4_engine.model.ops import Linear, Module
from dsv4_engine.parallel.groups import SINGLE, Parallel

if TYPE_CHECKING:
    from dsv4_engine.model.batch import StepBatch
    from dsv4_engine.model.packed import Packed

__all__ = ["Experts", "MoE", "Router", "SharedExpert", "swiglu"]


class Router(Module):
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

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor, kernels: KernelSet
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k])."""
        table = self.tid2eid if self.is_hash else self.e_score_correction_bias
        return kernels.route(x, input_ids, self.weight, table, self.is_hash, self.top_k, self.scaling)


class Experts(Module):
    """Routed experts as 3-D tensors: `gate_up_proj [E, 2I, D]` (gate rows first), `down_proj [E, D, I]`;
    on several ranks E and I are this rank's (`first_expert` the global id of local expert 0). A W8A8
    checkpoint loaded for a set that runs int8 (`KernelSet.native_w8a8`) leaves both int8, with their
    per-expert, per-row float32 scales beside them as `gate_up_proj_scale [E, 2I]` and
    `down_proj_scale [E, D]` (loader.py); the set's `quant_routed_experts` runs them."""

    int8_weights: ClassVar[bool] = True  # the loader may keep these weights int8
    # Their scales as the grouped matmul takes them (`quant.store_grouped_scales`, at load).
    grouped_int8_scales: ClassVar[tuple[str, ...]] = ("gate_up_proj_scale", "down_proj_scale")

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

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, kernels: KernelSet
    ) -> torch.Tensor:
        """Routed experts' weighted sum `[T, D]` over this rank's experts, for global `ids`."""
        if not self.all_local:  # another rank's pairs as -1, which every form skips
            local = ids - self.first_expert
            ids = torch.where((local >= 0) & (local < self.num_experts), local, -1)
        if self.gate_up_proj.dtype == torch.int8:
            return kernels.quant_routed_experts(
                x, self.gate_up_proj, self.gate_up_proj_scale, self.down_proj, self.down_proj_scale,
                ids, weights, self.limit,
            )  # fmt: skip
        return kernels.routed_experts(x, self.gate_up_proj, self.down_proj, ids, weights, self.limit)


class SharedExpert(Module):
    def __init__(self, config: Dsv4Config, parallel: Parallel = SINGLE) -> None:
        super().__init__()
        self.limit = config.swiglu_limit
        inter = parallel.split(config.moe_intermediate_size, "moe_intermediate_size")
        hidden = config.hidden_size
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor, kernels: KernelSet, pack: Packed | None = None) -> torch.Tensor:
        """pack: the gate and up projections as one weight (`model.packed`, the decode step's): then
        the whole expert is the set's `shared_expert`; else one projection each."""
        if pack is not None:
            return kernels.shared_expert(x, pack.weight, self.down_proj.weight, self.limit)
        gate, up = self.gate_proj(x, kernels), self.up_proj(x, kernels)
        return self.down_proj(swiglu(gate, up, self.limit), kernels)


class MoE(Module):
    def __init__(self, config: Dsv4Config, layer: int, parallel: Parallel = SINGLE) -> None:
        super().__init__()
        self.layer = layer
        self.parallel = parallel
        self.gate = Router(config, is_hash=config.mlp_layer_types[layer] == HASH_MOE)
        self.experts = Experts(config, parallel)
        self.shared_experts = SharedExpert(config, parallel)

    def forward(self, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """Routed plus shared experts `[T, D]`, summed over the ranks. The set decides how the two
        run (`KernelSet.routed_and_shared`: on NPU decode steps, on two streams)."""
        k, pack = batch.kernels, batch.shared_pack(self.layer)

        def routed() -> torch.Tensor:
            weights, ids = self.gate(x, batch.input_ids, k)
            return self.experts(x, weights, ids, k)

        out = k.routed_and_shared(routed, lambda: self.shared_experts(x, k, pack))
        return self.parallel.all_reduce(out)
