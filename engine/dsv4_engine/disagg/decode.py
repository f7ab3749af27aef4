"""The decode side: pair with a prefill server, reserve pages, receive the state, admit as running.

One task per PD sequence (`receive`), in order:
1. the prefill peer (decode_peers.py): `/route` once (layout fingerprint compared: a mismatch fails
   the request naming the field), the session registered once (destination pointers), a heartbeat;
2. claim the room (prompt digest, checked on both sides);
3. reserve the request's pages and tables (the decode request pool) where the running requests keep
   room to grow (decode_reserve.py), else queue while pages are short: the queue and the engine's
   waiting requests together are bounded by --max-waiting (beyond, 503 with Retry-After); and a
   span of the staging arena that holds all of them packed, when one is free (else the prefill
   writes every page directly);
4. send the destination pages (and the span) and wait for the transfer, bounded from admission by
   the waiting timeout, and ended sooner by the heartbeat declaring the peer dead or by a
   connection error;
5. unpack the segments the prefill sent staged into the reserved pages, and admit the request as
   running from its transferred first token.
Every failure after 3 gives the pages and the span back; when a write from the prefill may still
land in them (peer dead or stalled, abort unacknowledged, entries its transport abandoned still
moving) they stay quarantined first: until the prefill says no write of the room can land any more,
or, while it does not answer, for Mooncake's transfer timeout plus a margin. The room is aborted at
the prefill so its response ends too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import httpx
import torch

from dsv4_engine.disagg.base import EngineCalls, PdEngine, PdMetrics, Transport
from dsv4_engine.disagg.decode_peers import PrefillPeer, PrefillPeers
from dsv4_engine.disagg.decode_reserve import Reservation, horizon, reserve
from dsv4_engine.disagg.faults import FaultHooks, page_digests, poisoned
from dsv4_engine.disagg.fingerprint import prompt_digest
from dsv4_engine.disagg.lanes import RankEndpoint
from dsv4_engine.disagg.protocol import (
    PdError,
    PdTarget,
    draft_offer,
    draft_slots,
    read_cached_tokens,
    read_draft_tokens,
    read_logprobs,
    read_window_from,
    register_state,
    stage_segments,
    staged_bytes,
    unpack_aux,
)
from dsv4_engine.memory import OutOfPages, StateType
from dsv4_engine.memory.staging import StagingArena, scatter_pages
from dsv4_engine.sampling_params import SamplingParams

log = logging.getLogger("dsv4.pd.decode")

QUARANTINE_POLL_SECONDS = 0.5  # how often a quarantine asks the prefill whether a write may still land


class DecodeReceiver:
    """The decode server's half (base.DecodeSide): every PD sequence's pages, transfer and admission."""

    def __init__(
        self,
        engine: PdEngine,
        bridge: EngineCalls,
        transport: Transport,
        *,
        fingerprint: dict[str, Any],
        waiting_timeout: float,
        heartbeat_interval: float,
        heartbeat_failures: int,
        quarantine: float,
        metrics: PdMetrics,
        may_queue: Callable[[], bool] = lambda: True,
        reserve_tokens: int = 512,
        staging: StagingArena | None = None,
        faults: FaultHooks | None = None,
        endpoints: list[RankEndpoint] | None = None,
    ) -> None:
        """`endpoints`: a parallel server's other ranks' transports (lanes.py): each is written the
        request's state directly by a prefill rank, so nothing is copied between ranks here."""
        self.engine = engine
        self.bridge = bridge
        self.waiting_timeout = waiting_timeout
        self.heartbeat_interval = heartbeat_interval  # also how often a queued sequence renews its claim
        self.quarantine = quarantine  # seconds, while the prefill cannot say whether a write may land
        self.metrics = metrics
        self.may_queue = may_queue  # whether one more sequence may wait for pages (--max-waiting)
        self.reserve_tokens = reserve_tokens  # growth each decoding request keeps room for
        # Rows reserved whose state has not been admitted yet; decode_reserve adds them (engine thread).
        self.reserved: dict[int, Reservation] = {}
        self.faults = faults
        self.decode_id = uuid.uuid4().hex
        self.queued = 0  # waiting for pages
        self.receiving = 0  # pages reserved, waiting for the transfer
        self.quarantined = 0  # requests whose pages are out of the free lists for a while
        self.pages_freed = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()  # fire-and-forget work, kept alive until done
        rows = engine.req_pool.req_to_token.shape[0]
        self.staging = staging  # one span per room being received; freed with (or after) its pages
        self.draft = draft_slots(engine.draft_geometry(), rows, engine.kv_pool.device)
        components, self.aux = register_state(transport, engine.kv_pool, rows, staging, self.draft)
        self.page_bytes = {c.state_type: sum(c.item_lens) for c in components}
        session = {
            "mooncake_session": transport.session_id,
            "dst_ptrs": {str(c.state_type): c.data_ptrs for c in components},
            "aux_ptr": self.aux.data_ptr(),
            "fingerprint": fingerprint,
            "staging_ptr": staging.data_ptr if staging is not None else None,
        }
        if endpoints:  # absent on one rank: the body a prefill of any version takes
            session["ranks"] = [
                {
                    "rank": e.rank,
                    "mooncake_session": e.session,
                    "dst_ptrs": {str(t): p for t, p in e.ptrs.items()},
                }
                for e in endpoints
            ]
        draft = None
        if self.draft is not None:  # taken from a prefill whose /route offers the same slots
            draft = {"ptr": self.draft.data_ptr(), "offer": draft_offer(self.draft)}
        self.peers = PrefillPeers(
            self.decode_id, session, fingerprint=fingerprint, heartbeat_interval=heartbeat_interval,
            heartbeat_failures=heartbeat_failures, metrics=metrics, draft=draft,
        )  # fmt: skip

    # ---- base.DecodeSide (loop) --------------------------------------------------------------
    def depths(self) -> dict[str, int]:
        spans = self.staging.spans if self.staging is not None else 0
        return {
            "prealloc": self.queued,
            "transfer": self.receiving,
            "quarantine": self.quarantined,
            "staging": spans,
        }

    def pages_may_be_free(self) -> None:
        self.pages_freed.set()

    def paired(self) -> list[str]:
        return sorted(self.peers.peers)

    def refuse(self, target: PdTarget, reason: str, message: str) -> None:
        """Abort a room this server will not take (queue full, draining), so the prefill ends it."""
        self.spawn(self.peers.delete(target, reason, message))

    async def close(self) -> None:
        await self.peers.close()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # errors here are expected

    # ---- one sequence ------------------------------------------------------------------------
    async def receive(
        self, request_id: str, target: PdTarget, prompt_ids: list[int], params: SamplingParams
    ) -> None:
        digest = prompt_digest(prompt_ids)
        req_idx: int | None = None
        span: tuple[int, int] | None = None  # (offset, bytes) in the staging arena
        peer: PrefillPeer | None = None
        may_land = False  # the prefill may have our page lists, so a write may land in them
        try:
            peer = await self.peers.get(target)
            await self.peers.claim(peer, target, digest)
            end = horizon(
                len(prompt_ids), params.max_tokens, self.reserve_tokens, self.engine.allocator.max_ctx
            )
            req_idx, pages = await self._reserve(
                len(prompt_ids), end, lambda: self.peers.claim(peer, target, digest)
            )
            span = self._stage_span(pages)
            may_land = True
            self.receiving += 1
            admitted = time.monotonic()  # the waiting timeout counts from here, not from arrival
            try:
                answer = await self._transfer(peer, target, pages, req_idx, span)
                staged = list(answer.get("staged") or [])
                if staged:
                    assert span is not None
                    await asyncio.to_thread(self._unpack, pages, span, staged)
            finally:
                self.receiving -= 1
            self.metrics.pd_transfer_seconds.observe(time.monotonic() - admitted)
            for t, ids in pages.items():
                self.metrics.pd_bytes.labels(str(t)).inc(sum(1 for p in ids if p) * self.page_bytes[t])
            if self.faults is not None:
                await self._probe(target.room, pages)
            token, state = unpack_aux(self.aux[req_idx])
            first, prompt = read_logprobs(answer.get("logprobs"), params, prompt_ids, token)
            cached = read_cached_tokens(answer.get("cached_tokens"), len(prompt_ids))
            drafts = read_draft_tokens(answer.get("draft_token_ids"), self.engine.config.vocab_size)
            window = self._draft_window(answer.get("draft_window_from"), req_idx, len(prompt_ids))
            args = (request_id, prompt_ids, params, req_idx, token, state)
            await self.bridge.run(
                lambda e: e.admit_transferred(
                    *args, first_logprobs=first, prompt_logprobs=prompt, cached_tokens=cached, drafts=drafts,
                    draft_window=window,
                )
            )  # fmt: skip
            self.reserved.pop(req_idx, None)
            req_idx = None  # the engine owns it now (its free path frees it)
        except BaseException as exc:
            if isinstance(exc, (PdError, asyncio.CancelledError)):
                self.metrics.pd_failures.labels(getattr(exc, "reason", "client_gone")).inc()
            if isinstance(exc, PdError) and exc.reason == "room_in_use":
                raise  # someone else's room: nothing of ours to abort
            # Tell the prefill either way, so its response ends within a step; its answer says
            # whether a write may still land in the reserved pages.
            writing = await self._abort_room(peer, target, exc)
            if req_idx is not None:
                self._release(target, req_idx, span, quarantine=may_land and writing)
                span = None
            raise
        finally:
            if span is not None:  # unpacked (or never written): nothing can land in it any more
                assert self.staging is not None
                self.staging.free(span[0])

    def _draft_window(self, value: Any, req_idx: int, prompt_len: int) -> tuple[int, torch.Tensor] | None:
        """The MTP window the prefill wrote into the row's slot with the state, as (first position,
        rows), checked; None when none came (a prefill that does not speculate, or older)."""
        if self.draft is None:
            return None
        start = read_window_from(value, prompt_len, self.draft.shape[1])
        if start is None:
            return None
        return start, self.draft[req_idx, : prompt_len - start].clone()

    async def _reserve(
        self, prompt_len: int, end: int, renew: Callable[[], Awaitable[None]]
    ) -> tuple[int, dict[StateType, list[int]]]:
        """Pages and tables for the prompt; waits (queued) while the pools are short. Only a request
        that found the pools short counts as queued: --max-waiting bounds those with the engine's
        waiting requests, checked here on the loop as the request joins, so a burst that arrived at
        once still queues no more than the bound and the rest get 503 with Retry-After."""
        queued = False
        poison = self.faults is not None and self.faults.poison
        try:
            while True:
                self.pages_freed.clear()
                try:
                    return await self._call_reserve(
                        functools.partial(
                            reserve, prompt_len=prompt_len, end=end, reserved=self.reserved,
                            reserve_tokens=self.reserve_tokens, poison=poison,
                        )
                    )  # fmt: skip
                except OutOfPages as short:
                    if not queued:
                        if not self.may_queue():
                            raise PdError("queue_full", f"no pages for the request now ({short}) and the "
                                          "queue is full; retry later", status=503, retry_after=1) from None  # fmt: skip
                        queued = True
                        self.queued += 1
                try:
                    await asyncio.wait_for(self.pages_freed.wait(), self.heartbeat_interval)
                except TimeoutError:  # still queued: renew the claim so the prefill keeps the room
                    await renew()
        finally:
            if queued:
                self.queued -= 1

    async def _call_reserve(
        self, fn: Callable[[PdEngine], tuple[int, dict[StateType, list[int]]]]
    ) -> tuple[int, dict[StateType, list[int]]]:
        """fn on the engine thread; if this task is cancelled (the client left) while it is queued
        or running there, the row it reserves after all is given back."""
        call = self.bridge.call(fn)
        try:
            return await asyncio.shield(asyncio.wrap_future(call))
        except asyncio.CancelledError:
            loop = asyncio.get_running_loop()

            def undo(done: concurrent.futures.Future[Any]) -> None:
                if not done.cancelled() and done.exception() is None:
                    row = done.result()[0]
                    loop.call_soon_threadsafe(self._release_unused, row)

            call.add_done_callback(undo)
            raise

    def _release_unused(self, row: int) -> None:
        self.reserved.pop(row, None)
        self.spawn(self._free(row))

    async def _probe(self, room: int, pages: dict[StateType, list[int]]) -> None:
        """Test hooks: digest what arrived, and fail a request any of whose pages still hold the NaN
        poison (a page no write reached must never be decoded from)."""
        assert self.faults is not None
        kv = self.engine.kv_pool
        self.faults.checksums[room] = await asyncio.to_thread(page_digests, kv, pages)
        if self.faults.poison:
            missed = await asyncio.to_thread(poisoned, kv, pages)
            if missed:
                raise PdError("payload_mismatch", f"room {room}: pages of {', '.join(missed)} still hold the "
                              "NaN poison after the transfer ended: no write reached them")  # fmt: skip

    def _stage_span(self, pages: dict[StateType, list[int]]) -> tuple[int, int] | None:
        """A staging span that holds every page of the request packed, if the arena has one free."""
        if self.staging is None:
            return None
        nbytes = staged_bytes(self.engine.kv_pool, pages)
        offset = self.staging.alloc(nbytes) if nbytes else None
        return None if offset is None else (offset, nbytes)

    def _unpack(
        self, pages: dict[StateType, list[int]], span: tuple[int, int], staged: list[list[Any]]
    ) -> None:
        """Copy the segments the prefill sent packed from the span into the reserved pages. The pages
        are this request's alone until it is admitted, so this runs beside the engine's steps."""
        assert self.staging is not None
        segments = []
        for item in staged:
            try:
                name, lo, hi = item
                state_type = StateType(name)
                ids = pages[state_type]
                if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi <= len(ids)):
                    raise ValueError(f"pages [{lo}, {hi}) of {len(ids)}")
            except (KeyError, TypeError, ValueError) as exc:
                raise PdError("payload_mismatch", f"the prefill's staged segment {item!r} is invalid: "
                              f"{exc}") from exc  # fmt: skip
            segments.append((state_type, ids[lo:hi]))
        stage_segments(self.engine.kv_pool, segments, self.staging.view(*span), scatter_pages)

    async def _transfer(
        self,
        peer: PrefillPeer,
        target: PdTarget,
        pages: dict[StateType, list[int]],
        req_idx: int,
        span: tuple[int, int] | None,
    ) -> dict[str, Any]:
        """Send the destination and wait for the transfer; returns the prefill's answer: the segments
        that came staged and the logprobs only it computed."""
        body = {
            "decode_id": self.decode_id,
            "pages": {str(t): p for t, p in pages.items()},
            "aux_index": req_idx,
            "staging": None if span is None else {"offset": span[0], "nbytes": span[1]},
        }
        post = asyncio.ensure_future(
            peer.client.post(
                f"/rooms/{target.room}/transfer", json=body, timeout=httpx.Timeout(None, connect=10.0)
            )
        )
        dead = asyncio.ensure_future(peer.dead.wait())
        done: set[asyncio.Future[Any]] = set()
        try:
            done, _ = await asyncio.wait(
                {post, dead}, timeout=self.waiting_timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            dead.cancel()
            if post not in done:
                # Keep the call open until the abort (sent next, also when this task is cancelled)
                # ends it at the prefill: hanging up first reads there as this server's death.
                # Bounded, for a prefill that never answers.
                self.spawn(asyncio.wait_for(post, self.quarantine))
        if post not in done:
            if peer.dead.is_set():
                raise PdError("prefill_dead", peer.reason or f"prefill {peer.address} is dead")
            raise PdError("transfer_timeout", f"no state from prefill {peer.address} for room {target.room} "
                          f"within {self.waiting_timeout:g}s", status=504)  # fmt: skip
        try:
            r = post.result()
        except httpx.HTTPError as exc:
            # A refused or reset connection: the prefill process is gone (sooner than the heartbeat).
            self.peers.declare_dead(peer, f"Lost connection with prefill instance {peer.address}: {exc!r}")
            raise PdError(
                "prefill_dead", f"prefill {peer.address} went away during room {target.room}"
            ) from exc
        answer = r.json()
        if r.status_code != 200 or answer.get("status") != "success":
            raise PdError.from_body(answer)
        if answer.get("staged") and span is None:
            raise PdError("payload_mismatch", f"prefill {peer.address} sent staged pages without a span")
        return answer

    async def _abort_room(self, peer: PrefillPeer | None, target: PdTarget, exc: BaseException) -> bool:
        """Tell the prefill to give the room up; True if a write may still land (quarantine)."""
        reason = exc.reason if isinstance(exc, PdError) else "client_gone"
        if peer is not None and peer.dead.is_set():
            return True  # nobody to ask: assume the worst
        return await self.peers.delete(target, reason, str(exc) or reason)

    def _release(
        self, target: PdTarget, req_idx: int, span: tuple[int, int] | None, *, quarantine: bool
    ) -> None:
        self.reserved.pop(req_idx, None)
        if not quarantine:
            self._free_span(span)
            self.spawn(self._free(req_idx))
            return
        self.quarantined += 1
        self.metrics.pd_failures.labels("quarantined").inc()
        log.warning(
            "request row %d quarantined (a late write of room %d may still land)", req_idx, target.room
        )
        self.spawn(self._quarantine(target, req_idx, span))

    async def _quarantine(self, target: PdTarget, req_idx: int, span: tuple[int, int] | None) -> None:
        """Keep the row and span out of use until the prefill says no write of the room can land
        any more; while it gives no answer (stalled, unreachable, gone), for `quarantine` seconds."""
        until = time.monotonic() + self.quarantine
        try:
            while True:
                answer = await self.peers.may_land(target)
                if answer is False or (answer is None and time.monotonic() >= until):
                    break
                await asyncio.sleep(QUARANTINE_POLL_SECONDS)
        finally:
            log.info("request row %d out of quarantine (room %d)", req_idx, target.room)
            self.quarantined -= 1
            self._free_span(span)
            await self._free(req_idx)

    def _free_span(self, span: tuple[int, int] | None) -> None:
        if span is not None:
            assert self.staging is not None
            self.staging.free(span[0])

    async def _free(self, req_idx: int) -> None:
        await self.bridge.run(lambda e: e.free_request(req_idx))
        self.pages_freed.set()
