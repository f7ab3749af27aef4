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
from dsv4_engine.kernels import KernelSet
from dsv4_engine.model.batch import ForwardBatch, SeqSlice, StepBatch
from dsv4_engine.model.compressor import Compressor, Indexer
from dsv4_engine.model.ops import Linear, Module, RMSNorm
from dsv4_engine.parallel.groups import SINGLE, Parallel, local_o_groups
from dsv4_engine.rope import RopeTable

# Queries per block: a block of b queries attends to b + window - 1 window keys (those its
# queries can see) instead of the whole chunk's; blocks run as one batched product. On CPU
# (window 64, 128-token chunks) 32 beat 64 and unblocked chunks by ~10% and ~40% of the time.
QUERY_BLOCK = 32


class GroupedLinear(Linear):
    """Block-diagonal projection: group g of the input uses rows [g*R, (g+1)*R) of the weight."""

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__(in_per_group, out_features, bias=False)
        self.groups = groups

    def forward(self, x: torch.Tensor, kernels: KernelSet) -> torch.Tensor:  # [T, G, in] -> [T, G*R]
        return kernels.grouped_linear(x, self.weight)


class CompressorWithIndexer(Compressor):
    """The CSA compressor (ratio 4, overlapping) that owns the lightning indexer."""

    def __init__(self, config: Dsv4Config, rope: RopeTable) -> None:
        super().__init__(config, 4, config.head_dim, rope, name="compressor")
        self.indexer = Indexer(config, rope)


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
            self.compressor = CompressorWithIndexer(config, rope_compress)
        elif self.ratio:
            self.compressor = Compressor(config, self.ratio, self.head_dim, rope_compress, name="compressor")

    def forward(self, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """The block's output `[T, hidden]`: the batch's attention (over the caches, or the paged
        decode step), then the grouped output projection; summed over the ranks."""
        k = batch.kernels
        out = batch.attend(self, x)  # [T, H, D], RoPE undone
        grouped = self.o_a_proj(out.reshape(len(x), self.o_groups, -1), k)
        return self.parallel.all_reduce(self.o_b_proj(grouped, k))

    def extend_attention(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Attention `[T, H, D]` of an extend batch (RoPE undone): per request, over its SeqCache."""
        k = batch.kernels
        cos, sin = batch.memo[id(self.rope)]
        q_residual = self.q_a_norm(self.q_a_proj(x, k), k)
        q = self.q_b_proj(q_residual, k).view(len(x), self.num_heads, self.head_dim)
        q = k.rope(k.head_rms_norm(q, self.eps), cos, sin)
        kv = k.rope(self.kv_norm(self.kv_proj(x, k), k), cos, sin)

        comp_kv = comp_gate = idx_kv = idx_gate = idx_q = idx_w = None
        if self.compressor is not None:
            comp_kv, comp_gate = self.compressor.project(x, k)
            indexer = getattr(self.compressor, "indexer", None)
            if indexer is not None:
                idx_kv, idx_gate = indexer.project(x, k)
                idx_q, idx_w = indexer.queries(x, q_residual, cos, sin, k)

        out = q  # a request's output overwrites its queries once they are read
        for seq in batch.seqs:
            rows = seq.rows
            keys = self._window_keys(seq, kv[rows])
            bias = self._window_bias(seq, batch)
            if self.compressor is not None:
                comp = self.compressor.update(self.layer, seq, comp_kv[rows], comp_gate[rows], k)
                if idx_q is not None:
                    indexer = self.compressor.indexer
                    idx_keys = indexer.update(self.layer, seq, idx_kv[rows], idx_gate[rows], k)
                    comp_bias = indexer.select(idx_q[rows], idx_w[rows], idx_keys, seq)
                else:
                    comp_bias = _causal_rows_bias(seq, self.ratio, len(comp), batch, x.device)
                keys = torch.cat([keys, comp.expand(len(keys), -1, -1)], dim=1)
                bias = torch.cat([bias, _blocks(comp_bias.to(bias.dtype), bias.shape[1])], dim=2)
            out[rows] = self._attend(_blocks(q[rows], bias.shape[1]), keys, bias)[: seq.length]

        return k.rope(out, cos, sin, inverse=True)  # undo RoPE carried by V

    def _window_keys(self, seq: SeqSlice, kv: torch.Tensor) -> torch.Tensor:
        """Window keys per query block, `[nb, b + w - 1, D]` (w: sliding window), as overlapping
        views of one buffer: block i's row s holds position start + i*b + s - w + 1, zero where that
        is before the window or past the chunk (`_window_bias` masks those)."""
        n, dim = kv.shape
        b, nb = _block_shape(n)
        m = min(seq.start, self.window - 1)  # cached positions the chunk's queries see
        keys = kv.new_zeros(self.window - 1 + nb * b, dim)
        if m:
            keys[self.window - 1 - m : self.window - 1] = seq.cache.read_swa(
                self.layer, seq.start - m, seq.start
            )
        keys[self.window - 1 : self.window - 1 + n] = kv
        seq.cache.write_swa(self.layer, seq.start, kv)
        return keys.as_strided((nb, b + self.window - 1, dim), (b * dim, dim, 1))

    def _window_bias(self, seq: SeqSlice, batch: ForwardBatch) -> torch.Tensor:
        """Additive bias `[nb, b, b + w - 1]` over `_window_keys`: query j of a block sees rows
        j .. j + w - 1 of its block's keys, none before position 0. Shared by all layers."""
        key = ("swa", seq.offset)
        if key not in batch.memo:
            device = batch.positions.device
            b, nb = _block_shape(seq.length)
            j = torch.arange(b, device=device)[:, None]
            s = torch.arange(b + self.window - 1, device=device)[None, :]
            first = torch.arange(nb, device=device)[:, None, None] * b + seq.start - self.window + 1
            visible = (s >= j) & (s < j + self.window) & (first + s >= 0)  # first: position of row 0
            batch.memo[key] = torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))
        return batch.memo[key]

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Softmax over [keys | sink] per head for query blocks: `q [nb, b, H, D]`, `keys [nb, K, D]`,
        `bias [nb, b, K]`; returns `[nb * b, H, D]`."""
        nb, b, heads, dim = q.shape
        logits = torch.bmm(q.view(nb, b * heads, dim), keys.transpose(1, 2)).view(nb, b, heads, -1)
        logits = logits.mul_(self.scaling).add_(bias.to(q.dtype)[:, :, None, :])
        sinks = self.sinks.view(1, 1, -1, 1).expand(nb, b, -1, 1)
        logits = torch.cat([logits, sinks], dim=-1)  # sinks are fp32: promotes like HF
        # HF subtracts the row max first; softmax does exactly that itself (same values).
        probs = logits.softmax(dim=-1)[..., :-1].to(keys.dtype)
        return torch.bmm(probs.reshape(nb, b * heads, -1), keys).view(nb * b, heads, dim)


def _block_shape(n: int) -> tuple[int, int]:
    """(queries per block, blocks) for a chunk of n queries."""
    b = min(QUERY_BLOCK, n)
    return b, -(-n // b)


def _blocks(x: torch.Tensor, b: int) -> torch.Tensor:
    """Rows of `x` as blocks of b, `[nb, b, ...]`; the last block padded with zeros."""
    pad = -len(x) % b
    if pad:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    return x.view(len(x) // b, b, *x.shape[1:])


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
