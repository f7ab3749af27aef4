"""The prefill's transfer threads: each room's jobs written in order, rooms side by side, and a room
closed once no write of it can still read its pages.

A job is one step's worth of a room's pages (prefill_send makes them). Its path: direct (an entry
per run of pages contiguous on both sides), staged (packed into this server's arena, one entry
into the decode's span), pack_only (packed here, an entry per run of the decode's pages) or
unpack_only (an entry per run of our pages into the decode's span); a packing path may be
pipelined, each piece packed while the one before is on the wire.

Concurrency (SGLang #5450: one transfer thread made every room wait behind a stalled peer): up to
`threads` jobs run at once, each of a different room, and at most `per_peer` of them to one decode
server, so a peer that stops answering holds at most that many threads until Mooncake's timeout
while every other room goes on. A room's jobs (and its close) never run concurrently or out of order.

Ownership: the engine holds a PD request's pages after it finishes or is aborted, and only a room's
close releases them, after every write of it returned. Each queued job pins the request row it
reads (allocator.pin), so the scheduler never preempts a request under a write. A write abandoned
at its deadline while Mooncake may still move some entries (TransferError.late) keeps its pins,
its arena span and the room's close until those entries end (SGLang PR#27372's corruption, from
the sending side).

Lanes (a parallel decode server): each job also carries the same pages for the decode's other ranks,
decode rank r's written by this server's rank r mod P (disagg/lanes.py), all at once; the job has
been written only once every lane has, and fails as a whole when any lane fails.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from dsv4_engine.disagg.base import EngineCalls, LateWrites, PdEngine, PdMetrics, TransferError, Transport
from dsv4_engine.disagg.faults import FaultHooks, Hold
from dsv4_engine.disagg.lanes import AllEnded, RankLinks, RemoteWrite
from dsv4_engine.disagg.mooncake.config import LATE_MARGIN_SECONDS, transfer_timeout_s
from dsv4_engine.disagg.protocol import PdError, RoomStatus, stage_segments, staged_bytes
from dsv4_engine.disagg.room import Room
from dsv4_engine.disagg.transfer import PACKING, Entries, path_label, plan_packed, plan_writes
from dsv4_engine.memory import StateComponent, StateType
from dsv4_engine.memory.staging import StagingArena, gather_pages

log = logging.getLogger("dsv4.pd.prefill")

Piece = list[tuple[StateType, int, int]]  # (state type, lo, hi) positions in the room's page lists
LATE_POLL_SECONDS = 0.01  # how often an idle thread asks Mooncake whether late entries ended


@dataclass(frozen=True)
class Lane:
    """A job's pages for another decode rank, written directly by prefill rank `rank`."""

    rank: int  # the prefill rank that writes it (its own transport, its own pools)
    peer_rank: int  # the decode rank it lands in
    peer: str  # that decode rank's Mooncake session
    entries: Entries


@dataclass
class Job:
    room: Room
    entries: Entries  # the pages when direct, and the aux slot
    nbytes: dict[str, int]
    final: bool
    row: int | None = None  # the request row it reads, pinned until the write returned (or ended late)
    path: str = "direct"  # transfer.PATHS
    # Other paths: pieces in span order (one unless pipelined), over the job's full source page lists.
    pieces: list[Piece] = field(default_factory=list)
    src_pages: dict[StateType, list[int]] = field(default_factory=dict)
    staged_dst: int = 0  # where the job's packed bytes start in the decode's span (staged, unpack_only)
    staged_bytes: int = 0
    # What to give back once no entry can read its sources any more (the pin, an arena span).
    release: list[Callable[[], None]] = field(default_factory=list)
    lanes: list[Lane] = field(default_factory=list)
    after: int = 0  # step messages a rank must have run before its lane reads the pages


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
        threads: int = 4,
        per_peer: int | None = None,
        links: RankLinks | None = None,
    ) -> None:
        self.engine = engine
        self.links = links  # the server's other ranks, which write their lanes
        self.bridge = bridge
        self.transport = transport
        self.components = components
        self.src_ptrs = {c.state_type: c.data_ptrs for c in components}
        self.staging = staging  # shared by the threads; a job that finds it full goes unpacked
        self.metrics = metrics
        # The rooms' lock: orders a room's failure (loop) against a thread starting its next write,
        # so an abort can tell the decode side for certain whether a write may still land in its pages.
        self.lock = lock
        self.fail_soon, self.succeed_soon = fail_soon, succeed_soon  # posted to the loop, thread-safe
        self.faults = faults
        self.per_peer = per_peer or max(1, threads // 2)
        self._cond = threading.Condition()
        self._queues: dict[int, deque[Job | Close]] = {}  # id(room) -> its items, in order
        self._rooms: dict[int, Room] = {}
        self._ready: deque[int] = deque()  # rooms with items and no thread on them, oldest first
        self._busy_peers: Counter[str] = Counter()
        self._queued = 0
        self._late: list[tuple[LateWrites, Room, list[Callable[[], None]]]] = []
        self._stop = False
        self._threads = [
            threading.Thread(target=self._work, name=f"dsv4-pd-transfer-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def put(self, job: Job | Close) -> None:
        key = id(job.room)
        with self._cond:
            items = self._queues.get(key)
            if items is None:
                items = self._queues[key] = deque()
                self._rooms[key] = job.room
                self._ready.append(key)
            items.append(job)
            self._queued += 1
            self._cond.notify()

    def close_after_writes(self, room: Room) -> None:
        """Release the room's pages once the writes queued before now have returned (and any entry
        they abandoned has ended)."""
        self.put(Close(room))

    def pending(self) -> int:
        """Jobs queued or being written, plus writes abandoned whose entries may still move."""
        with self._cond:
            return self._queued + len(self._late)

    def late(self) -> int:
        with self._cond:
            return len(self._late)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=60)

    # ---- the threads -------------------------------------------------------------------------
    def _peer(self, room: Room) -> str:
        return room.session.mooncake_session if room.session is not None else ""

    def _next(self) -> tuple[int, Job | Close] | None:
        """The oldest ready room whose peer has a thread to spare, and its next item (lock held)."""
        for i, key in enumerate(self._ready):
            peer = self._peer(self._rooms[key])
            if self._busy_peers[peer] < self.per_peer:
                del self._ready[i]
                self._busy_peers[peer] += 1
                return key, self._queues[key].popleft()
        return None

    def _work(self) -> None:
        while True:
            with self._cond:
                while True:
                    ended = self._reap() if self._late else []
                    if ended:
                        break
                    taken = self._next()
                    if taken is not None:
                        break
                    if self._stop:  # after what was queued (a drain's last writes)
                        return
                    self._cond.wait(LATE_POLL_SECONDS if self._late else None)
            if ended:
                for room, release in ended:
                    self._give_back(room, release)
                continue
            key, item = taken
            room = item.room
            try:
                if isinstance(item, Close):
                    self._close(room)
                else:
                    self._run(item)
            except Exception:  # a bug: never lose the thread (the room's close still comes)
                log.exception("transfer job of room %d failed", room.room)
            finally:
                with self._cond:
                    self._queued -= 1
                    self._busy_peers[self._peer(room)] -= 1
                    if self._queues[key]:
                        self._ready.append(key)
                    else:
                        del self._queues[key], self._rooms[key]
                    self._cond.notify_all()

    def _reap(self) -> list[tuple[Room, list[Callable[[], None]]]]:
        """Late writes whose entries all ended (lock held): taken out, to be given back."""
        ended = [(late, room, release) for late, room, release in self._late if late.ended()]
        if ended:
            self._late = [x for x in self._late if not any(x[0] is e[0] for e in ended)]
        return [(room, release) for _, room, release in ended]

    def _give_back(self, room: Room, release: list[Callable[[], None]]) -> None:
        for fn in release:
            fn()
        with self.lock:
            room.late -= 1
            close = room.late == 0 and room.close_requested
        log.info("room %d: the entries abandoned at the deadline ended", room.room)
        if close:
            self._close(room)

    def _run(self, job: Job) -> None:
        room = job.room
        if job.row is not None:
            row = job.row
            job.release.append(lambda: self.bridge.call(lambda engine: engine.allocator.unpin(row)))
        with self.lock:
            skip = room.status is RoomStatus.FAILED or room.closed
            room.writing = not skip
        if skip:
            self._release(job.release)
            return
        assert room.session is not None
        try:
            self._write_lanes(room.session.mooncake_session, job)
        except Exception as exc:  # one failed write blacklists the session until it re-registers
            late = exc.late if isinstance(exc, TransferError) else None
            with self.lock:
                room.writing = False
                if late is not None:  # its pages, span and close wait for those entries
                    room.late += 1
            if late is not None:
                with self._cond:
                    self._late.append((late, room, job.release))
            else:
                self._release(job.release)
            room.session.dead = True
            self.fail_soon(
                room,
                PdError("transfer_failed", f"writing room {room.room} to the decode server failed: {exc}"),
            )
            return
        with self.lock:
            room.writing = False
        self._release(job.release)
        for t, n in job.nbytes.items():
            room.bytes_by_type[t] = room.bytes_by_type.get(t, 0) + n
        for lane in job.lanes:
            key = (lane.rank, lane.peer_rank)
            room.lane_bytes[key] = room.lane_bytes.get(key, 0) + lane.entries.nbytes
        if job.final:
            if self.faults is not None:
                self.faults.sent(room.room)
            self._close(room)
            self.succeed_soon(room)

    @staticmethod
    def _release(release: list[Callable[[], None]]) -> None:
        for fn in release:
            fn()

    def _write_lanes(self, peer: str, job: Job) -> None:
        """The job into decode rank 0 and every lane at once: other ranks' lanes go first (they run
        on those ranks), then this rank's own; returns once all ended, and raises if any failed, its
        `late` covering every lane's entries still moving."""
        remote: list[RemoteWrite] = []
        for lane in job.lanes:
            if lane.rank:
                assert self.links is not None
                remote.append(self.links.write(lane.rank, lane.peer, lane.entries, job.after))
        errors: list[str] = []
        late: list[LateWrites] = []
        try:
            self._write(peer, job)
            for lane in job.lanes:
                if not lane.rank:
                    self.transport.write(lane.peer, lane.entries)
        except TransferError as exc:
            errors.append(str(exc))
            late += [exc.late] if exc.late is not None else []
        finally:  # even on a bug: no lane may still read the pages once this returns
            bound = 2 * transfer_timeout_s() + LATE_MARGIN_SECONDS  # the rank's own deadline first
            for w in remote:
                w.wait(bound)
                errors += [w.error] if w.error is not None else []
                late += [w] if w.late else []
        if errors:
            raise TransferError("; ".join(errors), AllEnded(late) if late else None)

    def _write(self, peer: str, job: Job) -> None:
        """One job into the decode's memory on its path (the aux slot rides with the last entries)."""
        hold = self.faults.hold_for(job.room.room) if self.faults is not None else None
        path = job.path
        if path in PACKING:
            offset = self.staging.alloc(job.staged_bytes) if self.staging is not None else None
            if offset is not None:
                self._write_packed(peer, job, offset, hold)
                return
            # Another thread's pack fills the arena: the same pages unpacked instead (the decode
            # takes a staged job's bytes in its span either way).
            path = "unpack_only" if path == "staged" else "direct"
        if path == "unpack_only":  # our page runs straight into the decode's span
            entries = plan_packed(self.components, self.src_ptrs, _segments(job, job.src_pages),
                                  job.staged_dst, into_packed=True)  # fmt: skip
            entries.extend(job.entries)
        elif job.path != "direct":  # pack_only without room to pack: an entry per run of both sides
            room = job.room
            assert room.session is not None and room.dst_pages is not None
            src, dst = _pages(job, job.src_pages), _pages(job, room.dst_pages)
            entries = plan_writes(self.components, room.session.dst_ptrs, src, dst)
            entries.extend(job.entries)
        else:
            entries = job.entries
        self.transport.write(peer, entries, hold=hold)
        self.metrics.pd_writes.labels(
            path_label(path, 1 if path != job.path else max(len(job.pieces), 1))
        ).inc()

    def _write_packed(self, peer: str, job: Job, offset: int, hold: Hold | None) -> None:
        """staged and pack_only: each piece packed into this server's arena, then written; pieces
        past the first are packed while the earlier ones are on the wire. The span is given back
        with the job's other sources."""
        assert self.staging is not None
        staging = self.staging
        job.release.append(lambda: staging.free(offset))
        steps = self._packed_steps(job, offset)
        if len(steps) == 1:
            steps[0][0]()
            self.transport.write(peer, steps[0][1], hold=hold)
        else:
            self.transport.write_pipelined(peer, steps, hold=hold)
        self.metrics.pd_writes.labels(path_label(job.path, max(len(job.pieces), 1))).inc()

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
        """Every write of the room has returned: the engine may free its pages now, unless entries a
        write abandoned may still read them (then once those ended: _give_back)."""
        with self.lock:
            if room.closed:
                return
            if room.late:
                room.close_requested = True
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


def _pages(job: Job, pages: dict[StateType, list[int]]) -> dict[StateType, list[int]]:
    """One side's page lists of every piece, per type, in piece order (for a direct plan)."""
    out: dict[StateType, list[int]] = {}
    for t, ids in _segments(job, pages):
        out.setdefault(t, []).extend(ids)
    return out
