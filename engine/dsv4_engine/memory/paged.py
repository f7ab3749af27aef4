"""One paged memory: the layout, the pools, the request tables and the allocator over them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .allocator import Dsv4Allocator
from .layout import Dsv4MemoryLayout
from .pools import Dsv4TokenToKVPool
from .req_to_token import Dsv4ReqToTokenPool
from .sizing import PoolSizes


@dataclass
class PagedMemory:
    layout: Dsv4MemoryLayout
    sizes: PoolSizes
    kv: Dsv4TokenToKVPool
    req_pool: Dsv4ReqToTokenPool
    allocator: Dsv4Allocator

    @classmethod
    def build(
        cls,
        layout: Dsv4MemoryLayout,
        sizes: PoolSizes,
        max_reqs: int,
        max_ctx: int,
        device: str | torch.device = "cpu",
    ) -> PagedMemory:
        """Pools of `sizes` on `device` and `max_reqs` request rows. On `meta` the pools are only sized
        (nothing allocated) while the tables stay on the host, where the allocator reads them."""
        kv = Dsv4TokenToKVPool(layout, sizes, device)
        req_pool = Dsv4ReqToTokenPool(max_reqs, max_ctx, "cpu" if str(device) == "meta" else device)
        return cls(layout, sizes, kv, req_pool, Dsv4Allocator(layout, sizes, req_pool))
