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
    step_inputs,
)
from dsv4_engine.memory import ExtendSpec

# Prompt lengths around the window (16), ratio-4, ratio-128 and state-tail (tail <= 3) boundaries.
LENGTHS = (1, 3, 15, 16, 126, 127, 128, 130, 255, 256, 259, 383, 511)


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
