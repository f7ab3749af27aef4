"""`torch.npu` as the reference provides it: devices, memory, streams and events, graphs.

Names and signatures follow torch_npu 2.14.0 (`torch_npu/npu/__init__.py`, `utils.py`, `streams.py`,
`memory.py`, `graphs.py` in the wheel). Work is synchronous here; streams and events keep the order
the device would give it (`_streams`): which stream each op ran on, what each stream waited for, and
an access no wait orders is refused. Graph capture refuses the default stream, as aclgraph does.

Memory: `mem_get_info` reports a device of `reference.memory_total` bytes (default 1 GiB, so an
engine sizing its pools by free memory stays small on a CPU) minus what "npu" tensors hold now.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .. import _device, _streams
from .graphs import (
    NPUGraph,
    graph,
    graph_pool_handle,
    graph_task_group_begin,
    graph_task_group_end,
    graph_task_update_begin,
    graph_task_update_end,
    is_current_stream_capturing,
)

__all__ = [
    "Event",
    "NPUGraph",
    "Stream",
    "current_device",
    "current_stream",
    "default_stream",
    "device_count",
    "empty_cache",
    "graph",
    "graph_pool_handle",
    "graph_task_group_begin",
    "graph_task_group_end",
    "graph_task_update_begin",
    "graph_task_update_end",
    "is_available",
    "is_current_stream_capturing",
    "mem_get_info",
    "memory_allocated",
    "set_device",
    "set_stream",
    "stream",
    "synchronize",
]


# --- devices ------------------------------------------------------------------------------------
def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def _lazy_init() -> None:
    pass


def device_count() -> int:
    return _device._state.device_count


def set_device(device: torch.device | str | int) -> None:
    index = _device._index(device)
    if not 0 <= index < device_count():
        raise RuntimeError(f"Invalid device ID {index}: the reference has {device_count()} NPUs")
    _device._state.thread.device = index


def current_device() -> int:
    return _device.current_device()


def manual_seed(seed: int) -> None:
    torch.random.default_generator.manual_seed(seed)  # the device's work runs on the host generator


def manual_seed_all(seed: int) -> None:
    pass  # torch.manual_seed calls this after seeding the host generator, which the device uses


def synchronize(device: Any = None) -> None:
    _streams.synchronize()  # work is synchronous; this orders every stream's work before later work


# --- memory -------------------------------------------------------------------------------------
def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes, as aclrtGetMemInfo reports them."""
    from .. import reference

    used = memory_allocated(device)
    return max(0, reference.memory_total - used), reference.memory_total


def memory_allocated(device: Any = None) -> int:
    return _device.allocated_bytes()


def empty_cache() -> None:
    pass


# --- streams and events -------------------------------------------------------------------------
_DEVICE_TYPE = 20  # c10::DeviceType::PrivateUse1, which the reference renames "npu"


class Stream(torch.Stream):
    """A stream handle (a `torch.Stream` of the "npu" device, so `Tensor.record_stream` takes it).
    `npu_stream` is its id, unique per stream (0 is the default stream). Work runs at once; `_streams`
    keeps the order the device would give it and refuses accesses that order does not cover."""

    _ids = iter(range(1, 1 << 62))

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> Stream:
        stream_id = kwargs.get("_id", next(Stream._ids))
        index = _device._index(device)
        return super().__new__(cls, stream_id=stream_id, device_index=index, device_type=_DEVICE_TYPE)

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.priority = priority
        self.npu_stream = self.stream_id

    def wait_stream(self, stream: torch.Stream) -> None:
        if stream.stream_id != self.stream_id:
            self.wait_event(stream.record_event())

    def wait_event(self, event: Event) -> None:
        if event.recorded_on is not None:
            _streams.wait(self.stream_id, event.recorded_on.stream_id, event.tasks)

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _streams.synchronize()  # more than the device orders; nothing here relies on less

    def __repr__(self) -> str:
        return f"<torch_npu.npu.Stream device={self.device} npu_stream={self.npu_stream}>"


class Event:
    """Records what its stream has issued (`_streams.snapshot`); a stream waiting on it is ordered
    after that. Waiting on an event never recorded is a no-op, as on the device."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self.recorded_on: Stream | None = None
        self.tasks: dict[int, int] = {}

    def record(self, stream: Stream | None = None) -> None:
        self.recorded_on = stream or current_stream()
        self.tasks = _streams.snapshot(self.recorded_on.stream_id)

    def wait(self, stream: Stream | None = None) -> None:
        (stream or current_stream()).wait_event(self)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _streams.synchronize()


_default_streams: dict[int, Stream] = {}


def default_stream(device: Any = None) -> Stream:
    index = _device._index(device)
    if index not in _default_streams:
        _default_streams[index] = Stream(index, _id=0)
    return _default_streams[index]


def current_stream(device: Any = None) -> Stream:
    return _streams.current() or default_stream(device)


def set_stream(stream: Stream) -> None:
    _streams.set_current(stream)


@contextlib.contextmanager
def stream(stream: Stream | None) -> Iterator[None]:
    if stream is None:
        yield
        return
    before = current_stream()
    set_stream(stream)
    try:
        yield
    finally:
        set_stream(before)
