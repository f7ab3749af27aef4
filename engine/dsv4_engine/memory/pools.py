"""The DSV4 token-to-KV pools: paged buffers per layer, page 0 a sentinel in each."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import STATE_TYPE_ORDER, Dsv4MemoryLayout, StateType
from .sizing import PoolSizes
from .state_copies import SNAPSHOT_ROWS, StateCopy


@dataclass(frozen=True)
class StateComponent:
    """One PD state type: its buffers as (pointer, byte length, bytes per page), in layer order."""

    state_type: StateType
    data_ptrs: list[int]
    data_lens: list[int]
    item_lens: list[int]


def _kv_pool(pages: int, rows: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Zeros everywhere: page 0 must be zero (the kernels' skip page) and the rest is overwritten.
    return torch.zeros((pages + 1, rows, width), dtype=dtype, device=device)


def _state_pool(pages: int, rows: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    buf = torch.zeros((pages + 1, rows, width), dtype=dtype, device=device)
    # Sentinel row semantics: kv = 0, score = -inf, so a missing (or block -1) row adds nothing.
    buf[0, :, width // 2 :] = float("-inf")
    return buf


class Dsv4TokenToKVPool:
    """Per-layer buffers for layers of each type only, all shaped [pages + 1, rows_per_page, width].

    swa_kv[layer]:          every layer, P rows of D           (SWA page ids)
    c4_kv[layer]:           ratio-4 layers, P/4 rows of D      (full page ids)
    indexer_kv[layer]:      ratio-4 layers, P/4 rows of Di     (full page ids)
    c128_kv[layer]:         ratio-128 layers, P/128 rows of D  (full page ids)
    c4_state[layer]:        ratio-4 layers, P rows of 4D fp32  (C4 state page ids)
    c4_index_state[layer]:  ratio-4 layers, P rows of 4Di fp32 (C4 state page ids)
    c128_state[layer]:      ratio-128 layers, P rows of 2D fp32 (C128 state page ids)

    and, not registered for PD (a snapshot never leaves its server), the prefix cache's snapshot slots:
    c4_state_snap[layer], c4_index_state_snap[layer]: ratio-4 layers, [slots + 1, 4, width] fp32
    """

    def __init__(
        self, layout: Dsv4MemoryLayout, sizes: PoolSizes, device: str | torch.device = "cpu"
    ) -> None:
        self.layout = layout
        self.sizes = sizes
        self.device = torch.device(device)
        p, d, di = layout.page_size, layout.head_dim, layout.index_head_dim
        kv, idx, st, dev = layout.kv_dtype, layout.resolved_index_dtype, layout.state_dtype, self.device
        self.swa_kv = {i: _kv_pool(sizes.swa_pages, p, d, kv, dev) for i in layout.swa_layers}
        self.c4_kv = {i: _kv_pool(sizes.full_pages, p // 4, d, kv, dev) for i in layout.c4_layers}
        self.c128_kv = {i: _kv_pool(sizes.full_pages, p // 128, d, kv, dev) for i in layout.c128_layers}
        self.indexer_kv = {i: _kv_pool(sizes.full_pages, p // 4, di, idx, dev) for i in layout.c4_layers}
        self.c4_state = {
            i: _state_pool(sizes.c4_state_pages, p, layout.c4_state_width, st, dev) for i in layout.c4_layers
        }
        self.c4_index_state = {
            i: _state_pool(sizes.c4_state_pages, p, layout.c4_index_state_width, st, dev)
            for i in layout.c4_layers
        }
        self.c128_state = {
            i: _state_pool(sizes.c128_state_pages, p, layout.c128_state_width, st, dev)
            for i in layout.c128_layers
        }
        n, rows = sizes.c4_snapshot_slots, SNAPSHOT_ROWS
        self.c4_state_snap = {
            i: _state_pool(n, rows, layout.c4_state_width, st, dev) for i in layout.c4_layers
        }
        self.c4_index_state_snap = {
            i: _state_pool(n, rows, layout.c4_index_state_width, st, dev) for i in layout.c4_layers
        }

    def apply_state_copies(self, copies: list[StateCopy]) -> None:
        """Run the allocator's queued C4 state copies (`Dsv4Allocator.take_state_copies`), before a
        forward. Saves go first: a queued restore holds its slot and a queued save its source page, so
        no restore writes what a save of the same batch reads, and no save writes a slot a restore
        reads unless it was queued before it."""
        for save in (True, False):
            group = [c for c in copies if c.save is save]
            if not group:
                continue
            slots = torch.tensor([c.slot for c in group], device=self.device)
            rows = torch.tensor([c.row + j for c in group for j in range(SNAPSHOT_ROWS)], device=self.device)
            for pages, snaps in (
                (self.c4_state, self.c4_state_snap),
                (self.c4_index_state, self.c4_index_state_snap),
            ):
                for layer, buf in pages.items():
                    flat, snap = buf.view(-1, buf.shape[-1]), snaps[layer]
                    if save:
                        snap[slots] = flat[rows].view(len(group), SNAPSHOT_ROWS, -1)
                    else:
                        flat[rows] = snap[slots].view(-1, buf.shape[-1])

    def buffers_by_type(self) -> dict[StateType, list[torch.Tensor]]:
        """Every registered buffer, grouped by PD state type, each group in layer order.

        C4_STATE bundles the attention compressors' state (all ratio-4 layers) followed by the
        indexer compressors' state (all ratio-4 layers).
        """
        return {
            StateType.SWA: list(self.swa_kv.values()),
            StateType.C4: list(self.c4_kv.values()),
            StateType.C128: list(self.c128_kv.values()),
            StateType.INDEXER: list(self.indexer_kv.values()),
            StateType.C4_STATE: [*self.c4_state.values(), *self.c4_index_state.values()],
            StateType.C128_STATE: list(self.c128_state.values()),
        }

    def pd_state_components(self) -> list[StateComponent]:
        """(pointer, length, item length) of every buffer, in STATE_TYPE_ORDER; empty types dropped.

        item length is one page of that buffer (buf[0].nbytes), so a PD transfer of page k of a
        buffer copies [ptr + k*item, ptr + (k+1)*item).
        """
        groups = self.buffers_by_type()
        out: list[StateComponent] = []
        for state_type in STATE_TYPE_ORDER:
            bufs = groups[state_type]
            if not bufs:
                continue
            out.append(
                StateComponent(
                    state_type=state_type,
                    data_ptrs=[b.data_ptr() for b in bufs],
                    data_lens=[b.nbytes for b in bufs],
                    item_lens=[b[0].nbytes for b in bufs],
                )
            )
        return out

    def page_bytes(self, state_type: StateType) -> int:
        """Bytes one page id costs across all buffers of a state type (0 if the type is empty)."""
        return sum(b[0].nbytes for b in self.buffers_by_type()[state_type])

    def total_bytes(self) -> int:
        snaps = [*self.c4_state_snap.values(), *self.c4_index_state_snap.values()]
        return sum(b.nbytes for bufs in self.buffers_by_type().values() for b in bufs) + sum(
            b.nbytes for b in snaps
        )
