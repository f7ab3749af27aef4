"""KV compressor (CSA at ratio 4 with overlap, HCA at ratio 128) and the lightning indexer.

Block b covers positions [b*r, (b+1)*r). When its last token arrives it becomes compressed
row b: a per-channel softmax over the block's scores (`gate_proj(x) + position_bias[p % r]`)
weights its kv (`kv_proj(x)`). At ratio 4 the projections are twice as wide: the second half
belongs to the block itself and the first half to the *next* block, so row b pools 2r slots
(block b-1's first halves, then block b's second halves; block -1 contributes nothing).
The row is RMS-normalised and rotated (compress RoPE) at position b*r.

The attention block computes the projections (with its own, as one GEMM in a decode step); these
modules hand their parameters to the batch, which keeps the state where its mode keeps it
(`model.batch.StepBatch.compress` and `index_topk`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dsv4_engine.config import Dsv4Config
from dsv4_engine.model.batch import StepBatch
from dsv4_engine.model.ops import Linear, Module, RMSNorm
from dsv4_engine.rope import RopeTable


class Compressor(Module):
    """Folds blocks of `ratio` tokens of layer `layer` into compressed KV rows of width `head_dim`."""

    def __init__(
        self, config: Dsv4Config, layer: int, ratio: int, head_dim: int, rope: RopeTable, name: str
    ) -> None:
        super().__init__()
        self.layer = layer
        self.ratio = ratio
        self.head_dim = head_dim
        self.coff = 2 if ratio == 4 else 1  # overlap at ratio 4
        self.name = name  # which of the layer's compressors ("compressor" or "indexer")
        width = self.coff * head_dim
        self.kv_proj = Linear(config.hidden_size, width, bias=False)
        self.gate_proj = Linear(config.hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width))
        self.kv_norm = RMSNorm(head_dim, config.rms_norm_eps)
        object.__setattr__(self, "rope", rope)  # shared table, owned by the model's registry

    def forward(self, kv: torch.Tensor, gate: torch.Tensor, batch: StepBatch) -> Any:
        """Fold the step's tokens (their `kv_proj` and `gate_proj` outputs) into this compressor's
        state and write the rows of the blocks they complete; the batch's handle on the rows."""
        cos, sin = self.rope.tables()
        norm = self.kv_norm
        return batch.compress(
            self.layer, self.name, kv, gate, self.position_bias, norm.weight, norm.eps, cos, sin
        )


class IndexerScorer(Module):
    def __init__(self, config: Dsv4Config) -> None:
        super().__init__()
        self.weights_proj = Linear(config.hidden_size, config.index_n_heads, bias=False)


class Indexer(Compressor):
    """Lightning indexer: its own ratio-4 compressor at `index_head_dim`, and per query the
    top-k compressed rows by `sum_h w_h * relu(q_h . k_j)`."""

    def __init__(self, config: Dsv4Config, layer: int, rope: RopeTable) -> None:
        super().__init__(config, layer, 4, config.index_head_dim, rope, name="indexer")
        self.num_heads = config.index_n_heads
        self.topk = config.index_topk
        self.softmax_scale = config.index_head_dim**-0.5
        self.weights_scaling = config.index_n_heads**-0.5
        self.q_b_proj = Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.scorer = IndexerScorer(config)

    def select(self, q_residual: torch.Tensor, weights: torch.Tensor, keys: Any, batch: StepBatch) -> Any:
        """Each token's top-k compressed rows (the batch's answer) from the attention's query residual
        and `scorer.weights_proj`'s output; keys: this indexer's rows (`forward`'s handle)."""
        k = batch.kernels
        cos, sin = batch.memo[id(self.rope)]
        q = self.q_b_proj(q_residual, k).view(len(q_residual), self.num_heads, self.head_dim)
        head_weights = weights.float() * self.weights_scaling
        return batch.index_topk(
            self.layer, k.rope(q, cos, sin), head_weights, keys, self.softmax_scale, self.topk
        )
