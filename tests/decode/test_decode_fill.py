"""`fill_decode_buffers` writes exactly what `build_decode_metadata` + `DecodeBuffers.refresh` write,
from the same bundle of out-cache locations."""

from __future__ import annotations

import pytest
import torch

from dsv4_engine import kernels
from dsv4_engine.attention import DecodeBuffers, build_decode_metadata
from dsv4_engine.attention.decode_fill import (
    DecodeLocs,
    fill_decode_buffers,
    fill_decode_buffers_kernel,
)
from dsv4_engine.memory import ExtendSpec

# Prompt lengths around the window (16), ratio-4, ratio-128 and state-tail (tail <= 3) boundaries.
LENGTHS = (1, 3, 15, 16, 126, 127, 128, 130, 255, 256, 259, 383, 511)


def step_inputs(reqs: list[int], positions: list[int], bucket: int) -> tuple[torch.Tensor, ...]:
    """Padded (req, pos, valid) host tensors, as `DecodeGraphRunner.prepare` fills them."""
    pad = [0] * (bucket - len(reqs))
    return torch.tensor(reqs + pad), torch.tensor(positions + pad), torch.arange(bucket) < len(reqs)


@pytest.mark.parametrize("fill", ["torch", "kernel"])
@pytest.mark.parametrize("batch", [1, 3, 4])
def test_fill_equals_reference_builder(make_mem, batch: int, fill: str) -> None:
    if fill == "kernel":
        assert kernels.available()
    fill_fn = fill_decode_buffers_kernel if fill == "kernel" else fill_decode_buffers
    mem = make_mem()
    ref_bufs = DecodeBuffers(mem.layout, 1024, buckets=(1, 4))
    fast_bufs = DecodeBuffers(mem.layout, 1024, buckets=(1, 4))
    g = torch.Generator().manual_seed(batch)
    lengths = {}
    for _ in range(batch):
        r = mem.alloc.alloc_request()
        lengths[r] = LENGTHS[int(torch.randint(len(LENGTHS), (1,), generator=g))]
        mem.alloc.alloc_extend([ExtendSpec(r, 0, lengths[r])])
    for step in range(6):  # decode steps; the first bucket is reused with other contents
        reqs = list(lengths)[: max(1, batch - step % 2)]
        specs = [ExtendSpec(r, lengths[r], lengths[r] + 1) for r in reqs]
        bundle = mem.alloc.alloc_decode(reqs)
        meta = build_decode_metadata(mem.layout, mem.req_pool, specs, bundle, num_pages=ref_bufs.num_pages)
        want = ref_bufs.refresh(meta)
        bs = fast_bufs.bucket_for(len(reqs))
        req, pos, valid = step_inputs(reqs, [s.prefix_len for s in specs], bs)
        fast_bufs.buffers(bs).page_table.fill_(-7)  # stale contents must all be overwritten
        fill_fn(fast_bufs.buffers(bs), mem.req_pool, 128, req, pos, valid, DecodeLocs.of(bundle, bs))
        got = fast_bufs.buffers(bs).tensors()
        for name, value in want.tensors().items():
            assert torch.equal(got[name], value), f"step {step}: {name} differs"
        for r in reqs:
            lengths[r] += 1


def test_decode_locs_refuse_two_slots_of_a_kind_in_one_row() -> None:
    """A row writes at most one slot of each kind in a decode step; two in one row and none in the
    other (as many slots as rows) is refused, not spread over the rows."""
    from dsv4_engine.memory.out_cache_loc import DSV4OutCacheLoc

    i64 = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    bundle = DSV4OutCacheLoc(
        i64(10, 11), i64(20, 21), i64(30, 31), i64(), i64(40, 41), i64(),
        extend_counts=[1, 1], c4_counts=[2, 0], c128_counts=[0, 0], c4_state_counts=[1, 1], c128_state_counts=[0, 0],
    )  # fmt: skip
    with pytest.raises(ValueError, match="at most one slot of a kind per row"):
        DecodeLocs.rows(bundle, 4)
    bundle.c4_counts = [1, 1]
    assert DecodeLocs.of(bundle, 4).slots.tolist() == [
        [20, 21, 0, 0], [30, 31, 0, 0], [40, 41, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0],
    ]  # fmt: skip
