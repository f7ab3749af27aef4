"""Prefill / decode metadata: hand-checked fields, and a toy compressor driven only by the metadata
and the real pools that must give the same compressed rows chunked, unchunked and in decode as a
direct computation over the whole sequence (the global-grid and state-tail rules, end to end)."""

from __future__ import annotations

import pytest
import torch

from dsv4_engine.attention import DecodeBuffers, build_decode_metadata, build_extend_metadata, row_slots
from dsv4_engine.memory import ExtendSpec

D = 8  # head_dim of the small layout; c4 state rows are [kv 2D | score 2D], c128 rows [kv D | score D]
C4_LAYER, C128_LAYER = 1, 2


def test_chunked_prefill_fields_hand_checked(make_mem) -> None:
    mem = make_mem(window=16)
    r = mem.alloc.alloc_request()
    b1 = mem.alloc.alloc_extend([ExtendSpec(r, 0, 128)])
    m1 = build_extend_metadata(mem.layout, mem.req_pool, [ExtendSpec(r, 0, 128)], b1)
    # First chunk: the overlap of block 0 reads positions -4..-1 -> sentinel slots.
    assert m1.c4.state_read_start.tolist() == [-4] and m1.c4.state_read_len.tolist() == [4]
    assert m1.c4.state_read_slots.tolist() == [[0] * 8]
    assert m1.c128.block_positions.tolist() == [0]
    b2 = mem.alloc.alloc_extend([ExtendSpec(r, 128, 300)])
    m2 = build_extend_metadata(mem.layout, mem.req_pool, [ExtendSpec(r, 128, 300)], b2)
    # Global grid: chunk 2 completes c4 blocks 32..74 (positions 128..296) and c128 block 1 (128).
    assert m2.c4.block_positions.tolist() == list(range(128, 300 - 3, 4))
    assert m2.c128.block_positions.tolist() == [128]
    # Only the ratio-4 overlap crosses the boundary: block 32 borrows positions 124..127.
    assert m2.c4.state_read_start.tolist() == [124] and m2.c4.state_read_len.tolist() == [4]
    assert m2.c4.state_read_slots[0, :4].tolist() == mem.req_pool.req_to_token_c4_state[r, 124:128].tolist()
    assert (
        all(s > 0 for s in m2.c4.state_read_slots[0, :4].tolist())
        and m2.c4.state_read_slots[0, 4:].sum() == 0
    )
    assert m2.c128.state_read_len.tolist() == [0]  # 128 is a block boundary: nothing to carry
    # State writes: tail of 300 is [256, 300) for both ratios, and for c4 the block [252, 256) before
    # the last page boundary (what a prefix-cache snapshot at 256 reads); token index = position - 128.
    assert m2.c4.state_write_pos.tolist() == list(range(252, 300))
    assert m2.c4.state_write_token.tolist() == list(range(124, 172))
    assert m2.positions.tolist() == list(range(128, 300)) and m2.cu_extend.tolist() == [0, 172]
    assert m2.c4.visible[:3].tolist() == [32, 32, 32] and int(m2.c4.visible[-1]) == 75
    # SWA: window of position 128 is 113..128 in slot order; compressed rows via one page table.
    assert m2.swa_slots[0].tolist() == mem.req_pool.req_to_token_swa[r, 113:129].tolist()
    rows = torch.arange(32, 75)
    assert row_slots(m2.page_table[0], rows, 4, 128).tolist() == b2.out_c4_loc.tolist()


def test_first_tokens_mask_negative_window(make_mem) -> None:
    mem = make_mem(window=16)
    r = mem.alloc.alloc_request()
    spec = ExtendSpec(r, 0, 3)
    m = build_extend_metadata(mem.layout, mem.req_pool, [spec], mem.alloc.alloc_extend([spec]))
    assert m.swa_slots[0, :15].tolist() == [-1] * 15 and int(m.swa_slots[0, 15]) > 0
    assert m.c4.block_positions.numel() == 0 and m.c4.visible.tolist() == [0, 0, 0]


def test_decode_fields_are_per_request(make_mem) -> None:
    mem = make_mem()
    r0, r1 = mem.alloc.alloc_request(), mem.alloc.alloc_request()
    mem.alloc.alloc_extend([ExtendSpec(r0, 0, 127), ExtendSpec(r1, 0, 130)])
    specs = [ExtendSpec(r0, 127, 128), ExtendSpec(r1, 130, 131)]
    m = build_decode_metadata(mem.layout, mem.req_pool, specs, mem.alloc.alloc_decode([r0, r1]))
    assert m.is_decode and m.positions.tolist() == [127, 130]
    # r0 completes c4 block 31 (pos 124) and c128 block 0; r1 completes neither.
    assert m.c4.block_mask.tolist() == [True, False] and m.c4.block_positions.tolist() == [124, 0]
    assert m.c128.block_mask.tolist() == [True, False]
    assert int(m.c4.block_loc[1]) == 0 and int(m.c4.block_loc[0]) > 0
    # seq 128 ends on a c128 boundary: no c128 state left behind for r0; r1 writes position 130.
    assert m.c128.state_write_mask.tolist() == [False, True]
    assert m.c4.state_write_mask.tolist() == [True, True]
    assert m.c4.state_read_start.tolist() == [120, 124]  # the open block and the one before it


# ---- toy compressor over the real pools --------------------------------------------------------


def split_rows(blk: torch.Tensor, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, coff*ratio, width] state rows of blocks -> (kv, score), each [n, coff*ratio, D]."""
    if ratio == 4:  # previous block's first half, current block's second half
        kv = torch.cat([blk[:, :4, :D], blk[:, 4:, D : 2 * D]], 1)
        score = torch.cat([blk[:, :4, 2 * D : 3 * D], blk[:, 4:, 3 * D :]], 1)
        return kv, score
    return blk[..., :D], blk[..., D:]


def compress(blk: torch.Tensor, ratio: int) -> torch.Tensor:
    kv, score = split_rows(blk, ratio)
    return (kv * torch.softmax(score, 1)).sum(1)


def reference_rows(x: torch.Tensor, ratio: int, seq: int) -> torch.Tensor:
    n = seq // ratio
    cur = x[: n * ratio].view(n, ratio, x.shape[1])
    if ratio == 4 and n:
        fill = torch.cat([torch.zeros(1, 4, 2 * D), torch.full((1, 4, 2 * D), -torch.inf)], 2)
        cur = torch.cat([torch.cat([fill, cur[:-1]]), cur], 1)
    return compress(cur, ratio)


def run_step(mem, data: dict, meta) -> None:
    """Apply one step's compressor and SWA writes using only `meta` and the pools."""
    valid = meta.seq_lens > 0  # padded decode rows have seq_len 0
    reqs = meta.req_indices.tolist()
    tok = torch.nonzero(valid[meta.token_req]).flatten()
    swa = mem.kv.swa_kv[0].view(-1, D)
    all_swa = torch.stack([data[r]["swa"] for r in reqs])
    swa[meta.out_swa_loc[tok]] = all_swa[meta.token_req[tok], meta.positions[tok]]
    for ratio, cm in ((4, meta.c4), (128, meta.c128)):
        key = f"c{ratio}"
        state = mem.kv.c4_state[C4_LAYER] if ratio == 4 else mem.kv.c128_state[C128_LAYER]
        state = state.view(-1, state.shape[-1])
        comp = (mem.kv.c4_kv[C4_LAYER] if ratio == 4 else mem.kv.c128_kv[C128_LAYER]).view(-1, D)
        inflight = torch.stack([data[r][key] for r in reqs])  # [B, ctx, width]
        blocks = torch.nonzero(cm.block_mask).flatten()
        b = cm.block_req[blocks]
        lo = cm.block_positions[blocks] - (4 if ratio == 4 else 0)
        q = lo[:, None] + torch.arange(8 if ratio == 4 else 128)[None, :]  # positions of each block's rows
        stored = q < meta.prefix_lens[b][:, None]
        col = (q - cm.state_read_start[b][:, None]).clamp(0, cm.state_read_slots.shape[1] - 1)
        from_pool = state[cm.state_read_slots[b[:, None], col]]  # sentinel rows below position 0
        from_step = inflight[b[:, None], q.clamp(min=0)]
        rows = torch.where(stored[..., None], from_pool, from_step)
        new = compress(rows, ratio) if blocks.numel() else None
        w = torch.nonzero(cm.state_write_mask).flatten()
        t = cm.state_write_token[w]
        assert meta.positions[t].tolist() == cm.state_write_pos[w].tolist()
        state[cm.state_write_loc[w]] = inflight[meta.token_req[t], cm.state_write_pos[w]]
        if new is not None:
            assert bool((cm.block_loc[blocks] > 0).all())  # never the sentinel
            comp[cm.block_loc[blocks]] = new


def make_data(max_ctx: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "c4": torch.randn(max_ctx, 4 * D, generator=g),
        "c128": torch.randn(max_ctx, 2 * D, generator=g),
        "swa": torch.randn(max_ctx, D, generator=g),
    }


def check_against_reference(mem, data: dict, r: int, seq: int) -> None:
    table = mem.req_pool.req_to_token[r, 0:seq:128] // 128
    for ratio, layer_pool in ((4, mem.kv.c4_kv[C4_LAYER]), (128, mem.kv.c128_kv[C128_LAYER])):
        want = reference_rows(data[f"c{ratio}"], ratio, seq)
        slots = row_slots(table, torch.arange(seq // ratio), ratio, 128)
        got = layer_pool.view(-1, D)[slots]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    w = mem.layout.window
    last = build_swa_view(mem, r, seq)
    torch.testing.assert_close(last, data["swa"][max(0, seq - w) : seq])


def build_swa_view(mem, r: int, seq: int) -> torch.Tensor:
    w = mem.layout.window
    slots = mem.req_pool.req_to_token_swa[r, max(0, seq - w) : seq].to(torch.int64)
    assert bool((slots > 0).all())
    return mem.kv.swa_kv[0].view(-1, D)[slots]


def assert_sentinels_clean(mem) -> None:
    assert int(torch.count_nonzero(mem.kv.c4_kv[C4_LAYER][0])) == 0
    assert int(torch.count_nonzero(mem.kv.swa_kv[0][0])) == 0
    for buf in (mem.kv.c4_state[C4_LAYER], mem.kv.c128_state[C128_LAYER]):
        half = buf.shape[-1] // 2
        assert int(torch.count_nonzero(buf[0, :, :half])) == 0 and bool(
            torch.isneginf(buf[0, :, half:]).all()
        )


def prefill(mem, data: dict, lens: dict[int, int], chunk: int | None) -> None:
    """Prefill all requests together, chunk by chunk (non-final chunks page-aligned)."""
    while any(mem.alloc.seq_len(r) < n for r, n in lens.items()):
        specs = []
        for r, n in lens.items():
            cur = mem.alloc.seq_len(r)
            if cur < n:
                specs.append(ExtendSpec(r, cur, n if chunk is None else min(n, cur + chunk)))
        meta = build_extend_metadata(mem.layout, mem.req_pool, specs, mem.alloc.alloc_extend(specs))
        run_step(mem, data, meta)


def two_requests(mem, prompt: int, other: int) -> tuple[dict, dict[int, int]]:
    reqs = [mem.alloc.alloc_request(), mem.alloc.alloc_request()]
    data = {r: make_data(1024, seed=prompt * 10 + i) for i, r in enumerate(reqs)}
    return data, {reqs[0]: prompt, reqs[1]: other}


@pytest.mark.parametrize("chunk", [128, 256, None])
@pytest.mark.parametrize("prompt", [1, 5, 131, 300, 517])
def test_toy_compressor_chunked_prefill_equals_direct(make_mem, chunk: int | None, prompt: int) -> None:
    mem = make_mem(window=16, max_ctx=1024, full_pages=12, swa_pages=10, state_pages=6)
    data, lens = two_requests(mem, prompt, 140)
    prefill(mem, data, lens, chunk)
    for r, n in lens.items():
        check_against_reference(mem, data[r], r, n)
    assert_sentinels_clean(mem)


@pytest.mark.parametrize("prompt", [3, 250])
def test_toy_compressor_decode_from_static_buffers(make_mem, prompt: int) -> None:
    mem = make_mem(window=16, max_ctx=1024, full_pages=12, swa_pages=10, state_pages=6)
    data, lens = two_requests(mem, prompt, 140)
    prefill(mem, data, lens, 128)
    reqs = list(lens)
    # Decode through 4-, 128- and watermark boundaries from static buffers refreshed in place.
    bufs = DecodeBuffers(mem.layout, 1024, buckets=(1, 4))

    def all_ptrs() -> dict[tuple[int, str], int]:
        return {(bs, k): v.data_ptr() for bs in (1, 4) for k, v in bufs.buffers(bs).tensors().items()}

    ptrs = all_ptrs()
    for step in range(140):
        active = reqs if step % 3 else reqs[:1]  # batch composition changes
        specs = [ExtendSpec(r, mem.alloc.seq_len(r), mem.alloc.seq_len(r) + 1) for r in active]
        meta = build_decode_metadata(mem.layout, mem.req_pool, specs, mem.alloc.alloc_decode(active))
        run_step(mem, data, bufs.refresh(meta))
    assert all_ptrs() == ptrs  # both buckets were used (batch 1 and 2); nothing was reallocated
    assert mem.alloc.seq_len(reqs[0]) == prompt + 140
    for r in reqs:
        check_against_reference(mem, data[r], r, mem.alloc.seq_len(r))
    assert_sentinels_clean(mem)


def test_decode_buffers_refresh_in_place_and_pad(make_mem) -> None:
    mem = make_mem()
    bufs = DecodeBuffers(mem.layout, 2048, buckets=(2, 4))
    r = [mem.alloc.alloc_request() for _ in range(3)]
    mem.alloc.alloc_extend([ExtendSpec(x, 0, 10 + i) for i, x in enumerate(r)])
    specs = [ExtendSpec(x, 10 + i, 11 + i) for i, x in enumerate(r)]
    meta = build_decode_metadata(mem.layout, mem.req_pool, specs, mem.alloc.alloc_decode(r), num_pages=1)
    out = bufs.refresh(meta)
    assert out is bufs.buffers(4) and bufs.bucket_for(3) == 4
    assert out.positions.tolist() == [10, 11, 12, 0] and out.seq_lens.tolist() == [11, 12, 13, 0]
    assert out.swa_slots[3].tolist() == [-1] * 16  # padding row attends to nothing
    assert not bool(out.c4.state_write_mask[3]) and not bool(out.c4.block_mask[3])
    assert (
        tuple(out.page_table.shape) == (4, 16)
        and out.page_table[:3, 0].tolist() == meta.page_table[:, 0].tolist()
    )
    with pytest.raises(ValueError, match="largest bucket"):
        bufs.bucket_for(5)
