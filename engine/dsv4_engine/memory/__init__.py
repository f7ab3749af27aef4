"""Paged DSV4 memory: pools, request tables, allocator, PD components and payloads."""

from .allocator import Dsv4Allocator
from .layout import STATE_TYPE_ORDER, Dsv4MemoryLayout, StateType
from .out_cache_loc import DSV4OutCacheLoc, ExtendSpec
from .page_pool import OutOfPages, PagePool
from .paged import PagedMemory
from .payloads import dsv4_state_payloads
from .pools import Dsv4TokenToKVPool, StateComponent
from .req_to_token import Dsv4DecodeReqToTokenPool, Dsv4ReqToTokenPool
from .sizing import PoolSizes, plan_pool_sizes

__all__ = [
    "STATE_TYPE_ORDER",
    "DSV4OutCacheLoc",
    "Dsv4Allocator",
    "Dsv4DecodeReqToTokenPool",
    "Dsv4MemoryLayout",
    "Dsv4ReqToTokenPool",
    "Dsv4TokenToKVPool",
    "ExtendSpec",
    "OutOfPages",
    "PagePool",
    "PagedMemory",
    "PoolSizes",
    "StateComponent",
    "StateType",
    "dsv4_state_payloads",
    "plan_pool_sizes",
]
