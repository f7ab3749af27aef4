"""The extend step's batch: new tokens of several requests (prefill chunks, any prefix; also the
reference decode the batched step is tested against), each request's state behind its `SeqCache`.

`ForwardBatch` answers the model's state questions (`model.batch.StepBatch`) one request at a time:
- `compress`: read the open blocks' state from the cache, write the new tokens' state, pool the
  blocks the chunk completes (`KernelSet.compress_blocks`) into the cache's rows, read them all;
- `index_topk`: the indexer's picks among those rows as an additive bias per query
  (`KernelSet.index_bias`);
- `attend`: the window keys (the cache's SWA rows before the chunk, then the chunk's own, written
  back) and the compressed rows, queries in blocks of `QUERY_BLOCK` (`KernelSet.block_attention`).
The parameters come from the modules; nothing here reads one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4_engine.kernels import KernelSet, choose_kernels
from dsv4_engine.model.cache import SeqCache
from dsv4_engine.model.packed import Packed

# Queries per block: a block of b queries attends to b + window - 1 window keys (those its
# queries can see) instead of the whole chunk's; blocks run as one batched product. On CPU
# (window 64, 128-token chunks) 32 beat 64 and unblocked chunks by ~10% and ~40% of the time.
QUERY_BLOCK = 32
NEG_INF = float("-inf")


@dataclass
class SeqSlice:
    """One request's new tokens: rows [offset, offset + length) of the batch, positions
    [start, start + length); `cache` holds positions [0, start)."""

    cache: SeqCache
    start: int
    length: int
    offset: int

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.length)


@dataclass(frozen=True)
class SeqRows:
    """`ForwardBatch.compress`'s answer: each request's compressed rows, at the compressor's ratio."""

    ratio: int
    rows: list[torch.Tensor]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    seqs: list[SeqSlice]
    kernels: KernelSet
    # Per-forward memo (RoPE lookups, masks shared by all layers), filled by the model and here.
    memo: dict = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        chunks: list[tuple[SeqCache, list[int]]],
        device: torch.device | str = "cpu",
        kernels: KernelSet | None = None,
    ) -> ForwardBatch:
        """A batch from (cache, new token ids) pairs; each chunk continues at `cache.num_tokens`.
        kernels: the engine's set (default: what an engine on `device` runs)."""
        seqs, ids, positions, offset = [], [], [], 0
        for cache, tokens in chunks:
            start = cache.num_tokens
            seqs.append(SeqSlice(cache=cache, start=start, length=len(tokens), offset=offset))
            ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            offset += len(tokens)
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            seqs=seqs,
            kernels=kernels or choose_kernels(device),
        )

    def check_positions(self, max_positions: int) -> None:
        if len(self.positions) and int(self.positions.max()) >= max_positions:
            raise ValueError(f"position {int(self.positions.max())} exceeds max_positions {max_positions}")

    def attention_pack(self, layer: int) -> Packed | None:
        return None  # the modules' own projections

    def shared_pack(self, layer: int) -> Packed | None:
        return None

    # ---- the model's state questions (model.batch.StepBatch) ----------------------------------------
    def compress(
        self,
        layer: int,
        name: str,
        kv: torch.Tensor,
        gate: torch.Tensor,
        position_bias: torch.Tensor,
        norm_weight: torch.Tensor,
        norm_eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> SeqRows:
        """Each request's compressed rows so far `[end // ratio, D]`, its new tokens folded in."""
        fold = (layer, name, position_bias, norm_weight, norm_eps, cos, sin, self.kernels)
        rows = [_fold(seq, kv[seq.rows], gate[seq.rows], *fold) for seq in self.seqs]
        return SeqRows(position_bias.shape[0], rows)

    def index_topk(
        self,
        layer: int,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: SeqRows,
        scale: float,
        k: int,
    ) -> list[torch.Tensor]:
        """Per request, an additive bias `[n, rows]` over its compressed rows: 0 where a query picked
        the row (among rows j < (t + 1) // ratio), else -inf."""
        biases = []
        for seq, rows in zip(self.seqs, keys.rows, strict=True):
            visible = (torch.arange(seq.start, seq.end, device=q.device) + 1) // keys.ratio
            biases.append(self.kernels.index_bias(q[seq.rows], weights[seq.rows], rows, visible, scale, k))
        return biases

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        kv: torch.Tensor,
        rows: SeqRows | None,
        picks: list[torch.Tensor] | None,
        sinks: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        out = q  # a request's output overwrites its queries once they are read
        for i, seq in enumerate(self.seqs):
            keys = _window_keys(seq, layer, kv[seq.rows])
            bias = self._window_bias(seq)
            if rows is not None:
                comp = rows.rows[i]
                comp_bias = picks[i] if picks is not None else self._causal_bias(seq, rows.ratio, len(comp))
                keys = torch.cat([keys, comp.expand(len(keys), -1, -1)], dim=1)
                bias = torch.cat([bias, _blocks(comp_bias.to(bias.dtype), bias.shape[1])], dim=2)
            blocks = _blocks(q[seq.rows], bias.shape[1])
            out[seq.rows] = self.kernels.block_attention(blocks, keys, bias, sinks, scaling)[: seq.length]
        return out

    def advance(self) -> None:
        """After the forward: every request's cache holds its new tokens too."""
        for seq in self.seqs:
            seq.cache.num_tokens = seq.end

    # ---- masks every layer shares ------------------------------------------------------------------
    def _window_bias(self, seq: SeqSlice) -> torch.Tensor:
        """Additive bias `[nb, b, b + w - 1]` over `_window_keys`: query j of a block sees rows
        j .. j + w - 1 of its block's keys, none before position 0."""
        key = ("swa", seq.offset)
        if key not in self.memo:
            device, window = self.positions.device, seq.cache.window
            b, nb = _block_shape(seq.length)
            j = torch.arange(b, device=device)[:, None]
            s = torch.arange(b + window - 1, device=device)[None, :]
            first = torch.arange(nb, device=device)[:, None, None] * b + seq.start - window + 1
            visible = (s >= j) & (s < j + window) & (first + s >= 0)  # first: position of row 0
            self.memo[key] = torch.zeros(visible.shape, device=device).masked_fill_(~visible, NEG_INF)
        return self.memo[key]

    def _causal_bias(self, seq: SeqSlice, ratio: int, num_rows: int) -> torch.Tensor:
        """HCA: query t sees compressed rows j < (t + 1) // ratio."""
        key = ("rows", seq.offset, ratio, num_rows)
        if key not in self.memo:
            device = self.positions.device
            visible = (torch.arange(seq.start, seq.end, device=device) + 1) // ratio
            future = torch.arange(num_rows, device=device)[None, :] >= visible[:, None]
            self.memo[key] = torch.zeros(future.shape, device=device).masked_fill(future, NEG_INF)
        return self.memo[key]


def _fold(
    seq: SeqSlice,
    kv: torch.Tensor,
    gate: torch.Tensor,
    layer: int,
    name: str,
    position_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kernels: KernelSet,
) -> torch.Tensor:
    """Fold one request's new tokens into its compressor state; all its compressed rows so far.

    Block b covers positions [b*r, (b+1)*r). At ratio 4 the projections are twice as wide: the second
    half belongs to the block itself and the first half to the next (overlap), so the open state
    reaches back one block further."""
    r, cache = position_bias.shape[0], seq.cache
    head_dim = norm_weight.shape[0]
    coff = position_bias.shape[1] // head_dim
    s, e = seq.start, seq.end
    positions = torch.arange(s, e, device=kv.device)
    score = gate + position_bias.index_select(0, positions % r)
    base = max(0, (s // r - (coff - 1)) * r)  # oldest position still needed
    if base < s:
        old_kv, old_score = cache.read_state(layer, name, base, s)
        all_kv, all_score = torch.cat([old_kv, kv]), torch.cat([old_score, score])
    else:
        all_kv, all_score = kv, score
    cache.write_state(layer, name, s, kv, score)

    first, last = s // r, e // r  # blocks completed by this slice: [first, last)
    if last > first:
        n_full = last * r - base
        blocks_kv = all_kv[:n_full].view(-1, r, all_kv.shape[-1])
        blocks_score = all_score[:n_full].view(-1, r, all_score.shape[-1])
        win_kv, win_score = _windows(blocks_kv, blocks_score, first, head_dim, coff)
        block_positions = torch.arange(first, last, device=kv.device) * r
        cos_b, sin_b = cos.index_select(0, block_positions), sin.index_select(0, block_positions)
        rows = kernels.compress_blocks(win_kv, win_score, norm_weight, norm_eps, cos_b, sin_b)
        cache.write_rows(layer, name, first, rows)
    if last == 0:
        return kv.new_zeros(0, head_dim)
    return cache.read_rows(layer, name, last)


def _windows(
    blocks_kv: torch.Tensor, blocks_score: torch.Tensor, first: int, d: int, coff: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pooling windows `[n_new, coff*r, D]` for the new blocks; `blocks_*` start at `base`."""
    if coff == 1:
        return blocks_kv, blocks_score
    cur_kv, cur_score = blocks_kv[..., d:], blocks_score[..., d:]
    prev_kv, prev_score = blocks_kv[..., :d], blocks_score[..., :d]
    if first == 0:  # block 0 borrows from nothing: zero kv, -inf score (softmax weight 0)
        pad_kv = prev_kv.new_zeros(1, *prev_kv.shape[1:])
        pad_score = prev_score.new_full((1, *prev_score.shape[1:]), NEG_INF)
        prev_kv, prev_score = torch.cat([pad_kv, prev_kv[:-1]]), torch.cat([pad_score, prev_score[:-1]])
    else:  # blocks start one before `first`: it only lends its first halves
        prev_kv, prev_score = prev_kv[:-1], prev_score[:-1]
        cur_kv, cur_score = cur_kv[1:], cur_score[1:]
    return torch.cat([prev_kv, cur_kv], dim=1), torch.cat([prev_score, cur_score], dim=1)


def _window_keys(seq: SeqSlice, layer: int, kv: torch.Tensor) -> torch.Tensor:
    """Window keys per query block, `[nb, b + w - 1, D]` (w: sliding window), as overlapping views of
    one buffer: block i's row s holds position start + i*b + s - w + 1, zero where that is before the
    window or past the chunk (`_window_bias` masks those). Writes the chunk's rows to the cache."""
    n, dim = kv.shape
    b, nb = _block_shape(n)
    window = seq.cache.window
    m = min(seq.start, window - 1)  # cached positions the chunk's queries see
    keys = kv.new_zeros(window - 1 + nb * b, dim)
    if m:
        keys[window - 1 - m : window - 1] = seq.cache.read_swa(layer, seq.start - m, seq.start)
    keys[window - 1 : window - 1 + n] = kv
    seq.cache.write_swa(layer, seq.start, kv)
    return keys.as_strided((nb, b + window - 1, dim), (b * dim, dim, 1))


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
