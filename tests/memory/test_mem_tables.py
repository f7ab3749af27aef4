"""Request tables: shapes, zero init, the shared mixin, and the one free path."""

from __future__ import annotations

import pytest
import torch

from dsv4_engine.memory import Dsv4ReqToTokenTablesMixin, ExtendSpec


@pytest.mark.parametrize("decode", [False, True])
def test_table_shapes_and_zero_init(make_mem, decode: bool) -> None:
    mem = make_mem(max_reqs=3, max_ctx=1024, decode=decode)
    pool = mem.req_pool
    assert isinstance(pool, Dsv4ReqToTokenTablesMixin)
    rows = 3 + (2 if decode else 0)  # the decode pool carries pre-allocation rows
    expected = {
        "req_to_token": 1024,
        "req_to_token_swa": 1024,
        "req_to_token_c4": 256,
        "req_to_token_c128": 8,
        "req_to_token_c4_state": 1024,
        "req_to_token_c128_state": 1024,
    }
    for name, cols in expected.items():
        table = getattr(pool, name)
        assert tuple(table.shape) == (rows, cols), name
        assert table.dtype == torch.int32
        assert int(table.abs().sum()) == 0, name
    assert pool.available_size() == rows


@pytest.mark.parametrize("decode", [False, True])
def test_free_goes_through_allocator_and_clears_rows(make_mem, decode: bool) -> None:
    mem = make_mem(decode=decode)
    initial = mem.alloc.num_free()
    r = mem.req_pool.alloc()
    mem.alloc.alloc_extend([ExtendSpec(r, 0, 700)])
    assert mem.alloc.num_free() != initial
    mem.req_pool.free(r)
    assert mem.alloc.num_free() == initial  # c4/c128 (full) pages, SWA and both states released
    for name in ("req_to_token", *mem.req_pool.DSV4_TABLES):
        assert int(getattr(mem.req_pool, name)[r].abs().sum()) == 0, name
    with pytest.raises(ValueError, match="not allocated"):
        mem.req_pool.free(r)


def test_rows_are_reused_clean(make_mem) -> None:
    mem = make_mem(max_reqs=1)
    r = mem.req_pool.alloc()
    mem.alloc.alloc_extend([ExtendSpec(r, 0, 300)])
    assert mem.req_pool.alloc() is None  # one row only
    mem.req_pool.free(r)
    r2 = mem.req_pool.alloc()
    assert r2 == r
    assert mem.alloc.seq_len(r2) == 0
    mem.alloc.alloc_extend([ExtendSpec(r2, 0, 10)])  # starts from scratch, no stale prefix
    assert mem.alloc.held_pages(r2)["full"] == 1
