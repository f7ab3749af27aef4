"""KV compressor (CSA at ratio 4 with overlap, HCA at ratio 128) and the lightning indexer.

Block b covers positions [b*r, (b+1)*r). When its last token arrives it becomes compressed
row b: a per-channel softmax over the block's scores (`gate_proj(x) + position_bias[p % r]`)
weights its kv (`kv_proj(x)`). At ratio 4 the projections are twice as wide: the second half
belongs to the block itself and the first half to the *next* block, so row b pools 2r slots
(block b-1's first halves, then block b's second halves; block -1 contributes nothing).
The row is RMS-normalised and rotated (compress RoPE) at position b*r.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4_engine.config import Dsv4Config
from dsv4_engine.kernels import KernelSet
from dsv4_engine.kernels.torch_forms import stable_topk
from dsv4_engine.model.batch import SeqSlice
from dsv4_engine.model.ops import Linear, Module, RMSNorm
from dsv4_engine.rope import RopeTable


class Compressor(Module):
    """Folds blocks of `ratio` tokens into compressed KV rows of width `head_dim`."""

    def __init__(self, config: Dsv4Config, ratio: int, head_dim: int, rope: RopeTable, name: str) -> None:
        super().__init__()
        self.ratio = ratio
        self.head_dim = head_dim
        self.coff = 2 if ratio == 4 else 1  # overlap at ratio 4
        self.name = name  # state key in the cache ("compressor" or "indexer")
        width = self.coff * head_dim
        self.kv_proj = Linear(config.hidden_size, width, bias=False)
        self.gate_proj = Linear(config.hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width))
        self.kv_norm = RMSNorm(head_dim, config.rms_norm_eps)
        object.__setattr__(self, "rope", rope)  # shared table, owned by the model's registry

    def project(self, x: torch.Tensor, kernels: KernelSet) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv_proj(x, kernels), self.gate_proj(x, kernels)

    def update(
        self, layer: int, seq: SeqSlice, kv: torch.Tensor, gate: torch.Tensor, kernels: KernelSet
    ) -> torch.Tensor:
        """Fold this slice's tokens into the cache; return all compressed rows so far `[end // r, D]`."""
        r, cache = self.ratio, seq.cache
        s, e = seq.start, seq.end
        positions = torch.arange(s, e, device=kv.device)
        score = gate + self.position_bias.index_select(0, positions % r)
        base = max(0, (s // r - (self.coff - 1)) * r)  # oldest position still needed
        if base < s:
            old_kv, old_score = cache.read_state(layer, self.name, base, s)
            all_kv, all_score = torch.cat([old_kv, kv]), torch.cat([old_score, score])
        else:
            all_kv, all_score = kv, score
        cache.write_state(layer, self.name, s, kv, score)

        first, last = s // r, e // r  # blocks completed by this slice: [first, last)
        if last > first:
            n_full = last * r - base
            blocks_kv = all_kv[:n_full].view(-1, r, all_kv.shape[-1])
            blocks_score = all_score[:n_full].view(-1, r, all_score.shape[-1])
            win_kv, win_score = self._windows(blocks_kv, blocks_score, first)
            weights = win_score.softmax(dim=1, dtype=torch.float32).to(win_kv.dtype)
            rows = self.kv_norm((win_kv * weights).sum(dim=1), kernels)
            cos, sin = self.rope.lookup(torch.arange(first, last, device=kv.device) * r)
            cache.write_rows(layer, self.name, first, kernels.rope(rows, cos, sin))
        if last == 0:
            return kv.new_zeros(0, self.head_dim)
        return cache.read_rows(layer, self.name, last)

    def _windows(
        self, blocks_kv: torch.Tensor, blocks_score: torch.Tensor, first: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pooling windows `[n_new, coff*r, D]` for the new blocks; `blocks_*` start at `base`."""
        if self.coff == 1:
            return blocks_kv, blocks_score
        d = self.head_dim
        cur_kv, cur_score = blocks_kv[..., d:], blocks_score[..., d:]
        prev_kv, prev_score = blocks_kv[..., :d], blocks_score[..., :d]
        if first == 0:  # block 0 borrows from nothing: zero kv, -inf score (softmax weight 0)
            pad_kv = prev_kv.new_zeros(1, *prev_kv.shape[1:])
            pad_score = prev_score.new_full((1, *prev_score.shape[1:]), float("-inf"))
            prev_kv, prev_score = torch.cat([pad_kv, prev_kv[:-1]]), torch.cat([pad_score, prev_score[:-1]])
        else:  # blocks start one before `first`: it only lends its first halves
            prev_kv, prev_score = prev_kv[:-1], prev_score[:-1]
            cur_kv, cur_score = cur_kv[1:], cur_score[1:]
        return torch.cat([prev_kv, cur_kv], dim=1), torch.cat([prev_score, cur_score], dim=1)


class IndexerScorer(Module):
    def __init__(self, config: Dsv4Config) -> None:
        super().__init__()
        self.weights_proj = Linear(config.hidden_size, config.index_n_heads, bias=False)


class Indexer(Compressor):
    """Lightning indexer: its own ratio-4 compressor at `index_head_dim`, and per query the
    top-k compressed rows by `sum_h w_h * relu(q_h . k_j)`."""

    def __init__(self, config: Dsv4Config, rope: RopeTable) -> None:
        super().__init__(config, 4, config.index_head_dim, rope, name="indexer")
        self.num_heads = config.index_n_heads
        self.topk = config.index_topk
        self.softmax_scale = config.index_head_dim**-0.5
        self.weights_scaling = config.index_n_heads**-0.5
        self.q_b_proj = Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.scorer = IndexerScorer(config)

    def queries(
        self,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kernels: KernelSet,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated index queries `[T, H, Di]` and head weights `[T, H]` (fp32) for all tokens."""
        q = self.q_b_proj(q_residual, kernels).view(len(q_residual), self.num_heads, self.head_dim)
        weights = self.head_weights(self.scorer.weights_proj(x, kernels))
        return kernels.rope(q, cos, sin), weights

    def head_weights(self, projected: torch.Tensor) -> torch.Tensor:
        """Per-head weights `[T, H]` (fp32) from `scorer.weights_proj`'s output."""
        return projected.float() * self.weights_scaling

    def select(
        self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, seq: SeqSlice
    ) -> torch.Tensor:
        """Additive bias `[n, N]` over compressed rows: 0 where a query selected the row."""
        n, num_rows = len(q), len(keys)
        bias = q.new_full((n, num_rows), float("-inf"), dtype=torch.float32)
        if num_rows == 0:
            return bias
        visible = (torch.arange(seq.start, seq.end, device=q.device) + 1) // self.ratio
        future = torch.arange(num_rows, device=q.device)[None, :] >= visible[:, None]
        if num_rows <= self.topk:  # the top-k of all rows is every visible row: no scores needed
            return bias.masked_fill_(~future, 0.0)
        scores = F.relu(torch.matmul(q.float(), keys.float().T)) * self.softmax_scale  # [n, H, N]
        scores = (scores * weights[:, :, None]).sum(dim=1)  # [n, N]
        scores = scores.masked_fill(future, float("-inf"))
        picked = stable_topk(scores, min(self.topk, num_rows))
        valid = picked < visible[:, None]
        # Invalid picks go to a spare column that is dropped.
        picked = torch.where(valid, picked, torch.full_like(picked, num_rows))
        bias = torch.cat([bias, bias[:, :1]], dim=1)
        return bias.scatter_(1, picked, 0.0)[:, :num_rows]
