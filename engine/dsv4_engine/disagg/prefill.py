"""The prefill side: rooms that pair this server's PD requests with decode servers' claims.

A room pairs two halves that arrive in either order: this server's own HTTP request (prompt,
sampling) and a decode server's claim (then its destination pages). The prompt reaches the engine
only once the decode side has reserved its pages, so nothing is computed for a request no decode
server can take. Then the step observer (prefill_send) queues each step's finished pages as write
jobs and the transfer threads (prefill_writer) write them, each room's in order, and close it. The
transfer's answer lists the segments that landed in the decode's staging span, for it to unpack.

The loop owns rooms and sessions; the engine thread and the worker post results back through it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from dsv4_engine.disagg.base import EngineCalls, PdEngine, PdMetrics, Transport
from dsv4_engine.disagg.faults import FaultHooks
from dsv4_engine.disagg.fingerprint import prompt_digest
from dsv4_engine.disagg.lanes import RankEndpoint, RankLinks
from dsv4_engine.disagg.prefill_send import ChunkSender
from dsv4_engine.disagg.prefill_writer import TransferWorker
from dsv4_engine.disagg.protocol import (
    PdError,
    PdTarget,
    RoomStatus,
    draft_offer,
    draft_slots,
    register_state,
)
from dsv4_engine.disagg.room import DecodeSession, Room
from dsv4_engine.memory import StateType
from dsv4_engine.memory.staging import StagingArena
from dsv4_engine.sampling_params import SamplingParams

log = logging.getLogger("dsv4.pd.prefill")


class PrefillRooms:
    """Rooms and sessions of one prefill server (base.PrefillSide, and what bootstrap.py serves)."""

    def __init__(
        self,
        engine: PdEngine,
        bridge: EngineCalls,
        transport: Transport,
        loop: asyncio.AbstractEventLoop,
        *,
        fingerprint: dict[str, Any],
        bootstrap_timeout: float,
        metrics: PdMetrics,
        staging: StagingArena | None = None,
        faults: FaultHooks | None = None,
        threads: int = 4,
        links: RankLinks | None = None,
        endpoints: list[RankEndpoint] | None = None,
    ) -> None:
        """`links`, `endpoints`: a parallel server's other ranks and their transports (lanes.py)."""
        self.transport = transport
        self.endpoints = endpoints or []
        self.loop = loop
        self.fingerprint = fingerprint
        self.bootstrap_timeout = bootstrap_timeout
        self.metrics = metrics
        self.faults = faults
        self.rooms: dict[int, Room] = {}
        self.by_request: dict[str, Room] = {}
        self.sessions: dict[str, DecodeSession] = {}
        rows = engine.req_pool.req_to_token.shape[0]
        draft = draft_slots(engine.draft_geometry(), rows, engine.kv_pool.device)
        self.draft_offer = draft_offer(draft)  # in /route: a decode whose slots match takes the window
        components, aux = register_state(transport, engine.kv_pool, rows, staging, draft)
        self.src_types = [c.state_type for c in components]
        self._lock = threading.Lock()  # a room's failure against its next write (TransferWorker.lock)
        self.writer = TransferWorker(
            engine, bridge, transport, components, staging=staging, metrics=metrics, lock=self._lock,
            fail_soon=self._fail_soon, succeed_soon=self._succeed_soon, faults=faults, threads=threads,
            links=links,
        )  # fmt: skip
        sources = [components] + [
            [dataclasses.replace(c, data_ptrs=e.ptrs[c.state_type]) for c in components]
            for e in self.endpoints
        ]
        sender = ChunkSender(
            engine, components, aux, staging=staging, room_of=self.by_request.get,
            fail_soon=self._fail_soon, writer=self.writer, faults=faults, sources=sources,
            steps_sent=links.sent if links is not None else lambda: 0, draft=draft,
        )  # fmt: skip
        engine.step_observers.append(sender.on_step)

    def _fail_soon(self, room: Room, error: PdError) -> None:  # any thread
        self.loop.call_soon_threadsafe(self.fail, room, error)

    def _succeed_soon(self, room: Room) -> None:  # any thread
        self.loop.call_soon_threadsafe(self._succeed, room)

    # ---- base.PrefillSide: this server's requests (loop) ---------------------------------------
    def open(
        self,
        target: PdTarget,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        start: Callable[[], None],
    ) -> asyncio.Future[None]:
        digest = prompt_digest(prompt_ids)
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
            return room.result  # the decode side already gave up on it: the result holds why
        if room.claim_digest is not None and room.claim_digest != digest:
            self.fail(room, _digest_mismatch(target.room))
        self._maybe_start(room)
        return room.result

    def cancel_request(self, request_id: str, reason: str, message: str) -> None:
        room = self.by_request.get(request_id)
        if room is not None:
            self.fail(room, PdError(reason, message))

    def refuse(self, target: PdTarget, reason: str, message: str) -> None:
        """Fail the room (unless another request of this server has it), so a decode server's claim
        (or its wait for the transfer) ends now, not at a deadline."""
        number = target.room
        room = self.rooms.get(number)
        if room is not None and room.request_id is not None:
            return  # another request's room
        if room is None:
            room = self._new_room(number)
        self.fail(room, PdError(reason, f"the prefill server refused room {number}: {message}", status=503))

    def depths(self) -> dict[str, int]:
        waiting = sum(
            1
            for r in self.rooms.values()
            if RoomStatus.BOOTSTRAPPING <= r.status <= RoomStatus.WAITING_FOR_INPUT
        )
        return {"bootstrap": waiting, "transfer": self.writer.pending()}

    def dead_sessions(self) -> list[str]:
        return sorted(k for k, v in self.sessions.items() if v.dead)

    def late_writes(self) -> int:
        return self.writer.late()

    async def close(self) -> None:
        await asyncio.to_thread(self.writer.stop)

    # ---- a room's life (loop) ------------------------------------------------------------------
    def _new_room(self, number: int) -> Room:
        now = time.monotonic()
        room = Room(number, now, now + self.bootstrap_timeout, self.loop.create_future())
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
        missing = [t for t in self.src_types if t not in pages]
        if missing or set(pages) - set(self.src_types):
            self.fail(room, PdError("payload_mismatch", f"decode sent pages for {sorted(map(str, pages))}, "
                                    f"prefill has {[str(t) for t in self.src_types]}"))  # fmt: skip
            return room
        room.dst_pages, room.dst_aux = pages, aux
        room.dst_staging = staging if room.session.staging_ptr is not None else None
        self._maybe_start(room)
        return room

    def abort(self, number: int, decode_id: str, reason: str, message: str) -> bool:
        """The decode side gives the room up; True if a write of it may still land there."""
        if self.faults is not None and self.faults.deaf:
            return True
        room = self.rooms.get(number)
        if room is not None and room.session is not None and room.session.decode_id != decode_id:
            return False  # another decode server's room
        if room is None:
            room = self._new_room(number)  # the prefill request may still arrive: it must fail at once
        self.fail(room, PdError(reason, f"the decode server aborted room {number}: {message}"))
        return self.may_land(number, decode_id)

    def may_land(self, number: int, decode_id: str) -> bool:
        """Whether a write of the room may still change `decode_id`'s pages (room.may_land). A room
        this server does not know (never started here, forgotten after it closed, or a process
        restarted since) or another decode server's has none."""
        room = self.rooms.get(number)
        if room is None or room.session is None or room.session.decode_id != decode_id:
            return False
        with self._lock:
            return room.may_land

    # ---- ending a room (loop) ----------------------------------------------------------------
    def fail(self, room: Room, error: PdError) -> None:
        if room.status in (RoomStatus.FAILED, RoomStatus.SUCCESS):
            return
        log.warning("room %d failed: %s", room.room, error.message)
        with self._lock:
            room.status, room.error = RoomStatus.FAILED, error
        self.metrics.pd_failures.labels(error.reason).inc()
        if not room.result.done():
            room.result.set_exception(error)
        if room.started:
            self.writer.close_after_writes(room)  # then the pages are released
        self.loop.call_later(self.bootstrap_timeout, self._forget, room)

    def _succeed(self, room: Room) -> None:
        if room.status is RoomStatus.FAILED:
            return
        room.status = RoomStatus.SUCCESS
        if room.transfer_started is not None:
            self.metrics.pd_transfer_seconds.observe(time.monotonic() - room.transfer_started)
        for t, n in room.bytes_by_type.items():
            self.metrics.pd_bytes.labels(t).inc(n)
        lanes = {(0, 0): sum(room.bytes_by_type.values()), **room.lane_bytes}
        for (rank, peer_rank), n in lanes.items():
            self.metrics.pd_rank_bytes.labels(str(rank), str(peer_rank)).inc(n)
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
        if (self.faults is not None and self.faults.deaf) or room.status is RoomStatus.FAILED:
            return  # already ended (an abort that came first is not a death)
        if room.session is not None:
            room.session.dead = True
        self.fail(room, PdError("decode_gone", f"the decode server hung up on room {room.room}"))


def _digest_mismatch(room: int) -> PdError:
    return PdError(
        "prompt_mismatch",
        f"room {room}: the decode and prefill servers received different prompts (token digests differ)",
        status=400,
    )
