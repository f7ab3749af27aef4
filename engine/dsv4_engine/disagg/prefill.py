"""The prefill side: rooms, the engine-step hook that queues each chunk's pages, the transfer worker.

A room pairs two halves that arrive in either order: the prefill server's own HTTP request (prompt,
sampling) and the decode server's claim (then its destination pages). The prompt reaches the engine
only once the decode side has reserved its pages, so nothing is computed for a request no decode
server can take. Then, after every engine step, `on_step` (engine thread) queues the pages that
step finished: full-family pages (C4, C128, INDEXER) of each completed page as chunks complete, and
with the last chunk the SWA window, the compressor-state tails and the aux slot (first token and the
seeded generator's state). One worker thread writes them in order, one Mooncake batch per job.
Each job takes the path `transfer.choose_write` expects to be fastest for its pages, among those
both sides have room for: direct (an entry per run of pages contiguous on both sides), staged (this
server packs into its staging arena, one entry into the decode's span, the decode unpacks),
pack_only (packed here, written into the decode's page runs: its pages are contiguous, ours not) or
unpack_only (our page runs written into the decode's span, the decode unpacks: the reverse). A
packing path may be pipelined: the job cut into pieces, each packed while the one before is on the
wire. The transfer's answer lists the segments that landed in the decode's span, in span order, for
the decode to unpack.

Ownership: the engine holds a PD request's pages (`hold=True`) after it finishes or is aborted, and
only the worker's `close` job releases them, after every earlier write of that room returned. So a
prefill client that hangs up mid-transfer never frees pages Mooncake is still reading.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dsv4_engine.disagg.protocol import (
    AUX_BYTES,
    PdError,
    PdTarget,
    RoomStatus,
    logprobs_body,
    pack_aux,
    page_digests,
    register_state,
    stage_segments,
    staged_bytes,
)
from dsv4_engine.memory import StateType
from dsv4_engine.memory.staging import StagingArena, gather_pages

# Test hook modes for `stage_mode` besides "auto" (the cost model): a path label forces that path
# where both sides have room for it (else direct); "always" and "never" are staged and direct.
FORCED_PIECES = 4  # pieces of a forced *_pipelined path (fewer when the job has fewer pages)

log = logging.getLogger("dsv4.pd.prefill")

# State types whose pages are final as soon as the chunk that filled them is done: compressed rows
# only ever append. The SWA window and the state tails are sent with the last chunk.
_APPEND_ONLY = (StateType.C4, StateType.C128, StateType.INDEXER)


@dataclass
class DecodeSession:
    """What one decode server registered: where its buffers are, and its layout fingerprint."""

    decode_id: str
    mooncake_session: str
    dst_ptrs: dict[StateType, list[int]]
    aux_ptr: int
    fingerprint: dict[str, Any]
    staging_ptr: int | None = None  # its staging arena, when it has one
    dead: bool = False  # a write to it failed: later rooms fail fast until it registers again


@dataclass
class Room:
    room: int
    created: float
    deadline: float  # until the decode sends its pages; each claim (renewed while it queues) extends it
    status: RoomStatus = RoomStatus.BOOTSTRAPPING
    # the prefill's own request
    request_id: str | None = None
    prompt_ids: list[int] | None = None
    params: Any = None
    digest: str | None = None
    start: Callable[[], None] | None = None  # hands the prompt to the engine (loop side)
    # the decode's half
    session: DecodeSession | None = None
    claim_digest: str | None = None
    dst_pages: dict[StateType, list[int]] | None = None
    dst_aux: int | None = None
    dst_staging: tuple[int, int] | None = None  # (offset, bytes) of the decode's span for this room
    staged_at: int = 0  # bytes of that span the queued staged jobs fill
    staged: list[tuple[str, int, int]] = field(default_factory=list)  # (type, lo, hi) in span order
    # progress
    started: bool = False
    sent_pages: int = 0  # full-family pages [0, sent_pages) are queued
    writing: bool = False  # a write of this room is in Mooncake right now (worker thread)
    closed: bool = False
    error: PdError | None = None
    result: asyncio.Future[None] | None = None
    bytes_by_type: dict[str, int] = field(default_factory=dict)
    src_sent: dict[StateType, list[int]] = field(default_factory=dict)  # for the checksum test hook
    transfer_started: float | None = None
    logprobs: dict[str, Any] | None = None  # protocol.logprobs_body, sent with the transfer's answer


@dataclass
class _Job:
    room: Room
    entries: Any  # transfer.Entries: the pages when direct, and the aux slot
    nbytes: dict[str, int]
    final: bool
    path: str = "direct"  # transfer.PATHS
    # Other paths: pieces of (state type, lo, hi) positions in the room's page lists, in span order
    # (one piece unless pipelined), over the job's full source page lists.
    pieces: list[list[tuple[StateType, int, int]]] = field(default_factory=list)
    src_pages: dict[StateType, list[int]] = field(default_factory=dict)
    staged_dst: int = 0  # where the job's packed bytes start in the decode's span (staged, unpack_only)
    staged_bytes: int = 0


@dataclass
class _Close:
    room: Room


class PrefillRooms:
    """Rooms and sessions of one prefill server; the loop owns them, the engine and worker threads
    only read a started room's destination and post results back through `loop`."""

    def __init__(
        self,
        engine: Any,
        bridge: Any,
        transport: Any,
        loop: asyncio.AbstractEventLoop,
        *,
        fingerprint: dict[str, Any],
        bootstrap_timeout: float,
        metrics: Any,
        staging: StagingArena | None = None,
    ) -> None:
        self.engine = engine
        self.bridge = bridge
        self.transport = transport
        self.loop = loop
        self.fingerprint = fingerprint
        self.bootstrap_timeout = bootstrap_timeout
        self.metrics = metrics
        self.rooms: dict[int, Room] = {}
        self.by_request: dict[str, Room] = {}
        self.sessions: dict[str, DecodeSession] = {}
        rows = engine.allocator.req_pool.req_to_token.shape[0]
        self.staging = staging  # the worker's: it packs one job at a time
        self.components, self.aux = register_state(transport, engine.kv_pool, rows, staging)
        self.src_ptrs = {c.state_type: c.data_ptrs for c in self.components}
        self.stage_mode = "auto"  # test hook: a path label (or "always"/"never") overrides the model
        # Test hooks (DSV4_TEST_HOOKS): perturb one source page before the next send; keep per-room
        # digests of the bytes sent, for comparison with the decode side's.
        self.corrupt_next: StateType | None = None
        self.deaf = False  # ignore the decode's aborts and hang-ups: force a late write (SIGSTOP test)
        self.checksums: dict[int, dict[str, str]] | None = None
        self._jobs: queue.Queue[_Job | _Close | None] = queue.Queue()
        # Orders a room's failure against the worker starting its next write, so `abort` can tell
        # the decode side for certain whether a write may still land in its pages.
        self._lock = threading.Lock()
        self._worker = threading.Thread(target=self._work, name="dsv4-pd-transfer", daemon=True)
        self._worker.start()
        engine.step_observers.append(self.on_step)

    # ---- queue depths ------------------------------------------------------------------------
    def depths(self) -> dict[str, int]:
        waiting = sum(
            1
            for r in self.rooms.values()
            if RoomStatus.BOOTSTRAPPING <= r.status <= RoomStatus.WAITING_FOR_INPUT
        )
        return {"bootstrap": waiting, "transfer": self._jobs.qsize()}

    # ---- the prefill's own request (loop) -----------------------------------------------------
    def open(
        self,
        target: PdTarget,
        request_id: str,
        prompt_ids: list[int],
        params: Any,
        digest: str,
        start: Callable[[], None],
    ) -> Room:
        room = self.rooms.get(target.room)
        if room is not None and room.request_id is not None:
            raise PdError(
                "room_in_use",
                f"bootstrap_room {target.room} is already in use on this prefill server",
                status=400,
            )
        if room is None:
            room = self._new_room(target.room)
        room.request_id, room.prompt_ids, room.params, room.digest = request_id, prompt_ids, params, digest
        room.start = start
        self.by_request[request_id] = room
        if room.status is RoomStatus.FAILED:
            return room  # the decode side already gave up on it: the caller sees room.error
        if room.claim_digest is not None and room.claim_digest != digest:
            self.fail(room, _digest_mismatch(target.room))
        self._maybe_start(room)
        return room

    def _new_room(self, number: int) -> Room:
        now = time.monotonic()
        room = Room(number, now, now + self.bootstrap_timeout, result=self.loop.create_future())
        room.result.add_done_callback(lambda f: f.exception() if not f.cancelled() else None)
        self.rooms[number] = room
        # A room no decode server claims (or that never gets its pages) fails and frees in bounded time.
        self.loop.call_later(self.bootstrap_timeout, self._bootstrap_deadline, room)
        return room

    def _bootstrap_deadline(self, room: Room) -> None:
        if room.started or room.status is RoomStatus.FAILED:
            return
        left = room.deadline - time.monotonic()
        if left > 0:
            self.loop.call_later(left, self._bootstrap_deadline, room)
            return
        if room.status <= RoomStatus.WAITING_FOR_INPUT:
            what = "claimed it" if room.session is None else "sent its pages"
            self.fail(room, PdError("bootstrap_timeout", f"no decode server {what} within "
                                    f"{self.bootstrap_timeout:g}s (room {room.room})", status=504))  # fmt: skip

    def _maybe_start(self, room: Room) -> None:
        if room.started or room.status is RoomStatus.FAILED:
            return
        if room.request_id is None or room.dst_pages is None or room.start is None:
            return
        room.started = True
        room.status = RoomStatus.TRANSFERRING
        room.transfer_started = time.monotonic()
        room.start()

    # ---- the decode's half (loop, from bootstrap.py) -----------------------------------------
    def register(self, session: DecodeSession) -> None:
        self.sessions[session.decode_id] = session  # a re-registration clears `dead`

    def claim(self, number: int, decode_id: str, digest: str) -> Room:
        session = self.sessions.get(decode_id)
        if session is None:
            raise PdError("unknown_session", f"decode server {decode_id} has not registered", status=409)
        if session.dead:
            raise PdError("peer_dead", f"decode server {decode_id} was declared dead; it must register again")
        room = self.rooms.get(number) or self._new_room(number)
        if room.session is not None and room.session.decode_id != decode_id:
            raise PdError(
                "room_in_use", f"bootstrap_room {number} is already claimed by another decode", status=409
            )
        room.session, room.claim_digest = session, digest
        room.deadline = time.monotonic() + self.bootstrap_timeout
        if room.status is RoomStatus.BOOTSTRAPPING:
            room.status = RoomStatus.WAITING_FOR_INPUT
        if room.digest is not None and room.digest != digest:
            self.fail(room, _digest_mismatch(number))
        return room

    def set_destination(
        self,
        number: int,
        decode_id: str,
        pages: dict[StateType, list[int]],
        aux: int,
        staging: tuple[int, int] | None = None,
    ) -> Room:
        room = self.rooms.get(number)
        if room is None or room.session is None or room.session.decode_id != decode_id:
            raise PdError(
                "unknown_room", f"room {number} was not claimed by decode server {decode_id}", status=404
            )
        if room.status is RoomStatus.FAILED:
            return room
        if room.session.dead:
            self.fail(room, PdError("peer_dead", f"an earlier write to decode server {decode_id} failed"))
            return room
        missing = [t for t in self.src_ptrs if t not in pages]
        if missing or set(pages) - set(self.src_ptrs):
            self.fail(room, PdError("payload_mismatch", f"decode sent pages for {sorted(map(str, pages))}, "
                                    f"prefill has {[str(t) for t in self.src_ptrs]}"))  # fmt: skip
            return room
        room.dst_pages, room.dst_aux = pages, aux
        room.dst_staging = staging if room.session.staging_ptr is not None else None
        self._maybe_start(room)
        return room

    def abort(self, number: int, decode_id: str, reason: str, message: str) -> bool:
        """The decode side gives the room up; True if a write of it may still land there."""
        if self.deaf:
            return True
        room = self.rooms.get(number)
        if room is not None and room.session is not None and room.session.decode_id != decode_id:
            return False  # another decode server's room
        if room is None:
            room = self._new_room(number)  # the prefill request may still arrive: it must fail at once
        self.fail(room, PdError(reason, f"the decode server aborted room {number}: {message}"))
        with self._lock:
            return room.writing

    def refuse(self, number: int, reason: str, message: str) -> None:
        """This server refused the prefill request of room `number` (draining, queue full): fail the
        room, so a decode server's claim (or its wait for the transfer) ends now, not at a deadline."""
        room = self.rooms.get(number)
        if room is not None and room.request_id is not None:
            return  # another request's room
        if room is None:
            room = self._new_room(number)
        self.fail(room, PdError(reason, f"the prefill server refused room {number}: {message}", status=503))

    # ---- ending a room (loop) ----------------------------------------------------------------
    def fail(self, room: Room, error: PdError) -> None:
        if room.status in (RoomStatus.FAILED, RoomStatus.SUCCESS):
            return
        log.warning("room %d failed: %s", room.room, error.message)
        with self._lock:
            room.status, room.error = RoomStatus.FAILED, error
        self.metrics.pd_failures.labels(error.reason).inc()
        assert room.result is not None
        if not room.result.done():
            room.result.set_exception(error)
        if room.started:
            self._jobs.put(_Close(room))  # after the room's queued writes; then the pages are released
        self.loop.call_later(self.bootstrap_timeout, self._forget, room)

    def _succeed(self, room: Room) -> None:
        if room.status is RoomStatus.FAILED:
            return
        room.status = RoomStatus.SUCCESS
        if room.transfer_started is not None:
            self.metrics.pd_transfer_seconds.observe(time.monotonic() - room.transfer_started)
        for t, n in room.bytes_by_type.items():
            self.metrics.pd_bytes.labels(t).inc(n)
        assert room.result is not None
        if not room.result.done():
            room.result.set_result(None)
        self._forget(room)

    def _forget(self, room: Room) -> None:
        if self.rooms.get(room.room) is room and (room.closed or not room.started):
            del self.rooms[room.room]
            if room.request_id is not None:
                self.by_request.pop(room.request_id, None)
        elif room.started and not room.closed:
            self.loop.call_later(1.0, self._forget, room)

    def decode_gone(self, room: Room) -> None:
        """The decode's transfer call hung up: its process or its network is gone, so its session is
        dead (later rooms fail fast) until it registers again."""
        if self.deaf or room.status is RoomStatus.FAILED:
            return  # already ended (an abort that came first is not a death)
        if room.session is not None:
            room.session.dead = True
        self.fail(room, PdError("decode_gone", f"the decode server hung up on room {room.room}"))

    def cancel_request(self, request_id: str, reason: str, message: str) -> None:
        """The prefill's client went away (or the server drains past its grace): fail the room."""
        room = self.by_request.get(request_id)
        if room is not None:
            self.fail(room, PdError(reason, message))

    # ---- engine thread -----------------------------------------------------------------------
    def on_step(self, out: Any, sampled: dict[str, int]) -> None:
        """Queue what this step finished of every started PD room (engine thread, after sampling)."""
        page = self.engine.layout.page_size
        for chunk in out.chunks:
            room = self.by_request.get(chunk.seq.request_id)
            if room is None or not room.started or room.status is RoomStatus.FAILED:
                continue
            seq = chunk.seq
            final = chunk.sample
            done_pages = -(-chunk.end // page) if final else chunk.end // page
            try:
                self._queue(room, seq, done_pages, final, sampled.get(seq.request_id))
            except ValueError as err:  # transfer.PayloadMismatch: never truncate, fail the request
                self.loop.call_soon_threadsafe(self.fail, room, PdError("payload_mismatch", str(err)))
            except PdError as err:
                self.loop.call_soon_threadsafe(self.fail, room, err)

    def _queue(self, room: Room, seq: Any, done_pages: int, final: bool, token: int | None) -> None:
        from dsv4_engine.disagg.transfer import Entries, plan_writes, write_shape

        assert room.dst_pages is not None and room.session is not None and seq.req_idx is not None
        # Only the types this step sends are built: a non-final chunk sends the append-only ones,
        # and none at all when it completed no page.
        types = [t for t in self.src_ptrs if final or (t in _APPEND_ONLY and done_pages > room.sent_pages)]
        src_all = self.engine.payloads(seq.req_idx, len(seq.prompt_token_ids), types)
        src: dict[StateType, list[int]] = {}
        dst: dict[StateType, list[int]] = {}
        spans: dict[StateType, tuple[int, int]] = {}
        for t in types:
            s, d = src_all[t], room.dst_pages[t]
            # Page lists of compressed types can be shorter than the prompt's pages (rows [0, n//4)).
            hi = min(done_pages, len(s)) if t in _APPEND_ONLY else len(s)
            lo = min(room.sent_pages, hi) if t in _APPEND_ONLY else 0
            if len(s) != len(d):
                raise PdError(
                    "payload_mismatch", f"{t}: prefill sends {len(s)} pages, decode expects {len(d)}"
                )
            src[t], dst[t], spans[t] = s[lo:hi], d[lo:hi], (lo, hi)
        if self.corrupt_next is not None and self.corrupt_next in src:
            self._corrupt(self.corrupt_next, src[self.corrupt_next])
        room.sent_pages = done_pages
        if self.checksums is not None:
            for t, pages in src.items():
                room.src_sent.setdefault(t, []).extend(pages)
        entries = plan_writes(self.components, room.session.dst_ptrs, src, dst)
        job = _Job(room, entries, _bytes_by_type(self.components, src), final)
        shape = write_shape(self.components, src, dst, len(entries))
        if shape.nbytes:
            self._route(job, shape, [(t, spans[t][0], src[t]) for t in src], src_all)
        if final:
            assert token is not None and room.dst_aux is not None
            slot = self.aux[seq.req_idx]
            pack_aux(slot, token, seq.generator)
            room.logprobs = logprobs_body(
                seq.step_logprobs if seq.params.logprobs is not None else None,
                list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None,
            )
            job.entries.extend(
                Entries.one(slot.data_ptr(), room.session.aux_ptr + room.dst_aux * AUX_BYTES, AUX_BYTES)
            )
        if len(job.entries) or job.pieces or final:
            self._jobs.put(job)

    def _route(
        self,
        job: _Job,
        shape: Any,
        segments: list[tuple[StateType, int, list[int]]],
        src_all: dict[StateType, list[int]],
    ) -> None:
        """Put the job on the path `_choose` picks: its pieces, and its place in the decode's span."""
        from dsv4_engine.disagg.transfer import UNPACKING, Entries, split_pieces

        room = job.room
        path, pieces = self._choose(room, shape)
        if path == "direct":
            return
        page_bytes = {c.state_type: sum(c.item_lens) for c in self.components}
        job.path, job.entries, job.staged_bytes = path, Entries(), shape.nbytes  # aux added after
        job.pieces = split_pieces(segments, page_bytes, pieces)
        job.src_pages = {t: src_all[t] for t, _, _ in segments}
        if path in UNPACKING:
            assert room.dst_staging is not None and room.session is not None
            assert room.session.staging_ptr is not None
            job.staged_dst = room.session.staging_ptr + room.dst_staging[0] + room.staged_at
            room.staged_at += shape.nbytes
            room.staged.extend((str(t), lo, hi) for piece in job.pieces for t, lo, hi in piece)

    def _choose(self, room: Room, shape: Any) -> tuple[str, int]:
        """(path, pieces) for one job: the cost model's pick among the paths both sides have room
        for, or the path a test forces (direct when it has no room)."""
        from dsv4_engine.disagg.transfer import PACKING, UNPACKING, choose_write

        can_pack = self.staging is not None and shape.nbytes <= self.staging.nbytes
        can_unpack = (
            room.dst_staging is not None
            and room.session is not None
            and room.session.staging_ptr is not None
            and room.staged_at + shape.nbytes <= room.dst_staging[1]
        )
        mode = {"always": "staged", "never": "direct"}.get(self.stage_mode, self.stage_mode)
        if mode == "auto":
            return choose_write(shape, can_pack=can_pack, can_unpack=can_unpack)
        path = mode.removesuffix("_pipelined")
        if (path in PACKING and not can_pack) or (path in UNPACKING and not can_unpack):
            return "direct", 1
        return path, FORCED_PIECES if mode.endswith("_pipelined") else 1

    def _corrupt(self, state_type: StateType, pages: list[int]) -> None:
        bufs = self.engine.kv_pool.buffers_by_type()[state_type]
        page = next((p for p in reversed(pages) if p), None)
        if page is None:
            return
        self.corrupt_next = None
        for buf in bufs:
            buf[page] += 1.0
        log.warning("test hook: perturbed %s page %d before the send", state_type, page)

    # ---- worker thread -----------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if isinstance(job, _Close):
                self._close(job.room)
                continue
            room = job.room
            with self._lock:
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
                self.loop.call_soon_threadsafe(self.fail, room, err)
                continue
            finally:
                room.writing = False
            for t, n in job.nbytes.items():
                room.bytes_by_type[t] = room.bytes_by_type.get(t, 0) + n
            if job.final:
                if self.checksums is not None:
                    self.checksums[room.room] = page_digests(self.engine.kv_pool, room.src_sent)
                self._close(room)
                self.loop.call_soon_threadsafe(self._succeed, room)

    def _write(self, peer: str, job: _Job) -> None:
        """One job into the decode's memory on its path (the aux slot rides with the last entries)."""
        from dsv4_engine.disagg.transfer import PACKING, path_label, plan_packed

        if job.path in PACKING:
            self._write_packed(peer, job)
        elif job.path == "unpack_only":  # our page runs straight into the decode's span
            entries = plan_packed(self.components, self.src_ptrs, self._segments(job, job.src_pages),
                                  job.staged_dst, into_packed=True)  # fmt: skip
            entries.extend(job.entries)
            self.transport.write(peer, entries)
        else:
            self.transport.write(peer, job.entries)
        self.metrics.pd_writes.labels(path_label(job.path, max(len(job.pieces), 1))).inc()

    @staticmethod
    def _segments(
        job: _Job, pages: dict[StateType, list[int]], piece: list[tuple[StateType, int, int]] | None = None
    ) -> list[tuple[StateType, list[int]]]:
        """(state type, page ids) of one piece (default: every piece) over one side's page lists."""
        parts = [seg for p in job.pieces for seg in p] if piece is None else piece
        return [(t, pages[t][lo:hi]) for t, lo, hi in parts]

    def _write_packed(self, peer: str, job: _Job) -> None:
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

    def _packed_steps(self, job: _Job, offset: int) -> list[tuple[Callable[[], Any], Any]]:
        """(pack, entries) per piece, packed one after another from `offset` in the arena: one entry
        into the decode's span (staged) or an entry per run of the decode's pages (pack_only); the
        aux slot rides with the last piece."""
        from dsv4_engine.disagg.transfer import Entries, plan_packed

        assert self.staging is not None and job.room.session is not None and job.room.dst_pages is not None
        kv, dst_ptrs, dst_pages = self.engine.kv_pool, job.room.session.dst_ptrs, job.room.dst_pages
        steps, at = [], 0
        for piece in job.pieces:
            segments = self._segments(job, job.src_pages, piece)
            n = staged_bytes(kv, dict(segments))
            span, packed = self.staging.view(offset + at, n), self.staging.data_ptr + offset + at
            if job.path == "staged":
                entries = Entries.one(packed, job.staged_dst + at, n)
            else:
                entries = plan_packed(self.components, dst_ptrs, self._segments(job, dst_pages, piece), packed,
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
        if room.request_id is not None and room.started:
            rid = room.request_id
            self.bridge.call(lambda engine: engine.release_held(rid))

    def stop(self) -> None:
        self._jobs.put(None)
        self._worker.join(timeout=60)


def _digest_mismatch(room: int) -> PdError:
    return PdError(
        "prompt_mismatch",
        f"room {room}: the decode and prefill servers received different prompts (token digests differ)",
        status=400,
    )


def _bytes_by_type(components: list[Any], pages: dict[StateType, list[int]]) -> dict[str, int]:
    out = {}
    for c in components:
        if c.state_type in pages:
            n = sum(1 for p in pages[c.state_type] if p)
            out[str(c.state_type)] = n * sum(c.item_lens)
    return out
