"""The paged-attention CPU kernels (`kernels/attention.cpp`) against the torch forms they replace.

The batched-decode test drives all three through real metadata for 100 steps (logits and every pool
against the reference); these pin the edges that run rarely there: rows with nothing visible, fewer
visible rows than the indexer's k, exact score ties, picks outside [0, visible)."""

from __future__ import annotations

import pytest
import torch

from dsv4_engine import kernels
from dsv4_engine.kernels import CpuKernels, TorchKernels

PAGE = 128
TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    assert kernels.available(), "the dsv4 CPU kernels did not build"


def _layer(model, ratio: int):
    return next(layer.self_attn for layer in model.model.layers if layer.self_attn.ratio == ratio)


def _page_table(bsz: int, pages: int, g: torch.Generator) -> torch.Tensor:
    """Distinct random pages per row (page 0 is the sentinel), int32 as the decode buffers hold."""
    return (torch.randperm(bsz * pages, generator=g) + 1).view(bsz, pages).to(torch.int32)


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_paged_attention_equals_torch_form(model, ratio: int) -> None:
    attn = _layer(model, ratio)
    g = torch.Generator().manual_seed(ratio)
    bsz, heads, dim, window, pages = 5, attn.num_heads, attn.head_dim, 16, 2
    q = torch.randn(bsz, heads, dim, generator=g)
    swa = torch.randn(64, dim, generator=g)
    swa_slots = torch.randint(1, 64, (bsz, window), generator=g)
    swa_slots[0] = -1  # nothing in the window (a padding row)
    swa_slots[1, :10] = -1  # a window not yet full
    page_table = _page_table(bsz, pages, g)
    per_row = PAGE // ratio if ratio else 0
    comp = torch.randn((bsz * pages + 1) * per_row, dim, generator=g) if ratio else None
    visible = torch.tensor([0, 3, 17, 64, 1]).clamp(max=per_row * pages) if ratio else None
    rows = None
    if ratio == 4:  # CSA: the indexer's picks, some at or past `visible`
        rows = torch.randint(0, per_row * pages, (bsz, 12), generator=g)
        rows[2, :4] = torch.tensor([16, 0, 5, 16])  # a repeated pick counts twice in both forms
    params = (attn.ratio, PAGE, attn.sinks, attn.scaling)
    args = (q, swa, swa_slots, comp, page_table, rows, visible, *params)
    want = TorchKernels().paged_attention(*args)
    got = CpuKernels().paged_attention(*args)
    torch.testing.assert_close(got, want, **TOL)
    assert torch.count_nonzero(got[0]) == 0  # nothing to attend but the sink
    if rows is not None:  # -1 (the kernel's "no pick") is skipped like a pick past `visible`
        past = torch.where(rows >= visible[:, None], -1, rows)
        torch.testing.assert_close(
            CpuKernels().paged_attention(q, swa, swa_slots, comp, page_table, past, visible, *params), got
        )


def test_paged_attention_rejects_other_dtypes_and_missing_visible(model) -> None:
    attn = _layer(model, 128)
    q, swa = torch.randn(1, attn.num_heads, attn.head_dim), torch.randn(4, attn.head_dim)
    slots, table = torch.zeros(1, 16, dtype=torch.long), torch.ones(1, 1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="need `visible`"):
        torch.ops.dsv4.paged_attention(q, swa, slots, swa, table, None, None, 128, PAGE, attn.sinks, 1.0)
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        torch.ops.dsv4.paged_attention(
            q.double(), swa, slots, None, table, None, None, 128, PAGE, attn.sinks, 1.0
        )
    # The CPU set sends other dtypes to the torch form instead.
    bf16 = CpuKernels().paged_attention(
        q.bfloat16(),
        swa.bfloat16(),
        slots,
        None,
        table,
        None,
        None,
        attn.ratio,
        PAGE,
        attn.sinks,
        attn.scaling,
    )
    assert bf16.dtype == torch.bfloat16


@pytest.mark.parametrize("visible", [[0, 3, 16, 40, 64], [64, 64, 17, 1, 0]])
def test_index_topk_equals_torch_form(model, visible: list[int]) -> None:
    indexer = _layer(model, 4).compressor.indexer
    g = torch.Generator().manual_seed(sum(visible))
    bsz, pages, k = len(visible), 2, indexer.topk
    q = torch.randn(bsz, indexer.num_heads, indexer.head_dim, generator=g)
    weights = torch.randn(bsz, indexer.num_heads, generator=g)
    keys = torch.randn((bsz * pages + 1) * PAGE // 4, indexer.head_dim, generator=g)
    table, vis = _page_table(bsz, pages, g), torch.tensor(visible)
    args = (q, weights, keys, table, vis, indexer.ratio, PAGE, indexer.softmax_scale, indexer.topk)
    want = TorchKernels().index_topk(*args)
    got = CpuKernels().index_topk(*args)
    assert got.shape == (bsz, k) and got.dtype == torch.long
    for b, n in enumerate(visible):
        picked = [r for r in got[b].tolist() if r >= 0]
        assert len(picked) == min(n, k) and all(r < n for r in picked), (b, got[b])
        assert got[b, len(picked) :].eq(-1).all()  # -1 pads rows with fewer than k visible
        assert sorted(picked) == sorted(r for r in want[b].tolist() if r < n), b


def test_index_topk_ties_go_to_the_lower_row(model) -> None:
    """Every key equal: every score ties, and both forms pick rows 0..k-1."""
    indexer = _layer(model, 4).compressor.indexer
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, indexer.num_heads, indexer.head_dim, generator=g)
    weights = torch.rand(2, indexer.num_heads, generator=g)
    keys = torch.randn(1, indexer.head_dim, generator=g).expand(3 * PAGE // 4, -1).contiguous()
    table, vis = _page_table(2, 1, g), torch.tensor([32, 32])
    args = (q, weights, keys, table, vis, indexer.ratio, PAGE, indexer.softmax_scale, indexer.topk)
    want = TorchKernels().index_topk(*args)
    got = CpuKernels().index_topk(*args)
    assert torch.equal(got, want)
    assert got[0].tolist() == list(range(indexer.topk))


@pytest.mark.parametrize("zeros", [False, True])
def test_index_bias_equals_torch_form(model, zeros: bool) -> None:
    """An extend chunk's indexer bias: the kernel's parallel top-k picks what the torch form's stable
    sort picks, for rows seeing none, fewer than k, exactly k and all of the rows; with half the keys
    zero, many scores tie at 0 and the lower rows must win."""
    indexer = _layer(model, 4).compressor.indexer
    g = torch.Generator().manual_seed(int(zeros))
    k, num_rows = indexer.topk, 4 * indexer.topk + 3
    visible = torch.tensor([0, 1, k - 1, k, k + 1, 2 * k, num_rows - 1, num_rows] * 5)
    q = torch.randn(len(visible), indexer.num_heads, indexer.head_dim, generator=g)
    weights = torch.randn(len(visible), indexer.num_heads, generator=g)
    keys = torch.randn(num_rows, indexer.head_dim, generator=g)
    if zeros:
        keys[::2] = 0.0
    args = (q, weights, keys, visible, indexer.softmax_scale, k)
    want = TorchKernels().index_bias(*args)
    got = CpuKernels().index_bias(*args)
    assert torch.equal(got, want)
    assert got.eq(0).sum(dim=1).tolist() == visible.clamp(max=k).tolist()


def test_block_attention_equals_torch_form(model) -> None:
    """An extend chunk's attention: blocks of queries over their window keys and a C4 layer's rows,
    each query seeing a causal window, a few picked rows, or (a pad row) nothing but the sink."""
    attn = _layer(model, 4)
    g = torch.Generator().manual_seed(7)
    nb, b, width = 3, 8, 40
    q = torch.randn(nb, b, attn.num_heads, attn.head_dim, generator=g)
    keys = torch.randn(nb, width, attn.head_dim, generator=g)
    seen = torch.rand(nb, b, width, generator=g) < 0.2
    seen[0, 0] = False  # a row with no key at all
    seen[1, 1] = True  # a row with every key
    bias = torch.zeros(nb, b, width).masked_fill_(~seen, float("-inf"))
    args = (q, keys, bias, attn.sinks, attn.scaling)
    want = TorchKernels().block_attention(*args)
    got = CpuKernels().block_attention(*args)
    assert got.shape == want.shape == (nb * b, attn.num_heads, attn.head_dim)
    torch.testing.assert_close(got, want, **TOL)
    assert got[0].abs().max() == 0  # only the sink: nothing attended


def test_eager_decode_runs_the_attention_kernels(model, make_mem, monkeypatch) -> None:
    """The fp32 eager step takes the kernels, not the torch forms (which the batched test also
    passes): with the torch forms made to fail, a decode over all three layer kinds still runs."""
    from dsv4_engine.graph_runner import DecodeGraphRunner

    mem = make_mem()
    runner = DecodeGraphRunner(
        model, mem.kv, mem.req_pool, 1024, buckets=(2,), mode="eager", kernels=kernels.choose_kernels("cpu")
    )
    mem.join(model, "a", list(range(3, 130)))  # past a ratio-4 and a ratio-128 block
    mem.join(model, "b", list(range(3, 40)))

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("fell back to the torch form")

    for name in ("compress_paged", "index_topk", "paged_attention"):
        monkeypatch.setattr(TorchKernels, name, fail)
    logits = mem.decode_batched(runner, ["a", "b"], [5, 6])
    assert logits.shape[0] == 2 and torch.isfinite(logits).all()
