"""`torch.npu` as the reference provides it: devices, memory, streams and events, graphs.

Names and signatures follow torch_npu 2.14.0 (`torch_npu/npu/__init__.py`, `utils.py`, `streams.py`,
`memory.py`, `graphs.py` in the wheel). Work is synchronous here, so streams and events only keep
the bookkeeping the engine relies on: which stream is current (graph capture refuses the default
stream, as aclgraph does) and that `wait_stream`/`record_event`/`synchronize` exist.

Memory: `mem_get_info` reports a device of `reference.memory_total` bytes (default 1 GiB, so an
engine sizing its pools by free memory stays small on a CPU) minus what "npu" tensors hold now.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from .. import _device
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
    pass  # work is synchronous


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
class Stream:
    """A stream handle. `npu_stream` is an id, unique per stream (0 is the default stream)."""

    _ids = iter(range(1, 1 << 62))

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device(_device.NAME, _device._index(device))
        self.priority = priority
        self.npu_stream = kwargs.get("_id", next(Stream._ids))

    def wait_stream(self, stream: Stream) -> None:
        pass

    def wait_event(self, event: Event) -> None:
        pass

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and other.npu_stream == self.npu_stream

    def __hash__(self) -> int:
        return hash(self.npu_stream)

    def __repr__(self) -> str:
        return f"<torch_npu.npu.Stream device={self.device} npu_stream={self.npu_stream}>"


class Event:
    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self.recorded_on: Stream | None = None

    def record(self, stream: Stream | None = None) -> None:
        self.recorded_on = stream or current_stream()

    def wait(self, stream: Stream | None = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


_default_streams: dict[int, Stream] = {}
_current = threading.local()


def default_stream(device: Any = None) -> Stream:
    index = _device._index(device)
    if index not in _default_streams:
        _default_streams[index] = Stream(index, _id=0)
    return _default_streams[index]


def current_stream(device: Any = None) -> Stream:
    return getattr(_current, "stream", None) or default_stream(device)


def set_stream(stream: Stream) -> None:
    _current.stream = stream


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
