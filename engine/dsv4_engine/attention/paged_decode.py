"""Batched decode attention straight from the paged pools, driven only by static decode metadata.

One token per batch row; every shape is fixed by the bucket (B rows) and the buffers (window W,
page-table width), and nothing reads a value back to the host, so a graph backend can capture it.
Padding rows (seq_len 0) compute garbage that is never kept: their pool writes go to slot 0 of the
sentinel page with the sentinel's own values (KV 0; state kv 0 / score -inf), so page 0 stays clean.

Per layer, in this order. Every pool is written before it is read (reads of the token's own slots
substitute the fresh values), so a compiler updates the pools in place instead of copying them.
1. SWA: write the token's K=V row at `out_swa_loc`, gather the window by `swa_slots` (-1 masked).
2. Compressor (ratio 4 / 128), per row: write the token's (kv, score) state row at
   `state_write_loc` (when `state_write_mask`), gather the stored state of the open block(s) by
   `state_read_slots` and put the token's own row in its column, pool the window and write the
   compressed row at `block_loc` (when `block_mask`: the token completes a block).
3. Compressed keys: HCA attends to every row j < visible (gathered through `page_table`); CSA's
   indexer scores every indexer row j < visible and a stable sort (ties to the lower row) picks
   top-k, and only those k compressed rows are gathered.
4. Softmax over [window | compressed | sink] per head, as `Dsv4Attention._attend`.

The pool writes and steps 2-4 are the attention backend's (`attention.backends`): the torch
forms here (`compress_decode`, `index_topk`, `paged_attend`, backend first) are what a compiler
fuses and a device graph captures; the CPU-kernel backend runs them as loops over the pools in
place (`kernels/attention.cpp`), ~40 fewer dispatched ops a layer. The projections, norms and RoPE
around them are the modules' own, each choosing its kernel (`model.ops.KernelChoice`).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from ..memory.pools import Dsv4TokenToKVPool
from ..model.attention import Dsv4Attention
from ..model.compressor import Compressor, Indexer
from ..model.ops import unweighted_rms_norm
from ..model.packed import Packed, attention_inputs
from ..rope import rotate_rows
from .metadata import AttentionMetadata, CompressMetadata

NEG_INF = float("-inf")


class AttentionBackend(Protocol):
    """What `paged_decode_attention` leaves to its backend (`attention.backends`): the pool writes,
    the compressors' state update, the indexer's top-k and the attention itself."""

    def masked_put(
        self, pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor
    ) -> None: ...

    def attend(
        self, attn: Dsv4Attention, q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor: ...

    def compress(
        self,
        comp: Compressor,
        kv: torch.Tensor,
        gate: torch.Tensor,
        positions: torch.Tensor,
        cm: CompressMetadata,
        state: torch.Tensor,
        rows: torch.Tensor,
        sparse: bool,
    ) -> None: ...

    def index_topk(
        self,
        indexer: Indexer,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        page_table: torch.Tensor,
        visible: torch.Tensor,
        page_size: int,
    ) -> torch.Tensor: ...

    def paged_attend(
        self,
        attn: Dsv4Attention,
        q: torch.Tensor,
        swa: torch.Tensor,
        swa_slots: torch.Tensor,
        comp: torch.Tensor | None,
        page_table: torch.Tensor,
        rows: torch.Tensor | None,
        visible: torch.Tensor | None,
        page_size: int,
    ) -> torch.Tensor: ...


class DecodeBatch:
    """The batched decode step's batch for `Dsv4Model.forward` (model/batch.py): one token per row,
    everything read from the static metadata `meta` and the pools, attention by `backend`
    (`attention.backends`). Nothing here reads a value back to the host (but an eager step's
    `num_pages`), so the forward over it can be compiled or captured.

    num_pages (eager only): the step's longest context in pages (`paged_decode_attention`).
    packs: per layer, the packed attention-input and shared-expert projections (`model.packed`)."""

    def __init__(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        pools: PoolViews,
        backend: AttentionBackend,
        num_pages: int | None = None,
        packs: list[tuple[Packed, Packed]] | None = None,
    ) -> None:
        self.input_ids, self.meta, self.pools, self.backend = input_ids, meta, pools, backend
        self.num_pages, self.packs = num_pages, packs
        self.memo: dict = {}  # RoPE lookups of the step, filled by the model

    static = True  # one row per request at the bucket's size: the modules' static-shape forms

    @property
    def positions(self) -> torch.Tensor:
        return self.meta.positions

    def check_positions(self, max_positions: int) -> None:
        """Nothing to read back: the graph runner checks positions when it fills the inputs."""

    def attend(self, attn: Dsv4Attention, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.memo[id(attn.rope)]
        pack = self.packs[attn.layer][0] if self.packs is not None else None
        return paged_decode_attention(
            attn, x, self.meta, self.pools, cos, sin, self.backend, self.num_pages, pack
        )

    def shared_pack(self, layer: int) -> Packed | None:
        return self.packs[layer][1] if self.packs is not None else None

    def advance(self) -> None:
        """The tables, not caches, say what is stored: nothing to advance."""


def _flat(buf: torch.Tensor) -> torch.Tensor:
    return buf.view(-1, buf.shape[-1])


class PoolViews:
    """Flat `[slots, width]` views of every per-layer pool buffer (views share storage, so the
    pointers a captured graph holds stay the pools' own)."""

    def __init__(self, kv: Dsv4TokenToKVPool) -> None:
        self.page_size = kv.layout.page_size
        self.swa = {i: _flat(b) for i, b in kv.swa_kv.items()}
        self.c4 = {i: _flat(b) for i, b in kv.c4_kv.items()}
        self.c128 = {i: _flat(b) for i, b in kv.c128_kv.items()}
        self.indexer = {i: _flat(b) for i, b in kv.indexer_kv.items()}
        self.c4_state = {i: _flat(b) for i, b in kv.c4_state.items()}
        self.c4_index_state = {i: _flat(b) for i, b in kv.c4_index_state.items()}
        self.c128_state = {i: _flat(b) for i, b in kv.c128_state.items()}


def all_row_slots(page_table: torch.Tensor, ratio: int, page_size: int) -> torch.Tensor:
    """Slots `[B, N]` of compressed rows 0..N-1 of every request (N = pages * P / ratio)."""
    per_page = page_size // ratio
    j = torch.arange(page_table.shape[1] * per_page, device=page_table.device)
    return page_table.to(torch.int64)[:, j // per_page] * per_page + j % per_page


def gather_rows(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`pool[slots]` for a flat pool `[S, W]` and slots of any shape, as one `index_select` (advanced
    indexing is several times slower on CPU for these shapes)."""
    return pool.index_select(0, slots.reshape(-1)).view(*slots.shape, pool.shape[-1])


def compress_decode(
    backend: AttentionBackend,
    comp: Compressor,
    kv: torch.Tensor,
    gate: torch.Tensor,
    positions: torch.Tensor,
    cm: CompressMetadata,
    state: torch.Tensor,
    rows_pool: torch.Tensor,
    sparse: bool = False,
) -> None:
    """Advance one compressor by one token per row (`kv`, `gate`: its projections of the input,
    `[B, coff*D]`): state write and, where a block completes, its row.

    sparse: pool only the rows that complete a block (one in `ratio` per step on average; at ratio 128
    the static form gathers and softmaxes 128 state rows for every row, every step). It reads
    `block_mask` back to the host, so only the eager step may ask for it."""
    half = comp.coff * comp.head_dim
    score = gate + comp.position_bias.index_select(0, positions % comp.ratio)
    own = torch.cat([kv.to(state.dtype), score.to(state.dtype)], dim=-1)  # [B, 2*coff*D]
    # Write before read (so a compiler updates the pool in place instead of copying it): the token's
    # state row goes to its slot; masked rows rewrite the state sentinel (kv 0, score -inf) into slot 0.
    # The read below never sees it: columns at or after the token's position are slot 0 there.
    keep = cm.state_write_mask[:, None]
    sentinel_score = torch.full_like(own[:, half:], NEG_INF)
    masked = torch.cat(
        [torch.where(keep, own[:, :half], 0.0), torch.where(keep, own[:, half:], sentinel_score)], dim=-1
    )
    state.index_put_((torch.where(cm.state_write_mask, cm.state_write_loc, 0),), masked)
    if not sparse:
        row = _pool(comp, own, positions, cm.state_read_start, cm.state_read_slots, state, kv.dtype)
        cos, sin = comp.rope.lookup(cm.block_positions)
        backend.masked_put(rows_pool, cm.block_loc, rotate_rows(row, cos, sin), cm.block_mask)
        return
    done = cm.block_mask.nonzero().squeeze(1)
    if len(done):
        start, slots = cm.state_read_start[done], cm.state_read_slots[done]
        row = _pool(comp, own[done], positions[done], start, slots, state, kv.dtype)
        cos, sin = comp.rope.lookup(cm.block_positions[done])
        rows_pool.index_put_((cm.block_loc[done],), rotate_rows(row, cos, sin).to(rows_pool.dtype))


def _pool(
    comp: Compressor,
    own: torch.Tensor,
    positions: torch.Tensor,
    read_start: torch.Tensor,
    read_slots: torch.Tensor,
    state: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The normalised compressed row `[B, D]` each row's window pools (the token's own state row in
    its column, the stored rows elsewhere), before RoPE."""
    r, d, half = comp.ratio, comp.head_dim, comp.coff * comp.head_dim
    width = read_slots.shape[1]
    stored = gather_rows(state, read_slots)  # [B, width, 2*coff*D]; sentinel rows where not stored
    col = torch.arange(width, device=own.device)[None, :] == (positions - read_start)[:, None]
    window = torch.where(col[..., None], own[:, None, :], stored)
    if comp.coff == 2:  # row b pools block b-1's first halves and block b's second halves
        win_kv = torch.cat([window[:, :r, :d], window[:, r:, d:half]], dim=1)
        win_score = torch.cat([window[:, :r, half : half + d], window[:, r:, half + d :]], dim=1)
    else:
        win_kv, win_score = window[..., :half], window[..., half:]
    win_kv = win_kv.to(dtype)
    weights = win_score.to(dtype).softmax(dim=1, dtype=torch.float32).to(win_kv.dtype)
    return comp.kv_norm((win_kv * weights).sum(dim=1))


def _bias(visible: torch.Tensor) -> torch.Tensor:
    return torch.where(visible, 0.0, NEG_INF)


def paged_decode_attention(
    attn: Dsv4Attention,
    x: torch.Tensor,
    meta: AttentionMetadata,
    pools: PoolViews,
    cos: torch.Tensor,
    sin: torch.Tensor,
    backend: AttentionBackend,
    num_pages: int | None = None,
    packed: Packed | None = None,
) -> torch.Tensor:
    """`Dsv4Attention.extend_attention` for one decode token per row `x [B, hidden]`, from the pools:
    `[B, H, D]`, RoPE undone (the module applies the output projections).

    packed: `attention_inputs(attn)` packed into one GEMM (`model.packed`); else one per projection.

    num_pages (eager only): the step's longest context in pages. Compressed keys are gathered from
    that many pages instead of the table's full width (the longest context the buffers allow), and
    block pooling runs only for rows that complete a block (host reads; see `compress_decode`)."""
    layer, bsz = attn.layer, x.shape[0]
    if packed is not None:
        projected = packed(x, attn.kernel_for(x, opaque=True, loops=False))
    else:
        projected = [m(x) for m in attention_inputs(attn)]
    loops = attn.kernel_for(x)  # RoPE and the unit norm as one-dispatch kernels, or None
    q_residual = attn.q_a_norm(projected[0])
    q = attn.q_b_proj(q_residual).view(bsz, attn.num_heads, attn.head_dim)
    q = rotate_rows(unweighted_rms_norm(q, attn.eps, loops), cos, sin, kernels=loops)
    kv = rotate_rows(attn.kv_norm(projected[1]), cos, sin, kernels=loops)
    backend.masked_put(pools.swa[layer], meta.out_swa_loc, kv, meta.seq_lens > 0)

    comp, comp_pool, rows, visible = attn.compressor, None, None, None
    sparse = num_pages is not None
    page_table = meta.page_table if num_pages is None else meta.page_table[:, :num_pages]
    if comp is not None:
        c4 = attn.ratio == 4
        cm = meta.c4 if c4 else meta.c128
        comp_pool, state = (pools.c4, pools.c4_state) if c4 else (pools.c128, pools.c128_state)
        comp_pool, visible = comp_pool[layer], cm.visible
        backend.compress(comp, *projected[2:4], meta.positions, cm, state[layer], comp_pool, sparse)
        if c4:
            indexer = comp.indexer
            idx_kv, idx_gate, idx_w = projected[4:]
            index_pool = pools.indexer[layer]
            backend.compress(
                indexer, idx_kv, idx_gate, meta.positions, cm, pools.c4_index_state[layer], index_pool, sparse
            )
            idx_q = indexer.q_b_proj(q_residual).view(bsz, indexer.num_heads, indexer.head_dim)
            idx_q = rotate_rows(idx_q, cos, sin, kernels=loops)  # as Indexer.queries
            idx_w = indexer.head_weights(idx_w)
            rows = backend.index_topk(indexer, idx_q, idx_w, index_pool, page_table, visible, pools.page_size)

    out = backend.paged_attend(
        attn, q, pools.swa[layer], meta.swa_slots, comp_pool, page_table, rows, visible, pools.page_size
    )
    return rotate_rows(out, cos, sin, inverse=True, kernels=loops)  # undo RoPE carried by V


def index_topk(
    backend: AttentionBackend,
    indexer: Indexer,
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    page_table: torch.Tensor,
    visible: torch.Tensor,
    page_size: int,
) -> torch.Tensor:
    """The compressed rows `[B, k]` each row's indexer picks: top-k of `sum_h w_h * relu(q_h . key_j)`
    over every indexer row of the table (rows j >= visible score -inf); `q [B, H, Di]` rotated,
    `weights [B, H]` (fp32). Picks at or past `visible` (fewer visible rows than k) are not rows."""
    slots = all_row_slots(page_table, indexer.ratio, page_size)  # [B, N]
    idx_keys = gather_rows(keys, slots).float()  # [B, N, Di]
    scores = F.relu(torch.matmul(q.float(), idx_keys.transpose(1, 2))) * indexer.softmax_scale
    scores = (scores * weights[:, :, None]).sum(dim=1)  # [B, N]
    rows = torch.arange(slots.shape[1], device=q.device)[None, :]
    scores = scores.masked_fill(rows >= visible[:, None], NEG_INF)
    return _stable_topk(scores, min(indexer.topk, slots.shape[1]), torch.compiler.is_compiling())


def paged_attend(
    backend: AttentionBackend,
    attn: Dsv4Attention,
    q: torch.Tensor,
    swa: torch.Tensor,
    swa_slots: torch.Tensor,
    comp_pool: torch.Tensor | None,
    page_table: torch.Tensor,
    rows: torch.Tensor | None,
    visible: torch.Tensor | None,
    page_size: int,
) -> torch.Tensor:
    """Softmax over [window | compressed | sink] per head, `q [B, H, D]` -> `[B, H, D]`: the window
    `swa[swa_slots]` (-1 masked) and, with a compressor, compressed rows `rows [B, k]` (CSA's picks)
    or every row (HCA), through the page table, those at or past `visible` masked."""
    keys = gather_rows(swa, swa_slots.clamp(min=0)).to(q.dtype)  # [B, W, D], oldest first
    bias = _bias(swa_slots >= 0)
    if comp_pool is not None and visible is not None:
        slots = all_row_slots(page_table, attn.ratio, page_size)  # [B, N]
        if rows is None:
            comp_keys = gather_rows(comp_pool, slots)
            rows = torch.arange(slots.shape[1], device=q.device)[None, :]
        else:
            comp_keys = gather_rows(comp_pool, slots.gather(1, rows))
        keys = torch.cat([keys, comp_keys.to(keys.dtype)], dim=1)
        bias = torch.cat([bias, _bias(rows < visible[:, None])], dim=1)
    return backend.attend(attn, q, keys, bias)


def _stable_topk(scores: torch.Tensor, k: int, by_keys: bool) -> torch.Tensor:
    """Indices of the k largest fp32 scores per row, ties to the lower index (`ops.stable_topk`).

    by_keys: one `topk` over unique int64 keys (order-preserving integer image of the float, then
    the reversed index) instead of a stable sort, which is an order of magnitude slower on small
    rows here; the same indices (-0.0 is folded into +0.0 first: they tie in the float order).
    """
    if not by_keys:
        return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    n = scores.shape[-1]
    bits = (scores.float() + 0.0).view(torch.int32).to(torch.int64)
    order = torch.where(bits >= 0, bits, -(bits & 0x7FFFFFFF))  # monotone in the float value
    rev = n - 1 - torch.arange(n, device=scores.device)
    return torch.topk(order * n + rev, k, dim=-1).indices
