"""The decode step's attention, indexer and paged writes on torch_npu's ops (`kernels/npu.py`):
`paged_attention` through npu_sparse_flash_attention, `index_topk` through npu_lightning_indexer,
the pools' writes (`masked_put`, the compressors' state) through npu_scatter_nd_update_. Each against
the torch forms and, in fp32, the fused CPU kernels, on the same host values; the decode variant's
three captured as one graph. The ops take bf16/fp16 only: an fp32 call runs the torch form (and no
op). With DSV4_TORCH_NPU=real on an Ascend node the same assertions check the real ops."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from dsv4_engine.kernels import CpuKernels, TorchKernels, available

BF16 = torch.bfloat16
PAGE, DIM, HEADS, WINDOW, DI = 128, 512, 4, 16, 128
# bf16: the op computes in fp32 and rounds its output once; the torch form rounds its logits and
# probabilities to bf16 too. Both are held to the fp32 torch form on the same bf16 values.
TOL = {torch.float32: 1e-5, BF16: 2e-2}
# Rows: a window reaching before position 0, a full window, a long context, a padding row (seq 0).
POSITIONS, SEQ = torch.tensor([5, 40, 600, 0]), torch.tensor([6, 41, 601, 0])


def _calls(torch_npu: ModuleType) -> object | None:
    reference = getattr(torch_npu, "reference", None)
    if reference is not None:
        reference.op_calls.clear()
    return reference


def _case(ratio: int, seed: int) -> dict[str, torch.Tensor | None]:
    """A decode step's paged_attention inputs (fp32 host tensors; the window's slots -1 before
    position 0 and on the padding row; CSA picks with a -1, picks past visible, and a row with fewer
    visible rows than k)."""
    g = torch.Generator().manual_seed(seed)
    bsz, pages = len(SEQ), 6
    swa = torch.randn(4 * PAGE, DIM, generator=g)
    free = torch.randperm(3 * PAGE, generator=g) + PAGE  # page 0 is the sentinel
    swa_slots = torch.full((bsz, WINDOW), -1)
    for b, seq in enumerate(SEQ.tolist()):
        n = min(WINDOW, seq)
        swa_slots[b, WINDOW - n :] = free[b * WINDOW : b * WINDOW + n]  # oldest first
    case: dict[str, torch.Tensor | None] = {
        "q": 2 * torch.randn(bsz, HEADS, DIM, generator=g),
        "swa": swa,
        "swa_slots": swa_slots,
        "comp": None,
        "page_table": (torch.randperm(bsz * pages, generator=g) + 1).view(bsz, pages).to(torch.int32),
        "rows": None,
        "visible": None,
        "sinks": torch.randn(HEADS, generator=g),
    }
    if ratio:
        case["comp"] = torch.randn((bsz * pages + 1) * (PAGE // ratio), DIM, generator=g)
        case["visible"] = SEQ // ratio
    if ratio == 4:
        rows = torch.stack([torch.randperm(pages * PAGE // 4, generator=g)[:8] for _ in range(bsz)])
        rows[1, 2], rows[2, 5] = -1, 190  # a -1 pick, a pick past visible (150)
        rows[0] = torch.tensor([0, -1, 3, 1, 7, -1, 2, 5])  # visible 1: one row of eight picks
        case["rows"] = rows
    return case


def _args(case: dict[str, torch.Tensor | None], dtype: torch.dtype, device: str, ratio: int) -> tuple:
    def put(name: str, cast: bool = False) -> torch.Tensor | None:
        t = case[name]
        if t is None:
            return None
        return (t.to(dtype) if cast else t).to(device)

    return (
        put("q", True), put("swa", True), put("swa_slots"), put("comp", True), put("page_table"),
        put("rows"), put("visible"), ratio, PAGE, put("sinks"), DIM**-0.5,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("ratio", [0, 128, 4], ids=["swa", "hca", "csa"])
def test_paged_attention_equals_the_cpu_forms(torch_npu: ModuleType, ratio: int, dtype: torch.dtype) -> None:
    """One npu_sparse_flash_attention over the window (sinks in), a second over the compressed rows
    (HCA every visible row, CSA the picks), merged: the torch form's softmax over both and the sink.
    Padding rows come out 0, as in the torch form."""
    from dsv4_engine.kernels.npu import NpuDecodeKernels

    case = _case(ratio, seed=ratio)
    reference = _calls(torch_npu)
    got = NpuDecodeKernels().paged_attention(*_args(case, dtype, "npu", ratio))
    assert got.device.type == "npu" and got.dtype == dtype and got.shape == (len(SEQ), HEADS, DIM)
    if reference is not None:
        want_calls = 0 if dtype == torch.float32 else 1 + (ratio > 0)
        assert reference.op_calls["npu_sparse_flash_attention"] == want_calls
    exact = TorchKernels().paged_attention(*_args(case, dtype, "cpu", ratio)).float()
    upcast = _args(case, dtype, "cpu", ratio)
    upcast = tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in upcast)
    refs = [exact, TorchKernels().paged_attention(*upcast)]
    if available():
        refs.append(CpuKernels().paged_attention(*upcast))
    for want in refs:
        torch.testing.assert_close(got.cpu().float(), want, atol=TOL[dtype], rtol=TOL[dtype])
    assert got.cpu()[-1].abs().max() == 0  # the padding row


def _index_case(seed: int) -> tuple[torch.Tensor, ...]:
    """Indexer inputs: bf16 queries and keys (some keys zero: score-0 ties), bf16-exact weights."""
    g = torch.Generator().manual_seed(seed)
    bsz, pages, per_page = 4, 3, PAGE // 4
    keys = torch.randn((bsz * pages + 1) * per_page, DI, generator=g)
    keys[torch.randperm(len(keys), generator=g)[:40]] = 0
    q = torch.randn(bsz, 4, DI, generator=g)
    weights = torch.randn(bsz, 4, generator=g).to(BF16).float()
    table = (torch.randperm(bsz * pages, generator=g) + 1).view(bsz, pages).to(torch.int32)
    visible = torch.tensor([0, 5, 40, pages * per_page])  # none, fewer than k, more, every row
    return q.to(BF16), weights, keys.to(BF16), table, visible


def _rows(picks: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Picks with everything that is not a row (-1, or at or past visible) as -1: the sets mark them
    differently (the torch form lists unseen rows, the CPU kernels and the op -1)."""
    return torch.where((picks >= 0) & (picks < visible[:, None]), picks, -1)


def test_index_topk_equals_the_cpu_forms(torch_npu: ModuleType) -> None:
    """A power-of-two scale (what the op takes folded into bf16 weights, exactly): the torch form's
    rows in its order (ties to the lower row), the CPU kernels' rows, none past visible."""
    from dsv4_engine.kernels.npu import NpuDecodeKernels

    q, weights, keys, table, visible = _index_case(4)
    args = (table, visible, 4, PAGE, 0.125, 16)
    reference = _calls(torch_npu)
    got = NpuDecodeKernels().index_topk(q.to("npu"), weights.to("npu"), keys.to("npu"), *(a.to("npu") for a in args[:2]), *args[2:])  # fmt: skip
    assert got.dtype == torch.int64 and got.shape == (4, 16)
    if reference is not None:
        assert reference.op_calls["npu_lightning_indexer"] == 1
    got = _rows(got.cpu(), visible)
    assert (got[0] == -1).all() and (got[1, 5:] == -1).all() and (got[1, :5] >= 0).all()
    assert torch.equal(got, _rows(TorchKernels().index_topk(q, weights, keys, *args), visible))
    if available():  # the CPU kernels list every visible row in row order when there are at most k
        cpu = CpuKernels().index_topk(q.float(), weights, keys.float(), *args)
        assert torch.equal(got.sort(dim=1).values, _rows(cpu, visible).sort(dim=1).values)


def test_index_topk_with_dsv4s_scale_differs_only_on_near_ties(torch_npu: ModuleType) -> None:
    """DSV4's scale (index_head_dim ** -0.5) rounds in the bf16 weights the op takes: a pick may
    differ from the torch form's only where the two rows' scores are within that rounding."""
    from dsv4_engine.kernels.npu import NpuDecodeKernels

    q, weights, keys, table, visible = _index_case(5)
    scale = DI**-0.5
    args = (table, visible, 4, PAGE, scale, 16)
    got = NpuDecodeKernels().index_topk(q.to("npu"), weights.to("npu"), keys.to("npu"), *(a.to("npu") for a in args[:2]), *args[2:])  # fmt: skip
    got, want = _rows(got.cpu(), visible), _rows(TorchKernels().index_topk(q, weights, keys, *args), visible)
    slots = (table.long()[:, :, None] * 32 + torch.arange(32)).flatten(1)  # rows -> slots
    scores = (
        torch.relu(q.double() @ keys.double()[slots].transpose(1, 2)) * weights.double()[..., None]
    ).sum(1)
    picked = lambda p: torch.where(p >= 0, scores.gather(1, p.clamp(min=0)), 0.0)  # noqa: E731
    torch.testing.assert_close(picked(got), picked(want), atol=0.0, rtol=1e-2)
    assert torch.equal(got >= 0, want >= 0)


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_masked_put_scatters_rows(torch_npu: ModuleType, dtype: torch.dtype) -> None:
    """`pool[slots] = rows` where mask, else 0 into the sentinel slot 0: one npu_scatter_nd_update_
    (int64 slots: the op takes them; index_put_'s int32-values limit does not apply)."""
    from dsv4_engine.kernels.npu import NpuDecodeKernels

    g = torch.Generator().manual_seed(6)
    pool = torch.randn(40, DIM, generator=g).to(dtype)
    slots, mask = torch.tensor([7, 0, 39, 12]), torch.tensor([True, False, True, False])
    rows = torch.randn(4, DIM, generator=g).to(dtype)
    dev = pool.to("npu")
    reference = _calls(torch_npu)
    NpuDecodeKernels().masked_put(dev, slots.to("npu"), rows.to("npu"), mask.to("npu"))
    if reference is not None:
        assert reference.op_calls["npu_scatter_nd_update_"] == 1
    want = pool.clone()
    TorchKernels().masked_put(want, slots, rows, mask)
    assert torch.equal(dev.cpu(), want) and want[0].abs().max() == 0


def test_compress_paged_writes_state_and_rows_through_the_scatter(torch_npu: ModuleType) -> None:
    """The compressor's state row and its completed row: both writes are npu_scatter_nd_update_,
    and the pools equal the torch form's."""
    from dsv4_engine.attention.decode_buffers import _compress_buffers
    from dsv4_engine.kernels.npu import NpuDecodeKernels

    g = torch.Generator().manual_seed(7)
    ratio, width, bsz = 128, 64, 2
    state = torch.randn(300, 2 * width, generator=g)
    state[0, width:] = float("-inf")  # the sentinel row: kv 0, score -inf
    state[0, :width] = 0
    rows = torch.randn(20, width, generator=g)
    positions = torch.tensor([127, 40])  # the first completes its block
    cm = _compress_buffers(ratio, bsz, torch.device("cpu"))
    cm.block_loc.copy_(torch.tensor([5, 0]))
    cm.block_mask.copy_(torch.tensor([True, False]))
    cm.state_read_start.copy_(positions)  # the window: the token's own row and sentinels
    cm.state_write_loc.copy_(torch.tensor([130, 200]))
    cm.state_write_mask.copy_(torch.tensor([True, True]))
    angles = torch.arange(256)[:, None] * 0.01 * torch.arange(1, 9)[None, :]
    cos, sin = angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)
    inputs = (
        torch.randn(bsz, width, generator=g), torch.randn(bsz, width, generator=g),
        torch.randn(ratio, width, generator=g), positions,
    )  # fmt: skip

    def run(kernels: object, device: str) -> tuple[torch.Tensor, torch.Tensor]:
        st, rw = state.clone().to(device), rows.clone().to(device)
        kv, gate, bias, pos, c, s, norm = (t.to(device) for t in (*inputs, cos, sin, torch.ones(width)))
        kernels.compress_paged(kv, gate, bias, pos, cm.to(device), c, s, norm, 1e-6, st, rw, False)  # type: ignore[attr-defined]
        return st.cpu(), rw.cpu()

    reference = _calls(torch_npu)
    got = run(NpuDecodeKernels(), "npu")
    if reference is not None:
        assert reference.op_calls["npu_scatter_nd_update_"] == 2
    want = run(TorchKernels(), "cpu")
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-6)
    assert not torch.equal(want[1][5], rows[5])  # the completed row was written


def test_the_decode_variant_captures_attention_indexer_and_writes_as_a_graph(torch_npu: ModuleType) -> None:
    """The three captured once after an eager step (no host reads, static shapes: the ops' lengths
    are device tensors), then replayed on new queries and KV rows written into the static buffers:
    the eager values each time."""
    from dsv4_engine.kernels.npu import NpuDecodeKernels

    case = _case(4, seed=8)
    args = list(_args(case, BF16, "npu", 4))
    q, swa = args[0], args[1]
    q_idx, weights, _, _, _ = _index_case(9)
    keys = torch.randn(len(case["comp"]), DI).to(BF16).to("npu")  # type: ignore[arg-type]  # indexer rows
    q_idx, weights = q_idx.to("npu"), weights.to("npu")
    new_kv = torch.randn(len(SEQ), DIM).to(BF16).to("npu")
    slots, valid = args[2][:, -1].clone(), (SEQ > 0).to("npu")
    decode = NpuDecodeKernels()

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        decode.masked_put(swa, slots, new_kv, valid)
        picks = decode.index_topk(q_idx, weights, keys, args[4], args[6], 4, PAGE, 0.125, 8)
        return picks, decode.paged_attention(q, swa, *args[2:5], picks, *args[6:])

    step()  # the engine's warm-up: the op's zero rope inputs exist before capture
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        picks, out = step()
    g = torch.Generator().manual_seed(10)
    for _ in range(2):
        q.copy_(torch.randn(q.shape, generator=g).to(BF16))  # in place: the buffers the graph reads
        q_idx.copy_(torch.randn(q_idx.shape, generator=g).to(BF16))
        new_kv.copy_(torch.randn(new_kv.shape, generator=g).to(BF16))
        graph.replay()
        want_picks, want = step()
        assert torch.equal(picks.cpu(), want_picks.cpu())
        torch.testing.assert_close(out.cpu().float(), want.cpu().float(), atol=0.0, rtol=0.0)
