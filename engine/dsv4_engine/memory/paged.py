"""One paged memory: the layout, the pools, the request tables and the allocator over them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .allocator import Dsv4Allocator
from .layout import Dsv4MemoryLayout
from .pools import Dsv4TokenToKVPool
from .req_to_token import Dsv4DecodeReqToTokenPool, Dsv4ReqToTokenPool
from .sizing import PoolSizes


@dataclass
class PagedMemory:
    layout: Dsv4MemoryLayout
    sizes: PoolSizes
    kv: Dsv4TokenToKVPool
    req_pool: Dsv4ReqToTokenPool  # read its tables; rows come and go through `allocator` only
    allocator: Dsv4Allocator

    @classmethod
    def build(
        cls,
        layout: Dsv4MemoryLayout,
        sizes: PoolSizes,
        max_reqs: int,
        max_ctx: int,
        device: str | torch.device = "cpu",
        *,
        pre_alloc_rows: int = 0,
        prefix_cache: bool = False,
    ) -> PagedMemory:
        """Pools of `sizes` on `device` and `max_reqs` request rows. On `meta` the pools are only sized
        (nothing allocated) while the tables stay on the host, where the allocator reads them.

        pre_alloc_rows > 0 builds a disaggregated decode server's pool: that many rows more, for
        requests pre-allocated while their KV is still arriving."""
        if pre_alloc_rows < 0:
            raise ValueError(f"pre_alloc_rows must be >= 0, got {pre_alloc_rows}")
        kv = Dsv4TokenToKVPool(layout, sizes, device)
        table_device = "cpu" if str(device) == "meta" else device
        req_pool = (
            Dsv4DecodeReqToTokenPool(max_reqs, max_ctx, table_device, pre_alloc_size=pre_alloc_rows)
            if pre_alloc_rows > 0
            else Dsv4ReqToTokenPool(max_reqs, max_ctx, table_device)
        )
        allocator = Dsv4Allocator(layout, sizes, req_pool, prefix_cache=prefix_cache)
        return cls(layout, sizes, kv, req_pool, allocator)
