"""aclgraph as the reference records it: capture, replay, what capture refuses, task-group updates."""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch

# These test the reference itself (graph recording); DSV4_TORCH_NPU=real runs the ops tests on the real torch_npu.
pytestmark = pytest.mark.skipif(
    os.environ.get("DSV4_TORCH_NPU") == "real", reason="tests the reference torch_npu"
)


def _captured(fn: Callable[[], Any]) -> tuple[Any, Any]:
    """Capture `fn` once (torch.npu.graph uses its own side stream)."""
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        out = fn()
    return g, out


def test_replay_reads_the_static_buffers_in_place(torch_npu: ModuleType) -> None:
    x = torch.zeros(4, device="npu")
    w = torch.full((4,), 2.0, device="npu")
    g, out = _captured(lambda: torch.relu(x * w - 1))
    assert g.input_ptrs == {x.data_ptr(), w.data_ptr()}
    for step in range(3):
        x.copy_(torch.arange(4.0) + step)  # refreshed in place: same data_ptr
        g.replay()
        assert out.cpu().tolist() == torch.relu((torch.arange(4.0) + step) * 2 - 1).tolist()
    assert g.replays == [sorted(g.input_ptrs)] * 3


def test_a_rebound_buffer_is_not_seen_by_replay(torch_npu: ModuleType) -> None:
    """Replacing a static buffer by a new tensor (new data_ptr) leaves the graph on the old one."""
    bufs = {"x": torch.ones(3, device="npu")}
    g, out = _captured(lambda: bufs["x"] * 10)
    bufs["x"] = torch.full((3,), 5.0, device="npu")  # the mistake
    g.replay()
    assert out.cpu().tolist() == [10.0] * 3
    assert bufs["x"].data_ptr() not in g.input_ptrs


def test_host_values_are_frozen_at_capture(torch_npu: ModuleType) -> None:
    x = torch.ones(2, device="npu")
    lengths = torch.tensor(3.0)  # a host scalar, as a host-side length would be
    g, out = _captured(lambda: x * lengths)
    lengths.fill_(7.0)
    g.replay()
    assert out.cpu().tolist() == [3.0, 3.0]


def test_reference_ops_replay_with_new_inputs(torch_npu: ModuleType) -> None:
    x = torch.zeros(2, 8, dtype=torch.bfloat16, device="npu")
    gamma = torch.ones(8, dtype=torch.bfloat16, device="npu")
    g, (y, _) = _captured(lambda: torch_npu.npu_rms_norm(x, gamma))
    x.copy_(torch.full((2, 8), 3.0, dtype=torch.bfloat16))
    g.replay()
    torch.testing.assert_close(y.cpu(), torch.ones(2, 8, dtype=torch.bfloat16), rtol=0.01, atol=0.01)


@pytest.mark.parametrize(
    ("what", "fn"),
    [
        ("item", lambda x: x.sum().item()),
        ("tolist", lambda x: x.tolist()),
        ("to host", lambda x: x.cpu()),
        ("from host", lambda x: x.copy_(torch.ones(4))),
        ("data-dependent shape", lambda x: x[x > 0]),
    ],
)
def test_capture_refuses_host_syncs_and_dynamic_shapes(
    torch_npu: ModuleType, what: str, fn: Callable[[torch.Tensor], Any]
) -> None:
    x = torch.ones(4, device="npu")
    before = len(torch_npu.reference.captures)
    with pytest.raises(torch_npu._device.CaptureError):
        _captured(lambda: fn(x))
    assert len(torch_npu.reference.captures) == before  # a failed capture leaves no graph
    assert not torch.npu.is_current_stream_capturing()


def test_capture_refuses_the_default_stream(torch_npu: ModuleType) -> None:
    g = torch.npu.NPUGraph()
    with pytest.raises(torch_npu._device.CaptureError, match="non-default stream"):
        g.capture_begin()


def test_graph_task_update_replaces_the_group_arguments(torch_npu: ModuleType) -> None:
    """graph_task_group_begin/end mark a task at capture; graph_task_update_begin/end re-issue it
    with new arguments (what torch_npu does for host lengths), without running it until replay."""
    x = torch.ones(3, device="npu")
    out = torch.empty(3, device="npu")
    g = torch.npu.NPUGraph()
    stream = torch.npu.Stream()
    with torch.npu.graph(g, stream=stream):
        torch.npu.graph_task_group_begin(stream)
        torch.mul(x, 2.0, out=out)
        handle = torch.npu.graph_task_group_end(stream)
    g.replay()
    assert out.cpu().tolist() == [2.0] * 3
    torch.npu.graph_task_update_begin(stream, handle)
    torch.mul(x, 5.0, out=out)  # recorded, not run
    torch.npu.graph_task_update_end(stream)
    assert out.cpu().tolist() == [2.0] * 3 and g.task_updates == 1
    g.replay()
    assert out.cpu().tolist() == [5.0] * 3
    torch.npu.graph_task_update_begin(stream, handle)
    with pytest.raises(RuntimeError, match="captured aten::mul but updated with aten::add"):
        torch.add(x, 1.0, out=out)
    assert (x + 1).cpu().tolist() == [2.0] * 3  # the abandoned update leaves eager work running


def test_update_needs_auto_dispatch_capture(torch_npu: ModuleType) -> None:
    g, _ = _captured(lambda: torch.ones(1, device="npu") + 1)
    with pytest.raises(RuntimeError, match="auto_dispatch_capture=True"):
        g.update(cpu_update_input=[{"actual_seq_lengths_kv": [1]}])


def test_the_engine_graph_api_captures_once_per_bucket(torch_npu: ModuleType) -> None:
    """dsv4_engine.device.graph_api (product code) on the reference: the runner's capture pattern,
    one capture per bucket, none during traffic, replays reading the buffers the capture saw."""
    from dsv4_engine.device import graph_api

    api = graph_api(torch.device("npu"))
    weights = torch.randn(8, 8, device="npu")
    buckets = {bs: torch.zeros(bs, 8, device="npu") for bs in (1, 2, 4)}
    graphs, outs = {}, {}
    start = len(torch_npu.reference.captures)
    for bs, static in buckets.items():
        side = api.stream()
        side.wait_stream(api.current_stream())
        with api.use_stream(side):
            _ = static @ weights  # warm-up
        api.current_stream().wait_stream(side)
        graphs[bs] = api.graph()
        with api.capture(graphs[bs]):
            outs[bs] = torch.tanh(static @ weights)
    assert len(torch_npu.reference.captures) - start == len(buckets)
    for step in range(4):  # traffic
        bs = (1, 2, 4)[step % 3]
        batch = torch.randn(bs, 8)
        buckets[bs].copy_(batch)
        graphs[bs].replay()
        torch.testing.assert_close(outs[bs].cpu(), torch.tanh(batch @ weights.cpu()))
        assert buckets[bs].data_ptr() in graphs[bs].input_ptrs
    assert len(torch_npu.reference.captures) - start == len(buckets)


def test_replay_writes_each_output_of_a_multi_output_op_into_its_own_buffer(torch_npu: ModuleType) -> None:
    """torch.sort and max(dim) reach the device as out= ops with two outputs. The reference once
    mapped a fresh output back by the id of a host alias it had let die, so a capture could record
    sort's values as its indices and a replay copy one into the other (the engine's decode graph then
    gathered at index INT64_MIN, in about one start in ten). Several captures make a reuse of ids
    all but certain."""
    for _ in range(10):
        x = torch.zeros(2, 4, 8, device="npu")
        with torch.inference_mode():  # as the engine's decode step runs
            g, (top, order) = _captured(
                lambda x=x: (x.max(dim=-1), torch.sort(x, dim=-1, descending=True, stable=True))
            )
        for _ in range(3):
            h = torch.randn(2, 4, 8)
            x.copy_(h)
            g.replay()
            want_top, want_order = h.max(dim=-1), torch.sort(h, dim=-1, descending=True, stable=True)
            for got, want in zip((*top, *order), (*want_top, *want_order), strict=True):
                assert got.dtype == want.dtype and torch.equal(got.cpu(), want)


def test_a_buffer_grown_during_capture_is_the_graphs_own(torch_npu: ModuleType) -> None:
    """An output resized inside the capture (torch.arange's out starts empty) gets memory from the
    graph's pool, so it is not counted among the graph's inputs."""
    n = torch.zeros(1, dtype=torch.long, device="npu")
    g, out = _captured(lambda: torch.arange(16, device="npu") + n)
    assert g.input_ptrs == {n.data_ptr()}
    n.fill_(3)
    g.replay()
    assert out.cpu().tolist() == list(range(3, 19))


def test_capture_refuses_fusion_attention(torch_npu: ModuleType) -> None:
    """npu_fusion_attention documents no aclgraph support (its lengths are host lists)."""
    q = torch.randn(6, 2, 8, device="npu")
    with pytest.raises(torch_npu._device.CaptureError, match="npu_fusion_attention"):
        _captured(lambda: torch_npu.npu_fusion_attention(
            q, q, q, 2, "TND", actual_seq_qlen=[6], actual_seq_kvlen=[6]
        ))  # fmt: skip
