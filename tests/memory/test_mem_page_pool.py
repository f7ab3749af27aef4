"""PagePool: the lowest free ids first, in ascending order (contiguous runs for PD transfers), and its
range / double-free checks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_engine.memory import OutOfPages, PagePool


def test_fresh_pool_gives_consecutive_ids() -> None:
    pool = PagePool("t", 10)
    assert pool.alloc(4) == [1, 2, 3, 4]
    assert pool.alloc(3) == [5, 6, 7]
    assert pool.num_free == 3 and pool.num_used == 7


def test_after_interleaved_frees_alloc_is_ascending_lowest_first() -> None:
    pool = PagePool("t", 12)
    pages = pool.alloc(12)
    pool.free([pages[i] for i in (9, 1, 7, 3, 5)])  # ids 10, 2, 8, 4, 6, freed out of order
    assert pool.alloc(3) == [2, 4, 6]
    pool.free([12, 1])
    assert pool.alloc(4) == [1, 8, 10, 12]
    assert pool.num_free == 0
    with pytest.raises(OutOfPages, match="need 1 pages, 0 free"):
        pool.alloc(1)


def test_range_and_double_free_checks_leave_the_pool_unchanged() -> None:
    pool = PagePool("t", 4)
    pool.alloc(3)
    for bad, match in (([0], "out of range"), ([5], "out of range"), ([4], "double free"),
                       ([1, 1], "double free"), ([2, 9], "out of range")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            pool.free(bad)
        assert pool.num_free == 1, bad  # nothing of a rejected list was freed
    pool.free([3, 1])
    assert pool.alloc(3) == [1, 3, 4]


@settings(max_examples=50, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 6), st.randoms()), max_size=40))
def test_alloc_always_returns_the_lowest_free_ids(ops) -> None:
    pool, free = PagePool("t", 16), set(range(1, 17))
    for is_alloc, n, rnd in ops:
        if is_alloc:
            n = min(n, len(free))
            got = pool.alloc(n)
            assert got == sorted(free)[:n]
            free -= set(got)
        else:
            used = sorted(set(range(1, 17)) - free)
            back = rnd.sample(used, min(n, len(used)))
            pool.free(back)
            free |= set(back)
        assert pool.num_free == len(free)
