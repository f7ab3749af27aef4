"""Per-request decode state behind a small storage interface.

The model's math reads and writes state only through `SeqCache`, addressed by absolute
token position (SWA rows, compressor state rows) or compressed-row index. The engine's backend is
paged (`attention.paged_extend.PagedSeqCache`, SGLang design A: `req_to_token` tables for
swa/c4/c128 and c4/c128 state pools), translating positions through the step's attention metadata,
built from those tables and the allocator's out-cache locations, without touching the model;
`dsv4_engine.testing.DenseSeqCache` backs it with dense per-request tensors, the reference the
tests and benchmarks hold the paged one to.

What a request holds per layer:
- `swa`: the sliding-window K=V rows of the last `sliding_window` positions (ring by position);
- `compressor` / `indexer` state: the projected (kv, score) rows of the tokens not yet folded
  into a compressed row, plus, at ratio 4, the previous full block (the overlap borrows it);
  ring by position, `coff * ratio` rows;
- `compressor` / `indexer` rows: the compressed KV rows emitted so far, by row index.
"""

from __future__ import annotations

from typing import Protocol

import torch


class SeqCache(Protocol):
    """Storage for one request's decode state (all layers)."""

    num_tokens: int  # positions [0, num_tokens) have been written
    window: int  # the sliding window: SWA rows are kept for the last `window` positions

    def read_swa(self, layer: int, start: int, end: int) -> torch.Tensor: ...
    def write_swa(self, layer: int, start: int, rows: torch.Tensor) -> None: ...
    def read_state(
        self, layer: int, name: str, start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    def write_state(
        self, layer: int, name: str, start: int, kv: torch.Tensor, score: torch.Tensor
    ) -> None: ...
    def read_rows(self, layer: int, name: str, end: int) -> torch.Tensor: ...
    def write_rows(self, layer: int, name: str, start: int, rows: torch.Tensor) -> None: ...
    def free(self) -> None: ...
