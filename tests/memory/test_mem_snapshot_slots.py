"""Prefix-cache snapshots keep the C4 state of block [P-4, P) in a 4-row slot, not a state page.

A fake forward writes every state row a step's bundle names with a value of the tokens up to that
position, so two rows hold the same value exactly when they are the same prefix's state. Layout
(conftest): page 128, window 16, layers [swa, c4, c128, swa].
"""

from __future__ import annotations

import torch

from dsv4_engine.memory import ExtendSpec
from dsv4_engine.testing import random_ids

TOKENS = random_ids(600, seed=21)
OTHER = TOKENS[:256] + random_ids(100, seed=22)  # shares [0, 256) with TOKENS


def _value(tokens: list[int]) -> float:
    return float(hash(tuple(tokens)) % 9973 + 1)  # never 0 (the sentinel's kv)


def _state_bufs(mem) -> list[torch.Tensor]:
    return [*mem.kv.c4_state.values(), *mem.kv.c4_index_state.values()]


def _flat(buf: torch.Tensor) -> torch.Tensor:
    return buf.view(-1, buf.shape[-1])


def _step(mem, r: int, end: int, tokens: list[int]) -> None:
    """One step of row r to `end`, as the model runner runs it: the queued copies, then the forward's
    state writes."""
    start = mem.alloc.seq_len(r)
    bundle = mem.alloc.alloc_extend([ExtendSpec(r, start, end)])
    mem.kv.apply_state_copies(mem.alloc.take_state_copies())
    locs = bundle.out_c4_state_loc.tolist()
    for pos, loc in zip(range(end - len(locs), end), locs, strict=True):
        for buf in _state_bufs(mem):
            _flat(buf)[loc] = _value(tokens[: pos + 1])


def _rows(mem, r: int, lo: int, hi: int) -> list[torch.Tensor]:
    """Row r's C4 state of positions [lo, hi), every buffer, read through its table."""
    locs = mem.req_pool.req_to_token_c4_state[r, lo:hi].long()
    return [_flat(buf)[locs].clone() for buf in _state_bufs(mem)]


def test_a_resume_reads_the_rows_a_request_that_prefilled_them_wrote(make_mem) -> None:
    mem, ref = make_mem(prefix_cache=True), make_mem()
    a = mem.alloc
    r = a.alloc_request()
    _step(mem, r, 128, TOKENS)
    _step(mem, r, 300, TOKENS)  # runs past 256, and leaves block [252, 256)'s state behind
    a.cache_prefix(r, TOKENS[:256])
    at_snapshot = _rows(mem, r, 252, 256)
    mem.kv.apply_state_copies(a.take_state_copies())  # after the step, as the engine does
    (slot,) = [n.slot for n in a.prefix_cache._nodes() if n.slot]
    snaps = [*mem.kv.c4_state_snap.values(), *mem.kv.c4_index_state_snap.values()]
    for snap, rows in zip(snaps, at_snapshot, strict=True):
        assert snap[slot].equal(rows)  # the slot holds the rows as they were when it was taken
    _step(mem, r, 600, TOKENS)  # the row moves on and gives up its state page of [128, 256)
    a.free(r)
    assert a.num_free()["c4s"] == a.pools["c4s"].num_pages  # the snapshot holds no state page
    for buf in _state_bufs(mem):
        buf[1:] = -7.0  # whatever the pages held is gone: only the slot can give the rows back

    r2 = a.alloc_request()
    assert a.match_prefix(r2, OTHER, len(OTHER) - 1).length == 256
    _step(mem, r2, 300, OTHER)
    ref_row = ref.alloc.alloc_request()
    _step(ref, ref_row, 300, OTHER)  # the same prompt prefilled from 0, no cache
    for got, want in zip(_rows(mem, r2, 252, 256), _rows(ref, ref_row, 252, 256), strict=True):
        assert got.equal(want)
    assert bool((_rows(mem, r2, 252, 256)[0] > 0).all())  # real values, not the sentinel or the fill


def test_slots_are_their_own_pool_evicted_and_flushed_with_their_snapshots(make_mem) -> None:
    mem = make_mem(prefix_cache=True, snapshot_slots=2)
    a, slots = mem.alloc, mem.alloc.snapshot_slots
    prompts = [random_ids(300, seed=30 + i) for i in range(3)]
    for p in prompts:
        r = a.alloc_request()
        _step(mem, r, 256, p)
        a.cache_prefix(r, p[:256])
        mem.kv.apply_state_copies(a.take_state_copies())
        a.free(r)
    cache = a.prefix_cache
    assert cache is not None and cache.num_snapshots == 2 and slots.num_free == 0
    assert a.num_free()["c4s"] == a.pools["c4s"].num_pages  # no snapshot holds a C4 state page
    # The least recently taken snapshot gave its slot to the third: prompt 0 keeps its full pages.
    assert [cache.match(p, 299, touch=False).length for p in prompts] == [0, 256, 256]
    a.flush_cache()
    assert a.num_free() == {f: p.num_pages for f, p in a.pools.items()}
    assert slots.num_free == slots.num_pages


def test_queued_copies_are_cancelled_with_their_owner(make_mem) -> None:
    """A snapshot dropped before its save ran, or a resumed request freed before its restore ran:
    the copy is dropped with what it held, and every pool is back at its initial free count."""
    mem = make_mem(prefix_cache=True)
    a, slots = mem.alloc, mem.alloc.snapshot_slots
    r = a.alloc_request()
    _step(mem, r, 256, TOKENS)
    a.cache_prefix(r, TOKENS[:256])
    a.free(r)  # the queued save still holds the state page it reads
    assert a.num_free()["c4s"] == a.pools["c4s"].num_pages - 1
    a.flush_cache()
    assert a.take_state_copies() == []
    assert a.num_free() == {f: p.num_pages for f, p in a.pools.items()} and slots.num_free == slots.num_pages

    r = a.alloc_request()
    _step(mem, r, 256, TOKENS)
    a.cache_prefix(r, TOKENS[:256])
    mem.kv.apply_state_copies(a.take_state_copies())
    a.free(r)
    r2 = a.alloc_request()
    assert a.match_prefix(r2, OTHER, 299).length == 256
    a.flush_cache()  # the queued restore still holds the slot
    assert slots.num_free == slots.num_pages - 1
    a.free(r2)  # preempted before its first step
    assert a.take_state_copies() == []
    assert a.num_free() == {f: p.num_pages for f, p in a.pools.items()} and slots.num_free == slots.num_pages
