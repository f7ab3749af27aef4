"""The prefix cache's memory side: page holders, what a snapshot keeps, resuming, eviction, replay.

Layout (conftest): page 128, window 16, layers [swa, c4, c128, swa]. A prefix P = 256 cached by a row
whose chunk ended there keeps full pages 0-1, the SWA page of [240, 256) (page 1) and, in a snapshot
slot, the C4 state rows of block [252, 256); C128 has no partial block at a multiple of 128.
"""

from __future__ import annotations

import pytest

from dsv4_engine.memory import ExtendSpec, OutOfPages, PagePool
from dsv4_engine.memory.req_to_token import Dsv4ReqToTokenPool
from dsv4_engine.memory.state_copies import StateCopy
from dsv4_engine.testing import random_ids

TOKENS = random_ids(600, seed=11)
TABLES = Dsv4ReqToTokenPool.TABLES


def test_page_holders_and_evictable_count() -> None:
    pool = PagePool("t", 4)
    a, b = pool.alloc(2)
    pool.cache_hold(a)
    assert pool.num_evictable == 0 and pool.releasable(
        a
    )  # its one request holder letting go frees it for the cache
    pool.free([a])  # the request lets go: the cache alone holds it
    assert pool.num_free == 2 and pool.num_evictable == 1
    pool.share([a])  # a request resumes from it
    assert pool.num_evictable == 0 and pool.holders(a) == 2
    pool.cache_drop(a)
    assert pool.num_evictable == 0 and pool.num_free == 2
    pool.free([a])
    assert pool.num_free == 3
    with pytest.raises(ValueError, match="double free"):
        pool.free([a])
    with pytest.raises(ValueError, match="does not hold"):
        pool.cache_drop(b)
    pool.cache_hold(b)
    pool.cache_hold(b)  # two snapshots may keep one SWA page (a window longer than a page)
    pool.free([b])
    assert pool.num_evictable == 1
    pool.cache_drop(b)
    assert pool.num_evictable == 1 and pool.num_free == 3
    pool.cache_drop(b)
    assert pool.num_evictable == 0 and pool.num_free == 4


def _prefill(a, r: int, ends: list[int]) -> None:
    start = a.seq_len(r)
    for end in ends:
        a.alloc_extend([ExtendSpec(r, start, end)])
        start = end


def _tables(pool, r: int, n: int) -> dict[str, list[int]]:
    """Row r's entries for positions (or blocks) below n, per table."""
    cols = {"req_to_token_c4": n // 4, "req_to_token_c128": n // 128}
    return {t: getattr(pool, t)[r, : cols.get(t, n)].tolist() for t in TABLES}


def test_snapshot_keeps_what_resuming_at_the_boundary_reads(make_mem) -> None:
    mem = make_mem(prefix_cache=True)
    a, pool = mem.alloc, mem.req_pool
    r = a.alloc_request()
    _prefill(a, r, [128, 256])
    a.cache_prefix(r, TOKENS[:256])
    cache = a.prefix_cache
    assert cache is not None and cache.num_nodes == 2 and cache.num_snapshots == 1
    held = a.pages_of(r)
    hit = cache.match(TOKENS, 599, touch=False)
    assert hit.length == 256 and hit.matched == 256 and list(hit.full) == held["full"][:2]
    assert set(hit.snapshot) == {"swa"} and hit.slot == 1  # C128: no partial block at 256
    assert list(hit.snapshot["swa"]) == [1]
    row = int(pool.req_to_token_c4_state[r, 252])  # the state slot of position 252 (P - 4)
    assert a.take_state_copies() == [StateCopy(slot=1, row=row, save=True, req_idx=r, position=256)]
    before = _tables(pool, r, 256)
    a.alloc_extend([ExtendSpec(r, 256, 300)])  # the row moves on; its pages below 256 never change
    a.free(r)
    # Nothing the cache keeps went back to the pools; everything else did: no C4 state page, one slot.
    assert a.num_available() == {f: p.num_pages for f, p in a.pools.items()}
    assert {f: p.num_pages - p.num_free for f, p in a.pools.items()} == {
        "full": 2,
        "swa": 1,
        "c4s": 0,
        "c128s": 0,
    }
    assert a.snapshot_slots.num_free == a.snapshot_slots.num_pages - 1

    # A new row resumes: its tables read exactly what the first row's did, within what a step from
    # 256 reads (the SWA window [240, 256) and the C4 state of [252, 256)).
    r2 = a.alloc_request()
    assert a.match_prefix(r2, TOKENS, 599).length == 256 and a.seq_len(r2) == 256
    after = _tables(pool, r2, 256)
    for t in ("req_to_token", "req_to_token_c4", "req_to_token_c128"):
        assert after[t] == before[t], t
    assert after["req_to_token_swa"][240:] == before["req_to_token_swa"][240:]
    # Its C4 state page of [128, 256) is its own; the slot's rows go back to [252, 256) of it.
    (own,) = a.pages_of(r2)["c4s"]
    assert after["req_to_token_c4_state"][128:] == list(range(own * 128, own * 128 + 128))
    assert a.take_state_copies() == [
        StateCopy(slot=1, row=own * 128 + 124, save=False, req_idx=r2, position=256)
    ]
    a.alloc_extend([ExtendSpec(r2, 256, 400)])  # the step reads the shared pages, writes its own
    assert a.pages_of(r2)["full"][:2] == list(hit.full)
    a.free(r2)
    a.flush_cache()
    assert a.num_free() == {f: p.num_pages for f, p in a.pools.items()}
    assert a.snapshot_slots.num_free == a.snapshot_slots.num_pages


def test_a_chunk_past_the_boundary_leaves_its_snapshot_and_only_the_latest(make_mem) -> None:
    """A chunk [0, 300) also writes the C4 state of block [252, 256), so the boundary 256 is
    resumable after it. Once the row reached the next boundary (384), 256 keeps only its full pages:
    a junction the scheduler can end a chunk at, nothing to resume from."""
    mem = make_mem(prefix_cache=True)
    a = mem.alloc
    r = a.alloc_request()
    _prefill(a, r, [300])
    a.cache_prefix(r, TOKENS[:256])
    cache = a.prefix_cache
    assert cache is not None and cache.num_snapshots == 1
    r2 = a.alloc_request()
    _prefill(a, r2, [400])
    a.cache_prefix(r2, random_ids(400, seed=12)[:256])
    assert cache.num_snapshots == 1 and cache.num_nodes == 4
    r3 = a.alloc_request()
    hit = a.match_prefix(r3, random_ids(400, seed=12), 399)
    assert hit.length == 0 and hit.matched == 256 and a.seq_len(r3) == 0
    r4 = a.alloc_request()
    assert a.match_prefix(r4, TOKENS, 599).length == 256


def test_eviction_is_lru_and_never_takes_a_running_rows_page(make_mem) -> None:
    mem = make_mem(prefix_cache=True, full_pages=6)
    a = mem.alloc
    prompts = [random_ids(300, seed=s) for s in range(3)]
    rows = []
    for p in prompts:
        r = a.alloc_request()
        _prefill(a, r, [128])
        a.cache_prefix(r, p[:128])
        rows.append(r)
    a.free(rows[0])
    a.free(rows[1])  # prompt 2's row keeps running
    cache = a.prefix_cache
    assert cache is not None
    cache.match(prompts[0], 299)  # prompt 0 is now more recent than prompt 1
    assert a.num_available()["full"] == 5 and a.num_free()["full"] == 3
    r = a.alloc_request()
    a.alloc_extend([ExtendSpec(r, 0, 512)])  # 4 pages: one cached page must go, prompt 1's
    assert cache.match(prompts[1], 299, touch=False).length == 0
    assert cache.match(prompts[0], 299, touch=False).length == 128
    with pytest.raises(OutOfPages):  # prompt 2's page is its running row's: not available
        a.alloc_extend([ExtendSpec(r, 512, 1024)])
    assert a.seq_len(r) == 512  # the failed step changed nothing


def test_a_release_into_the_cache_then_eviction_funds_the_step(make_mem) -> None:
    """Short of free pages, a step's own releases go first: an SWA page it gives up that a snapshot
    also holds becomes evictable, and eviction then frees the page the step takes."""
    mem = make_mem(prefix_cache=True, swa_pages=3)
    a = mem.alloc
    r = a.alloc_request()
    _prefill(a, r, [128, 256])  # SWA pages of positions [0, 128) and [128, 256)
    a.cache_prefix(r, TOKENS[:256])  # the snapshot keeps the second (the window before 256)
    _prefill(a, r, [400])  # gives up the first, takes [256, 384) and [384, 512)
    assert a.num_free()["swa"] == 0 and a.num_available()["swa"] == 0
    # [400, 768) needs two pages and gives up [128, 256) (the snapshot's) and [256, 384): only one is
    # free after the releases, the other comes from evicting the snapshot.
    _prefill(a, r, [768])
    cache = a.prefix_cache
    assert cache is not None and cache.num_snapshots == 0 and cache.num_nodes == 2
    assert a.num_free()["swa"] == 0 and a.held_pages(r)["swa"] == 3


def test_replicas_replay_the_cache(make_mem) -> None:
    """A tensor-parallel server's other ranks replay rank 0's journal, cache operations included, and
    end with the same pages and tables."""
    lead, follower = make_mem(prefix_cache=True, full_pages=8), make_mem(prefix_cache=True, full_pages=8)
    a = lead.alloc
    a.record()
    r = a.alloc_request()
    _prefill(a, r, [128, 256])
    a.cache_prefix(r, TOKENS[:256])
    taken = a.take_state_copies()  # the model runner's, after each step and before each forward
    a.free(r)
    r = a.alloc_request()
    a.match_prefix(r, TOKENS, 599)
    taken += a.take_state_copies()
    _prefill(a, r, [512])
    a.cache_prefix(r, TOKENS[:512])
    taken += a.take_state_copies()
    _prefill(a, r, [600])
    a.free(r)
    r2 = a.alloc_request()
    _prefill(a, r2, [640])  # five pages of eight, four cached: one leaf is evicted
    assert a.prefix_cache is not None and a.prefix_cache.num_nodes == 3
    a.flush_cache()
    ran: list[StateCopy] = []
    follower.alloc.replay(a.take_journal(), ran.extend)
    assert ran == taken and [c.save for c in taken] == [True, False, True]
    assert follower.alloc.num_free() == a.num_free()
    assert follower.alloc.snapshot_slots.num_free == a.snapshot_slots.num_free
    for t in TABLES:
        assert getattr(follower.req_pool, t).equal(getattr(lead.req_pool, t)), t
