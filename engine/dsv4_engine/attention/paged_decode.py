"""The batched decode step's batch: one token per row, every row's state in the paged pools, driven
only by the static decode metadata of its bucket.

Every shape is fixed by the bucket (B rows) and the buffers (window W, page-table width), and nothing
reads a value back to the host (but an eager step's trimmed width), so the forward over it can be
compiled or captured. Padding rows (seq_len 0) compute garbage that is never kept: their pool writes go
to slot 0 of the sentinel page with the sentinel's own values (KV 0; state kv 0 / score -inf), so page
0 stays clean.

`DecodeBatch` answers the model's state questions (`model.batch.StepBatch`) with one op of the step's
kernel set each, over every row at once:
- `compress` (`KernelSet.compress_paged`): write the token's (kv, score) state row at
  `state_write_loc` (when `state_write_mask`), pool the open block's window (stored rows by
  `state_read_slots`, the token's own in its column) and write the compressed row at `block_loc`
  (when `block_mask`: the token completes a block);
- `index_topk` (`KernelSet.index_topk`): CSA's picks among the indexer rows j < visible, through the
  page table;
- `attend` (`masked_put`, `paged_attention`): write the token's K=V row at `out_swa_loc`, then softmax
  over [window by `swa_slots` | compressed rows (HCA: all visible; CSA: the picks) | sink].
Every pool is written before it is read, so a compiler updates the pools in place. The parameters
come from the modules; nothing here reads one.
"""

from __future__ import annotations

import torch

from ..kernels import KernelSet
from ..memory.pools import Dsv4TokenToKVPool
from ..model.packed import Packed
from .metadata import AttentionMetadata


def _flat(buf: torch.Tensor) -> torch.Tensor:
    return buf.view(-1, buf.shape[-1])


class PoolViews:
    """Flat `[slots, width]` views of every per-layer pool buffer (views share storage, so the
    pointers a captured graph holds stay the pools' own), and each layer's compress ratio."""

    def __init__(self, kv: Dsv4TokenToKVPool) -> None:
        self.page_size = kv.layout.page_size
        self.ratios = kv.layout.compress_ratios
        self.swa = {i: _flat(b) for i, b in kv.swa_kv.items()}
        self.c4 = {i: _flat(b) for i, b in kv.c4_kv.items()}
        self.c128 = {i: _flat(b) for i, b in kv.c128_kv.items()}
        self.indexer = {i: _flat(b) for i, b in kv.indexer_kv.items()}
        self.c4_state = {i: _flat(b) for i, b in kv.c4_state.items()}
        self.c4_index_state = {i: _flat(b) for i, b in kv.c4_index_state.items()}
        self.c128_state = {i: _flat(b) for i, b in kv.c128_state.items()}

    def compressor(self, layer: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(state pool, rows pool) of one of the layer's compressors ("compressor" or "indexer")."""
        if name == "indexer":
            return self.c4_index_state[layer], self.indexer[layer]
        if self.ratios[layer] == 4:
            return self.c4_state[layer], self.c4[layer]
        return self.c128_state[layer], self.c128[layer]


class DecodeBatch:
    """num_pages (eager only): the step's longest context in pages; compressed keys are then read from
    that many pages instead of the table's full width (the longest context the buffers allow), and
    compressors pool only the rows that complete a block (host reads).
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
        self.packs = packs
        self.sparse = num_pages is not None
        self.page_table = meta.page_table if num_pages is None else meta.page_table[:, :num_pages]
        self.memo: dict = {}  # RoPE lookups of the step, filled by the model

    @property
    def positions(self) -> torch.Tensor:
        return self.meta.positions

    def check_positions(self, max_positions: int) -> None:
        """Nothing to read back: the graph runner checks positions when it fills the inputs."""

    def attention_pack(self, layer: int) -> Packed | None:
        return self.packs[layer][0] if self.packs is not None else None

    def shared_pack(self, layer: int) -> Packed | None:
        return self.packs[layer][1] if self.packs is not None else None

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
    ) -> torch.Tensor:
        """The rows pool, the token's state and any completed row written."""
        cm = self.meta.c4 if position_bias.shape[0] == 4 else self.meta.c128
        assert cm is not None
        state, rows = self.pools.compressor(layer, name)
        self.kernels.compress_paged(
            kv, gate, position_bias, self.meta.positions, cm, cos, sin, norm_weight, norm_eps, state, rows,
            self.sparse,
        )  # fmt: skip
        return rows

    def index_topk(
        self, layer: int, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float, k: int
    ) -> torch.Tensor:
        """The picked compressed rows `[B, k]` (at or past visible: none)."""
        cm = self.meta.c4
        assert cm is not None
        return self.kernels.index_topk(
            q, weights, keys, self.page_table, cm.visible, cm.ratio, self.pools.page_size, scale, k
        )

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        kv: torch.Tensor,
        rows: torch.Tensor | None,
        picks: torch.Tensor | None,
        sinks: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        meta, pools, k = self.meta, self.pools, self.kernels
        swa = pools.swa[layer]
        k.masked_put(swa, meta.out_swa_loc, kv, meta.seq_lens > 0)
        ratio = pools.ratios[layer]
        cm = None if rows is None else meta.c4 if ratio == 4 else meta.c128
        visible = None if cm is None else cm.visible
        return k.paged_attention(
            q,
            swa,
            meta.swa_slots,
            rows,
            self.page_table,
            picks,
            visible,
            ratio,
            pools.page_size,
            sinks,
            scaling,
        )

    def advance(self) -> None:
        """The tables, not caches, say what is stored: nothing to advance."""
