"""The DSV4 token-to-KV pools: a paged buffer per pool family, its layers interleaved, page 0 a sentinel."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import STATE_TYPE_ORDER, Dsv4MemoryLayout, StateType
from .sizing import PoolSizes


@dataclass(frozen=True)
class StateComponent:
    """One PD state type: its buffers as (pointer, byte length, bytes per page across their layers)."""

    state_type: StateType
    data_ptrs: list[int]
    data_lens: list[int]
    item_lens: list[int]


def _family(
    pages: int,
    rows: int,
    layers: tuple[int, ...],
    width: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    state: bool = False,
) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
    """One pool family: its buffer [pages + 1, rows, layers, width] (none without layers) and each
    layer's view of it, [pages + 1, rows, width].

    Zeros everywhere: page 0 must be zero (the kernels' skip page) and the rest is overwritten. A state
    family's sentinel rows are kv = 0, score = -inf, so a missing (or block -1) row adds nothing."""
    if not layers:
        return [], {}
    buf = torch.zeros((pages + 1, rows, len(layers), width), dtype=dtype, device=device)
    if state:
        buf[0, :, :, width // 2 :] = float("-inf")
    return [buf], {layer: buf[:, :, k] for k, layer in enumerate(layers)}


class Dsv4TokenToKVPool:
    """The pools, one buffer per family shared by the layers of its type, their rows interleaved.

    Each layer sees its pool as a view shaped [pages + 1, rows_per_page, width]:

    swa_kv[layer]:          every layer, P rows of D           (SWA page ids)
    c4_kv[layer]:           ratio-4 layers, P/4 rows of D      (full page ids)
    indexer_kv[layer]:      ratio-4 layers, P/4 rows of Di     (full page ids)
    c128_kv[layer]:         ratio-128 layers, P/128 rows of D  (full page ids)
    c4_state[layer]:        ratio-4 layers, P rows of 4D fp32  (C4 state page ids)
    c4_index_state[layer]:  ratio-4 layers, P rows of 4Di fp32 (C4 state page ids)
    c128_state[layer]:      ratio-128 layers, P rows of 2D fp32 (C128 state page ids)

    Why interleaved: a PD transfer moves pages, and Mooncake pays per entry (~20-40 us over TCP,
    whatever its size). With a buffer per layer a run of pages is an entry per layer (23 for a
    4096-token request on the small preset's fresh pools); here a page of every layer is one
    contiguous block ([rows, layers, width]), so a run is one entry per family (6 there: that request
    has no C128 state to move). Slot arithmetic does not change: slot s of a layer is row s of its
    view, which is `[slots, width]` with a row stride of
    layers * width, and each row is still contiguous for the kernels.
    """

    def __init__(
        self, layout: Dsv4MemoryLayout, sizes: PoolSizes, device: str | torch.device = "cpu"
    ) -> None:
        self.layout = layout
        self.sizes = sizes
        self.device = torch.device(device)
        p, d, di = layout.page_size, layout.head_dim, layout.index_head_dim
        kv, idx, st, dev = layout.kv_dtype, layout.resolved_index_dtype, layout.state_dtype, self.device
        c4, c128 = layout.c4_layers, layout.c128_layers
        swa, self.swa_kv = _family(sizes.swa_pages, p, layout.swa_layers, d, kv, dev)
        c4_kv, self.c4_kv = _family(sizes.full_pages, p // 4, c4, d, kv, dev)
        c128_kv, self.c128_kv = _family(sizes.full_pages, p // 128, c128, d, kv, dev)
        indexer, self.indexer_kv = _family(sizes.full_pages, p // 4, c4, di, idx, dev)
        c4s, self.c4_state = _family(sizes.c4_state_pages, p, c4, layout.c4_state_width, st, dev, state=True)
        c4is, self.c4_index_state = _family(
            sizes.c4_state_pages, p, c4, layout.c4_index_state_width, st, dev, state=True
        )
        c128s, self.c128_state = _family(
            sizes.c128_state_pages, p, c128, layout.c128_state_width, st, dev, state=True
        )
        self._by_type: dict[StateType, list[torch.Tensor]] = {
            StateType.SWA: swa,
            StateType.C4: c4_kv,
            StateType.C128: c128_kv,
            StateType.INDEXER: indexer,
            StateType.C4_STATE: [*c4s, *c4is],
            StateType.C128_STATE: c128s,
        }

    def buffers_by_type(self) -> dict[StateType, list[torch.Tensor]]:
        """Every registered buffer (a family's, all its layers), grouped by PD state type.

        Page k of a buffer, buf[k], is that page of every layer of the family. C4_STATE bundles the
        attention compressors' state followed by the indexer compressors' state.
        """
        return {t: list(bufs) for t, bufs in self._by_type.items()}

    def pd_state_components(self) -> list[StateComponent]:
        """(pointer, length, item length) of every buffer, in STATE_TYPE_ORDER; empty types dropped.

        item length is one page of that buffer across its layers (buf[0].nbytes), so a PD transfer of
        page k of a buffer copies [ptr + k*item, ptr + (k+1)*item).
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
        return sum(b.nbytes for bufs in self.buffers_by_type().values() for b in bufs)
