"""DSV4 attention: MQA over one shared latent (K = V) with per-head sinks.

A query at position t attends to
- the sliding window: K=V rows of positions (t - sliding_window, t];
- at ratio 128 (HCA): every compressed row j < (t + 1) // 128;
- at ratio 4 (CSA): the indexer's top-k among compressed rows j < (t + 1) // 4.
Each head's learned sink joins the softmax denominator only. Since V carries RoPE on its
trailing channels, the output is rotated back (inverse RoPE at t) before the grouped output
projection: heads split into `o_groups` groups, each projected to `o_lora_rank`, then mixed.

`Dsv4Attention.forward` is the one implementation for every step: the batch only says where the
window, the compressor state and the compressed rows live (`model.batch.StepBatch`), taking the
parameters it needs from here.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from dsv4_engine.config import Dsv4Config
from dsv4_engine.kernels import KernelSet
from dsv4_engine.model.batch import StepBatch
from dsv4_engine.model.compressor import Compressor, Indexer
from dsv4_engine.model.ops import Linear, Module, RMSNorm
from dsv4_engine.model.packed import attention_inputs
from dsv4_engine.parallel.groups import SINGLE, Parallel, local_o_groups
from dsv4_engine.rope import RopeTable


class GroupedLinear(Linear):
    """Block-diagonal projection: group g of the input uses rows [g*R, (g+1)*R) of the weight."""

    # Int8, it runs as a grouped matmul: its scales as that op takes them (`quant.store_grouped_scales`).
    grouped_int8_scales: ClassVar[tuple[str, ...]] = ("weight_scale",)

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__(in_per_group, out_features, bias=False)
        self.groups = groups

    def forward(self, x: torch.Tensor, kernels: KernelSet) -> torch.Tensor:  # [T, G, in] -> [T, G*R]
        if self.weight.dtype == torch.int8:
            return kernels.quant_grouped_linear(x, self.weight, self.weight_scale)
        return kernels.grouped_linear(x, self.weight)


class CompressorWithIndexer(Compressor):
    """The CSA compressor (ratio 4, overlapping) that owns the lightning indexer."""

    def __init__(self, config: Dsv4Config, layer: int, rope: RopeTable) -> None:
        super().__init__(config, layer, 4, config.head_dim, rope, name="compressor")
        self.indexer = Indexer(config, layer, rope)


class Dsv4Attention(Module):
    """On tp_size ranks each holds num_attention_heads / tp_size query heads, their sinks and their
    share of the output projections; the latent (one KV head), compressor and indexer are replicated,
    so every rank writes the same state and selects the same compressed rows."""

    def __init__(
        self,
        config: Dsv4Config,
        layer: int,
        rope_main: RopeTable,
        rope_compress: RopeTable,
        parallel: Parallel = SINGLE,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.parallel = parallel
        self.ratio = config.compress_ratio(layer)
        self.num_heads = parallel.split(config.num_attention_heads, "num_attention_heads")
        self.head_dim = config.head_dim
        self.window = config.sliding_window
        self.o_groups = local_o_groups(config.o_groups, parallel.tp_size)
        self.eps = config.rms_norm_eps
        self.scaling = self.head_dim**-0.5
        rope = rope_compress if self.ratio else rope_main
        object.__setattr__(self, "rope", rope)

        self.q_a_proj = Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.kv_proj = Linear(config.hidden_size, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        in_per_group = self.num_heads * self.head_dim // self.o_groups
        self.o_a_proj = GroupedLinear(in_per_group, self.o_groups * config.o_lora_rank, self.o_groups)
        self.o_b_proj = Linear(self.o_groups * config.o_lora_rank, config.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))
        self.compressor: Compressor | None = None
        if self.ratio == 4:
            self.compressor = CompressorWithIndexer(config, layer, rope_compress)
        elif self.ratio:
            self.compressor = Compressor(
                config, layer, self.ratio, self.head_dim, rope_compress, "compressor"
            )

    def forward(self, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """The block's output `[T, hidden]` for the batch's tokens `x [T, hidden]`: queries and the
        K=V latent, the compressors' and the indexer's state advanced, attention over the window,
        the compressed rows and the sinks, RoPE undone, the grouped output projection; summed over
        the ranks."""
        k = batch.kernels
        cos, sin = batch.memo[id(self.rope)]
        pack = batch.attention_pack(self.layer)  # every input projection as one GEMM, or one each
        projected = pack(x, k) if pack is not None else [m(x, k) for m in attention_inputs(self)]
        q_residual = self.q_a_norm(projected[0], k)
        q = self.q_b_proj(q_residual, k).view(len(x), self.num_heads, self.head_dim)
        q = k.rope(k.head_rms_norm(q, self.eps), cos, sin)
        kv = k.rope(self.kv_norm(projected[1], k), cos, sin)

        rows = picks = None
        if self.compressor is not None:
            rows = self.compressor(projected[2], projected[3], batch)
            if isinstance(self.compressor, CompressorWithIndexer):
                indexer = self.compressor.indexer
                keys = indexer(projected[4], projected[5], batch)
                picks = indexer.select(q_residual, projected[6], keys, batch)
        out = batch.attend(self.layer, q, kv, rows, picks, self.sinks, self.scaling)  # [T, H, D]
        out = k.rope(out, cos, sin, inverse=True)  # undo RoPE carried by V
        grouped = self.o_a_proj(out.reshape(len(x), self.o_groups, -1), k)
        return self.parallel.all_reduce(self.o_b_proj(grouped, k))
