"""Allocator: prefix-aware extends, the bundle, state tail, watermark eviction, window release.

Layout: page 128, window 16, layers [swa, c4, c128, swa]. Expected values are worked out by hand in
the comments from the seed's formulas.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_engine.memory import ExtendSpec, OutOfPages
from dsv4_engine.memory.state_tail import c4_state_alloc_len, c128_state_alloc_len


def nonzero_range(row: torch.Tensor) -> tuple[int, int] | None:
    idx = torch.nonzero(row).flatten()
    return (int(idx[0]), int(idx[-1]) + 1) if idx.numel() else None


def test_state_tail_formula_hand_cases() -> None:
    # tail = seq % 128; c4 keeps 128 more when tail <= 3 (the overlap's previous block).
    assert [c4_state_alloc_len(n) for n in (0, 3, 100, 128, 131, 132, 300)] == [0, 3, 100, 128, 131, 4, 44]
    assert [c128_state_alloc_len(n) for n in (0, 127, 128, 300)] == [0, 127, 0, 44]


def test_prefix_aware_chunks_allocate_only_what_they_add(make_mem) -> None:
    mem = make_mem()
    a, pool = mem.alloc, mem.req_pool
    r = a.alloc_request()
    free0 = a.num_free()
    b1 = a.alloc_extend([ExtendSpec(r, 0, 256)])
    assert a.held_pages(r)["full"] == 2 and free0["full"] - a.num_free()["full"] == 2
    b2 = a.alloc_extend([ExtendSpec(r, 256, 300)])
    assert a.held_pages(r)["full"] == 3  # one more page for positions 256..299
    page2 = int(pool.req_to_token[r, 256]) // 128
    assert b2.out_full_loc.tolist() == [page2 * 128 + i for i in range(44)]
    assert b1.c4_counts == [64] and b2.c4_counts == [11]  # blocks 64..74 complete in chunk 2
    assert b1.c128_counts == [2] and b2.c128_counts == [0]
    # c4 rows of chunk 2 live in full page 2, rows 0..10 of its 32 rows.
    assert b2.out_c4_loc.tolist() == [page2 * 32 + i for i in range(11)]
    with pytest.raises(ValueError, match="prefix_len 200"):
        a.alloc_extend([ExtendSpec(r, 200, 310)])


def test_bundle_concatenates_batch_and_matches_tables(make_mem) -> None:
    mem = make_mem()
    a, pool = mem.alloc, mem.req_pool
    r0, r1 = a.alloc_request(), a.alloc_request()
    b = a.alloc_extend([ExtendSpec(r0, 0, 130), ExtendSpec(r1, 0, 7)])
    assert b.extend_counts == [130, 7]
    assert b.out_full_loc.numel() == 137 and b.out_swa_loc.numel() == 137
    assert b.out_full_loc[:130].tolist() == pool.req_to_token[r0, :130].tolist()
    assert b.out_swa_loc[130:].tolist() == pool.req_to_token_swa[r1, :7].tolist()
    assert b.c4_counts == [32, 1] and b.out_c4_loc.numel() == 33
    assert b.c128_counts == [1, 0] and b.out_c128_loc.numel() == 1
    # A c4 row is the full slot of its block's last token divided by 4 (one page id, every pool).
    full = b.out_full_loc
    pos = torch.cat([torch.arange(130), torch.arange(7)])
    assert b.out_c4_loc.tolist() == (full[pos % 4 == 3] // 4).tolist()
    assert b.out_c128_loc.tolist() == (full[pos % 128 == 127] // 128).tolist()
    # State tails: r0 seq 130 -> tail 2 <= 3, so c4 keeps [0, 130); c128 keeps [128, 130). r1: [0, 7).
    assert b.c4_state_counts == [130, 7] and b.c128_state_counts == [2, 7]
    assert b.out_c4_state_loc[:130].tolist() == pool.req_to_token_c4_state[r0, :130].tolist()
    assert nonzero_range(pool.req_to_token_c128_state[r0]) == (128, 256)  # whole page 1 mapped
    assert int(pool.req_to_token_c128_state[r0, :128].abs().sum()) == 0  # page 0: not in the tail
    assert all(v > 0 for v in b.out_c128_state_loc.tolist())


def test_state_tail_after_prefill(make_mem) -> None:
    mem = make_mem()
    a, pool = mem.alloc, mem.req_pool
    r = a.alloc_request()
    a.alloc_extend([ExtendSpec(r, 0, 300)])
    # tail 44: both states keep [256, 300) -> page 2; c4 also writes the block [252, 256) before the
    # last page boundary (a prefix-cache snapshot at 256 reads it) -> page 1 too.
    assert nonzero_range(pool.req_to_token_c4_state[r]) == (128, 384)
    assert nonzero_range(pool.req_to_token_c128_state[r]) == (256, 384)
    assert a.held_pages(r) == {"full": 3, "swa": 3, "c4s": 2, "c128s": 1}
    r2 = a.alloc_request()
    a.alloc_extend([ExtendSpec(r2, 0, 257)])
    # tail 1: c4 keeps [128, 257) -> pages 1, 2; c128 keeps [256, 257) -> page 2.
    assert nonzero_range(pool.req_to_token_c4_state[r2]) == (128, 384)
    assert a.held_pages(r2)["c4s"] == 2 and a.held_pages(r2)["c128s"] == 1


def decode_to(a, r: int, seq: int) -> None:
    while a.seq_len(r) < seq:
        a.alloc_decode([r])


def test_watermark_eviction_of_old_state(make_mem) -> None:
    mem = make_mem()
    a, pool = mem.alloc, mem.req_pool
    r = a.alloc_request()
    a.alloc_extend([ExtendSpec(r, 0, 300)])
    decode_to(a, r, 408)
    # step 407->408: c4 keep_from = min(offset(408)=384, 407-24=383) = 383: page 2 [256, 384) kept.
    assert sorted(k for k in range(16) if int(pool.req_to_token_c4_state[r, k * 128]) > 0) == [2, 3]
    decode_to(a, r, 409)
    # step 408->409: min(384, 384) = 384 -> page 2 evicted, its table entries back to the sentinel.
    assert nonzero_range(pool.req_to_token_c4_state[r]) == (384, 512)
    assert a.held_pages(r)["c4s"] == 1
    # c128: keep_from = min(offset(seq), prefix - 192); page 2 goes once prefix reaches 576.
    decode_to(a, r, 576)
    assert a.held_pages(r)["c128s"] == 3  # pages 2, 3, 4
    decode_to(a, r, 577)
    assert a.held_pages(r)["c128s"] == 2
    assert nonzero_range(pool.req_to_token_c128_state[r]) == (384, 640)


def test_window_release_bounds_swa(make_mem) -> None:
    mem = make_mem(window=16)
    a, pool = mem.alloc, mem.req_pool
    r = a.alloc_request()
    a.alloc_extend([ExtendSpec(r, 0, 300)])
    assert a.held_pages(r)["swa"] == 3  # the step in flight holds all it writes
    a.alloc_decode([r])  # 300 -> 301: keep_from 284, pages 0 and 1 released
    assert a.held_pages(r)["swa"] == 1
    assert nonzero_range(pool.req_to_token_swa[r]) == (256, 384)
    decode_to(a, r, 385)  # page 3 opened, page 2 still within reach of 384 - 16
    assert a.held_pages(r)["swa"] == 2
    decode_to(a, r, 401)  # 400 -> 401: keep_from 384, page 2 released
    assert nonzero_range(pool.req_to_token_swa[r]) == (384, 512)
    decode_to(a, r, 1500)
    assert a.held_pages(r)["swa"] <= 2 and a.held_pages(r)["full"] == 12


def test_out_of_pages_changes_nothing(make_mem) -> None:
    mem = make_mem(full_pages=3)
    a, pool = mem.alloc, mem.req_pool
    r0, r1 = a.alloc_request(), a.alloc_request()
    a.alloc_extend([ExtendSpec(r0, 0, 200)])
    before = a.num_free()
    c4_row = pool.req_to_token_c4[r1].clone()
    with pytest.raises(OutOfPages, match="full pool"):
        a.alloc_extend([ExtendSpec(r0, 200, 260), ExtendSpec(r1, 0, 200)])  # needs 1 + 2 > 1 free
    assert a.num_free() == before and a.seq_len(r0) == 200 and a.seq_len(r1) == 0
    assert torch.equal(pool.req_to_token_c4[r1], c4_row)
    assert not a.can_alloc([ExtendSpec(r1, 0, 200)]) and a.can_alloc([ExtendSpec(r1, 0, 128)])


def test_decode_prealloc_matches_prefill_holdings(make_mem) -> None:
    prefill, decode = make_mem(), make_mem(decode=True)
    rp, rd = prefill.alloc.alloc_request(), decode.alloc.alloc_request()
    prefill.alloc.alloc_extend([ExtendSpec(rp, 0, 256)])
    prefill.alloc.alloc_extend([ExtendSpec(rp, 256, 301)])
    decode.alloc.alloc_prealloc(rd, 301)
    # window start floor((301 - 16)/128)*128 = 256; state tails [256, 301).
    assert decode.alloc.held_pages(rd) == {"full": 3, "swa": 1, "c4s": 1, "c128s": 1}
    assert decode.alloc.seq_len(rd) == 301
    decode.alloc.alloc_decode([rd])  # continues like a colocated request
    assert decode.alloc.seq_len(rd) == 302


def test_a_request_may_use_pages_a_later_request_of_the_batch_releases(make_mem) -> None:
    # SWA pool of 2 pages, both held by r0; r1 (listed first) needs one, which only r0's step releases
    # (144 -> 145 leaves page 0 behind the window of 16). The batch fits net, so it must succeed.
    mem = make_mem(swa_pages=2)
    a = mem.alloc
    r0, r1 = a.alloc_request(), a.alloc_request()
    a.alloc_extend([ExtendSpec(r0, 0, 130)])
    decode_to(a, r0, 144)
    assert a.num_free()["swa"] == 0
    b = a.alloc_extend([ExtendSpec(r1, 0, 100), ExtendSpec(r0, 144, 145)])
    assert a.held_pages(r1)["swa"] == 1 and a.held_pages(r0)["swa"] == 1
    assert b.out_swa_loc[:100].tolist() == mem.req_pool.req_to_token_swa[r1, :100].tolist()
    assert int(mem.req_pool.req_to_token_swa[r0, :128].abs().sum()) == 0  # r0's page 0 released


def test_a_step_that_fits_takes_fresh_pages_before_releasing(make_mem) -> None:
    # With room to spare, the pages a step releases are not handed straight back to the same step:
    # the window's pages stay one run of ids (one PD transfer entry instead of two).
    mem = make_mem(window=128)
    a = mem.alloc
    r = a.alloc_request()
    a.alloc_extend([ExtendSpec(r, 0, 256)])  # SWA pages 1, 2
    a.alloc_extend([ExtendSpec(r, 256, 384)])  # releases page index 0 (id 1), takes index 2
    assert [int(mem.req_pool.req_to_token_swa[r, k * 128]) // 128 for k in (1, 2)] == [2, 3]


def test_the_state_tail_rule_is_one_rule_for_ints_and_tensors() -> None:
    """The allocator (ints) and any tensor caller read memory/state_tail.py's one rule; the decode
    fills no longer apply it (where a decode row writes state is the allocator's bundle)."""
    import torch

    from dsv4_engine.memory.state_tail import STATE_TAIL_BLOCK, state_alloc_len

    seqs = range(0, 5 * STATE_TAIL_BLOCK + 7)
    for ratio in (4, 128):
        ints = [state_alloc_len(ratio, s) for s in seqs]
        assert state_alloc_len(ratio, torch.tensor(list(seqs))).tolist() == ints
    assert state_alloc_len(4, 130) == 130 and state_alloc_len(4, 132) == 4 and state_alloc_len(128, 130) == 2
