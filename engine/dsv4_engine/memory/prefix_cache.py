"""The prefix cache: a radix tree over page-aligned token ids, kept by the allocator.

A DSV4 prefix is more than KV pages. To resume prefill at a page boundary P exactly as if [0, P) had
just been prefilled, a request needs:
- the full pages of [0, P): C4, indexer and C128 rows. Their content never changes once written, so
  requests can share them like KV pages.
- the SWA pages of the last window before P. Older SWA pages have already been given back.
- the C4 compressor state of block [P-4, P), the overlap half of the next block. C128 has no partial
  block at a multiple of 128 (a page is), so it needs none.
The last two exist only at the last page boundary a prefill chunk of the request reached (the chunk
writes that block's state, `state_tail.state_write_from`), and only until the request moves past
its window. The node for P keeps them as a snapshot. A match resumes at the
deepest node that has a snapshot. The matched full pages beyond it show where a new snapshot would
pay off (a shared system prompt's junction); the scheduler ends a chunk there.

Pages are not copied. Every page covering positions < P is written once and never again, so the cache
holds each page as one more holder (`PagePool` counts holders) and a resumed request shares it.
A page is freed only when its last holder lets it go, so eviction never takes a page from a
running request. The C4 state is the exception: a snapshot keeps only the 4 rows of [P-4, P) of each
ratio-4 layer, in a slot of its own (the `slots` pool), copied out of the request's state page when
the snapshot is taken and back into a resumed request's own page (state_copies.py).

Eviction is LRU on a logical clock. The clock is deterministic, so the replicated allocators of a
tensor-parallel server evict the same nodes. To free full pages it removes leaves; to free SWA or
state pages or snapshot slots it drops snapshots and keeps the node's full page, which can still
show a junction.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from .page_pool import PagePool
from .state_copies import StateCopies

Snapshot = dict[str, dict[int, int]]  # shared page family ("swa") -> {page index: page}
EVICT_SLACK = 32  # an eviction frees 1/32 of the pool beyond what was asked
SLOTS = "slots"  # `evict`'s name for the snapshot slots


@dataclass(eq=False)
class _Node:
    parent: _Node | None
    key: tuple[int, ...]  # the page's tokens
    page: int  # full page of positions [(depth - 1) P, depth P)
    depth: int  # pages from the root
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    snapshot: Snapshot | None = None  # what resuming at depth * P needs besides the full pages
    slot: int = 0  # the snapshot's C4 state rows (0: the model has no ratio-4 layer)
    last_used: int = 0  # the last match or insert through this node
    snapshot_used: int = 0  # when its snapshot was taken or last resumed from
    chain: int = 0  # its tokens' hash (`_chain` of its parent's and its key)


def _chain(parent: int, key: tuple[int, ...]) -> int:
    return hash((parent, key))


@dataclass(frozen=True)
class PrefixHit:
    """A match: resume at `length` (0: nothing cached) with `full` and `snapshot`'s pages and the C4
    state rows of `slot`; `matched` tokens (>= length) have their full pages cached."""

    length: int = 0
    full: tuple[int, ...] = ()
    snapshot: Snapshot = field(default_factory=dict)
    matched: int = 0
    slot: int = 0


class Resumable(NamedTuple):
    """A prefix a request can resume at: its tokens, the index (in `PrefixCache.resumable`'s list) of
    the longest resumable prefix of its own (-1: none), and when it was last matched or inserted."""

    tokens: tuple[int, ...]
    parent: int
    last_used: int


class PrefixCache:
    def __init__(
        self, pools: Mapping[str, PagePool], page_size: int, slots: PagePool, copies: StateCopies
    ) -> None:
        self.pools = pools
        self.page_size = page_size
        self.slots = slots  # 4-row C4 state snapshots, one per snapshot (ratio-4 models)
        self.copies = copies
        self.root = _Node(parent=None, key=(), page=0, depth=0)
        self._clock = itertools.count(1)
        self.num_nodes = 0
        self.num_snapshots = 0
        self.changes = 0  # entries added or dropped so far: a saved copy is current while it is unchanged
        self._resumable: set[int] = set()  # `chain` of every node with a snapshot (`resumable_length`)

    def _page_key(self, tokens: Sequence[int], k: int) -> tuple[int, ...]:
        p = self.page_size
        return tuple(tokens[k * p : (k + 1) * p])

    def _path(self, tokens: Sequence[int], limit: int) -> list[_Node]:
        """The cached nodes of tokens' first pages, up to `limit` tokens."""
        node, path = self.root, []
        for k in range(min(limit, len(tokens)) // self.page_size):
            child = node.children.get(self._page_key(tokens, k))
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def match(self, tokens: Sequence[int], limit: int, *, touch: bool = True) -> PrefixHit:
        """The longest resumable prefix of tokens[:limit] (a node with a snapshot)."""
        path = self._path(tokens, limit)
        best = max((i + 1 for i, n in enumerate(path) if n.snapshot is not None), default=0)
        if touch and path:
            now = next(self._clock)
            for n in path:
                n.last_used = now
            if best:
                path[best - 1].snapshot_used = now
        if best == 0:
            return PrefixHit(matched=len(path) * self.page_size)
        node = path[best - 1]
        assert node.snapshot is not None
        return PrefixHit(
            length=best * self.page_size,
            full=tuple(n.page for n in path[:best]),
            snapshot={fam: dict(pages) for fam, pages in node.snapshot.items()},
            matched=len(path) * self.page_size,
            slot=node.slot,
        )

    def insert(
        self,
        tokens: Sequence[int],
        full: Sequence[int],
        snapshot: Snapshot | None,
        c4_row: int | None,
        req_idx: int,
    ) -> None:
        """Cache tokens (page-aligned) with their full pages and, when given, the snapshot at their end:
        its shared pages, and (c4_row: the state slot of position P-4 of request row `req_idx`) a slot
        the C4 state rows are saved to. Without a free slot after eviction, no snapshot. Pages already
        cached for the same tokens stay; the caller's duplicates stay the caller's."""
        n = len(tokens) // self.page_size
        if n * self.page_size != len(tokens) or len(full) < n:
            raise ValueError(f"insert needs page-aligned tokens and their pages: {len(tokens)}, {len(full)}")
        now = next(self._clock)
        node = self.root
        for k in range(n):
            key = self._page_key(tokens, k)
            child = node.children.get(key)
            if child is None:
                self.pools["full"].cache_hold(full[k])
                child = node.children[key] = _Node(
                    parent=node, key=key, page=full[k], depth=k + 1, chain=_chain(node.chain, key)
                )
                self.num_nodes += 1
                self.changes += 1
            child.last_used = now
            node = child
        if n and snapshot is not None and node.snapshot is None:
            if c4_row is not None:
                self.evict(SLOTS, 1)
                if not self.slots.num_free:
                    return
                node.slot = self.slots.alloc(1)[0]
                self.copies.save(c4_row, node.slot, req_idx, len(tokens))
            for fam, pages in snapshot.items():
                for page in pages.values():
                    self.pools[fam].cache_hold(page)
            node.snapshot = {fam: dict(pages) for fam, pages in snapshot.items()}
            node.snapshot_used = now
            self._resumable.add(node.chain)
            self.num_snapshots += 1
            self.changes += 1

    def resumable_length(self, tokens: Sequence[int]) -> int:
        """How long a prefix of tokens a request could resume at now, as `match` finds it but from
        the tokens' hashes alone, touching no node: so another thread may ask it while the engine
        steps (a server deciding whether a peer's cache holds more: server/prefix_peers.py). It reads
        one set, which the engine thread changes only in whole operations under the GIL. An answer
        is a hint: the next step may evict the prefix, and two prefixes of equal hash (2^-64) would
        be confused, so a caller matches again before it uses the pages."""
        p, h, best, known = self.page_size, self.root.chain, 0, self._resumable
        for k in range(len(tokens) // p):
            h = _chain(h, tuple(tokens[k * p : (k + 1) * p]))
            if h in known:
                best = k + 1
        return best * p

    def resumable(self) -> list[Resumable]:
        """Every prefix a request can resume at (a node with a snapshot), shorter first."""
        out: list[Resumable] = []
        level = [(self.root, -1)]  # breadth first: each level deeper than the one before
        while level:
            deeper = []
            for node, above in level:
                for child in node.children.values():
                    if child.snapshot is not None:
                        out.append(Resumable(self._tokens(child), above, child.last_used))
                    deeper.append((child, len(out) - 1 if child.snapshot is not None else above))
            level = deeper
        return out

    @staticmethod
    def _tokens(node: _Node) -> tuple[int, ...]:
        keys = []
        while node.parent is not None:
            keys.append(node.key)
            node = node.parent
        return tuple(t for key in reversed(keys) for t in key)

    # ---- giving pages back -----------------------------------------------------------------------
    def _drop_snapshot(self, node: _Node) -> None:
        assert node.snapshot is not None
        for fam, pages in node.snapshot.items():
            for page in pages.values():
                self.pools[fam].cache_drop(page)
        if node.slot:
            self.copies.cancel_save(node.slot)
            self.slots.free([node.slot])
        node.snapshot, node.slot = None, 0
        self._resumable.discard(node.chain)
        self.num_snapshots -= 1
        self.changes += 1

    def _remove_leaf(self, node: _Node) -> _Node | None:
        """Remove a leaf; its parent when that became a leaf (a new eviction candidate)."""
        assert not node.children and node.parent is not None
        if node.snapshot is not None:
            self._drop_snapshot(node)
        self.pools["full"].cache_drop(node.page)
        parent = node.parent
        del parent.children[node.key]
        self.num_nodes -= 1
        self.changes += 1
        return parent if parent is not self.root and not parent.children else None

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def evict(self, family: str, want_free: int) -> None:
        """Give back least recently used entries until `family` has `want_free` free pages (and some
        slack, so that a full cache is not scanned again at every step), or the cache holds nothing
        more of it. Entries whose pages requests still hold free nothing now, but go as well, in LRU
        order (they are the most recently used, so they go last). Snapshots go by their own use: the
        ones a long prompt left at every chunk go before the one a later turn resumes from.
        `family` SLOTS: the snapshot slots."""
        pool = self.slots if family == SLOTS else self.pools[family]
        if pool.num_free >= want_free:
            return
        want_free = min(pool.num_pages, want_free + pool.num_pages // EVICT_SLACK)
        if family == "full":
            heap = [(n.last_used, id(n), n) for n in self._nodes() if not n.children]
        else:
            heap = [
                (n.snapshot_used, id(n), n)
                for n in self._nodes()
                if n.snapshot is not None and self._keeps(n, family)
            ]
        heapq.heapify(heap)
        while heap and pool.num_free < want_free:
            _, _, node = heapq.heappop(heap)
            if family != "full":
                self._drop_snapshot(node)
                continue
            parent = self._remove_leaf(node)
            if parent is not None:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))

    @staticmethod
    def _keeps(node: _Node, family: str) -> bool:
        assert node.snapshot is not None
        return bool(node.slot) if family == SLOTS else bool(node.snapshot.get(family))

    def flush(self) -> None:
        """Drop every entry (pages running requests hold stay theirs)."""
        for node in self._nodes():
            if node.snapshot is not None:
                self._drop_snapshot(node)
            self.pools["full"].cache_drop(node.page)
        self.root.children = {}
        self._resumable.clear()
        self.num_nodes = 0
        self.changes += 1
