"""Request -> token tables: the six int32 tables a request row indexes, and which rows are in use.

Every table is int32 and zero-initialised: 0 is a slot in the sentinel page, so an unset entry reads
as "nothing here" (KV 0, state kv 0 / score -inf) instead of someone else's data.

The pool knows nothing about pages. Rows are handed out and released only by `Dsv4Allocator`
(`alloc_request` / `free`), through the package-private `_take_row` / `_release_row`: a row then can
never be released while it still holds pages, and a reused row always starts clean.
`TableWrites` gathers a step's per-position entries into one scatter per table.
"""

from __future__ import annotations

import torch


class Dsv4ReqToTokenPool:
    """The colocated (or prefill) pool: `size` rows of

    req_to_token[r, pos]            full slot of raw position pos (addresses C4 / indexer / C128 pages)
    req_to_token_swa[r, pos]        SWA slot of raw position pos (0 once out of the window)
    req_to_token_c4[r, j]           C4 / indexer row slot of compressed block j (= positions 4j..4j+3)
    req_to_token_c128[r, j]         C128 row slot of block j
    req_to_token_c4_state[r, pos]   C4 state slot of pos (0 outside the state tail)
    req_to_token_c128_state[r, pos] C128 state slot of pos (0 outside the state tail)
    """

    DSV4_TABLES = (
        "req_to_token_swa",
        "req_to_token_c4",
        "req_to_token_c128",
        "req_to_token_c4_state",
        "req_to_token_c128_state",
    )
    TABLES = ("req_to_token", *DSV4_TABLES)

    req_to_token: torch.Tensor
    req_to_token_swa: torch.Tensor
    req_to_token_c4: torch.Tensor
    req_to_token_c128: torch.Tensor
    req_to_token_c4_state: torch.Tensor
    req_to_token_c128_state: torch.Tensor

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu") -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self._alloc_size = size + self._extra_rows()
        cols = {
            "req_to_token": max_context_len,
            "req_to_token_swa": max_context_len,
            "req_to_token_c4": max(1, max_context_len // 4),
            "req_to_token_c128": max(1, max_context_len // 128),
            "req_to_token_c4_state": max_context_len,
            "req_to_token_c128_state": max_context_len,
        }
        for name in self.TABLES:
            setattr(self, name, torch.zeros((self._alloc_size, cols[name]), dtype=torch.int32, device=device))
        self._free_rows: list[int] = list(range(self._alloc_size - 1, -1, -1))  # pop() -> lowest first
        self._used_rows: set[int] = set()

    def _extra_rows(self) -> int:
        return 0

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return self._alloc_size

    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def is_allocated(self, req_idx: int) -> bool:
        return req_idx in self._used_rows

    # ---- rows (Dsv4Allocator only) -------------------------------------------------------------
    def _take_row(self) -> int | None:
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._used_rows.add(row)
        return row

    def _release_row(self, req_idx: int) -> None:
        """Zero every table row of req_idx and return it; the allocator has freed its pages."""
        if req_idx not in self._used_rows:
            raise ValueError(f"request row {req_idx} is not allocated")
        for name in self.TABLES:
            getattr(self, name)[req_idx].zero_()
        self._used_rows.remove(req_idx)
        self._free_rows.append(req_idx)


class Dsv4DecodeReqToTokenPool(Dsv4ReqToTokenPool):
    """The disaggregated-decode pool: `pre_alloc_size` extra rows for requests whose KV is still
    arriving (pre-allocated with `Dsv4Allocator.alloc_prealloc`), on top of the running ones."""

    def __init__(
        self, size: int, max_context_len: int, device: str | torch.device = "cpu", pre_alloc_size: int = 0
    ) -> None:
        if pre_alloc_size < 0:
            raise ValueError(f"pre_alloc_size must be >= 0, got {pre_alloc_size}")
        self.pre_alloc_size = pre_alloc_size
        super().__init__(size, max_context_len, device)

    def _extra_rows(self) -> int:
        return self.pre_alloc_size


# Either pool (the decode pool is a subclass); kept as the name the type hints use.
Dsv4ReqPool = Dsv4ReqToTokenPool


class TableWrites:
    """Per-position table entries of a whole step, scattered with one `index_put_` per table: a
    decode step of 64 requests otherwise costs ~20 small tensor ops per request (about 15% of a
    CPU decode step, and host time the device waits for on NPU)."""

    def __init__(self) -> None:
        self._by_table: dict[int, tuple[torch.Tensor, list[int], list[int], list[int]]] = {}

    def add(self, table: torch.Tensor, row: int, start: int, values: list[int]) -> None:
        if not values:
            return
        _, rows, cols, vals = self._by_table.setdefault(id(table), (table, [], [], []))
        rows += [row] * len(values)
        cols += range(start, start + len(values))
        vals += values

    def flush(self) -> None:
        for table, rows, cols, vals in self._by_table.values():
            # One host-to-device copy for indices and values. An int32 table is written through its
            # float32 view, bit for bit (a move, no arithmetic): Ascend's IndexPut refuses int32 values.
            packed = torch.tensor([rows, cols, vals], dtype=torch.int64).to(table.device)
            values = packed[2].to(table.dtype)
            if table.dtype == torch.int32:
                table, values = table.view(torch.float32), values.view(torch.float32)
            table.index_put_((packed[0], packed[1]), values)
        self._by_table.clear()
