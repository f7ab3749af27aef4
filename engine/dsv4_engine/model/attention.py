"""DSV4 attention: MQA over one shared latent (K = V) with per-head sinks.

A query at position t attends to
- the sliding window: K=V rows of positions (t - sliding_window, t];
- at ratio 128 (HCA): every compressed row j < (t + 1) // 128;
- at ratio 4 (CSA): the indexer's top-k among compressed rows j < (t + 1) // 4.
Each head's learned sink joins the softmax denominator only. Since V carries RoPE on its
trailing channels, the output is rotated back (inverse RoPE at t) before the grouped output
projection: heads split into `o_groups` groups, each projected to `o_lora_rank`, then mixed.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4_engine.config import Dsv4Config
from dsv4_engine.model.batch import ForwardBatch, SeqSlice
from dsv4_engine.model.compressor import Compressor, Indexer
from dsv4_engine.model.ops import RMSNorm, unweighted_rms_norm
from dsv4_engine.rope import RopeTable, rotate


class GroupedLinear(nn.Linear):
    """Block-diagonal projection: group g of the input uses rows [g*R, (g+1)*R) of the weight."""

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__(in_per_group, out_features, bias=False)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, G, in] -> [T, G*R]
        w = self.weight.view(self.groups, -1, x.shape[-1])  # [G, R, in]
        return torch.bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1).flatten(1)


class CompressorWithIndexer(Compressor):
    """The CSA compressor (ratio 4, overlapping) that owns the lightning indexer."""

    def __init__(self, config: Dsv4Config, rope: RopeTable) -> None:
        super().__init__(config, 4, config.head_dim, rope, name="compressor")
        self.indexer = Indexer(config, rope)


class Dsv4Attention(nn.Module):
    def __init__(
        self, config: Dsv4Config, layer: int, rope_main: RopeTable, rope_compress: RopeTable
    ) -> None:
        super().__init__()
        self.layer = layer
        self.ratio = config.compress_ratio(layer)
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.window = config.sliding_window
        self.o_groups = config.o_groups
        self.eps = config.rms_norm_eps
        self.scaling = self.head_dim**-0.5
        rope = rope_compress if self.ratio else rope_main
        object.__setattr__(self, "rope", rope)

        self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.kv_proj = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        in_per_group = self.num_heads * self.head_dim // config.o_groups
        self.o_a_proj = GroupedLinear(in_per_group, config.o_groups * config.o_lora_rank, config.o_groups)
        self.o_b_proj = nn.Linear(config.o_groups * config.o_lora_rank, config.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))
        self.compressor: Compressor | None = None
        if self.ratio == 4:
            self.compressor = CompressorWithIndexer(config, rope_compress)
        elif self.ratio:
            self.compressor = Compressor(config, self.ratio, self.head_dim, rope_compress, name="compressor")

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        cos, sin = batch.memo[id(self.rope)]
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_residual).view(len(x), self.num_heads, self.head_dim)
        q = rotate(unweighted_rms_norm(q, self.eps), cos[:, None], sin[:, None])
        kv = rotate(self.kv_norm(self.kv_proj(x)), cos, sin)

        comp_kv = comp_gate = idx_kv = idx_gate = idx_q = idx_w = None
        if self.compressor is not None:
            comp_kv, comp_gate = self.compressor.project(x)
            indexer = getattr(self.compressor, "indexer", None)
            if indexer is not None:
                idx_kv, idx_gate = indexer.project(x)
                idx_q, idx_w = indexer.queries(x, q_residual, cos, sin)

        out = torch.empty_like(q)
        for seq in batch.seqs:
            rows = seq.rows
            keys, bias = self._window_keys(seq, kv[rows], batch)
            if self.compressor is not None:
                comp = self.compressor.update(self.layer, seq, comp_kv[rows], comp_gate[rows])
                if idx_q is not None:
                    indexer = self.compressor.indexer
                    idx_keys = indexer.update(self.layer, seq, idx_kv[rows], idx_gate[rows])
                    comp_bias = indexer.select(idx_q[rows], idx_w[rows], idx_keys, seq)
                else:
                    comp_bias = _causal_rows_bias(seq, self.ratio, len(comp), batch, x.device)
                keys = torch.cat([keys, comp])
                bias = torch.cat([bias, comp_bias.to(bias.dtype)], dim=1)
            out[rows] = self._attend(q[rows], keys, bias)

        out = rotate(out, cos[:, None], -sin[:, None])  # undo RoPE carried by V
        grouped = self.o_a_proj(out.reshape(len(x), self.o_groups, -1))
        return self.o_b_proj(grouped)

    def _window_keys(
        self, seq: SeqSlice, kv: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K=V rows of positions [start - m, end) and the sliding-window bias `[n, m + n]`."""
        m = min(seq.start, self.window - 1)
        keys = kv
        if m:
            keys = torch.cat([seq.cache.read_swa(self.layer, seq.start - m, seq.start), kv])
        seq.cache.write_swa(self.layer, seq.start, kv)
        key = ("swa", seq.offset)
        if key not in batch.memo:
            qpos = torch.arange(seq.start, seq.end, device=kv.device)[:, None]
            kpos = torch.arange(seq.start - m, seq.end, device=kv.device)[None, :]
            visible = (kpos <= qpos) & (kpos > qpos - self.window)
            batch.memo[key] = torch.zeros(visible.shape, device=kv.device).masked_fill(
                ~visible, float("-inf")
            )
        return keys, batch.memo[key]

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Softmax over [keys | sink] per head; `q [n, H, D]`, `keys [K, D]`, `bias [n, K]`."""
        logits = torch.matmul(q.transpose(0, 1), keys.T) * self.scaling + bias.to(q.dtype)  # [H, n, K]
        sinks = self.sinks.view(-1, 1, 1).expand(-1, len(q), 1)
        logits = torch.cat([logits, sinks], dim=-1)  # sinks are fp32: promotes like HF
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = logits.softmax(dim=-1)[..., :-1].to(keys.dtype)
        return torch.matmul(probs, keys).transpose(0, 1)


def _causal_rows_bias(
    seq: SeqSlice, ratio: int, num_rows: int, batch: ForwardBatch, device: torch.device
) -> torch.Tensor:
    """HCA: query t sees compressed rows j < (t + 1) // ratio."""
    key = ("rows", seq.offset, ratio, num_rows)
    if key not in batch.memo:
        visible = (torch.arange(seq.start, seq.end, device=device) + 1) // ratio
        future = torch.arange(num_rows, device=device)[None, :] >= visible[:, None]
        batch.memo[key] = torch.zeros(future.shape, device=device).masked_fill(future, float("-inf"))
    return batch.memo[key]
