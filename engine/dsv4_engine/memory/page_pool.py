"""Free list of page ids for one pool family. Page 0 is the sentinel and is never handed out."""

from __future__ import annotations


class OutOfPages(RuntimeError):
    """A pool cannot satisfy an allocation; the caller (scheduler) preempts or waits."""


class PagePool:
    def __init__(self, name: str, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"{name}: num_pages must be >= 0, got {num_pages}")
        self.name = name
        self.num_pages = num_pages  # usable pages, ids 1..num_pages
        self._free: list[int] = list(range(num_pages, 0, -1))  # pop() yields the lowest id first
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
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p <= 0 or p > self.num_pages:
                raise ValueError(f"{self.name} pool: page {p} out of range (sentinel 0 is never freed)")
            if self._is_free[p]:
                raise ValueError(f"{self.name} pool: double free of page {p}")
            self._is_free[p] = True
            self._free.append(p)
