"""The PD write paths as pure functions: one-sided runs, the plans between pages and a packed span,
pieces of a pipelined write, and the cost model that picks a path per write.

Every path must leave the decode's pages holding exactly the prefill's bytes. Here each is run in
one process, Mooncake's part played by memmove over the planned entries, on real pools whose pages
are contiguous on one side, both or neither.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import pytest
import torch

from dsv4_engine.disagg.faults import page_digests
from dsv4_engine.disagg.protocol import stage_segments
from dsv4_engine.disagg.transfer import (
    COSTS,
    PATHS,
    PIECES,
    Costs,
    Entries,
    WriteShape,
    choose_write,
    plan_packed,
    plan_writes,
    side_runs,
    split_pieces,
    write_seconds,
    write_shape,
)
from dsv4_engine.memory import ExtendSpec, StateType, dsv4_state_payloads
from dsv4_engine.memory.staging import gather_pages, scatter_pages

SEQ = 700


def test_side_runs_follow_one_side_and_index_the_packed_pages() -> None:
    assert side_runs([]) == []
    assert side_runs([4, 5, 6, 9, 10]) == [(4, 0, 3), (9, 3, 2)]
    # Sentinels take no packed index, and do not break a run (ids decide, as in contiguous_runs).
    assert side_runs([0, 0, 7, 0, 8, 3]) == [(7, 0, 2), (3, 2, 1)]
    assert side_runs([5, 4]) == [(5, 0, 1), (4, 1, 1)]


def test_split_pieces_cuts_at_pages_into_about_equal_bytes() -> None:
    a, b = StateType.SWA, StateType.C4_STATE
    segments = [(a, 2, [3, 4, 0, 5, 6]), (b, 0, [0, 9])]
    page_bytes = {a: 10, b: 40}
    assert split_pieces(segments, page_bytes, 1) == [[(a, 2, 7), (b, 0, 2)]]
    assert split_pieces(segments, page_bytes, 2) == [[(a, 2, 7)], [(b, 1, 2)]]  # 40 and 40 bytes
    four = split_pieces(segments, page_bytes, 4)
    assert four == [[(a, 2, 5)], [(a, 5, 7)], [(b, 1, 2)]]  # a piece never splits a page
    assert split_pieces([(a, 0, [0, 0])], page_bytes, 3) == []  # nothing to pack
    for n in (1, 2, 3, 8):  # the pieces cover every real page once, in order
        pieces = split_pieces(segments, page_bytes, n)
        pages = [p for piece in pieces for t, lo, hi in piece for p in dict(segments_by(segments))[t][lo:hi]]
        assert [p for p in pages if p] == [3, 4, 5, 6, 9] and len(pieces) <= n


def segments_by(segments: list[tuple[StateType, int, list[int]]]) -> list[tuple[StateType, list[int]]]:
    """Each segment's page list placed at its positions (what the pieces index)."""
    return [(t, [0] * lo + pages) for t, lo, pages in segments]


# ---- every path on real pools ------------------------------------------------------------------


def apply(entries: Entries) -> None:
    """Mooncake's part: copy every entry (both sides live in this process)."""
    for src, dst, n in zip(entries.src, entries.dst, entries.lens, strict=True):
        ctypes.memmove(dst, src, n)


def placed(make_mem: Callable[..., object], scattered: bool, shift: int, decode: bool) -> tuple[object, dict]:
    """A request of SEQ tokens in fresh pools (one run per type), or with every other page of its
    pools taken by a request grown alongside (no two consecutive pages), `shift` pages off."""
    mem = make_mem(full_pages=60, swa_pages=24, state_pages=24, max_reqs=4, decode=decode)
    p = mem.layout.page_size
    for _ in range(shift):
        mem.alloc.alloc_extend([ExtendSpec(mem.alloc.alloc_request(), 0, p)])
    r, other = mem.alloc.alloc_request(), mem.alloc.alloc_request() if scattered else None
    for lo in range(0, SEQ, p):
        for req in (r, other) if other is not None else (r,):
            mem.alloc.alloc_extend([ExtendSpec(req, lo, min(lo + p, SEQ))])
    pages = {t: f() for t, f in dsv4_state_payloads(mem.kv, mem.req_pool, r, SEQ).items()}
    return mem, pages


def run_path(src_mem, src_pages, dst_mem, dst_pages, path: str, pieces: int) -> None:  # type: ignore[no-untyped-def]
    """One write of every page on `path`, as prefill.py plans and runs it."""
    comps = src_mem.kv.pd_state_components()
    src_ptrs = {c.state_type: c.data_ptrs for c in comps}
    dst_ptrs = {c.state_type: c.data_ptrs for c in dst_mem.kv.pd_state_components()}
    if path == "direct":
        apply(plan_writes(comps, dst_ptrs, src_pages, dst_pages))
        return
    page_bytes = {c.state_type: sum(c.item_lens) for c in comps}
    nbytes = sum(sum(1 for p in v if p) * page_bytes[t] for t, v in src_pages.items())
    arena, span = torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    parts = split_pieces([(t, 0, v) for t, v in src_pages.items()], page_bytes, pieces)
    at = 0
    for piece in parts:
        src_seg = [(t, src_pages[t][lo:hi]) for t, lo, hi in piece]
        dst_seg = [(t, dst_pages[t][lo:hi]) for t, lo, hi in piece]
        n = sum(sum(1 for p in v if p) * page_bytes[t] for t, v in src_seg)
        if path == "unpack_only":
            apply(plan_packed(comps, src_ptrs, src_seg, span.data_ptr() + at, into_packed=True))
        else:
            stage_segments(src_mem.kv, src_seg, arena[at : at + n], gather_pages)
            if path == "staged":
                apply(Entries.one(arena.data_ptr() + at, span.data_ptr() + at, n))
            else:
                apply(plan_packed(comps, dst_ptrs, dst_seg, arena.data_ptr() + at, into_packed=False))
        at += n
    assert at == nbytes
    if path in ("staged", "unpack_only"):  # the decode unpacks the segments in span order
        segments = [(t, dst_pages[t][lo:hi]) for piece in parts for t, lo, hi in piece]
        stage_segments(dst_mem.kv, segments, span, scatter_pages)


@pytest.mark.parametrize("layout", ["fresh", "scattered", "source contiguous", "destination contiguous"])
@pytest.mark.parametrize("path,pieces", [(p, 1) for p in PATHS] + [("staged", 3), ("pack_only", 4)])
def test_every_path_copies_exactly_the_prefill_bytes(make_mem, layout: str, path: str, pieces: int) -> None:  # type: ignore[no-untyped-def]
    src_scattered = layout in ("scattered", "destination contiguous")
    dst_scattered = layout in ("scattered", "source contiguous")
    src_mem, src_pages = placed(make_mem, src_scattered, shift=0, decode=False)
    dst_mem, dst_pages = placed(make_mem, dst_scattered, shift=1, decode=True)
    g = torch.Generator().manual_seed(1)
    for bufs in src_mem.kv.buffers_by_type().values():
        for b in bufs:
            b.copy_(torch.randn(b.shape, generator=g))
    for bufs in dst_mem.kv.buffers_by_type().values():
        for b in bufs:
            b.fill_(float("nan"))  # a page the path missed cannot pass
    run_path(src_mem, src_pages, dst_mem, dst_pages, path, pieces)
    assert page_digests(dst_mem.kv, dst_pages) == page_digests(src_mem.kv, src_pages)
    assert src_pages != dst_pages  # the two sides' page ids really differ


def test_write_shape_counts_each_sides_runs(make_mem) -> None:  # type: ignore[no-untyped-def]
    src_mem, src_pages = placed(make_mem, False, shift=0, decode=False)
    dst_mem, dst_pages = placed(make_mem, True, shift=1, decode=True)
    comps = src_mem.kv.pd_state_components()
    dst_ptrs = {c.state_type: c.data_ptrs for c in dst_mem.kv.pd_state_components()}
    direct = len(plan_writes(comps, dst_ptrs, src_pages, dst_pages))
    shape = write_shape(comps, src_pages, dst_pages, direct)
    buffers = sum(len(c.data_ptrs) for c in comps if any(src_pages[c.state_type]))
    assert shape.source_runs == buffers  # fresh: one run per type per buffer
    assert shape.destination_runs == direct > buffers  # scattered: every jump is an entry
    assert shape.nbytes == sum(sum(1 for p in src_pages[c.state_type] if p) * sum(c.item_lens) for c in comps)


# ---- the cost model ----------------------------------------------------------------------------

MIB4 = 4 << 20
# The small preset's 4096-token request (bench/pd_transfer.py): 23 entries from fresh pools, 302 with
# every other page taken on both sides.
FRESH = WriteShape(MIB4, direct=23, source_runs=23, destination_runs=23)
SCATTERED = WriteShape(MIB4, direct=302, source_runs=302, destination_runs=302)
SOURCE_CONTIGUOUS = WriteShape(MIB4, direct=302, source_runs=23, destination_runs=302)
DESTINATION_CONTIGUOUS = WriteShape(MIB4, direct=302, source_runs=302, destination_runs=23)


def test_the_model_picks_the_path_that_packs_only_the_scattered_side() -> None:
    both = {"can_pack": True, "can_unpack": True}
    assert choose_write(FRESH, **both) == ("direct", 1)
    assert choose_write(SCATTERED, **both)[0] == "staged"
    assert choose_write(SOURCE_CONTIGUOUS, **both) == ("unpack_only", 1)
    assert choose_write(DESTINATION_CONTIGUOUS, **both)[0] == "pack_only"
    assert choose_write(WriteShape(64, 1, 1, 1), **both) == ("direct", 1)  # the aux-sized write


def test_the_model_only_picks_paths_both_sides_have_room_for() -> None:
    assert choose_write(SCATTERED, can_pack=False, can_unpack=False) == ("direct", 1)
    # One side's arena alone: it pays only where the other side's pages are contiguous.
    assert choose_write(DESTINATION_CONTIGUOUS, can_pack=True, can_unpack=False)[0] == "pack_only"
    assert choose_write(SOURCE_CONTIGUOUS, can_pack=False, can_unpack=True) == ("unpack_only", 1)
    assert choose_write(SCATTERED, can_pack=True, can_unpack=False) == ("direct", 1)
    assert choose_write(SCATTERED, can_pack=False, can_unpack=True) == ("direct", 1)
    assert choose_write(SOURCE_CONTIGUOUS, can_pack=True, can_unpack=False) == ("direct", 1)


def test_pipelining_pays_only_when_packing_overlaps_something() -> None:
    perfect = Costs(**{**COSTS.__dict__, "overlap": 1.0, "piece": 0.0})
    none = Costs(**{**COSTS.__dict__, "overlap": 0.0})
    one = write_seconds(SCATTERED, "staged", 1, perfect)
    assert write_seconds(SCATTERED, "staged", 2, perfect) < one  # the pack hides behind the wire
    assert all(write_seconds(SCATTERED, "staged", k, none) >= one for k in PIECES)  # only costs
    assert choose_write(SCATTERED, can_pack=True, can_unpack=True, costs=none) == ("staged", 1)
    with pytest.raises(ValueError, match="cannot be cut"):
        write_seconds(SCATTERED, "unpack_only", 2)
    with pytest.raises(ValueError, match="unknown write path"):
        write_seconds(SCATTERED, "teleport")


def test_the_model_adds_up_its_measured_parts() -> None:
    c = COSTS
    assert write_seconds(SCATTERED, "direct") == pytest.approx(301 * c.entry + MIB4 * c.wire)
    assert write_seconds(SCATTERED, "staged") == pytest.approx(MIB4 * (c.pack + c.wire + c.unpack))
    assert write_seconds(SOURCE_CONTIGUOUS, "unpack_only") == pytest.approx(
        22 * c.entry + MIB4 * (c.wire + c.unpack)
    )
    assert write_seconds(DESTINATION_CONTIGUOUS, "pack_only") == pytest.approx(
        22 * c.entry + MIB4 * (c.pack + c.wire)
    )
