"""Request -> token tables: the ordinary pool, the disaggregated-decode pool, and the DSV4 mixin.

Every table is int32 and zero-initialised: 0 is a slot in the sentinel page, so an unset entry reads
as "nothing here" (KV 0, state kv 0 / score -inf) instead of someone else's data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .allocator import Dsv4Allocator


class ReqToTokenPool:
    """Rows of per-request slot tables; req_to_token holds the full-pool slot of every raw position."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu") -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self._alloc_size = self._rows(size)
        self.req_to_token = torch.zeros((self._alloc_size, max_context_len), dtype=torch.int32, device=device)
        self._free_rows: list[int] = list(range(self._alloc_size - 1, -1, -1))
        self._used_rows: set[int] = set()

    def _rows(self, size: int) -> int:
        return size

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._used_rows.add(row)
        return row

    def check_allocated(self, req_idx: int) -> None:
        if req_idx not in self._used_rows:
            raise ValueError(f"request row {req_idx} is not allocated (double free?)")

    def free(self, req_idx: int) -> None:
        self.check_allocated(req_idx)
        self.req_to_token[req_idx].zero_()
        self._used_rows.remove(req_idx)
        self._free_rows.append(req_idx)


class DecodeReqToTokenPool(ReqToTokenPool):
    """A decode server's pool: extra rows for requests whose KV is still arriving (pre-allocated)."""

    def __init__(
        self, size: int, max_context_len: int, device: str | torch.device = "cpu", pre_alloc_size: int = 0
    ) -> None:
        self.pre_alloc_size = pre_alloc_size
        super().__init__(size, max_context_len, device)

    def _rows(self, size: int) -> int:
        return size + self.pre_alloc_size


class Dsv4ReqToTokenTablesMixin:
    """The five DSV4 tables on top of a request pool.

    req_to_token_swa[r, pos]        SWA slot of raw position pos (0 once out of the window)
    req_to_token_c4[r, j]           C4 / indexer row slot of compressed block j (= positions 4j..4j+3)
    req_to_token_c128[r, j]         C128 row slot of block j
    req_to_token_c4_state[r, pos]   C4 state slot of pos (0 outside the state tail)
    req_to_token_c128_state[r, pos] C128 state slot of pos (0 outside the state tail)

    The host calls super().__init__ first (so _alloc_size exists), then _init_dsv4_tables; its free
    goes through _dsv4_free, i.e. the allocator's one free path, before releasing the row.
    """

    _alloc_size: int
    req_to_token: torch.Tensor
    req_to_token_swa: torch.Tensor
    req_to_token_c4: torch.Tensor
    req_to_token_c128: torch.Tensor
    req_to_token_c4_state: torch.Tensor
    req_to_token_c128_state: torch.Tensor

    DSV4_TABLES = (
        "req_to_token_swa",
        "req_to_token_c4",
        "req_to_token_c128",
        "req_to_token_c4_state",
        "req_to_token_c128_state",
    )

    def _init_dsv4_tables(self, max_context_len: int, device: str | torch.device) -> None:
        self._dsv4_allocator: Dsv4Allocator | None = None
        cols = {
            "req_to_token_swa": max_context_len,
            "req_to_token_c4": max(1, max_context_len // 4),
            "req_to_token_c128": max(1, max_context_len // 128),
            "req_to_token_c4_state": max_context_len,
            "req_to_token_c128_state": max_context_len,
        }
        for name in self.DSV4_TABLES:
            setattr(self, name, torch.zeros((self._alloc_size, cols[name]), dtype=torch.int32, device=device))

    def register_dsv4_allocator(self, allocator: Dsv4Allocator) -> None:
        self._dsv4_allocator = allocator

    def _dsv4_free(self, req_idx: int) -> None:
        if self._dsv4_allocator is not None:
            self._dsv4_allocator.free(req_idx)
        for name in self.DSV4_TABLES:
            getattr(self, name)[req_idx].zero_()


class Dsv4ReqToTokenPool(Dsv4ReqToTokenTablesMixin, ReqToTokenPool):
    """The ordinary (colocated or prefill) pool."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu") -> None:
        super().__init__(size, max_context_len, device)
        self._init_dsv4_tables(max_context_len, device)

    def free(self, req_idx: int) -> None:
        self.check_allocated(req_idx)
        self._dsv4_free(req_idx)
        super().free(req_idx)


class Dsv4DecodeReqToTokenPool(Dsv4ReqToTokenTablesMixin, DecodeReqToTokenPool):
    """The disaggregated-decode pool (rows for pre-allocated, in-transfer requests included)."""

    def __init__(
        self, size: int, max_context_len: int, device: str | torch.device = "cpu", pre_alloc_size: int = 0
    ) -> None:
        super().__init__(size, max_context_len, device, pre_alloc_size)
        self._init_dsv4_tables(max_context_len, device)

    def free(self, req_idx: int) -> None:
        self.check_allocated(req_idx)
        self._dsv4_free(req_idx)
        super().free(req_idx)


Dsv4ReqPool = Dsv4ReqToTokenPool | Dsv4DecodeReqToTokenPool
