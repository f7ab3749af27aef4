"""Pool sizes from a budget: the formula agrees with the buffers the pools actually allocate."""

from __future__ import annotations

import pytest
import torch

from dsv4_engine.memory import Dsv4MemoryLayout, Dsv4TokenToKVPool, StateType, plan_pool_sizes
from dsv4_engine.memory.sizing import (
    SLOTS_PER_SNAPSHOT,
    c4_slot_bytes,
    c4_state_page_bytes,
    c128_state_page_bytes,
    full_page_bytes,
    swa_page_bytes,
    table_bytes,
)


@pytest.mark.parametrize("page_size", [128, 256])
def test_page_bytes_formula_matches_buffers(page_size: int) -> None:
    layout = Dsv4MemoryLayout((0, 4, 128, 4), head_dim=16, index_head_dim=8, window=32, page_size=page_size)
    kv = Dsv4TokenToKVPool(
        layout, plan_pool_sizes(layout, 64 << 20, max_reqs=2, max_ctx=1024, max_batched_tokens=256)
    )
    assert kv.page_bytes(StateType.C4) + kv.page_bytes(StateType.INDEXER) + kv.page_bytes(
        StateType.C128
    ) == full_page_bytes(layout)
    assert kv.page_bytes(StateType.SWA) == swa_page_bytes(layout)
    assert kv.page_bytes(StateType.C4_STATE) == c4_state_page_bytes(layout)
    assert kv.page_bytes(StateType.C128_STATE) == c128_state_page_bytes(layout)


def test_budget_is_respected_and_fills_full_pages() -> None:
    layout = Dsv4MemoryLayout(
        (0, 4, 128, 0), head_dim=16, index_head_dim=8, window=32, kv_dtype=torch.float32
    )
    budget = 8 << 20
    kw = {"max_reqs": 4, "max_ctx": 2048, "max_batched_tokens": 512}
    sizes = plan_pool_sizes(layout, budget, snapshots=4, **kw)
    kv = Dsv4TokenToKVPool(layout, sizes)
    used = kv.total_bytes() + table_bytes(4, 2048)
    assert used <= budget < used + full_page_bytes(layout)  # leftover is less than one full page
    assert sizes.swa_pages == 4 * (1 + 2) + 4 + 4  # ceil(32/128) + 2 per request, + 512/128 in flight
    # + a window per snapshot; a snapshot's C4 state is a 4-row slot, not a state page
    assert sizes.c4_state_pages == 4 * 2 + 2 * 4 and sizes.c128_state_pages == 4 * 3 + 2 * 4
    # SLOTS_PER_SNAPSHOT slots per snapshot the SWA pool keeps room for
    assert sizes.c4_snapshot_slots == 4 * SLOTS_PER_SNAPSHOT
    assert c4_slot_bytes(layout) * 128 == 4 * c4_state_page_bytes(layout)
    without = plan_pool_sizes(layout, budget, **kw)  # the slots cost what only a few rows do
    spent = (without.full_pages - sizes.full_pages) * full_page_bytes(layout)
    want = 4 * (swa_page_bytes(layout) + SLOTS_PER_SNAPSHOT * c4_slot_bytes(layout))
    assert abs(spent - want) < full_page_bytes(layout)


def test_budget_too_small_names_the_numbers() -> None:
    layout = Dsv4MemoryLayout((0, 4), head_dim=16, index_head_dim=8, window=32)
    with pytest.raises(ValueError, match="needs 16"):
        plan_pool_sizes(layout, 300_000, max_reqs=1, max_ctx=2048, max_batched_tokens=128)


def test_layout_rejects_bad_page_size_and_reads_hf_config() -> None:
    with pytest.raises(ValueError, match="multiple of 128"):
        Dsv4MemoryLayout((0,), head_dim=8, index_head_dim=4, window=16, page_size=64)
    hf = {"num_hidden_layers": 3, "compress_ratios": [0, 4, 128, 4], "head_dim": 64, "index_head_dim": 32,
          "sliding_window": 16}  # fmt: skip
    layout = Dsv4MemoryLayout.from_config(hf, page_size=256)
    assert layout.compress_ratios == (0, 4, 128)  # the MTP entry is dropped
    assert layout.c4_layers == (1,) and layout.c128_layers == (2,) and layout.window == 16


def test_layout_description_names_what_pd_peers_must_share() -> None:
    a = Dsv4MemoryLayout((0, 4, 128), head_dim=16, index_head_dim=8, window=32, page_size=128)
    b = Dsv4MemoryLayout((0, 4, 128), head_dim=16, index_head_dim=8, window=32, page_size=256)
    c = Dsv4MemoryLayout(
        (0, 4, 128), head_dim=16, index_head_dim=8, window=32, index_dtype=torch.float8_e4m3fn
    )
    assert a.describe()["page_size"] == 128 and a.describe()["index_dtype"] == "torch.bfloat16"
    assert {k for k in a.describe() if a.describe()[k] != b.describe()[k]} == {"page_size"}
    assert {k for k in a.describe() if a.describe()[k] != c.describe()[k]} == {"index_dtype"}
