"""Staging for PD transfers: a registered byte arena, and packing a state type's pages into it.

A request whose pages are scattered costs Mooncake one entry per page run per layer buffer (~20-37 us
each over TCP whatever its size). Packed into one contiguous span, the same bytes go as one entry;
the receiver unpacks them into its own pages. The packed layout of one (state type, pages) segment
is buffer-major, each page the buffer's whole row block, in page-list order:

    staged[sum over earlier buffers of n * item + i * item(b)] == buffers[b][pages[i]]

`gather_pages` and `scatter_pages` run the kernel set's ops (`kernels/pages.cpp` on CPU, one call for
every buffer of a type; the torch set's `index_select` / `index_copy_` per buffer, the same layout).
"""

from __future__ import annotations

import threading

import torch

from ..kernels import KernelSet, choose_kernels
from ..kernels.torch_ops import staged_nbytes

__all__ = ["ALIGN", "StagingArena", "gather_pages", "scatter_pages", "staged_nbytes"]

ALIGN = 64  # spans start on a cache line, so a staged page never shares one with its neighbour


def gather_pages(
    buffers: list[torch.Tensor], pages: torch.Tensor, staged: torch.Tensor, kernels: KernelSet | None = None
) -> None:
    """Pack `pages` (int64 page ids) of every buffer into `staged` (uint8, exactly their size).
    kernels: the set to run (default: what an engine on staged's device runs)."""
    (kernels or choose_kernels(staged.device)).gather_pages(buffers, pages, staged)


def scatter_pages(
    buffers: list[torch.Tensor], pages: torch.Tensor, staged: torch.Tensor, kernels: KernelSet | None = None
) -> None:
    """Unpack `staged` (gather_pages' layout) into `pages` of every buffer."""
    (kernels or choose_kernels(staged.device)).scatter_pages(buffers, pages, staged)


class StagingArena:
    """One byte buffer, registered with the transport once, handed out in aligned spans.

    The arena owns its spans: `alloc` returns an offset (None when no free run is large enough: the
    caller then writes pages directly), `free` gives it back. First fit; spans of one side live for
    one request (decode) or one write (prefill), so the arena never fragments for long.
    """

    def __init__(self, nbytes: int, device: str | torch.device = "cpu") -> None:
        if nbytes <= 0:
            raise ValueError(f"a staging arena needs a positive size, got {nbytes}")
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.nbytes = nbytes
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, size), sorted by offset
        self._used: dict[int, int] = {}
        self._lock = threading.Lock()

    @property
    def data_ptr(self) -> int:
        return self.buffer.data_ptr()

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(size for _, size in self._free)

    @property
    def spans(self) -> int:
        """Spans handed out and not yet freed."""
        with self._lock:
            return len(self._used)

    def alloc(self, nbytes: int) -> int | None:
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        with self._lock:
            for i, (offset, free) in enumerate(self._free):
                if free >= size:
                    self._free[i : i + 1] = [(offset + size, free - size)] if free > size else []
                    self._used[offset] = size
                    return offset
        return None

    def free(self, offset: int) -> None:
        with self._lock:
            size = self._used.pop(offset)  # KeyError: not a span of this arena (or freed twice)
            spans = sorted([*self._free, (offset, size)])
            merged: list[tuple[int, int]] = []
            for at, n in spans:
                if merged and merged[-1][0] + merged[-1][1] == at:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((at, n))
            self._free = merged

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes [offset, offset + nbytes), which must lie inside one span handed out by alloc."""
        with self._lock:
            inside = any(at <= offset and offset + nbytes <= at + n for at, n in self._used.items())
        if not inside or nbytes < 0:
            raise ValueError(f"[{offset}, {offset + nbytes}) is not inside a span of this arena")
        return self.buffer[offset : offset + nbytes]
