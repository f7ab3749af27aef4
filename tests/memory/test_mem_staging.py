"""PD staging: the arena's spans, and packing pages (C++ kernel and torch code, one layout).

The kernel and the torch code must produce the same bytes, since a prefill may pack with one and a
decode unpack with the other (a server without a compiler runs the torch code).
"""

from __future__ import annotations

import pytest
import torch

from dsv4_engine import kernels
from dsv4_engine.kernels import TorchKernels
from dsv4_engine.memory.staging import ALIGN, StagingArena, gather_pages, scatter_pages, staged_nbytes
from suite import skips


def pools(seed: int = 0) -> list[torch.Tensor]:
    """Buffers shaped like one state type's: [pages + 1, rows, width], two widths and two dtypes."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(9, 8, 16, generator=g).to(torch.bfloat16),
        torch.randn(9, 8, 16, generator=g).to(torch.bfloat16),
        torch.randn(9, 4, 40, generator=g),
    ]


def packed_by_hand(buffers: list[torch.Tensor], pages: list[int]) -> bytes:
    return b"".join(buf[p].contiguous().view(torch.uint8).numpy().tobytes() for buf in buffers for p in pages)


@pytest.mark.parametrize("use_kernel", [False, True])
def test_gather_packs_buffer_major_in_page_order(use_kernel: bool) -> None:
    if use_kernel and not kernels.available():
        skips.missing("the fused kernels did not build: no C++ compiler here")
    buffers, pages = pools(), [5, 2, 7]
    staged = torch.zeros(staged_nbytes(buffers, len(pages)), dtype=torch.uint8)
    ids = torch.tensor(pages, dtype=torch.long)
    gather_pages(buffers, ids, staged, kernels=None if use_kernel else TorchKernels())
    assert staged.numpy().tobytes() == packed_by_hand(buffers, pages)


@pytest.mark.parametrize("use_kernel", [False, True])
def test_scatter_writes_exactly_the_listed_pages(use_kernel: bool) -> None:
    if use_kernel and not kernels.available():
        skips.missing("the fused kernels did not build: no C++ compiler here")
    source, pages = pools(1), [3, 8, 1]
    staged = torch.frombuffer(bytearray(packed_by_hand(source, pages)), dtype=torch.uint8)
    target = pools(2)
    before = [t.clone() for t in target]
    ids = torch.tensor(pages, dtype=torch.long)
    scatter_pages(target, ids, staged, kernels=None if use_kernel else TorchKernels())
    for src, dst, old in zip(source, target, before, strict=True):
        for p in range(dst.shape[0]):
            want = src[p] if p in pages else old[p]
            assert torch.equal(dst[p], want), f"page {p}"


def test_kernel_refuses_what_the_copy_cannot_do() -> None:
    if not kernels.available():
        skips.missing("the fused kernels did not build: no C++ compiler here")
    buffers = pools()
    ok = torch.zeros(staged_nbytes(buffers, 2), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="outside buffer 0"):
        torch.ops.dsv4.gather_pages(buffers, torch.tensor([1, 9]), ok)
    with pytest.raises(RuntimeError, match="staged holds"):
        torch.ops.dsv4.gather_pages(buffers, torch.tensor([1, 2, 3]), ok)
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.dsv4.scatter_pages(buffers, torch.tensor([1, 2], dtype=torch.int32), ok)
    with pytest.raises(ValueError, match="staged bytes"):
        gather_pages(buffers, torch.tensor([1, 2, 3]), ok, kernels=TorchKernels())


def test_arena_spans_are_aligned_first_fit_and_merge_back() -> None:
    arena = StagingArena(10 * ALIGN)
    a, b, c = arena.alloc(1), arena.alloc(2 * ALIGN), arena.alloc(ALIGN + 1)
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN)
    assert arena.alloc(6 * ALIGN) is None  # 5 lines left
    arena.free(b)
    assert arena.alloc(2 * ALIGN) == ALIGN  # first fit reuses the hole
    for offset in (a, ALIGN, c):
        arena.free(offset)
    assert arena.free_bytes == arena.nbytes and arena.spans == 0
    assert arena.alloc(10 * ALIGN) == 0  # every hole merged back into one run
    with pytest.raises(KeyError):
        arena.free(ALIGN)


def test_arena_views_stay_inside_a_span() -> None:
    arena = StagingArena(4 * ALIGN)
    offset = arena.alloc(2 * ALIGN)
    assert offset is not None
    assert arena.view(offset + 8, ALIGN).numel() == ALIGN
    with pytest.raises(ValueError, match="not inside"):
        arena.view(offset + ALIGN, 2 * ALIGN)
    with pytest.raises(ValueError, match="not inside"):
        arena.view(3 * ALIGN, 8)  # never handed out
