"""The model's SeqCache protocol over the paged pools: positions translate through the request tables.

The engine allocates each step before the forward (Dsv4Allocator.alloc_extend with prefix_len =
cache.num_tokens); the model then reads and writes exactly what the dense cache would give it:
- SWA rows of the window (released pages are never asked for),
- compressor / indexer state rows of the open blocks (the state tail); rows written for positions
  outside the new tail are dropped, as the dense cache drops rows that fall out of its ring,
- compressed rows by index (one page id per block of P raw positions in every compressed pool).
free() is the allocator's one free path for the cache's row (an engine driven by the Scheduler lets
the scheduler free rows and never calls it).
"""

from __future__ import annotations

import torch

from .allocator import Dsv4Allocator
from .pools import Dsv4TokenToKVPool
from .state_tail import state_alloc_offset


class PagedSeqCache:
    def __init__(
        self,
        kv_pool: Dsv4TokenToKVPool,
        allocator: Dsv4Allocator,
        req_idx: int,
        state_dtypes: tuple[torch.dtype, torch.dtype] | None = None,
    ) -> None:
        """state_dtypes: (kv, score) dtypes state reads return before this cache wrote any state
        (a PD decode request whose state arrived by transfer); default: the pool's KV dtype."""
        self.kv = kv_pool
        self.allocator = allocator
        self.req_pool = allocator.req_pool
        self.req_idx = req_idx
        self.num_tokens = 0
        self._ratios = kv_pool.layout.compress_ratios
        self._state_dtypes: dict[tuple[int, str], tuple[torch.dtype, torch.dtype]] = {}
        kv_dtype = kv_pool.layout.kv_dtype
        self._default_state_dtypes = state_dtypes or (kv_dtype, kv_dtype)
        self._freed = False
        # Slot lookups of the current step, once a driver calls new_step(): every layer asks for the
        # same table ranges, and the tables only change between steps (allocation precedes the forward).
        self._memo: dict[tuple[int, int, int], torch.Tensor] | None = None

    def new_step(self) -> None:
        """Start memoising slot lookups for one step (call after the step's allocation, every step)."""
        self._memo = {}

    # ---- helpers -------------------------------------------------------------------------------
    def _slots(self, table: torch.Tensor, start: int, end: int, what: str) -> torch.Tensor:
        key = (id(table), start, end)
        slots = None if self._memo is None else self._memo.get(key)
        if slots is None:
            slots = table[self.req_idx, start:end].to(torch.int64)
            if bool((slots == 0).any()):
                raise IndexError(f"{what} [{start}, {end}) of request {self.req_idx} is not resident")
            if self._memo is not None:
                self._memo[key] = slots
        return slots

    def _state(self, layer: int, name: str) -> tuple[torch.Tensor, torch.Tensor, int]:
        ratio = self._ratios[layer]
        if name == "indexer":
            buf, table = self.kv.c4_index_state[layer], self.req_pool.req_to_token_c4_state
        elif ratio == 4:
            buf, table = self.kv.c4_state[layer], self.req_pool.req_to_token_c4_state
        else:
            buf, table = self.kv.c128_state[layer], self.req_pool.req_to_token_c128_state
        return buf.view(-1, buf.shape[-1]), table, ratio

    def _rows(self, layer: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        ratio = self._ratios[layer]
        if name == "indexer":
            buf, table = self.kv.indexer_kv[layer], self.req_pool.req_to_token_c4
        elif ratio == 4:
            buf, table = self.kv.c4_kv[layer], self.req_pool.req_to_token_c4
        else:
            buf, table = self.kv.c128_kv[layer], self.req_pool.req_to_token_c128
        return buf.view(-1, buf.shape[-1]), table

    # ---- SeqCache ------------------------------------------------------------------------------
    def read_swa(self, layer: int, start: int, end: int) -> torch.Tensor:
        buf = self.kv.swa_kv[layer]
        slots = self._slots(self.req_pool.req_to_token_swa, start, end, "SWA")
        return buf.view(-1, buf.shape[-1]).index_select(0, slots)

    def write_swa(self, layer: int, start: int, rows: torch.Tensor) -> None:
        buf = self.kv.swa_kv[layer]
        slots = self._slots(self.req_pool.req_to_token_swa, start, start + len(rows), "SWA")
        buf.view(-1, buf.shape[-1]).index_copy_(0, slots, rows.to(buf.dtype))

    def read_state(self, layer: int, name: str, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        flat, table, _ = self._state(layer, name)
        rows = flat.index_select(0, self._slots(table, start, end, f"{name} state"))
        half = flat.shape[-1] // 2
        kv_dtype, score_dtype = self._state_dtypes.get((layer, name), self._default_state_dtypes)
        return rows[:, :half].to(kv_dtype), rows[:, half:].to(score_dtype)

    def write_state(self, layer: int, name: str, start: int, kv: torch.Tensor, score: torch.Tensor) -> None:
        flat, table, ratio = self._state(layer, name)
        self._state_dtypes[(layer, name)] = (kv.dtype, score.dtype)
        end = start + len(kv)
        lo = max(start, state_alloc_offset(ratio, end))  # only the new state tail is kept
        if lo >= end:
            return
        slots = self._slots(table, lo, end, f"{name} state")
        flat.index_copy_(0, slots, torch.cat([kv[lo - start :], score[lo - start :]], dim=-1).to(flat.dtype))

    def read_rows(self, layer: int, name: str, end: int) -> torch.Tensor:
        flat, table = self._rows(layer, name)
        return flat.index_select(0, self._slots(table, 0, end, f"{name} rows"))

    def write_rows(self, layer: int, name: str, start: int, rows: torch.Tensor) -> None:
        flat, table = self._rows(layer, name)
        flat.index_copy_(0, self._slots(table, start, start + len(rows), f"{name} rows"), rows.to(flat.dtype))

    def free(self) -> None:
        if not self._freed:
            self._freed = True
            self.allocator.free(self.req_idx)
        self.num_tokens = 0
