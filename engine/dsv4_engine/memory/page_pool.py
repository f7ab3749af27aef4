"""Free ids of one pool family. Page 0 is the sentinel and is never handed out.

`alloc(n)` returns the n lowest free ids in ascending order (a min-heap), not the most recently freed
ones: PD transfers merge runs of consecutive page ids into one transfer entry, so a request's pages
should be contiguous where the pool allows. O(n log N) per alloc or free.
"""

from __future__ import annotations

import heapq


class OutOfPages(RuntimeError):
    """A pool cannot satisfy an allocation; the caller (scheduler) preempts or waits."""


class PagePool:
    def __init__(self, name: str, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"{name}: num_pages must be >= 0, got {num_pages}")
        self.name = name
        self.num_pages = num_pages  # usable pages, ids 1..num_pages
        self._free: list[int] = list(range(1, num_pages + 1))  # ascending: already a valid heap
        self._is_free = [False] + [True] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def usage(self) -> float:
        return self.num_used / self.num_pages if self.num_pages else 0.0

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"{self.name} pool: need {n} pages, {len(self._free)} free")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        # Validate the whole list first, so a bad id leaves the pool unchanged.
        seen: set[int] = set()
        for p in pages:
            if p <= 0 or p > self.num_pages:
                raise ValueError(f"{self.name} pool: page {p} out of range (sentinel 0 is never freed)")
            if self._is_free[p] or p in seen:
                raise ValueError(f"{self.name} pool: double free of page {p}")
            seen.add(p)
        for p in pages:
            self._is_free[p] = True
            heapq.heappush(self._free, p)
