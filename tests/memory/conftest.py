"""Fixtures for the paged-memory tests: a small layout with every layer type and a memory factory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from dsv4_engine.memory import (
    Dsv4Allocator,
    Dsv4MemoryLayout,
    Dsv4ReqToTokenPool,
    Dsv4TokenToKVPool,
    PagedMemory,
    PoolSizes,
)


@dataclass
class Mem:
    layout: Dsv4MemoryLayout
    sizes: PoolSizes
    kv: Dsv4TokenToKVPool
    req_pool: Dsv4ReqToTokenPool  # or its subclass Dsv4DecodeReqToTokenPool
    alloc: Dsv4Allocator


def small_layout(
    page_size: int = 128, window: int = 16, ratios: tuple[int, ...] = (0, 4, 128, 0)
) -> Dsv4MemoryLayout:
    return Dsv4MemoryLayout(
        compress_ratios=ratios, head_dim=8, index_head_dim=4, window=window, page_size=page_size,
        kv_dtype=torch.float32,
    )  # fmt: skip


@pytest.fixture
def make_mem() -> Callable[..., Mem]:
    def make(
        *,
        page_size: int = 128,
        window: int = 16,
        ratios: tuple[int, ...] = (0, 4, 128, 0),
        full_pages: int = 40,
        swa_pages: int = 16,
        state_pages: int = 12,
        max_reqs: int = 4,
        max_ctx: int = 2048,
        decode: bool = False,
        prefix_cache: bool = False,
        snapshot_slots: int = 8,
    ) -> Mem:
        layout = small_layout(page_size, window, ratios)
        sizes = PoolSizes(full_pages, swa_pages, state_pages, state_pages, snapshot_slots)
        # decode: a disaggregated decode server's memory, 2 extra rows for in-transfer requests.
        mem = PagedMemory.build(
            layout, sizes, max_reqs, max_ctx, pre_alloc_rows=2 if decode else 0, prefix_cache=prefix_cache
        )
        return Mem(layout, sizes, mem.kv, mem.req_pool, mem.allocator)

    return make
