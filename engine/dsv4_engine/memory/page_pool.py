"""Free ids of one pool family, and how many holders each id has. Page 0 is the sentinel and is
never handed out.

`alloc(n)` returns the n lowest free ids in ascending order (a min-heap), not the most recently freed
ones: PD transfers merge runs of consecutive page ids into one transfer entry, so a request's pages
should be contiguous where the pool allows. O(n log N) per alloc or free.

A page can have several holders: the request that wrote it and the prefix cache, or requests that
resumed from a cached prefix (`share`). `free` drops one holder; the id goes back to the free list
with its last. The pool also counts the pages whose only holder is the cache (`num_evictable`): the
pages the cache can give back under memory pressure, which the scheduler counts as available.
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
        self._refs = [0] * (num_pages + 1)  # holders per page; 0: free (the sentinel stays 0)
        self._cache_refs = [0] * (num_pages + 1)  # how many of those holders are the prefix cache
        self.num_evictable = 0  # held pages whose every holder is the cache

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def usage(self) -> float:
        """The share held by requests: the cache's evictable pages count as free (as vLLM's and
        SGLang's usage figures do), so a full cache never looks like load to an autoscaler."""
        return (self.num_used - self.num_evictable) / self.num_pages if self.num_pages else 0.0

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"{self.name} pool: need {n} pages, {len(self._free)} free")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def _check_held(self, pages: list[int]) -> None:
        for p in pages:
            if p <= 0 or p > self.num_pages:
                raise ValueError(f"{self.name} pool: page {p} out of range (sentinel 0 is never freed)")
            if self._refs[p] == 0:
                raise ValueError(f"{self.name} pool: page {p} is free (double free, or never allocated)")
        if len(set(pages)) != len(pages):
            raise ValueError(f"{self.name} pool: double free: a page is listed twice in {pages}")

    def _evictable(self, page: int) -> bool:
        return 0 < self._refs[page] == self._cache_refs[page]

    def _change(self, page: int, refs: int, cache: int) -> None:
        """Move one page's holder counts, keeping num_evictable and the free list in step."""
        before = self._evictable(page)
        self._refs[page] += refs
        self._cache_refs[page] += cache
        self.num_evictable += self._evictable(page) - before
        if self._refs[page] == 0:
            heapq.heappush(self._free, page)

    def share(self, pages: list[int]) -> None:
        """One more holder for each (held) page: a request resuming from the cache's pages."""
        self._check_held(pages)
        for p in pages:
            self._change(p, 1, 0)

    def free(self, pages: list[int]) -> None:
        """Drop one holder of each page; a page goes back to the free list with its last holder."""
        self._check_held(pages)  # the whole list first, so a bad id leaves the pool unchanged
        for p in pages:
            self._change(p, -1, 0)

    def holders(self, page: int) -> int:
        return self._refs[page]

    def releasable(self, page: int) -> bool:
        """Whether one request letting go of the page makes it free or evictable (no other request
        holds it)."""
        return self._refs[page] - self._cache_refs[page] == 1

    # ---- the prefix cache's holds ----------------------------------------------------------------
    def cache_hold(self, page: int) -> None:
        """The prefix cache becomes one more holder of a held page (a node or a snapshot keeps it)."""
        self._check_held([page])
        self._change(page, 1, 1)

    def cache_drop(self, page: int) -> None:
        """The cache lets go of one of its holds on a page; the page is freed with its last holder."""
        if self._cache_refs[page] == 0:
            raise ValueError(f"{self.name} pool: the cache does not hold page {page}")
        self._change(page, -1, -1)
