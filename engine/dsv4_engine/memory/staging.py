"""Staging for PD transfers: a registered byte arena, and packing a state type's pages into it.

A request whose pages are scattered costs Mooncake one entry per page run per layer buffer (~20-37 us
each over TCP whatever its size). Packed into one contiguous span, the same bytes go as one entry;
the receiver unpacks them into its own pages. The packed layout of one (state type, pages) segment
is buffer-major, each page the buffer's whole row block, in page-list order:

    staged[sum over earlier buffers of n * item + i * item(b)] == buffers[b][pages[i]]

`gather_pages` and `scatter_pages` run the C++ kernels (`kernels/pages.cpp`, one call for every
buffer of a type) where they serve the device, else the torch code below, which is the same layout.
"""

from __future__ import annotations

import threading

import torch

from .. import kernels

ALIGN = 64  # spans start on a cache line, so a staged page never shares one with its neighbour


def staged_nbytes(buffers: list[torch.Tensor], pages: int) -> int:
    """Bytes `pages` pages of every buffer take when packed."""
    return pages * sum(b[0].nbytes for b in buffers)


def _segments(buffers: list[torch.Tensor], pages: torch.Tensor, staged: torch.Tensor):  # type: ignore[no-untyped-def]
    n, at = int(pages.numel()), 0
    if staged.numel() != staged_nbytes(buffers, n):
        raise ValueError(f"{staged.numel()} staged bytes for {n} pages of {len(buffers)} buffers")
    for buf in buffers:
        size = n * buf[0].nbytes
        yield buf, staged[at : at + size].view(buf.dtype).view(n, *buf.shape[1:])
        at += size


def _kernel(buffers: list[torch.Tensor], staged: torch.Tensor) -> bool:
    return (
        staged.device.type == "cpu"
        and all(b.is_contiguous() for b in buffers)
        and kernels.use_for(staged.device)
    )


def gather_pages(buffers: list[torch.Tensor], pages: torch.Tensor, staged: torch.Tensor) -> None:
    """Pack `pages` (int64 page ids) of every buffer into `staged` (uint8, exactly their size)."""
    if _kernel(buffers, staged):
        torch.ops.dsv4.gather_pages(buffers, pages, staged)
        return
    for buf, out in _segments(buffers, pages, staged):
        torch.index_select(buf, 0, pages.to(buf.device), out=out)


def scatter_pages(buffers: list[torch.Tensor], pages: torch.Tensor, staged: torch.Tensor) -> None:
    """Unpack `staged` (gather_pages' layout) into `pages` of every buffer."""
    if _kernel(buffers, staged):
        torch.ops.dsv4.scatter_pages(buffers, pages, staged)
        return
    for buf, src in _segments(buffers, pages, staged):
        buf.index_copy_(0, pages.to(buf.device), src)


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
