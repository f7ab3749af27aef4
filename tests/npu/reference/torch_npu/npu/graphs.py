"""aclgraph as the reference records it: `NPUGraph`, `graph(...)` and the graph-task update calls.

Signatures are torch_npu 2.14.0's (`torch_npu/npu/graphs.py` in the wheel):
`graph(npu_graph, pool=None, stream=None, auto_dispatch_capture=False, capture_error_mode="global")`,
`NPUGraph.capture_begin(pool=None, capture_error_mode="global")`, `capture_end()`, `replay()`,
`reset()`, `pool()`, `update(cpu_update_input)`, and `graph_task_group_begin(stream)`,
`graph_task_group_end(stream) -> handle`, `graph_task_update_begin(stream, handle)`,
`graph_task_update_end(stream)`.

Capture records every device op (aten or torch_npu) into a tape: the op, its device tensors by
reference, and its host arguments by value, exactly what a captured task keeps. `replay()` runs the
tape again: it reads whatever the captured input buffers hold now and writes the captured output
buffers, and host values (a Python list of lengths, a CPU tensor) are the ones seen at capture. So a
replay after the engine has refreshed its static buffers *in place* gives the right answer, and one
after it rebound a buffer to a new tensor, or changed a host-side length, gives the stale answer it
would give on the device. Capture refuses what aclgraph refuses: the default stream, host reads of
device values, host<->device copies, ops with data-dependent shapes (see `_device.py`), and work
on a stream that did not fork from the capture stream, or was not joined back (`_streams.py`).

For tests, each graph keeps what it saw: `input_ptrs` (device buffers the tape reads that were made
before capture), `output_ptrs` (what it writes), `replays` (per replay, the input pointers it read),
`task_groups` and `task_updates`; `reference.captures` lists every capture in the process.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _device, _streams
from .._device import CaptureError, TapeEntry


def _ptrs(tree: Any) -> list[int]:
    out: list[int] = []
    torch.utils._pytree.tree_map(lambda x: out.append(x.data_ptr()) if _device.is_npu(x) else None, tree)
    return out


class _TaskGroup:
    """Tape entries between graph_task_group_begin and _end: one updatable task (handle)."""

    def __init__(self, graph: NPUGraph, start: int) -> None:
        self.graph, self.start, self.end = graph, start, start

    def take(self, name: str, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """An op issued between graph_task_update_begin and _end: new arguments for the next entry
        of this group; nothing runs now (the replay runs it). Returns the captured outputs."""
        calls = _device._state.update_calls
        position = self.start + len(calls)
        entry = self.graph.tape[position] if position < self.end else None
        if entry is None or entry.name != name:
            _device._state.updating, _device._state.update_calls = None, []  # the update is abandoned
            captured = entry.name if entry is not None else f"{self.end - self.start} ops"
            raise RuntimeError(f"graph task update: captured {captured} but updated with {name}")
        calls.append(TapeEntry(name, fn, args, kwargs, entry.result, entry.stream))
        return entry.result


class NPUGraph:
    def __init__(self) -> None:
        self.tape: list[TapeEntry] = []
        self.auto_dispatch_capture = False
        self.captured = False
        self.input_ptrs: set[int] = set()
        self.output_ptrs: set[int] = set()
        self.replays: list[list[int]] = []
        self.task_groups: list[_TaskGroup] = []
        self.task_updates = 0
        self._open_group: _TaskGroup | None = None
        self._made: set[int] = set()  # storages allocated during capture (the graph's pool)
        self._stream = 0  # the capture stream

    # --- capture ---------------------------------------------------------------------------------
    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        from . import current_stream

        if _device._state.capturing is not None:
            raise CaptureError("another graph is being captured: one capture at a time in a process")
        if current_stream().npu_stream == 0:
            raise CaptureError("NPU graphs must be captured on a non-default stream")
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise ValueError(
                f"capture_error_mode must be global, thread_local or relaxed, got {capture_error_mode!r}"
            )
        self.reset()
        self._stream = current_stream().stream_id
        _device._state.capturing = self
        _streams.begin_capture(self._stream)

    def record(self, entry: TapeEntry) -> None:
        # An input is a buffer whose storage existed before capture (views of captured outputs are not).
        for x in _tensors((entry.args, entry.kwargs)):
            if x.untyped_storage().data_ptr() not in self._made:
                self.input_ptrs.add(x.data_ptr())
        for t in _tensors(entry.result):
            self.output_ptrs.add(t.data_ptr())
            if t.untyped_storage().data_ptr() not in self.input_ptrs:
                self.allocated(t)
        self.tape.append(entry)

    def allocated(self, t: torch.Tensor) -> None:
        self._made.add(t.untyped_storage().data_ptr())

    def capture_end(self) -> None:
        if _device._state.capturing is not self:
            raise CaptureError("capture_end without capture_begin on this graph")
        _device._state.capturing = None
        try:
            _streams.end_capture(self._stream, ok=True)  # a side stream left unjoined: no graph
        except CaptureError:
            self.reset()
            raise
        self.captured = True
        from .. import reference

        reference.captures.append(self)

    # --- replay ----------------------------------------------------------------------------------
    def replay(self) -> None:
        if not self.captured:
            raise RuntimeError("replay() of a graph that was not captured")
        if _device._state.capturing is not None:
            raise CaptureError("replay() during another graph's capture")
        read: list[int] = []
        for entry in self.tape:
            read.extend(p for p in _ptrs((entry.args, entry.kwargs)) if p in self.input_ptrs)
            fresh = entry.fn(*entry.args, **entry.kwargs)
            _write_into(entry.result, fresh)
        self.replays.append(sorted(set(read)))

    def reset(self) -> None:
        self.tape.clear()
        self.captured = False
        self.input_ptrs.clear()
        self.output_ptrs.clear()
        self._made.clear()
        self.task_groups.clear()

    def pool(self) -> int:
        return id(self)

    def update(self, cpu_update_input: list[dict[str, Any]]) -> None:
        """torch_npu refreshes host arguments of ops captured with auto_dispatch_capture=True whose
        handlers it registers (FIA v1/v2, FA3: `_npugraph_handlers/`); none of the reference's ops
        takes host lengths, so there are no such records here."""
        if not self.auto_dispatch_capture:
            raise RuntimeError(
                "The current graph configuration does not support update,"
                "Try to capture by setting auto_dispatch_capture=True during capture"
            )
        if cpu_update_input:
            raise RuntimeError(
                "Currently, there are 0 operators that need to be updated by capture, and there are "
                f"only {len(cpu_update_input)} elements in the incoming cpu_update_input list"
            )


def _tensors(tree: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    torch.utils._pytree.tree_map(lambda x: out.append(x) if _device.is_npu(x) else None, tree)
    return out


def _write_into(captured: Any, fresh: Any) -> None:
    """A replayed op writes the buffers its capture wrote (in-place ops already did)."""
    for old, new in zip(_tensors(captured), _tensors(fresh), strict=True):
        if old is not new and old.data_ptr() != new.data_ptr():
            _device.host_alias(old).copy_(_device.host_alias(new))


class graph:
    default_capture_stream: Any = None

    def __init__(
        self,
        npu_graph: NPUGraph,
        pool: Any = None,
        stream: Any = None,
        auto_dispatch_capture: bool = False,
        capture_error_mode: str = "global",
    ) -> None:
        from . import Stream

        if self.__class__.default_capture_stream is None:
            self.__class__.default_capture_stream = Stream()
        self.pool = () if pool is None else (pool,)
        self.capture_stream = stream if stream is not None else self.__class__.default_capture_stream
        self.npu_graph = npu_graph
        self.capture_error_mode = capture_error_mode
        self.npu_graph.auto_dispatch_capture = auto_dispatch_capture

    def __enter__(self) -> None:
        from . import current_stream, set_stream, synchronize

        synchronize()  # as torch_npu's graph.__enter__ does: earlier work on every stream is done
        self._before = current_stream()
        set_stream(self.capture_stream)
        self.npu_graph.capture_begin(*self.pool, capture_error_mode=self.capture_error_mode)

    def __exit__(self, exc_type: object, *exc: object) -> None:
        from . import set_stream

        try:
            if _device._state.capturing is self.npu_graph:
                if exc_type is None:
                    self.npu_graph.capture_end()
                else:  # a failed capture leaves no graph
                    _device._state.capturing = None
                    _streams.end_capture(self.npu_graph._stream, ok=False)
                    self.npu_graph.reset()
        finally:
            set_stream(self._before)


def graph_pool_handle() -> int:
    return id(object())


def is_current_stream_capturing() -> bool:
    return _device._state.capturing is not None


def graph_task_group_begin(stream: Any) -> None:
    g = _device._state.capturing
    if g is None:
        raise CaptureError("graph_task_group_begin outside a capture")
    if g._open_group is not None:
        raise CaptureError("graph_task_group_begin inside an open task group")
    g._open_group = _TaskGroup(g, len(g.tape))


def graph_task_group_end(stream: Any) -> _TaskGroup:
    g = _device._state.capturing
    if g is None or g._open_group is None:
        raise CaptureError("graph_task_group_end without graph_task_group_begin")
    group, g._open_group = g._open_group, None
    group.end = len(g.tape)
    g.task_groups.append(group)
    return group


def graph_task_update_begin(stream: Any, handle: _TaskGroup) -> None:
    if _device._state.capturing is not None:
        raise CaptureError("graph_task_update_begin during a capture")
    if _device._state.updating is not None:
        raise RuntimeError("graph_task_update_begin inside another update")
    _device._state.updating = handle
    _device._state.update_calls = []


def graph_task_update_end(stream: Any) -> None:
    group = _device._state.updating
    if group is None:
        raise RuntimeError("graph_task_update_end without graph_task_update_begin")
    calls = _device._state.update_calls
    _device._state.updating, _device._state.update_calls = None, []
    if len(calls) != group.end - group.start:
        raise RuntimeError(
            f"graph task update issued {len(calls)} ops; the group captured {group.end - group.start}"
        )
    group.graph.tape[group.start : group.end] = calls
    group.graph.task_updates += 1
