"""pd_state_components ordering and item sizes, sentinel pages, and the per-type PD payloads."""

from __future__ import annotations

import torch

from dsv4_engine.memory import ExtendSpec, StateType, dsv4_state_payloads


def test_components_order_counts_and_item_lens(make_mem) -> None:
    mem = make_mem(ratios=(0, 4, 128, 4, 0))
    comps = mem.kv.pd_state_components()
    assert [c.state_type for c in comps] == [
        StateType.SWA, StateType.C4, StateType.C128, StateType.INDEXER, StateType.C4_STATE, StateType.C128_STATE,
    ]  # fmt: skip
    by = {c.state_type: c for c in comps}
    assert len(by[StateType.SWA].data_ptrs) == 5
    assert len(by[StateType.C4].data_ptrs) == 2 and len(by[StateType.INDEXER].data_ptrs) == 2
    assert len(by[StateType.C128].data_ptrs) == 1
    assert len(by[StateType.C4_STATE].data_ptrs) == 4  # attention state x2 then indexer state x2
    # One page of each buffer (fp32; D=8, Di=4, P=128): hand-computed bytes.
    assert by[StateType.SWA].item_lens == [128 * 8 * 4] * 5
    assert by[StateType.C4].item_lens == [32 * 8 * 4] * 2
    assert by[StateType.C128].item_lens == [1 * 8 * 4]
    assert by[StateType.INDEXER].item_lens == [32 * 4 * 4] * 2
    assert by[StateType.C4_STATE].item_lens == [128 * 32 * 4] * 2 + [128 * 16 * 4] * 2
    assert by[StateType.C128_STATE].item_lens == [128 * 16 * 4]
    # Pointers are the buffers', in layer order; lengths are whole buffers (pages + sentinel).
    assert by[StateType.C4].data_ptrs == [mem.kv.c4_kv[1].data_ptr(), mem.kv.c4_kv[3].data_ptr()]
    assert by[StateType.C4_STATE].data_ptrs == [
        mem.kv.c4_state[1].data_ptr(), mem.kv.c4_state[3].data_ptr(),
        mem.kv.c4_index_state[1].data_ptr(), mem.kv.c4_index_state[3].data_ptr(),
    ]  # fmt: skip
    assert by[StateType.C4].data_lens == [(mem.sizes.full_pages + 1) * 32 * 8 * 4] * 2
    ptrs = [p for c in comps for p in c.data_ptrs]
    assert len(set(ptrs)) == len(ptrs)


def test_empty_pools_are_dropped(make_mem) -> None:
    assert [c.state_type for c in make_mem(ratios=(0, 0)).kv.pd_state_components()] == [StateType.SWA]
    assert [c.state_type for c in make_mem(ratios=(0, 4)).kv.pd_state_components()] == [
        StateType.SWA, StateType.C4, StateType.INDEXER, StateType.C4_STATE,
    ]  # fmt: skip
    assert [c.state_type for c in make_mem(ratios=(128,)).kv.pd_state_components()] == [
        StateType.SWA, StateType.C128, StateType.C128_STATE,
    ]  # fmt: skip


def test_sentinel_pages(make_mem) -> None:
    kv = make_mem().kv
    for buf in (*kv.swa_kv.values(), *kv.c4_kv.values(), *kv.c128_kv.values(), *kv.indexer_kv.values()):
        assert int(torch.count_nonzero(buf[0])) == 0
    for buf in (*kv.c4_state.values(), *kv.c4_index_state.values(), *kv.c128_state.values()):
        half = buf.shape[-1] // 2
        assert int(torch.count_nonzero(buf[0, :, :half])) == 0
        assert bool(torch.isneginf(buf[0, :, half:]).all())


def test_payloads_hand_checked(make_mem) -> None:
    mem = make_mem(window=16)
    pool, a = mem.req_pool, mem.alloc
    r = a.alloc_request()
    a.alloc_extend([ExtendSpec(r, 0, 256)])
    a.alloc_extend([ExtendSpec(r, 256, 301)])
    pl = {t: f() for t, f in dsv4_state_payloads(mem.kv, pool, r, 301).items()}
    full = [int(pool.req_to_token[r, k * 128]) // 128 for k in range(3)]
    assert pl[StateType.SWA] == [int(pool.req_to_token_swa[r, 256]) // 128]  # window from 256
    assert pl[StateType.C4] == full  # rows [0, 75): pages 0..2
    assert pl[StateType.INDEXER] == full
    assert pl[StateType.C128] == full[:2]  # rows [0, 2)
    c4s = int(pool.req_to_token_c4_state[r, 256]) // 128
    assert pl[StateType.C4_STATE] == [0, 0, c4s]  # whole prompt span, sentinel outside the tail
    assert pl[StateType.C128_STATE][:2] == [0, 0] and pl[StateType.C128_STATE][2] > 0


def test_payloads_pair_up_between_prefill_and_decode(make_mem) -> None:
    # Prefill chunks lag its watermarks (it may still hold older SWA/state pages); decode
    # pre-allocates only what is needed. The lists must still have equal length and the same zeros.
    for seq in (5, 127, 128, 129, 131, 132, 300, 513, 1000):
        pre, dec = make_mem(), make_mem(decode=True)
        rp, rd = pre.alloc.alloc_request(), dec.alloc.alloc_request()
        done = 0
        while done < seq:
            nxt = min(seq, done + 256)
            pre.alloc.alloc_extend([ExtendSpec(rp, done, nxt)])
            done = nxt
        dec.alloc.alloc_prealloc(rd, seq)
        src = {t: f() for t, f in dsv4_state_payloads(pre.kv, pre.req_pool, rp, seq).items()}
        dst = {t: f() for t, f in dsv4_state_payloads(dec.kv, dec.req_pool, rd, seq).items()}
        assert list(src) == list(dst)
        for t in src:
            assert len(src[t]) == len(dst[t]), (seq, t)
            assert [x == 0 for x in src[t]] == [x == 0 for x in dst[t]], (seq, t, src[t], dst[t])


def runs(pages: list[int]) -> int:
    """Runs of consecutive page ids among the non-sentinel entries (one Mooncake entry each)."""
    ids = [p for p in pages if p]
    return sum(1 for i, p in enumerate(ids) if i == 0 or p != ids[i - 1] + 1)


def test_request_in_a_fresh_pool_holds_one_run_per_family(make_mem) -> None:
    # Prefill in one step, decode-side pre-allocation, and chunked prefill (full pages are never freed
    # mid-life, so they stay one run; SWA and state pages released between chunks may leave holes).
    for seq in (5, 129, 300, 513, 1000):
        pre, dec, chunked = make_mem(window=128), make_mem(window=128, decode=True), make_mem(window=128)
        rp, rd, rc = pre.alloc.alloc_request(), dec.alloc.alloc_request(), chunked.alloc.alloc_request()
        pre.alloc.alloc_extend([ExtendSpec(rp, 0, seq)])
        dec.alloc.alloc_prealloc(rd, seq)
        for lo in range(0, seq, 256):
            chunked.alloc.alloc_extend([ExtendSpec(rc, lo, min(seq, lo + 256))])
        for mem, r, types in (
            (pre, rp, set(StateType)),
            (dec, rd, set(StateType)),
            (chunked, rc, {StateType.C4, StateType.INDEXER, StateType.C128}),
        ):
            payloads = {t: f() for t, f in dsv4_state_payloads(mem.kv, mem.req_pool, r, seq).items()}
            for t in types & set(payloads):
                assert runs(payloads[t]) == (1 if any(payloads[t]) else 0), (seq, t, payloads[t])
            if seq >= 4:
                assert payloads[StateType.C4][0] == 1  # a fresh pool starts at the lowest id
