"""The DSV4 allocator: every location a step needs, in one bundle, from four page families.

Families (page ids, each with sentinel page 0):
  full  - addresses the C4 KV, indexer KV and C128 KV pools (held for the request's whole life)
  swa   - the sliding-window KV pool (pages behind the window are released)
  c4s   - C4 compressor state (attention + indexer), only the state tail is held
  c128s - C128 compressor state, only the state tail is held

A step is `prefix_len -> seq_len` for one request: chunked prefill, a whole prompt, or one decode
token (prefix_len = seq_len - 1). Only what the step adds is allocated (prefix-aware).

The allocator owns the request pool's rows: `alloc_request` hands one out, `free` is the one path that
releases it (every page of every family, then the zeroed row). A row can be pinned while something
outside the engine still reads its pages (a PD transfer): a pinned row is never freed; `free` then
defers to the last `unpin`.

It also owns the prefix cache (prefix_cache.py), when enabled: `match_prefix` starts a new row from
the longest cached prefix, sharing its pages; `cache_prefix` offers a row's computed prefix to it. The
cache's pages that no request holds count as available (`num_available`): an allocation short of
free pages evicts them first, so a cached prefix never makes a request wait or be preempted. A
snapshot's C4 state rows live in a slot pool of their own; the allocator queues the copies to and from
those slots (state_copies.py) and the model runner runs them before the next forward
(`take_state_copies`): the allocator itself never touches tensor data.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .journal import Journaled
from .layout import Dsv4MemoryLayout
from .out_cache_loc import DSV4OutCacheLoc, ExtendSpec
from .page_pool import OutOfPages, PagePool
from .prefix_cache import PrefixCache, PrefixHit, Snapshot
from .req_pages import (
    FAMILIES,
    STATE_RATIOS,
    Geometry,
    Plan,
    ReqPages,
    bundle,
    hold_plan,
    plan_step,
    plan_truncate,
    rows,
    slots,
)
from .req_to_token import Dsv4ReqPool, TableWrites
from .sizing import PoolSizes
from .state_copies import SNAPSHOT_ROWS, StateCopies, StateCopy
from .state_tail import cdiv, state_read_range, swa_keep_from

__all__ = ["FAMILIES", "Dsv4Allocator"]


class Dsv4Allocator(Journaled):
    def __init__(
        self, layout: Dsv4MemoryLayout, sizes: PoolSizes, req_pool: Dsv4ReqPool, *, prefix_cache: bool = False
    ) -> None:
        self.layout = layout
        self.page_size = layout.page_size
        self.req_pool = req_pool
        self.max_ctx = req_pool.max_context_len
        has_c4, has_c128 = bool(layout.c4_layers), bool(layout.c128_layers)
        self.pools = {
            "full": PagePool("full", sizes.full_pages),
            "swa": PagePool("swa", sizes.swa_pages),
            "c4s": PagePool("c4_state", sizes.c4_state_pages if has_c4 else 0),
            "c128s": PagePool("c128_state", sizes.c128_state_pages if has_c128 else 0),
        }
        states = (("c4s",) if has_c4 else ()) + (("c128s",) if has_c128 else ())
        self.geometry = Geometry(self.page_size, layout.window, self.max_ctx, states)
        self._reqs: dict[int, ReqPages] = {}
        self._journal: list[tuple[str, tuple]] | None = None
        self._pins: dict[int, int] = {}  # row -> pins (PD writes queued or in flight that read it)
        self._deferred: set[int] = set()  # rows freed while pinned: freed at their last unpin
        # One slot per prefix-cache snapshot: the 4 C4 state rows a resume reads (not a family: only
        # the cache takes slots, and a request never holds one).
        self.snapshot_slots = PagePool("c4_snapshot", sizes.c4_snapshot_slots if has_c4 else 0)
        self.state_copies = StateCopies(self.pools["c4s"], self.snapshot_slots, self.page_size)
        self.prefix_cache = (
            PrefixCache(self.pools, self.page_size, self.snapshot_slots, self.state_copies)
            if prefix_cache
            else None
        )

    # ---- replication (journal.py: the other ranks of a server mirror rank 0's pages) -----------
    def take_state_copies(self) -> list[StateCopy]:
        """The C4 state copies queued since the last call (snapshots taken, requests resumed), in order,
        for the caller to run on the pools now (`Dsv4TokenToKVPool.apply_state_copies`): the model
        runner does before each forward and after each step. Journaled: a replica runs them at the
        same point of its replay."""
        copies = self.state_copies.take()
        if copies:
            self._log("take_state_copies")
        return copies

    # ---- request rows --------------------------------------------------------------------------
    def alloc_request(self) -> int | None:
        """A free request row (all its tables zero, no pages held); None when every row is in use."""
        row = self.req_pool._take_row()
        if row is not None:
            self._log("alloc_request", row)
        return row

    def num_free_requests(self) -> int:
        return self.req_pool.num_free_rows()

    def _check_row(self, req_idx: int) -> None:
        if not self.req_pool.is_allocated(req_idx):
            raise ValueError(f"request row {req_idx} was not handed out by alloc_request (or is freed)")

    # ---- queries -------------------------------------------------------------------------------
    def seq_len(self, req_idx: int) -> int:
        r = self._reqs.get(req_idx)
        return r.seq_len if r else 0

    def pages_of(self, req_idx: int) -> dict[str, list[int]]:
        """Every page the row holds, per family."""
        r = self._reqs.get(req_idx, ReqPages())
        return {"full": list(r.full), "swa": list(r.swa.values()), "c4s": list(r.c4s.values()),
                "c128s": list(r.c128s.values())}  # fmt: skip

    def held_pages(self, req_idx: int) -> dict[str, int]:
        r = self._reqs.get(req_idx, ReqPages())
        return {"full": len(r.full), "swa": len(r.swa), "c4s": len(r.c4s), "c128s": len(r.c128s)}

    def num_free(self) -> dict[str, int]:
        return {name: pool.num_free for name, pool in self.pools.items()}

    def num_available(self) -> dict[str, int]:
        """Free pages plus the cache's pages no request holds (an allocation evicts those first)."""
        return {name: pool.num_free + pool.num_evictable for name, pool in self.pools.items()}

    def usage(self) -> dict[str, float]:
        return {name: pool.usage() for name, pool in self.pools.items()}

    # ---- planning ------------------------------------------------------------------------------
    def _plan(self, spec: ExtendSpec) -> Plan:
        self._check_row(spec.req_idx)
        return plan_step(self._reqs.get(spec.req_idx, ReqPages()), spec, self.geometry)

    def _hold_plan(self, seq_len: int) -> dict[str, list[int]]:
        return hold_plan(seq_len, self.geometry)

    def pages_to_hold(self, seq_len: int) -> dict[str, int]:
        """Pages per family a request of seq_len holds (alloc_prealloc's)."""
        return {fam: len(ks) for fam, ks in self._hold_plan(seq_len).items()}

    def growth(self, req_idx: int, seq_len: int) -> dict[str, int]:
        """Pages per family the row must still take to reach seq_len: the full pages it lacks, and for
        the window and the state tails what a request of seq_len holds beyond what it holds now."""
        r = self._reqs.get(req_idx, ReqPages())
        hold = self.pages_to_hold(seq_len)
        return {
            "full": max(0, hold["full"] - len(r.full)),
            **{fam: max(0, hold[fam] - len(getattr(r, fam))) for fam in ("swa", "c4s", "c128s")},
        }

    def _net(self, plans: Sequence[Plan]) -> dict[str, int]:
        """Pages per family the plans take, less the releases that make a page free or evictable
        (a page another request also holds is counted as staying taken)."""
        pools = self.pools
        return {
            fam: sum(
                len(pl.need[fam]) - sum(pools[fam].releasable(pg) for _, pg in pl.free[fam]) for pl in plans
            )
            for fam in FAMILIES
        }

    def pages_needed(self, specs: Sequence[ExtendSpec]) -> dict[str, int]:
        """Net pages per family a batch step takes (allocations minus releases)."""
        return self._net([self._plan(spec) for spec in specs])

    def can_alloc(self, specs: Sequence[ExtendSpec]) -> bool:
        needed, available = self.pages_needed(specs), self.num_available()
        return all(needed[f] <= available[f] for f in FAMILIES)

    def _make_room(self, need: dict[str, int]) -> None:
        """Evict cached prefixes until each family has `need` free pages (or nothing is left to evict)."""
        if self.prefix_cache is not None:
            for fam, n in need.items():
                self.prefix_cache.evict(fam, n)

    # ---- allocation ----------------------------------------------------------------------------
    def alloc_extend(self, specs: Sequence[ExtendSpec]) -> DSV4OutCacheLoc:
        """Allocate one step for a batch; raises OutOfPages and changes nothing if a pool is short."""
        if len({s.req_idx for s in specs}) != len(specs):
            raise ValueError("a request may appear once per step")
        plans = [self._plan(s) for s in specs]
        net, available = self._net(plans), self.num_available()
        for fam in FAMILIES:
            if net[fam] > available[fam]:
                raise OutOfPages(f"{fam} pool: step needs {net[fam]} more pages, {available[fam]} available")
        gross = {fam: sum(len(pl.need[fam]) for pl in plans) for fam in FAMILIES}
        # Releases and allocations of the whole batch go in two phases: per request, an earlier request
        # could need pages only a later one releases. When the batch fits without its own releases,
        # allocate first so it does not take back pages it just released: new pages then follow the
        # ones a request already holds (contiguous runs, cheaper PD transfers) instead of filling holes.
        # Short of free pages, the releases go first: a page this step releases that the cache also
        # holds becomes evictable only then, and eviction then frees what the step takes.
        gross_fits = all(gross[fam] <= self.pools[fam].num_free for fam in FAMILIES)
        if not gross_fits:
            for spec, plan in zip(specs, plans, strict=True):
                self._release(spec, plan)
            self._make_room(gross)
        writes = TableWrites()
        for spec, plan in zip(specs, plans, strict=True):
            self._apply(spec, plan, writes)
        writes.flush()
        if gross_fits:
            for spec, plan in zip(specs, plans, strict=True):
                self._release(spec, plan)
        self._log("alloc_extend", list(specs))
        return self._bundle(specs)

    def alloc_decode(self, req_indices: Sequence[int]) -> DSV4OutCacheLoc:
        specs = [ExtendSpec(i, self.seq_len(i), self.seq_len(i) + 1) for i in req_indices]
        return self.alloc_extend(specs)

    def alloc_prealloc(self, req_idx: int, seq_len: int) -> None:
        """Disaggregated decode: hold what a request of seq_len needs to continue, before its KV
        arrives: all full pages, the SWA pages from swa_window_start, the state tails. Writes the
        tables (the seed's write_dsv4_prealloc_tables)."""
        self._check_row(req_idx)
        if req_idx in self._reqs:
            raise ValueError(f"request {req_idx} already holds memory")
        need = self._hold_plan(seq_len)
        self._make_room({fam: len(ks) for fam, ks in need.items()})
        for fam in FAMILIES:
            if len(need[fam]) > self.pools[fam].num_free:
                raise OutOfPages(
                    f"{fam} pool: prealloc needs {len(need[fam])}, {self.pools[fam].num_free} free"
                )
        self._reqs[req_idx] = ReqPages()
        empty = {f: [] for f in FAMILIES}
        writes = TableWrites()
        self._apply(ExtendSpec(req_idx, 0, seq_len), Plan(free=empty, need=need), writes)
        writes.flush()
        self._log("alloc_prealloc", req_idx, seq_len)

    def truncate(self, req_idx: int, seq_len: int) -> None:
        """Cut a row back to its first seq_len positions (speculative decoding: the drafts its verify
        step rejected): the pages wholly past them go back, and every table entry of a later
        position returns to the sentinel, so the row reads as if it had never gone further. The step
        that wrote past seq_len was allocated with `keep_len <= seq_len`, so the compressor state of
        seq_len's tail is all there, and its watermarks never passed what seq_len still reads."""
        self._check_row(req_idx)
        r = self._reqs.get(req_idx)
        if r is None or r.seq_len == seq_len:
            return
        free = plan_truncate(r, seq_len, self.geometry)
        pool, p, old = self.req_pool, self.page_size, r.seq_len
        tables = self._paged_tables()
        for fam, pages in free.items():
            if fam == "full":
                del r.full[len(r.full) - len(pages) :]
            else:
                held = getattr(r, fam)
                for k, _ in pages:
                    del held[k]
                    tables[fam][req_idx, k * p : (k + 1) * p] = 0
            self.pools[fam].free([pg for _, pg in pages])
        pool.req_to_token[req_idx, seq_len:old] = 0
        for ratio, table in ((4, pool.req_to_token_c4), (128, pool.req_to_token_c128)):
            table[req_idx, seq_len // ratio : old // ratio] = 0
        r.seq_len = seq_len
        self._log("truncate", req_idx, seq_len)

    def _paged_tables(self) -> dict[str, torch.Tensor]:
        pool = self.req_pool
        return {
            "swa": pool.req_to_token_swa,
            "c4s": pool.req_to_token_c4_state,
            "c128s": pool.req_to_token_c128_state,
        }

    def _release(self, spec: ExtendSpec, plan: Plan) -> None:
        """Give back the pages the plan releases and reset their table entries to the sentinel."""
        r, p, idx = self._reqs.get(spec.req_idx), self.page_size, spec.req_idx
        if r is None:
            return
        tables = self._paged_tables()
        for fam, freed in plan.free.items():
            if not freed:
                continue
            held = getattr(r, fam)
            for k, _ in freed:
                del held[k]
                tables[fam][idx, k * p : (k + 1) * p] = 0
            self.pools[fam].free([pg for _, pg in freed])

    def _apply(self, spec: ExtendSpec, plan: Plan, writes: TableWrites) -> None:
        """Take the plan's pages and map the step's positions (its releases are `_release`'s). The
        per-position entries (full slots, c4/c128 rows) go to `writes`, one scatter per table for the
        whole batch (see `TableWrites`); page-wide ones (a page taken, every p steps at most) are
        written here. Released and taken page indices are disjoint, so the order of the two is free."""
        r = self._reqs.setdefault(spec.req_idx, ReqPages())
        pool, p, idx = self.req_pool, self.page_size, spec.req_idx
        tables = self._paged_tables()
        for fam, ks in plan.need.items():
            pages = self.pools[fam].alloc(len(ks))
            if fam == "full":
                r.full.extend(pages)
                continue
            held = getattr(r, fam)
            for k, pg in zip(ks, pages, strict=True):
                held[k] = pg
                self._map_page(tables[fam], idx, k, pg)
        prefix, seq = spec.prefix_len, spec.seq_len
        writes.add(pool.req_to_token, idx, prefix, slots(r.full, p, prefix, seq))
        for ratio, table in ((4, pool.req_to_token_c4), (128, pool.req_to_token_c128)):
            writes.add(table, idx, prefix // ratio, rows(r.full, p, ratio, prefix, seq))
        r.seq_len = seq

    def _map_page(self, table: torch.Tensor, idx: int, k: int, page: int) -> None:
        """Point positions [kP, (k+1)P) of a paged table's row at `page` (a page-wide entry)."""
        p = self.page_size
        lo, hi = k * p, min((k + 1) * p, self.max_ctx)
        table[idx, lo:hi] = torch.arange(page * p, page * p + hi - lo, dtype=torch.int32)

    def _bundle(self, specs: Sequence[ExtendSpec]) -> DSV4OutCacheLoc:
        return bundle([(self._reqs[s.req_idx], s) for s in specs], self.geometry)

    # ---- the prefix cache ---------------------------------------------------------------------------
    def match_prefix(self, req_idx: int, tokens: Sequence[int], limit: int, touch: bool = True) -> PrefixHit:
        """Start a new row from the longest cached prefix of tokens[:limit]: the row shares its pages
        (its tables written as if it had prefilled them) and its next step starts at `hit.length`.
        touch=False leaves the cache's LRU order as it was (a reader of the cache, not a request)."""
        self._check_row(req_idx)
        if req_idx in self._reqs:
            raise ValueError(f"request {req_idx} already holds memory")
        if self.prefix_cache is None:
            return PrefixHit()
        hit = self.prefix_cache.match(tokens, limit, touch=touch)
        self._log("match_prefix", req_idx, list(tokens[: hit.matched]), hit.matched, touch)
        if hit.slot and not self.pools["c4s"].num_free:  # no page to restore the C4 state rows into
            hit = PrefixHit(matched=hit.matched)
        if not hit.length:
            return hit
        p, pool, n = self.page_size, self.req_pool, hit.length
        r = self._reqs[req_idx] = ReqPages(seq_len=n, full=list(hit.full))
        self.pools["full"].share(r.full)
        tables = self._paged_tables()
        for fam, pages in hit.snapshot.items():
            self.pools[fam].share(list(pages.values()))
            setattr(r, fam, dict(pages))
            for k, pg in pages.items():
                self._map_page(tables[fam], req_idx, k, pg)
        if hit.slot:  # the request's own state page for [n - P, n), its block [n-4, n) from the slot
            page = self.pools["c4s"].alloc(1)[0]
            r.c4s = {n // p - 1: page}
            self._map_page(tables["c4s"], req_idx, n // p - 1, page)
            self.state_copies.restore(hit.slot, page * p + p - SNAPSHOT_ROWS, req_idx, n)
        writes = TableWrites()
        writes.add(pool.req_to_token, req_idx, 0, slots(r.full, p, 0, n))
        for ratio, table in ((4, pool.req_to_token_c4), (128, pool.req_to_token_c128)):
            writes.add(table, req_idx, 0, rows(r.full, p, ratio, 0, n))
        writes.flush()
        return hit

    def cache_prefix(self, req_idx: int, tokens: Sequence[int]) -> None:
        """Offer the row's computed positions [0, len(tokens)) (page-aligned) to the cache. When the
        row's last step ended exactly there, its SWA window and compressor state at that boundary go
        with them (a snapshot a later request can resume from); otherwise only the full pages."""
        if self.prefix_cache is None:
            return
        r = self._reqs[req_idx]
        n = len(tokens)
        if n % self.page_size or not 0 < n <= r.seq_len:
            raise ValueError(f"request {req_idx}: cannot cache {n} of its {r.seq_len} positions")
        p, snapshot, c4_row = self.page_size, self._snapshot(r, n), None
        if snapshot is not None and "c4s" in snapshot:  # its 4 rows go to a slot, not the whole page
            c4_row = snapshot.pop("c4s")[n // p - 1] * p + p - SNAPSHOT_ROWS
        self.prefix_cache.insert(tokens, r.full[: n // p], snapshot, c4_row, req_idx)
        self._log("cache_prefix", req_idx, list(tokens))

    def _snapshot(self, r: ReqPages, n: int) -> Snapshot | None:
        """The SWA and state pages a request resuming at n reads, if the row holds all of them now
        (of the C4 state page, the snapshot then keeps only the rows of [n-4, n))."""
        if n != r.seq_len // self.page_size * self.page_size:  # only the latest boundary's state is kept
            return None
        p = self.page_size
        want = {"swa": range(swa_keep_from(n, self.layout.window) // p, n // p)}
        for fam in self.geometry.state_families:
            lo, hi = state_read_range(STATE_RATIOS[fam], n)
            want[fam] = range(lo // p, cdiv(hi, p)) if hi > lo else range(0)
        held = {"swa": r.swa, "c4s": r.c4s, "c128s": r.c128s}
        if any(k not in held[fam] for fam, ks in want.items() for k in ks):
            return None
        return {fam: {k: held[fam][k] for k in ks} for fam, ks in want.items() if ks}

    def flush_cache(self) -> None:
        """Empty the prefix cache (SGLang's /flush_cache): every page only it held is free again."""
        if self.prefix_cache is not None:
            self.prefix_cache.flush()
            self._log("flush_cache")

    # ---- pins (PD: a transfer reading the row's pages) -------------------------------------------
    def pin(self, req_idx: int) -> None:
        """Something outside the engine reads this row's pages until `unpin` (a PD write)."""
        self._check_row(req_idx)
        self._pins[req_idx] = self._pins.get(req_idx, 0) + 1

    def unpin(self, req_idx: int) -> None:
        n = self._pins[req_idx] - 1
        if n:
            self._pins[req_idx] = n
            return
        del self._pins[req_idx]
        if req_idx in self._deferred:
            self._deferred.discard(req_idx)
            self._free_now(req_idx)

    def pinned(self, req_idx: int) -> bool:
        return req_idx in self._pins

    # ---- freeing -------------------------------------------------------------------------------
    def free(self, req_idx: int) -> None:
        """The one free path: every page of every family the request holds (c4/c128 included), then
        the row itself with all its tables zeroed, so a reused row never points at someone else's page.
        A pinned row keeps everything until its last unpin.

        A row that holds no pages is just released. Raises ValueError for a row that is not in use
        (freed twice, or never handed out by `alloc_request`).
        """
        if not self.req_pool.is_allocated(req_idx) or req_idx in self._deferred:
            raise ValueError(f"request row {req_idx} is not allocated (double free, or never handed out)")
        if req_idx in self._pins:
            self._deferred.add(req_idx)
            return
        self._free_now(req_idx)

    def _free_now(self, req_idx: int) -> None:
        self.state_copies.cancel_restores(req_idx)  # before its page can go to another request
        r = self._reqs.pop(req_idx, None)
        if r is not None:  # pages shared with the cache or other rows only lose this holder
            self.pools["full"].free(r.full)
            for fam in ("swa", "c4s", "c128s"):
                self.pools[fam].free(list(getattr(r, fam).values()))
        self.req_pool._release_row(req_idx)
        self._log("free", req_idx)
