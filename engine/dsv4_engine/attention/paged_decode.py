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

The pool writes and steps 2-4 are ops of the step's kernel set (`masked_put`, `compress_paged`,
`index_topk`, `paged_attention`): the torch set's forms are what a compiler fuses and a device graph
captures; the CPU set runs them as loops over the pools in place (`kernels/attention.cpp`), ~40 fewer
dispatched ops a layer.
"""

from __future__ import annotations

import torch

from ..kernels import KernelSet
from ..memory.pools import Dsv4TokenToKVPool
from ..model.attention import Dsv4Attention
from ..model.compressor import Compressor
from ..model.packed import Packed, attention_inputs
from .metadata import AttentionMetadata, CompressMetadata


class DecodeBatch:
    """The batched decode step's batch for `Dsv4Model.forward` (model/batch.py): one token per row,
    everything read from the static metadata `meta` and the pools, every op on `kernels` (the engine's
    set's decode variant). Nothing here reads a value back to the host (but an eager step's
    `num_pages`), so the forward over it can be compiled or captured.

    num_pages (eager only): the step's longest context in pages (`paged_decode_attention`).
    packs: per layer, the packed attention-input and shared-expert projections (`model.packed`)."""

    def __init__(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        pools: PoolViews,
        kernels: KernelSet,
        num_pages: int | None = None,
        packs: list[tuple[Packed, Packed]] | None = None,
    ) -> None:
        self.input_ids, self.meta, self.pools, self.kernels = input_ids, meta, pools, kernels
        self.num_pages, self.packs = num_pages, packs
        self.memo: dict = {}  # RoPE lookups of the step, filled by the model

    @property
    def positions(self) -> torch.Tensor:
        return self.meta.positions

    def check_positions(self, max_positions: int) -> None:
        """Nothing to read back: the graph runner checks positions when it fills the inputs."""

    def attend(self, attn: Dsv4Attention, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.memo[id(attn.rope)]
        pack = self.packs[attn.layer][0] if self.packs is not None else None
        return paged_decode_attention(
            attn, x, self.meta, self.pools, cos, sin, self.kernels, self.num_pages, pack
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


def paged_decode_attention(
    attn: Dsv4Attention,
    x: torch.Tensor,
    meta: AttentionMetadata,
    pools: PoolViews,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k: KernelSet,
    num_pages: int | None = None,
    packed: Packed | None = None,
) -> torch.Tensor:
    """`Dsv4Attention.extend_attention` for one decode token per row `x [B, hidden]`, from the pools:
    `[B, H, D]`, RoPE undone (the module applies the output projections).

    packed: `attention_inputs(attn)` packed into one GEMM (`model.packed`); else one per projection.

    num_pages (eager only): the step's longest context in pages. Compressed keys are gathered from
    that many pages instead of the table's full width (the longest context the buffers allow), and
    block pooling runs only for rows that complete a block (host reads; `KernelSet.compress_paged`)."""
    layer, bsz = attn.layer, x.shape[0]
    projected = packed(x, k) if packed is not None else [m(x, k) for m in attention_inputs(attn)]
    q_residual = attn.q_a_norm(projected[0], k)
    q = attn.q_b_proj(q_residual, k).view(bsz, attn.num_heads, attn.head_dim)
    q = k.rope(k.head_rms_norm(q, attn.eps), cos, sin)
    kv = k.rope(attn.kv_norm(projected[1], k), cos, sin)
    k.masked_put(pools.swa[layer], meta.out_swa_loc, kv, meta.seq_lens > 0)

    comp, comp_pool, rows, visible = attn.compressor, None, None, None
    sparse = num_pages is not None
    page_table = meta.page_table if num_pages is None else meta.page_table[:, :num_pages]
    if comp is not None:
        c4 = attn.ratio == 4
        cm = meta.c4 if c4 else meta.c128
        comp_pool, state = (pools.c4, pools.c4_state) if c4 else (pools.c128, pools.c128_state)
        comp_pool, visible = comp_pool[layer], cm.visible
        _compress(k, comp, *projected[2:4], meta.positions, cm, state[layer], comp_pool, sparse)
        if c4:
            indexer = comp.indexer
            idx_kv, idx_gate, idx_w = projected[4:]
            index_pool = pools.indexer[layer]
            _compress(
                k,
                indexer,
                idx_kv,
                idx_gate,
                meta.positions,
                cm,
                pools.c4_index_state[layer],
                index_pool,
                sparse,
            )
            idx_q = indexer.q_b_proj(q_residual, k).view(bsz, indexer.num_heads, indexer.head_dim)
            idx_q = k.rope(idx_q, cos, sin)  # as Indexer.queries
            idx_w = indexer.head_weights(idx_w)
            rows = k.index_topk(
                idx_q, idx_w, index_pool, page_table, visible, indexer.ratio, pools.page_size,
                indexer.softmax_scale, indexer.topk,
            )  # fmt: skip

    out = k.paged_attention(
        q, pools.swa[layer], meta.swa_slots, comp_pool, page_table, rows, visible, attn.ratio,
        pools.page_size, attn.sinks, attn.scaling,
    )  # fmt: skip
    return k.rope(out, cos, sin, inverse=True)  # undo RoPE carried by V


def _compress(
    k: KernelSet,
    comp: Compressor,
    kv: torch.Tensor,
    gate: torch.Tensor,
    positions: torch.Tensor,
    cm: CompressMetadata,
    state: torch.Tensor,
    rows: torch.Tensor,
    sparse: bool,
) -> None:
    cos, sin = comp.rope.tables()
    norm = comp.kv_norm
    k.compress_paged(
        kv, gate, comp.position_bias, positions, cm, cos, sin, norm.weight, norm.eps, state, rows, sparse
    )
