"""Speculative decoding's side of the allocator: a verify step allocated with `keep_len` writes the
state tail of every length it may be cut back to, and `truncate` cuts a row back so that its tables
and pages are those of a row that never went further.

Layout (conftest): page 128, window 16, layers [swa, c4, c128, swa].
"""

from __future__ import annotations

import pytest

from dsv4_engine.memory import ExtendSpec
from dsv4_engine.memory.req_to_token import Dsv4ReqToTokenPool
from dsv4_engine.memory.state_tail import state_alloc_offset, state_write_from

TABLES = Dsv4ReqToTokenPool.TABLES


def _grow(a, r: int, ends: list[int]) -> None:  # type: ignore[no-untyped-def]
    for end in ends:
        a.alloc_extend([ExtendSpec(r, a.seq_len(r), end)])


def _row(pool, r: int) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    return {t: getattr(pool, t)[r].tolist() for t in TABLES}


def test_keep_len_writes_the_tail_of_the_shortest_length() -> None:
    # 126 -> 133 crosses a 128 block: the tails of 133 start at 128, but cut back to 127 the row
    # needs the state of 126 (c4 block [124, 128), the c128 block [0, 128)). (With page 128 the c4
    # rule for the block before a page boundary happens to write it anyway.)
    assert state_write_from(4, 126, 133, 256) == 128 and state_write_from(128, 126, 133, 128) == 128
    assert state_write_from(4, 126, 133, 256, keep_len=127) == 126
    assert state_write_from(128, 126, 133, 128, keep_len=127) == 126
    # keep_len only ever lowers the start: a step that stays inside one tail is unchanged.
    assert state_write_from(4, 140, 144, 128, keep_len=141) == state_write_from(4, 140, 144, 128) == 140


@pytest.mark.parametrize(
    ("prefix", "drafts", "kept"), [(126, 6, 0), (126, 6, 3), (250, 7, 5), (255, 4, 0), (300, 3, 3)]
)
def test_truncate_equals_a_row_that_never_drafted(make_mem, prefix: int, drafts: int, kept: int) -> None:
    spec_mem, plain_mem = make_mem(), make_mem()
    a, b = spec_mem.alloc, plain_mem.alloc
    ra, rb = a.alloc_request(), b.alloc_request()
    _grow(a, ra, [128, prefix] if prefix > 128 else [prefix])
    _grow(b, rb, [128, prefix] if prefix > 128 else [prefix])
    # a verify of the pending token and `drafts` drafts, of which `kept` are accepted
    bundle = a.alloc_extend([ExtendSpec(ra, prefix, prefix + 1 + drafts, keep_len=prefix + 1)])
    new_len = prefix + 1 + kept
    # the verify leaves the state of every position in the tail of any length it may be cut to
    seq = prefix + 1 + drafts
    for counts, ratio in ((bundle.c4_state_counts, 4), (bundle.c128_state_counts, 128)):
        assert counts[0] >= seq - max(prefix, state_alloc_offset(ratio, prefix + 1)), ratio
    a.truncate(ra, new_len)
    for pos in range(prefix + 1, new_len + 1):  # the plain row, one token at a time
        b.alloc_extend([ExtendSpec(rb, pos - 1, pos)])
    assert a.seq_len(ra) == b.seq_len(rb) == new_len
    got, want = _row(spec_mem.req_pool, ra), _row(plain_mem.req_pool, rb)
    # Page ids may differ between the two pools; which entries are set may not, nor past the end.
    for t in TABLES:
        assert [x != 0 for x in got[t]] == [x != 0 for x in want[t]] or t.endswith("state"), t
    for t in ("req_to_token", "req_to_token_c4", "req_to_token_c128"):
        assert got[t] == want[t], t  # both pools hand out the lowest free pages
    # the state tail new_len reads is mapped in both
    for t, ratio in (("req_to_token_c4_state", 4), ("req_to_token_c128_state", 128)):
        lo = state_alloc_offset(ratio, new_len)
        assert all(got[t][lo:new_len]) and all(want[t][lo:new_len]), t
    # a page the plain row never took is back in the pool
    assert a.pools["full"].num_free == b.pools["full"].num_free
    assert a.pools["swa"].num_free == b.pools["swa"].num_free
    a.free(ra)
    b.free(rb)
    assert all(p.num_free == p.num_pages for p in a.pools.values())


def test_truncate_is_replayed_by_a_replica(make_mem) -> None:
    leader, follower = make_mem(), make_mem()
    leader.alloc.record()
    r = leader.alloc.alloc_request()
    _grow(leader.alloc, r, [126])
    leader.alloc.alloc_extend([ExtendSpec(r, 126, 133, keep_len=127)])
    leader.alloc.truncate(r, 128)
    follower.alloc.replay(leader.alloc.take_journal())
    assert _row(leader.req_pool, r) == _row(follower.req_pool, r)
    assert leader.alloc.pages_of(r) == follower.alloc.pages_of(r)


def test_truncate_refuses_growing_or_emptying(make_mem) -> None:
    mem = make_mem()
    r = mem.alloc.alloc_request()
    _grow(mem.alloc, r, [40])
    with pytest.raises(ValueError, match="cut a row of 40"):
        mem.alloc.truncate(r, 41)
    with pytest.raises(ValueError, match="cut a row of 40"):
        mem.alloc.truncate(r, 0)
