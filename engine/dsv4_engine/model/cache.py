"""Per-request decode state behind a small storage interface.

The model's math reads and writes state only through `SeqCache`, addressed by absolute
token position (SWA rows, compressor state rows) or compressed-row index. `DenseSeqCache`
backs it with dense per-request tensors. A paged backend (SGLang design A: `req_to_token`
tables for swa/c4/c128 and c4/c128 state pools) implements the same methods by translating
positions through its tables, without touching the model.

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

from dsv4_engine.config import Dsv4Config


class SeqCache(Protocol):
    """Storage for one request's decode state (all layers)."""

    num_tokens: int  # positions [0, num_tokens) have been written

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


class DenseSeqCache:
    """Dense tensors per request; rings for SWA and compressor state, growing row buffers."""

    def __init__(self, config: Dsv4Config, dtype: torch.dtype, device: torch.device | str) -> None:
        self.window = config.sliding_window
        self.ratios = config.compress_ratios
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_tokens = 0
        self._swa: dict[int, torch.Tensor] = {}
        self._state: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._rows: dict[tuple[int, str], torch.Tensor] = {}

    def _ring(self, start: int, end: int, size: int) -> torch.Tensor:
        return torch.arange(start, end, device=self.device) % size

    def read_swa(self, layer: int, start: int, end: int) -> torch.Tensor:
        if end <= start:
            return torch.empty(0, 0, dtype=self.dtype, device=self.device)
        if end - start > self.window or start < self.num_tokens - self.window:
            raise IndexError(f"SWA rows [{start}, {end}) are outside the window")
        return self._swa[layer].index_select(0, self._ring(start, end, self.window))

    def write_swa(self, layer: int, start: int, rows: torch.Tensor) -> None:
        drop = max(0, len(rows) - self.window)
        rows, start = rows[drop:], start + drop
        if layer not in self._swa:
            self._swa[layer] = rows.new_zeros(self.window, rows.shape[-1])
        self._swa[layer].index_copy_(0, self._ring(start, start + len(rows), self.window), rows)

    def _state_size(self, layer: int) -> int:
        ratio = self.ratios[layer]
        return ratio * (2 if ratio == 4 else 1)

    def read_state(self, layer: int, name: str, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv, score = self._state[(layer, name)]
        idx = self._ring(start, end, self._state_size(layer))
        return kv.index_select(0, idx), score.index_select(0, idx)

    def write_state(self, layer: int, name: str, start: int, kv: torch.Tensor, score: torch.Tensor) -> None:
        size = self._state_size(layer)
        drop = max(0, len(kv) - size)
        kv, score, start = kv[drop:], score[drop:], start + drop
        if (layer, name) not in self._state:
            self._state[(layer, name)] = (
                kv.new_zeros(size, kv.shape[-1]),
                score.new_zeros(size, score.shape[-1]),
            )
        buf_kv, buf_score = self._state[(layer, name)]
        idx = self._ring(start, start + len(kv), size)
        buf_kv.index_copy_(0, idx, kv)
        buf_score.index_copy_(0, idx, score)

    def read_rows(self, layer: int, name: str, end: int) -> torch.Tensor:
        return self._rows[(layer, name)][:end]

    def write_rows(self, layer: int, name: str, start: int, rows: torch.Tensor) -> None:
        buf = self._rows.get((layer, name))
        need = start + len(rows)
        if buf is None or len(buf) < need:
            grown = rows.new_empty(max(need, 2 * (0 if buf is None else len(buf)), 16), rows.shape[-1])
            if buf is not None:
                grown[: len(buf)] = buf
            buf = self._rows[(layer, name)] = grown
        buf[start:need] = rows

    def free(self) -> None:
        self._swa.clear()
        self._state.clear()
        self._rows.clear()
        self.num_tokens = 0
