"""The prefill's transfer worker: one thread that writes the queued jobs in order, each on its path,
and closes a room once every write of it has returned.

A job is one step's worth of a room's pages (prefill_send makes them). Its path: direct (an entry
per run of pages contiguous on both sides), staged (packed into this server's arena, one entry
into the decode's span), pack_only (packed here, an entry per run of the decode's pages) or
unpack_only (an entry per run of our pages into the decode's span); a packing path may be
pipelined, each piece packed while the one before is on the wire.

Ownership: the engine holds a PD request's pages after it finishes or is aborted, and only this
worker's close releases them, after every earlier write of that room returned. So a prefill client
that hangs up mid-transfer never frees pages the transport is still reading.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from dsv4_engine.disagg.base import EngineCalls, PdEngine, PdMetrics, Transport
from dsv4_engine.disagg.faults import FaultHooks
from dsv4_engine.disagg.protocol import PdError, RoomStatus, stage_segments, staged_bytes
from dsv4_engine.disagg.room import Room
from dsv4_engine.disagg.transfer import PACKING, Entries, path_label, plan_packed
from dsv4_engine.memory import StateComponent, StateType
from dsv4_engine.memory.staging import StagingArena, gather_pages

Piece = list[tuple[StateType, int, int]]  # (state type, lo, hi) positions in the room's page lists


@dataclass
class Job:
    room: Room
    entries: Entries  # the pages when direct, and the aux slot
    nbytes: dict[str, int]
    final: bool
    path: str = "direct"  # transfer.PATHS
    # Other paths: pieces in span order (one unless pipelined), over the job's full source page lists.
    pieces: list[Piece] = field(default_factory=list)
    src_pages: dict[StateType, list[int]] = field(default_factory=dict)
    staged_dst: int = 0  # where the job's packed bytes start in the decode's span (staged, unpack_only)
    staged_bytes: int = 0


@dataclass
class Close:
    room: Room


class TransferWorker:
    def __init__(
        self,
        engine: PdEngine,
        bridge: EngineCalls,
        transport: Transport,
        components: list[StateComponent],
        *,
        staging: StagingArena | None,
        metrics: PdMetrics,
        lock: threading.Lock,
        fail_soon: Callable[[Room, PdError], None],
        succeed_soon: Callable[[Room], None],
        faults: FaultHooks | None,
    ) -> None:
        self.engine = engine
        self.bridge = bridge
        self.transport = transport
        self.components = components
        self.src_ptrs = {c.state_type: c.data_ptrs for c in components}
        self.staging = staging  # packed into one job at a time
        self.metrics = metrics
        # The rooms' lock: orders a room's failure (loop) against this thread starting its next write,
        # so an abort can tell the decode side for certain whether a write may still land in its pages.
        self.lock = lock
        self.fail_soon, self.succeed_soon = fail_soon, succeed_soon  # posted to the loop, thread-safe
        self.faults = faults
        self._jobs: queue.Queue[Job | Close | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="dsv4-pd-transfer", daemon=True)
        self._thread.start()

    def put(self, job: Job) -> None:
        self._jobs.put(job)

    def close_after_writes(self, room: Room) -> None:
        """Release the room's pages once the writes queued before now have returned."""
        self._jobs.put(Close(room))

    def pending(self) -> int:
        return self._jobs.qsize()

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=60)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if isinstance(job, Close):
                self._close(job.room)
                continue
            room = job.room
            with self.lock:
                if room.status is RoomStatus.FAILED or room.closed:
                    continue
                room.writing = True
            assert room.session is not None
            try:
                self._write(room.session.mooncake_session, job)
            except Exception as exc:  # one failed write blacklists the session until it re-registers
                room.session.dead = True
                err = PdError(
                    "transfer_failed", f"writing room {room.room} to the decode server failed: {exc}"
                )
                self.fail_soon(room, err)
                continue
            finally:
                room.writing = False
            for t, n in job.nbytes.items():
                room.bytes_by_type[t] = room.bytes_by_type.get(t, 0) + n
            if job.final:
                if self.faults is not None:
                    self.faults.sent(room.room, self.engine.kv_pool)
                self._close(room)
                self.succeed_soon(room)

    def _write(self, peer: str, job: Job) -> None:
        """One job into the decode's memory on its path (the aux slot rides with the last entries)."""
        if job.path in PACKING:
            self._write_packed(peer, job)
        elif job.path == "unpack_only":  # our page runs straight into the decode's span
            entries = plan_packed(self.components, self.src_ptrs, _segments(job, job.src_pages),
                                  job.staged_dst, into_packed=True)  # fmt: skip
            entries.extend(job.entries)
            self.transport.write(peer, entries)
        else:
            self.transport.write(peer, job.entries)
        self.metrics.pd_writes.labels(path_label(job.path, max(len(job.pieces), 1))).inc()

    def _write_packed(self, peer: str, job: Job) -> None:
        """staged and pack_only: each piece packed into this server's arena, then written; pieces
        past the first are packed while the earlier ones are on the wire."""
        assert self.staging is not None
        offset = self.staging.alloc(job.staged_bytes)
        assert offset is not None, "the worker packs one job at a time into an arena that holds it"
        try:
            steps = self._packed_steps(job, offset)
            if len(steps) == 1:
                steps[0][0]()
                self.transport.write(peer, steps[0][1])
            else:
                self.transport.write_pipelined(peer, steps)
        finally:
            self.staging.free(offset)  # every write that read it has ended, whatever happened

    def _packed_steps(self, job: Job, offset: int) -> list[tuple[Callable[[], object], Entries]]:
        """(pack, entries) per piece, packed one after another from `offset` in the arena: one entry
        into the decode's span (staged) or an entry per run of the decode's pages (pack_only); the
        aux slot rides with the last piece."""
        assert self.staging is not None and job.room.session is not None and job.room.dst_pages is not None
        kv, dst_ptrs, dst_pages = self.engine.kv_pool, job.room.session.dst_ptrs, job.room.dst_pages
        steps: list[tuple[Callable[[], object], Entries]] = []
        at = 0
        for piece in job.pieces:
            segments = _segments(job, job.src_pages, piece)
            n = staged_bytes(kv, dict(segments))
            span, packed = self.staging.view(offset + at, n), self.staging.data_ptr + offset + at
            if job.path == "staged":
                entries = Entries.one(packed, job.staged_dst + at, n)
            else:
                entries = plan_packed(self.components, dst_ptrs, _segments(job, dst_pages, piece), packed,
                                      into_packed=False)  # fmt: skip
            steps.append((functools.partial(stage_segments, kv, segments, span, gather_pages), entries))
            at += n
        steps[-1][1].extend(job.entries)
        return steps

    def _close(self, room: Room) -> None:
        """Every write of the room has returned: the engine may free its pages now."""
        if room.closed:
            return
        room.closed = True
        if self.faults is not None:
            self.faults.forget(room.room)
        if room.request_id is not None and room.started:
            rid = room.request_id
            self.bridge.call(lambda engine: engine.release_held(rid))


def _segments(
    job: Job, pages: dict[StateType, list[int]], piece: Piece | None = None
) -> list[tuple[StateType, list[int]]]:
    """(state type, page ids) of one piece (default: every piece) over one side's page lists."""
    parts = [seg for p in job.pieces for seg in p] if piece is None else piece
    return [(t, pages[t][lo:hi]) for t, lo, hi in parts]
