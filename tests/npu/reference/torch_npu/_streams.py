"""Stream ordering as the reference checks it: every op runs at once (results are those of one
stream), but each is recorded on the stream it was issued to, and an access the device would not
order is refused.

Each stream keeps a vector clock: `seq`, the tasks issued to it, and `seen`, for every other stream,
how many of its tasks are ordered before this stream's next one (`wait_stream`, `wait_event` of an
event recorded there; `synchronize` orders everything issued so far before everything after). Each
storage keeps its last write (stream, task) and its reads since (task per stream). An op on stream S
that reads a storage last written on W, or writes one last read or written on W, without S having
waited past that task, is a `StreamHazard`: the race CANN would run with no error. This covers every
device op the reference executes (aten or torch_npu, `_device.execute`), so a dropped join is caught
where its consumer runs.

Graph capture (aclgraph, as CUDA graphs): a capture starts on its stream alone; another stream takes
part once it waits on a capturing stream (the fork), and an op issued to a stream outside the capture
is refused, as are side streams whose work the capture stream has not waited for at capture end
(the join). The device runs nothing at capture, while the reference ran it all eagerly: capture end
orders it before everything later (a barrier), so only a replay's own stream reads its outputs.

Not modelled: replays (a replay runs its tape on the replaying stream, untracked), and the caching
allocator's reuse across streams (a block freed on its stream while another still reads it: what
`Tensor.record_stream` is for). `record_stream` calls are kept (`recorded_streams`) for tests.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_map

from . import reference


class CaptureError(RuntimeError):
    """What aclgraph refuses while a stream is being captured."""


class StreamHazard(RuntimeError):
    """An access to memory another stream used, with no wait ordering the two."""


@dataclass
class _Clock:
    seq: int = 0  # tasks issued to this stream
    seen: dict[int, int] = field(default_factory=dict)  # stream -> its tasks ordered before our next


@dataclass
class _Use:
    write: tuple[int, int] = (0, 0)  # (stream, task) of the last write
    reads: dict[int, int] = field(default_factory=dict)  # stream -> its last task reading since


_clocks: dict[int, _Clock] = {}
_barrier: dict[int, int] = {}  # stream -> tasks a synchronize ordered before all later work
_uses: dict[int, _Use] = {}  # storage data_ptr -> its last accesses
_capture: set[int] | None = None  # streams taking part in the capture in progress
recorded_streams: dict[int, set[int]] = {}  # storage data_ptr -> streams passed to record_stream
_thread = threading.local()  # .stream: the current stream object (None: the default stream)


def current() -> Any:
    return getattr(_thread, "stream", None)


def set_current(stream: Any) -> None:
    _thread.stream = stream


def current_id() -> int:
    stream = current()
    return 0 if stream is None else stream.stream_id


def _clock(stream: int) -> _Clock:
    if stream not in _clocks:
        _clocks[stream] = _Clock()
    return _clocks[stream]


def _ordered(stream: int, other: int, task: int) -> bool:
    """Whether `other`'s task number `task` is ordered before `stream`'s next task."""
    if other == stream or task == 0:
        return True
    return max(_clock(stream).seen.get(other, 0), _barrier.get(other, 0)) >= task


# --- waits ---------------------------------------------------------------------------------------
def snapshot(stream: int) -> dict[int, int]:
    """What an event recorded on `stream` now orders: its own tasks so far and all it has seen."""
    clock = _clock(stream)
    return {**clock.seen, stream: clock.seq}


def wait(stream: int, source: int, tasks: dict[int, int]) -> None:
    """`stream`'s later tasks run after `tasks` (the snapshot of an event recorded on `source`).
    Waiting on a capturing stream brings `stream` into the capture (a fork); the wait itself is a
    task of `stream`."""
    clock = _clock(stream)
    for other, task in tasks.items():
        if other != stream:
            clock.seen[other] = max(clock.seen.get(other, 0), task)
    if _capture is not None and source in _capture:
        _capture.add(stream)
    clock.seq += 1


def synchronize() -> None:
    _barrier.update((stream, clock.seq) for stream, clock in _clocks.items())


def record_stream(t: torch.Tensor, stream: Any) -> None:
    recorded_streams.setdefault(t.untyped_storage().data_ptr(), set()).add(stream.stream_id)


# --- capture -------------------------------------------------------------------------------------
def begin_capture(stream: int) -> None:
    global _capture
    _capture = {stream}


def end_capture(stream: int, ok: bool) -> None:
    """ok: the capture completed, so every side stream it forked must be joined back."""
    global _capture
    joined, _capture = _capture or set(), None
    unjoined = sorted(s for s in joined if s != stream and not _ordered(stream, s, _clock(s).seq))
    synchronize()  # the reference ran the captured work eagerly: it is all done
    if not ok:
        return
    if unjoined:
        raise CaptureError(
            f"the capture forked stream(s) {unjoined} that were not joined back to the capture "
            f"stream {stream} (wait on them before capture end): cudaErrorStreamCaptureUnjoined"
        )


# --- ops -----------------------------------------------------------------------------------------
def _storages(tree: Any) -> dict[int, torch.Tensor]:
    found: dict[int, torch.Tensor] = {}

    def add(x: Any) -> None:
        if isinstance(x, torch.Tensor) and x.device.type == "npu" and x.numel():
            found[x.untyped_storage().data_ptr()] = x

    tree_map(add, tree)
    return found


def issue(name: str, inputs: Any, written: list[torch.Tensor]) -> tuple[int, int, set[int]]:
    """Check an op about to run on the current stream against the capture and earlier accesses;
    returns (stream, its task number, the input storages) for `done`."""
    stream = current_id()
    if _capture is not None and stream not in _capture:
        raise CaptureError(
            f"{name} issued to stream {stream}, which is not part of the capture: a side stream must "
            "wait on the capture stream (wait_stream, or an event recorded there) before its work is captured"
        )
    used = _storages(inputs)
    writes = set(_storages(written))
    for ptr in used:
        use = _uses.get(ptr)
        if use is not None:
            _check(name, stream, ptr, use, ptr in writes)
    clock = _clock(stream)
    clock.seq += 1
    if reference.stream_log is not None:
        reference.stream_log.append((name, stream))
    return stream, clock.seq, set(used)


def _check(name: str, stream: int, ptr: int, use: _Use, writes: bool) -> None:
    writer, task = use.write
    if not _ordered(stream, writer, task):
        raise StreamHazard(
            f"{name} on stream {stream} {'writes' if writes else 'reads'} memory {ptr:#x} that stream "
            f"{writer} wrote (task {task}) with no wait between them"
        )
    for reader, task in use.reads.items() if writes else ():
        if not _ordered(stream, reader, task):
            raise StreamHazard(
                f"{name} on stream {stream} writes memory {ptr:#x} that stream {reader} still reads "
                f"(task {task}) with no wait between them"
            )


def allocated(t: torch.Tensor) -> None:
    _uses.pop(t.untyped_storage().data_ptr(), None)


def done(launch: tuple[int, int, set[int]], written: list[torch.Tensor], result: Any) -> None:
    """Record the op's accesses: its inputs read, in-place arguments and fresh outputs written (a
    fresh output's memory starts a new history, whatever used the address before)."""
    stream, task, inputs = launch
    writes = set(_storages(written)) | set(_storages(result))
    for ptr in inputs - writes:
        _uses.setdefault(ptr, _Use()).reads[stream] = task
    for ptr in writes:
        _uses[ptr] = _Use(write=(stream, task))
