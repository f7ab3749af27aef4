"""Pool sizes from a memory budget.

Four page families share one page size P (a multiple of 128); page 0 of each is a sentinel:

- full pages: one id addresses the same page in the C4 KV, indexer KV and C128 KV pools
  (P/4, P/4 and P/128 rows). A request holds ceil(seq_len / P) of them for its whole life.
- SWA pages (P rows, every layer): a request holds the pages of its window plus the step in flight.
- C4 / C128 state pages (P rows of fp32 [kv | score]): a request holds only its state tail.

    bytes/full page  = P * sum_{c4 layers}(D + Di) * kv_bytes / 4  (+ index dtype for Di)
                     + P * sum_{c128 layers} D * kv_bytes / 128
    bytes/SWA page   = P * num_layers * D * kv_bytes
    bytes/C4 state   = P * n_c4 * (4D + 4Di) * 4
    bytes/C128 state = P * n_c128 * 2D * 4
    bytes/C4 slot    = 4 * n_c4 * (4D + 4Di) * 4

    swa_pages        = max_reqs * (ceil(window / P) + 2) + ceil(max_batched_tokens / P)
                       + snapshots * ceil(window / P)
    c4_state_pages   = max_reqs * state_pages_per_req(4)   + 2 * max_prefill_reqs
    c128_state_pages = max_reqs * state_pages_per_req(128) + 2 * max_prefill_reqs
    c4_slots         = SLOTS_PER_SNAPSHOT * snapshots
    full_pages       = floor((budget - swa, state, slot bytes - table bytes) / bytes per full page)

state_pages_per_req(r) = max(2, ceil(1.8 r / P) + 1) is the seed's; a request in chunked prefill can
briefly hold two more (its previous tail and the new one), hence the prefill slack.

`snapshots` is how many prefix-cache snapshots the pools keep room for beyond the running requests'
share (prefix_cache.py): each holds the SWA pages of one window and one C4 slot, the 4 state rows
of the block before a page boundary (C128 has none at a multiple of 128). There are
SLOTS_PER_SNAPSHOT times as many slots: a slot is small (0.86 MB on V4-Flash, against 5.6 MB for a
window of SWA pages), and the SWA pages of the snapshots beyond the reserved ones come from what
running requests leave free (evicted, least recently used first, when they need it back). A chat
turn leaves two snapshots (where its prompt leaves the cached history, and its last page
boundary), so with slots only for `snapshots` a burst of returning conversations (after a restart
that imported them, docs/memory.md) found most evicted by the first few.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .layout import Dsv4MemoryLayout
from .state_copies import SNAPSHOT_ROWS
from .state_tail import cdiv

SLOTS_PER_SNAPSHOT = 4  # C4 snapshot slots per snapshot the SWA pool keeps room for (above)


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


@dataclass(frozen=True)
class PoolSizes:
    """Usable pages per family (the sentinel page 0 comes on top)."""

    full_pages: int
    swa_pages: int
    c4_state_pages: int
    c128_state_pages: int
    c4_snapshot_slots: int = 0  # prefix-cache snapshots' C4 state rows (state_copies.py), 4 rows each


def full_page_bytes(layout: Dsv4MemoryLayout) -> int:
    p, d, di = layout.page_size, layout.head_dim, layout.index_head_dim
    kv_b, idx_b = dtype_bytes(layout.kv_dtype), dtype_bytes(layout.resolved_index_dtype)
    c4 = len(layout.c4_layers) * (p // 4) * (d * kv_b + di * idx_b)
    c128 = len(layout.c128_layers) * (p // 128) * d * kv_b
    return c4 + c128


def swa_page_bytes(layout: Dsv4MemoryLayout) -> int:
    return layout.page_size * layout.num_layers * layout.head_dim * dtype_bytes(layout.kv_dtype)


def c4_state_page_bytes(layout: Dsv4MemoryLayout) -> int:
    width = layout.c4_state_width + layout.c4_index_state_width
    return layout.page_size * len(layout.c4_layers) * width * dtype_bytes(layout.state_dtype)


def c128_state_page_bytes(layout: Dsv4MemoryLayout) -> int:
    return (
        layout.page_size * len(layout.c128_layers) * layout.c128_state_width * dtype_bytes(layout.state_dtype)
    )


def c4_slot_bytes(layout: Dsv4MemoryLayout) -> int:
    """One snapshot's C4 state: the 4 rows of one block, every ratio-4 layer (attention + indexer)."""
    width = layout.c4_state_width + layout.c4_index_state_width
    return SNAPSHOT_ROWS * len(layout.c4_layers) * width * dtype_bytes(layout.state_dtype)


def state_pages_per_req(ratio: int, page_size: int) -> int:
    return max(2, cdiv(18 * ratio, 10 * page_size) + 1)  # ceil(1.8 r / P) in integers


def swa_pages_per_req(window: int, page_size: int) -> int:
    return cdiv(window, page_size) + 2


def table_bytes(max_reqs: int, max_ctx: int) -> int:
    """int32 request tables: full + swa + c4_state + c128_state (max_ctx) + c4 (/4) + c128 (/128)."""
    return 4 * max_reqs * (4 * max_ctx + max_ctx // 4 + max_ctx // 128)


def fixed_pool_sizes(
    layout: Dsv4MemoryLayout,
    full_pages: int,
    *,
    max_reqs: int,
    max_batched_tokens: int,
    max_prefill_reqs: int | None = None,
    snapshots: int = 0,
) -> PoolSizes:
    """The SWA and state families by the formula above, with full_pages given."""
    p = layout.page_size
    prefill_reqs = max_reqs if max_prefill_reqs is None else max_prefill_reqs
    swa = max_reqs * swa_pages_per_req(layout.window, p) + cdiv(max_batched_tokens, p)
    swa += snapshots * cdiv(layout.window, p)
    c4s = (max_reqs * state_pages_per_req(4, p) + 2 * prefill_reqs) if layout.c4_layers else 0
    c128s = (max_reqs * state_pages_per_req(128, p) + 2 * prefill_reqs) if layout.c128_layers else 0
    slots = SLOTS_PER_SNAPSHOT * snapshots if layout.c4_layers else 0
    return PoolSizes(full_pages, swa, c4s, c128s, slots)


def pool_bytes(layout: Dsv4MemoryLayout, sizes: PoolSizes) -> int:
    """Bytes the pools of `sizes` take, sentinel pages included (request tables excluded)."""
    return (
        (sizes.full_pages + 1) * full_page_bytes(layout)
        + (sizes.swa_pages + 1) * swa_page_bytes(layout)
        + (sizes.c4_state_pages + 1) * c4_state_page_bytes(layout)
        + (sizes.c128_state_pages + 1) * c128_state_page_bytes(layout)
        + (sizes.c4_snapshot_slots + 1) * c4_slot_bytes(layout)
    )


def plan_pool_sizes(
    layout: Dsv4MemoryLayout,
    budget_bytes: int,
    *,
    max_reqs: int,
    max_ctx: int,
    max_batched_tokens: int,
    max_prefill_reqs: int | None = None,
    snapshots: int = 0,
) -> PoolSizes:
    """Split budget_bytes between the four families (formula in the module docstring)."""
    p = layout.page_size
    fixed_sizes = fixed_pool_sizes(
        layout,
        0,
        max_reqs=max_reqs,
        max_batched_tokens=max_batched_tokens,
        max_prefill_reqs=max_prefill_reqs,
        snapshots=snapshots,
    )
    per_full = full_page_bytes(layout)
    fixed = pool_bytes(layout, fixed_sizes) - per_full + table_bytes(max_reqs, max_ctx)
    # A model without compressed layers: full pages cost nothing, give every request max_ctx.
    full = max_reqs * cdiv(max_ctx, p) if per_full == 0 else (budget_bytes - fixed) // per_full - 1
    if full < cdiv(max_ctx, p):
        raise ValueError(
            f"budget {budget_bytes} B leaves {max(full, 0)} full pages; one request of max_ctx={max_ctx} "
            f"needs {cdiv(max_ctx, p)} (fixed part {fixed} B, {per_full} B per full page)"
        )
    return dataclasses.replace(fixed_sizes, full_pages=full)
