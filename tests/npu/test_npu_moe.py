"""The NPU kernel set's MoE (`kernels/npu.py`: `route` through npu_moe_gating_top_k, `routed_experts`
through npu_moe_init_routing_v2 / npu_grouped_matmul / npu_swiglu / npu_moe_finalize_routing) on "npu"
tensors, against the torch forms and, where they build, the fused CPU kernels on the same host values;
then the calls those ops refuse, as the device does.

Tolerances: fp32 1e-5 (the reference runs the matmuls in float64, the torch forms in fp32); bf16 2e-2
(the torch forms round the scores and each expert's activations to bf16 where the NPU path keeps the
scores in fp32). Expert ids must match exactly: the inputs keep the k-th and (k+1)-th choice of every
row apart by more than bf16 rounding, so the comparison is well posed in both dtypes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from dsv4_engine.kernels import CpuKernels, KernelSet, TorchKernels, available
from dsv4_engine.kernels.torch_forms import StaticTorchKernels

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
T, D, E, INTER, K, VOCAB, LIMIT, SCALE = 9, 32, 16, 24, 3, 40, 1.5, 1.5


def _sets() -> list[KernelSet]:
    return [TorchKernels(), StaticTorchKernels(), *([CpuKernels()] if available() else [])]


def _npu_sets() -> list[KernelSet]:
    from dsv4_engine.kernels.npu import NpuDecodeKernels, NpuKernels

    return [NpuKernels(), NpuDecodeKernels()]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def _router(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Router inputs whose k-th and (k+1)-th choice differ by over 3% in every row, so bf16 rounding
    cannot swap them (a seed picked for it, and checked)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, D, generator=g).to(dtype)
    weight = (torch.randn(E, D, generator=g) / 2).to(dtype)
    bias = 0.1 * torch.randn(E, generator=g)  # fp32, as the checkpoint's e_score_correction_bias
    choice = F.softplus(F.linear(x, weight).float()).sqrt() + bias
    top = choice.topk(K + 1, dim=-1).values
    assert bool((top[:, K - 1] - top[:, K] > 0.03 * top[:, K - 1]).all()), "a near tie at the k-th choice"
    tid2eid = torch.rand(VOCAB, E, generator=g).argsort(dim=1)[:, :K].contiguous()  # int64, as loaded
    input_ids = torch.randint(0, VOCAB, (T,), generator=g)
    return {"x": x, "weight": weight, "bias": bias, "tid2eid": tid2eid, "input_ids": input_ids}


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) with each row's pairs in expert order: the sets do not promise an order."""
    order = ids.long().argsort(dim=-1)
    return weights.gather(1, order), ids.long().gather(1, order)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_hash", [False, True], ids=["scored", "hash"])
def test_route_equals_the_cpu_forms(torch_npu: ModuleType, dtype: torch.dtype, is_hash: bool) -> None:
    """A score-based layer (sqrtsoftplus + correction bias, noaux_tc top-K) and a hash layer (tid2eid),
    weights renormalised and scaled; the NPU set's ids are int32 on the device."""
    r = _router(dtype)
    table = r["tid2eid"] if is_hash else r["bias"]
    dev = {name: t.to("npu") for name, t in r.items()}
    for npu_set in _npu_sets():
        weights, ids = npu_set.route(
            dev["x"],
            dev["input_ids"],
            dev["weight"],
            dev["tid2eid" if is_hash else "bias"],
            is_hash,
            K,
            SCALE,
        )
        assert ids.device.type == "npu" and ids.dtype == torch.int32
        assert weights.dtype == dtype and weights.shape == (T, K)
        got_w, got_ids = _sorted(weights.cpu(), ids.cpu())
        for ref in _sets():
            want_w, want_ids = _sorted(
                *ref.route(r["x"], r["input_ids"], r["weight"], table, is_hash, K, SCALE)
            )
            assert torch.equal(got_ids, want_ids), type(ref).__name__
            _close(got_w, want_w, dtype)
        if is_hash:
            assert torch.equal(got_ids, r["tid2eid"][r["input_ids"]].sort(dim=-1).values)
        _close(got_w.float().sum(-1), torch.full((T,), SCALE), dtype)  # normalised, then scaled


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("foreign", [False, True], ids=["all-local", "ep-pairs"])
def test_routed_experts_equal_the_cpu_forms(torch_npu: ModuleType, dtype: torch.dtype, foreign: bool) -> None:
    """Inputs large enough that DSV4's clamps (limit 1.5) cut gate and up; an expert nobody picks;
    with `foreign`, pairs another rank holds (-1), which contribute nothing."""
    g = torch.Generator().manual_seed(7)
    x = (3 * torch.randn(T, D, generator=g)).to(dtype)
    gate_up = (torch.randn(E, 2 * INTER, D, generator=g) / 4).to(dtype)
    down = (torch.randn(E, D, INTER, generator=g) / 4).to(dtype)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])  # expert E-1 idle
    weights = torch.rand(T, K, generator=g).to(dtype)
    if foreign:
        ids[::2, 0] = -1
    assert (F.linear(x.float(), gate_up.float().flatten(0, 1)).abs() > LIMIT).any()
    for npu_set in _npu_sets():
        got = npu_set.routed_experts(
            x.to("npu"), gate_up.to("npu"), down.to("npu"), ids.to("npu"), weights.to("npu"), LIMIT
        )
        assert got.device.type == "npu" and got.dtype == dtype
        for ref in _sets():
            _close(got.cpu(), ref.routed_experts(x, gate_up, down, ids, weights, LIMIT), dtype)


def test_a_moe_layer_routes_and_runs_its_experts_on_the_npu_ops(torch_npu: ModuleType) -> None:
    """Router then experts, as `MoE.forward` chains them (int32 ids from one into the other): the
    same output as the torch set, and each op once per layer."""
    from dsv4_engine.kernels.npu import NpuKernels

    r = _router(torch.float32)
    g = torch.Generator().manual_seed(8)
    gate_up, down = torch.randn(E, 2 * INTER, D, generator=g) / 4, torch.randn(E, D, INTER, generator=g) / 4
    dev = {name: t.to("npu") for name, t in r.items()}
    calls = getattr(torch_npu, "reference", None)
    before = dict(calls.op_calls) if calls else {}
    npu_set, ref = NpuKernels(), TorchKernels()
    weights, ids = npu_set.route(dev["x"], dev["input_ids"], dev["weight"], dev["bias"], False, K, SCALE)
    got = npu_set.routed_experts(dev["x"], gate_up.to("npu"), down.to("npu"), ids, weights, LIMIT)
    w, i = ref.route(r["x"], r["input_ids"], r["weight"], r["bias"], False, K, SCALE)
    _close(got.cpu(), ref.routed_experts(r["x"], gate_up, down, i, w, LIMIT), torch.float32)
    if calls:
        ran = {op: n - before.get(op, 0) for op, n in calls.op_calls.items() if n > before.get(op, 0)}
        assert ran == {
            "npu_moe_gating_top_k": 1,
            "npu_moe_init_routing_v2": 1,
            "npu_grouped_matmul": 2,
            "npu_swiglu": 1,
            "npu_moe_finalize_routing": 1,
        }, ran


def test_the_decode_variant_captures_the_moe_as_a_graph(torch_npu: ModuleType) -> None:
    """Route and experts of the decode set captured once (no host reads, static shapes), then
    replayed on new inputs written into the static buffer: the eager values each time."""
    from dsv4_engine.kernels.npu import NpuDecodeKernels

    r = _router(torch.float32)
    g = torch.Generator().manual_seed(9)
    gate_up, down = torch.randn(E, 2 * INTER, D, generator=g) / 4, torch.randn(E, D, INTER, generator=g) / 4
    dev = {name: t.to("npu") for name, t in r.items()}
    experts = gate_up.to("npu"), down.to("npu")
    x = dev["x"].clone()  # the static input buffer
    decode = NpuDecodeKernels()

    def step() -> torch.Tensor:
        weights, ids = decode.route(x, dev["input_ids"], dev["weight"], dev["bias"], False, K, SCALE)
        return decode.routed_experts(x, *experts, ids, weights, LIMIT)

    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        out = step()
    for shift in (0.0, 0.5):
        x.copy_(dev["x"] + shift)  # in place: the buffer the graph reads
        graph.replay()
        _close(out.cpu(), step().cpu(), torch.float32)


# --- the decode set's two streams: the shared expert beside the routed experts ----------------------
Thunks = tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]
ROUTED_OPS = (
    "npu_moe_gating_top_k",
    "npu_moe_init_routing_v2",
    "npu_grouped_matmul",
    "npu_moe_finalize_routing",
)


def _moe_layer() -> Callable[[KernelSet, torch.Tensor], Thunks]:
    """A MoE layer's two halves on "npu" weights, as `MoE.forward` hands them to
    `routed_and_shared`: (router + routed experts, shared expert) of a kernel set and an input."""
    r = _router(torch.float32)
    g = torch.Generator().manual_seed(10)
    dev = {name: t.to("npu") for name, t in r.items()}
    gate_up, down = (
        (torch.randn(E, 2 * INTER, D, generator=g) / 4).to("npu"),
        (torch.randn(E, D, INTER, generator=g) / 4).to("npu"),
    )
    s_gate_up, s_down = (
        (torch.randn(2 * INTER, D, generator=g) / 4).to("npu"),
        (torch.randn(D, INTER, generator=g) / 4).to("npu"),
    )

    def halves(kernels: KernelSet, x: torch.Tensor) -> Thunks:
        def routed() -> torch.Tensor:
            weights, ids = kernels.route(x, dev["input_ids"], dev["weight"], dev["bias"], False, K, SCALE)
            return kernels.routed_experts(x, gate_up, down, ids, weights, LIMIT)

        return routed, lambda: kernels.shared_expert(x, s_gate_up, s_down, LIMIT)

    return halves


def _one_stream(kernels: KernelSet, halves: Thunks) -> torch.Tensor:
    """The base form: routed, then shared, on the current stream."""
    return KernelSet.routed_and_shared(kernels, *halves)


def test_the_decode_set_overlaps_the_shared_expert_bit_for_bit(torch_npu: ModuleType) -> None:
    from dsv4_engine.kernels.npu import NpuDecodeKernels

    layer, decode = _moe_layer(), NpuDecodeKernels()
    x = (3 * torch.randn(T, D, generator=torch.Generator().manual_seed(11))).to("npu")
    got = decode.routed_and_shared(*layer(decode, x))
    want = _one_stream(decode, layer(decode, x))
    assert torch.equal(got.cpu(), want.cpu())
    assert not torch.equal(want.cpu(), layer(decode, x)[0]().cpu())  # the shared expert is in the sum


def _logged(reference: ModuleType, fn: Callable[[], torch.Tensor]) -> list[tuple[str, int]]:
    reference.stream_log = []
    try:
        fn()
        return reference.stream_log
    finally:
        reference.stream_log = None


def test_the_shared_expert_runs_on_the_alt_stream_and_the_routed_ops_on_the_main_one(
    reference_npu: ModuleType,
) -> None:
    """Per op: the routed chain (route, init_routing, both grouped matmuls, its SwiGLU, finalize) and
    the sum on the calling stream, the shared expert's matmuls and SwiGLU on one alt stream, the same
    one every call (made once per set); the extend set stays on one stream."""
    from dsv4_engine.kernels.npu import NpuDecodeKernels, NpuKernels

    layer, decode = _moe_layer(), NpuDecodeKernels()
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(12)).to("npu")
    main = torch.npu.current_stream().stream_id
    calls = [
        _logged(reference_npu.reference, lambda: decode.routed_and_shared(*layer(decode, x)))
        for _ in range(2)
    ]
    alt = decode._alt.stream_id
    assert alt != main
    for log in calls:
        on = {name: {s for n, s in log if n == f"npu::{name}"} for name in (*ROUTED_OPS, "npu_swiglu")}
        assert on == {**{op: {main} for op in ROUTED_OPS}, "npu_swiglu": {main, alt}}, on
        side = [n for n, s in log if s == alt]
        assert side.count("npu::npu_swiglu") == 1 and len(side) >= 3, side  # gate/up, SwiGLU, down
        assert log[-1][0].startswith("aten::add") and log[-1][1] == main  # the sum, after the join
    assert {s for n, s in calls[0] + calls[1]} == {main, alt}
    extend = NpuKernels()
    log = _logged(reference_npu.reference, lambda: extend.routed_and_shared(*layer(extend, x)))
    assert {s for _, s in log} == {main}


def test_the_two_streams_capture_as_one_decode_graph(torch_npu: ModuleType) -> None:
    """Captured once on the capture stream (the alt stream forked from it and joined back), then
    replayed on new inputs written into the static buffer: the one-stream values, bit for bit."""
    from dsv4_engine.kernels.npu import NpuDecodeKernels

    layer, decode = _moe_layer(), NpuDecodeKernels()
    x = torch.zeros(T, D, device="npu")  # the static input buffer
    decode.routed_and_shared(*layer(decode, x))  # an eager warm-up makes the alt stream, as the runner's
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        out = decode.routed_and_shared(*layer(decode, x))
    if hasattr(graph, "tape"):  # the reference records each captured op's stream
        assert {e.stream for e in graph.tape} == {graph._stream, decode._alt.stream_id}
    for seed in (13, 14):
        x.copy_(torch.randn(T, D, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        assert torch.equal(out.cpu(), _one_stream(decode, layer(decode, x)).cpu()), seed


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("dropped", ["join", "fork"])
def test_dropping_a_wait_is_a_hazard(
    reference_npu: ModuleType, monkeypatch: pytest.MonkeyPatch, dropped: str, captured: bool
) -> None:
    """Mutations of `routed_and_shared`: without the main stream's wait on the alt stream the sum
    reads the shared output unordered; without the alt stream's wait on the main stream the shared
    expert reads x unordered (and, in a capture, runs on a stream the capture never forked)."""
    from dsv4_engine.kernels.npu import NpuDecodeKernels

    layer, decode = _moe_layer(), NpuDecodeKernels()
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(15)).to("npu")
    decode.routed_and_shared(*layer(decode, x))  # makes the alt stream
    alt, wait = decode._alt, torch.npu.Stream.wait_stream

    def wait_but_the_dropped(self: torch.npu.Stream, other: torch.npu.Stream) -> None:
        if (self == alt) == (dropped == "fork") and alt in (self, other):
            return
        wait(self, other)

    monkeypatch.setattr(torch.npu.Stream, "wait_stream", wait_but_the_dropped)
    errors: tuple[type[Exception], ...] = (reference_npu._streams.StreamHazard,)
    if captured and dropped == "fork":
        errors = (reference_npu._device.CaptureError,)
    capture = torch.npu.graph(torch.npu.NPUGraph()) if captured else contextlib.nullcontext()
    with pytest.raises(errors), capture:
        x.add_(1.0)  # x written again on the calling stream
        decode.routed_and_shared(*layer(decode, x))


# --- what the ops refuse, as the device does (the messages are the reference's) ---------------------
def npu(t: torch.Tensor) -> torch.Tensor:
    return t.to("npu")


def _gmm(torch_npu: ModuleType, x: torch.Tensor, w: torch.Tensor, group_list: torch.Tensor) -> torch.Tensor:
    return torch_npu.npu_grouped_matmul(
        [x], [w], group_list=group_list, split_item=2, group_type=0, group_list_type=1
    )[0]


def test_grouped_matmul_takes_weights_as_stored_transposed(reference_npu: ModuleType) -> None:
    """[E, N, K].transpose(1, 2) is the op's transposed weight: the same product as a contiguous copy."""
    x, w = torch.randn(6, 8), torch.randn(2, 5, 8)  # [E, N, K] as the engine stores its experts
    counts = npu(torch.tensor([4, 2]))
    got = _gmm(reference_npu, npu(x), npu(w).transpose(1, 2), counts)
    want = torch.cat([x[:4] @ w[0].T, x[4:] @ w[1].T])
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        _gmm(reference_npu, npu(x), npu(w.transpose(1, 2).contiguous()), counts).cpu(), got.cpu()
    )


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("x transposed", "x must be contiguous"),
        ("weight strided", "weight must be contiguous or the transpose"),
        ("weight dtype", r"weight dtype torch\.bfloat16 must equal x's torch\.float32"),
        ("int32 group_list", r"group_list has dtype torch\.int32"),
        ("one count", "must not have length 1"),
    ],
)
def test_grouped_matmul_refuses(reference_npu: ModuleType, case: str, match: str) -> None:
    x, w, counts = npu(torch.randn(6, 8)), npu(torch.randn(2, 8, 5)), npu(torch.tensor([4, 2]))
    if case == "x transposed":
        x = npu(torch.randn(8, 6)).T
    elif case == "weight strided":
        w = npu(torch.randn(2, 8, 10))[:, :, ::2]
    elif case == "weight dtype":
        w = w.to(torch.bfloat16)
    elif case == "int32 group_list":
        counts = counts.to(torch.int32)
    elif case == "one count":
        w, counts = w[:1], npu(torch.tensor([6]))
    with pytest.raises(RuntimeError, match=match):
        _gmm(reference_npu, x, w, counts)


def test_finalize_reads_the_map_column_major_in_mode_0_and_row_major_in_mode_2(
    reference_npu: ModuleType,
) -> None:
    """init_routing_v2's map is row-major (token * K + slot): mode 2 reads it as it comes, mode 0 needs
    it transposed (init_routing v1's layout)."""
    torch.manual_seed(3)
    n, k = 4, 2
    rows, scales = torch.randn(n * k, 5), torch.rand(n, k)
    row_major = torch.randperm(n * k).to(torch.int32)  # token i, slot j -> its row
    want = (rows[row_major.long().view(n, k)] * scales[..., None]).sum(1)
    by_rows = reference_npu.npu_moe_finalize_routing(
        npu(rows), None, None, None, npu(scales), npu(row_major), None, drop_pad_mode=2
    )
    by_cols = reference_npu.npu_moe_finalize_routing(
        npu(rows), None, None, None, npu(scales), npu(row_major.view(n, k).T.contiguous().view(-1)), None
    )
    torch.testing.assert_close(by_rows.cpu(), want)
    torch.testing.assert_close(by_cols.cpu(), want)


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("int64 map", r"expanded_src_to_dst_row has dtype torch\.int64"),
        ("scales dtype", r"scales dtype torch\.float16 must be"),
        ("drop pad", "drop_pad_mode 1"),
        ("map out of range", "out of"),
    ],
)
def test_finalize_refuses(reference_npu: ModuleType, case: str, match: str) -> None:
    rows, scales, dst = torch.randn(6, 4), torch.rand(3, 2), torch.arange(6, dtype=torch.int32)
    mode = 2
    if case == "int64 map":
        dst = dst.long()
    elif case == "scales dtype":
        scales = scales.half()
    elif case == "drop pad":
        mode = 1
    elif case == "map out of range":
        dst[0] = 6
    with pytest.raises(RuntimeError, match=match):
        reference_npu.npu_moe_finalize_routing(
            npu(rows), None, None, None, npu(scales), npu(dst), None, drop_pad_mode=mode
        )


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("bias dtype", r"bias dtype torch\.bfloat16 must equal x's torch\.float32"),
        ("x dtype", r"x has dtype torch\.int32"),
        ("k range", r"k 17 not in \[1, 16\]"),
        ("hash k", "exceeds 64 in hash mode"),
        ("sqrtsoftplus", "norm_type must be 0"),
    ],
)
def test_gating_top_k_refuses(reference_npu: ModuleType, case: str, match: str) -> None:
    x, kw, k = npu(torch.randn(3, 16)), {"norm_type": 1}, 2
    if case == "bias dtype":
        kw["bias"] = npu(torch.zeros(16, dtype=torch.bfloat16))
    elif case == "x dtype":
        x = npu(torch.zeros(3, 16, dtype=torch.int32))
    elif case == "k range":
        k = 17
    elif case == "hash k":
        x, k = npu(torch.randn(3, 128)), 65
        kw.update(input_ids=npu(torch.zeros(3, dtype=torch.int32)), tid2eid=npu(torch.zeros(2, 65).int()))
    elif case == "sqrtsoftplus":  # ops-transformer's norm_type 2: not in torch_npu 2.14.0's docstring
        kw["norm_type"] = 2
    with pytest.raises(RuntimeError, match=match):
        reference_npu.npu_moe_gating_top_k(x, k, **kw)


def test_init_routing_refuses_int64_expert_ids(reference_npu: ModuleType) -> None:
    with pytest.raises(RuntimeError, match=r"expert_idx has dtype torch\.int64"):
        reference_npu.npu_moe_init_routing_v2(
            npu(torch.randn(3, 4)), npu(torch.zeros(3, 2, dtype=torch.int64)), active_num=6, expert_num=4,
            expert_tokens_num_type=1, expert_tokens_num_flag=True,
        )  # fmt: skip
