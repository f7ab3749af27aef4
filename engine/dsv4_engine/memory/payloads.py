"""Per-state-type page lists for PD transfer (the seed's dsv4_state_payloads).

Prefill and decode call the same builder on their own request row; because both hold the same page
*positions* for a request of seq_len, the lists have equal length and pair up index by index (the
exact-index-match rule). Entries that name no page are 0 (the sentinel) on both sides and are skipped.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .layout import STATE_TYPE_ORDER, StateType
from .pools import Dsv4TokenToKVPool
from .req_to_token import Dsv4ReqPool
from .state_tail import cdiv, state_alloc_offset, swa_window_start


def _pages(table_row: torch.Tensor, lo: int, hi: int, rows_per_page: int) -> list[int]:
    """Page ids of the table entries in [lo, hi), one per page (slot // rows_per_page)."""
    if hi <= lo:
        return []
    first = (lo // rows_per_page) * rows_per_page
    return (table_row[first:hi:rows_per_page].to(torch.int64) // rows_per_page).tolist()


def _state_pages(table_row: torch.Tensor, ratio: int, seq_len: int, page_size: int) -> list[int]:
    # One entry per page of the whole prompt span; pages outside the state tail are sentinel 0 even
    # if the sender still holds them (its watermark may lag), so both sides agree.
    tail_lo = state_alloc_offset(ratio, seq_len)
    out = []
    for k in range(cdiv(seq_len, page_size)):
        in_tail = (k + 1) * page_size > tail_lo
        out.append(int(table_row[k * page_size]) // page_size if in_tail else 0)
    return out


def dsv4_state_payloads(
    kv_pool: Dsv4TokenToKVPool, req_pool: Dsv4ReqPool, req_idx: int, seq_len: int
) -> dict[StateType, Callable[[], list[int]]]:
    """Lazily built page lists per state type present in kv_pool, in STATE_TYPE_ORDER.

    SWA:            SWA pages of positions [floor((seq - window)/P)*P, seq)
    C4, INDEXER:    full pages of compressed rows [0, seq//4)
    C128:           full pages of compressed rows [0, seq//128)
    C4/C128_STATE:  state pages of every page of [0, seq); 0 outside the state tail
    """
    layout = kv_pool.layout
    p = layout.page_size
    swa_lo = swa_window_start(seq_len, layout.window, p)
    builders: dict[StateType, Callable[[], list[int]]] = {
        StateType.SWA: lambda: _pages(req_pool.req_to_token_swa[req_idx], swa_lo, seq_len, p),
        StateType.C4: lambda: _pages(req_pool.req_to_token_c4[req_idx], 0, seq_len // 4, p // 4),
        StateType.C128: lambda: _pages(req_pool.req_to_token_c128[req_idx], 0, seq_len // 128, p // 128),
        StateType.INDEXER: lambda: _pages(req_pool.req_to_token_c4[req_idx], 0, seq_len // 4, p // 4),
        StateType.C4_STATE: lambda: _state_pages(req_pool.req_to_token_c4_state[req_idx], 4, seq_len, p),
        StateType.C128_STATE: lambda: _state_pages(
            req_pool.req_to_token_c128_state[req_idx], 128, seq_len, p
        ),
    }
    present = {c.state_type for c in kv_pool.pd_state_components()}
    return {t: builders[t] for t in STATE_TYPE_ORDER if t in present}
