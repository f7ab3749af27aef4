"""Streams as the reference orders them (`_streams.py`): every op runs at once, but an access another
stream's work is not ordered with (no wait_stream, no event) is a StreamHazard, and a graph capture
takes a side stream's work only once it forked from the capture stream, and only if it is joined
back by capture end (CUDA graphs' rule, which aclgraph shares)."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch


def _streams(torch_npu: ModuleType) -> tuple[ModuleType, type[Exception]]:
    return torch_npu._streams, torch_npu._streams.StreamHazard


def test_a_read_of_another_streams_output_needs_a_wait(reference_npu: ModuleType) -> None:
    _, hazard = _streams(reference_npu)
    x = torch.ones(4, device="npu")
    main, alt = torch.npu.current_stream(), torch.npu.Stream()
    alt.wait_stream(main)
    with torch.npu.stream(alt):
        y = x * 2
    with pytest.raises(hazard, match=r"reads memory .* that stream .* wrote"):
        _ = y + 1  # main, before any wait
    with pytest.raises(hazard):
        y.cpu()  # a host read is ordered with the current stream only
    main.wait_stream(alt)
    assert (y + 1).cpu().tolist() == [3.0] * 4


def test_a_side_stream_must_wait_before_reading_the_main_streams_work(reference_npu: ModuleType) -> None:
    _, hazard = _streams(reference_npu)
    main, alt = torch.npu.current_stream(), torch.npu.Stream()
    x = torch.ones(4, device="npu") * 3  # written on main
    with torch.npu.stream(alt), pytest.raises(hazard, match="reads"):
        _ = x + 1
    event = torch.npu.Event()
    event.record(main)
    alt.wait_event(event)
    with torch.npu.stream(alt):
        z = x + 1
    main.wait_stream(alt)
    assert z.cpu().tolist() == [4.0] * 4


def test_a_write_after_another_streams_read_needs_a_wait(reference_npu: ModuleType) -> None:
    """Write-after-read: main must not overwrite x while alt may still read it."""
    _, hazard = _streams(reference_npu)
    main, alt = torch.npu.current_stream(), torch.npu.Stream()
    x = torch.ones(4, device="npu")
    alt.wait_stream(main)
    with torch.npu.stream(alt):
        y = x + 1
    with pytest.raises(hazard, match="still reads"):
        x.fill_(5.0)
    main.wait_stream(alt)
    x.fill_(5.0)
    assert y.cpu().tolist() == [2.0] * 4


def test_torch_npu_ops_are_ordered_too_and_synchronize_orders_everything(reference_npu: ModuleType) -> None:
    _, hazard = _streams(reference_npu)
    alt = torch.npu.Stream()
    h = torch.randn(3, 8, device="npu")
    alt.wait_stream(torch.npu.current_stream())
    with torch.npu.stream(alt):
        act = reference_npu.npu_swiglu(h, dim=-1)
    with pytest.raises(hazard, match="npu::npu_swiglu on stream 0 reads"):
        reference_npu.npu_swiglu(act)
    torch.npu.synchronize()
    assert reference_npu.npu_swiglu(act).shape == (3, 2)


def test_record_stream_is_recorded(reference_npu: ModuleType) -> None:
    streams, _ = _streams(reference_npu)
    alt = torch.npu.Stream()
    x = torch.ones(2, device="npu")
    x.record_stream(alt)
    assert alt.stream_id in streams.recorded_streams[x.untyped_storage().data_ptr()]


def _fork_join(x: torch.Tensor, alt: torch.npu.Stream, fork: bool, join: bool) -> torch.Tensor:
    main = torch.npu.current_stream()
    if fork:
        alt.wait_stream(main)
    with torch.npu.stream(alt):
        side = torch.tanh(x)
    out = x * 2
    if join:
        main.wait_stream(alt)
        out = out + side
    return out


def test_a_capture_takes_a_forked_and_joined_side_stream(reference_npu: ModuleType) -> None:
    x = torch.zeros(4, device="npu")
    alt = torch.npu.Stream()
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        out = _fork_join(x, alt, fork=True, join=True)
    assert {e.stream for e in graph.tape} == {graph._stream, alt.stream_id}
    assert [e.name for e in graph.tape if e.stream == alt.stream_id] == ["aten::tanh"]
    for shift in (0.5, -1.0):
        x.copy_(torch.arange(4.0) + shift)
        graph.replay()
        torch.testing.assert_close(
            out.cpu(), 2 * (torch.arange(4.0) + shift) + torch.tanh(torch.arange(4.0) + shift)
        )


@pytest.mark.parametrize(
    ("fork", "join", "match"),
    [(False, True, "not part of the capture"), (True, False, "not joined back")],
    ids=["no-fork", "no-join"],
)
def test_a_capture_refuses_an_unforked_or_unjoined_side_stream(
    reference_npu: ModuleType, fork: bool, join: bool, match: str
) -> None:
    x = torch.zeros(4, device="npu")
    graph = torch.npu.NPUGraph()
    with pytest.raises(reference_npu._device.CaptureError, match=match), torch.npu.graph(graph):
        _fork_join(x, torch.npu.Stream(), fork=fork, join=join)
    assert not graph.captured and not reference_npu._device._state.capturing
    with torch.npu.graph(graph):  # the next capture starts clean
        _fork_join(x, torch.npu.Stream(), fork=True, join=True)
    assert graph.captured
