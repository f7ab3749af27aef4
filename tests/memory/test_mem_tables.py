"""Request tables and who owns their rows: shapes, zero init, and the allocator's one free path."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

from dsv4_engine.memory import (
    Dsv4Allocator,
    Dsv4DecodeReqToTokenPool,
    Dsv4ReqToTokenPool,
    ExtendSpec,
    PagedMemory,
)
from dsv4_engine.memory import req_to_token as req_to_token_module


@pytest.mark.parametrize("decode", [False, True])
def test_table_shapes_and_zero_init(make_mem, decode: bool) -> None:
    mem = make_mem(max_reqs=3, max_ctx=1024, decode=decode)
    pool = mem.req_pool
    assert isinstance(pool, Dsv4DecodeReqToTokenPool) == decode
    rows = 3 + (2 if decode else 0)  # the decode pool carries pre-allocation rows
    expected = {
        "req_to_token": 1024,
        "req_to_token_swa": 1024,
        "req_to_token_c4": 256,
        "req_to_token_c128": 8,
        "req_to_token_c4_state": 1024,
        "req_to_token_c128_state": 1024,
    }
    assert set(pool.TABLES) == set(expected)
    for name, cols in expected.items():
        table = getattr(pool, name)
        assert tuple(table.shape) == (rows, cols), name
        assert table.dtype == torch.int32
        assert int(table.abs().sum()) == 0, name
    assert mem.alloc.num_free_requests() == rows
    assert [mem.alloc.alloc_request() for _ in range(rows)] == list(range(rows))
    assert mem.alloc.alloc_request() is None and mem.alloc.num_free_requests() == 0


def test_build_pre_alloc_rows(make_mem) -> None:
    base = make_mem()
    layout, sizes = base.layout, base.sizes
    plain = PagedMemory.build(layout, sizes, max_reqs=3, max_ctx=512)
    assert type(plain.req_pool) is Dsv4ReqToTokenPool and plain.allocator.num_free_requests() == 3
    dec = PagedMemory.build(layout, sizes, max_reqs=3, max_ctx=512, pre_alloc_rows=4)
    assert isinstance(dec.req_pool, Dsv4DecodeReqToTokenPool) and dec.req_pool.pre_alloc_size == 4
    assert dec.allocator.num_free_requests() == 7 and dec.req_pool.num_rows == 7
    with pytest.raises(ValueError, match="pre_alloc_rows"):
        PagedMemory.build(layout, sizes, max_reqs=3, max_ctx=512, pre_alloc_rows=-1)


@pytest.mark.parametrize("decode", [False, True])
def test_pool_has_no_back_reference_and_no_public_row_release(make_mem, decode: bool) -> None:
    mem = make_mem(decode=decode)
    pool = mem.req_pool
    assert mem.alloc.req_pool is pool
    # Nothing on the pool points back at an allocator: the pool is only tables and row bookkeeping.
    assert not any(isinstance(v, Dsv4Allocator) for v in vars(pool).values())
    assert not any("allocator" in name for name in vars(pool))
    # Rows are handed out and released by the allocator only.
    for name in ("alloc", "free", "available_size", "register_dsv4_allocator"):
        assert not hasattr(pool, name), name
    # The module does not import the allocator, not even for type checking.
    tree = ast.parse(inspect.getsource(req_to_token_module))
    imported = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)] + [
        alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    ]
    assert not any("allocator" in m for m in imported), imported


@pytest.mark.parametrize("decode", [False, True])
def test_free_releases_pages_row_and_zeroes_every_table(make_mem, decode: bool) -> None:
    mem = make_mem(decode=decode)
    initial, rows0 = mem.alloc.num_free(), mem.alloc.num_free_requests()
    r = mem.alloc.alloc_request()
    assert mem.req_pool.is_allocated(r) and mem.alloc.num_free_requests() == rows0 - 1
    mem.alloc.alloc_extend([ExtendSpec(r, 0, 700)])
    assert mem.alloc.num_free() != initial
    for name in mem.req_pool.TABLES:
        assert int(getattr(mem.req_pool, name)[r].abs().sum()) > 0, name
    mem.alloc.free(r)
    assert mem.alloc.num_free() == initial  # c4/c128 (full) pages, SWA and both states released
    assert mem.alloc.num_free_requests() == rows0 and not mem.req_pool.is_allocated(r)
    assert mem.alloc.held_pages(r) == {"full": 0, "swa": 0, "c4s": 0, "c128s": 0}
    for name in mem.req_pool.TABLES:
        assert int(getattr(mem.req_pool, name)[r].abs().sum()) == 0, name


def test_double_free_and_unknown_rows_raise(make_mem) -> None:
    mem = make_mem(max_reqs=2)
    r = mem.alloc.alloc_request()
    mem.alloc.alloc_extend([ExtendSpec(r, 0, 200)])
    mem.alloc.free(r)
    free_after = mem.alloc.num_free()
    with pytest.raises(ValueError, match="not allocated"):
        mem.alloc.free(r)
    assert mem.alloc.num_free() == free_after and mem.alloc.num_free_requests() == 2  # unchanged
    never = 1 - r
    with pytest.raises(ValueError, match="not allocated"):
        mem.alloc.free(never)  # a row never handed out
    # Nor can pages go to a row the allocator has not handed out.
    with pytest.raises(ValueError, match="alloc_request"):
        mem.alloc.alloc_extend([ExtendSpec(never, 0, 10)])
    assert mem.alloc.num_free() == free_after


def test_prealloc_needs_a_handed_out_row(make_mem) -> None:
    mem = make_mem(decode=True)
    with pytest.raises(ValueError, match="alloc_request"):
        mem.alloc.alloc_prealloc(0, 300)
    r = mem.alloc.alloc_request()
    mem.alloc.alloc_prealloc(r, 300)
    mem.alloc.free(r)
    assert mem.alloc.num_free() == {f: p.num_pages for f, p in mem.alloc.pools.items()}


def test_free_of_a_row_without_pages_just_releases_it(make_mem) -> None:
    mem = make_mem(max_reqs=1)
    initial = mem.alloc.num_free()
    r = mem.alloc.alloc_request()
    assert mem.alloc.alloc_request() is None
    mem.alloc.free(r)
    assert mem.alloc.num_free() == initial and mem.alloc.num_free_requests() == 1


def test_rows_are_reused_clean(make_mem) -> None:
    mem = make_mem(max_reqs=1)
    r = mem.alloc.alloc_request()
    mem.alloc.alloc_extend([ExtendSpec(r, 0, 300)])
    assert mem.alloc.alloc_request() is None  # one row only
    mem.alloc.free(r)
    r2 = mem.alloc.alloc_request()
    assert r2 == r
    assert mem.alloc.seq_len(r2) == 0
    mem.alloc.alloc_extend([ExtendSpec(r2, 0, 10)])  # starts from scratch, no stale prefix
    assert mem.alloc.held_pages(r2)["full"] == 1
