"""The prefill server's bootstrap endpoint: a second HTTP listener on --bootstrap-port.

Its own port (not the API port) so NetworkPolicies can open it to same-deployment decode pods only.
It runs on the server's event loop beside the API server, so room state has one owner (the loop).
Records are kept per rank (`ranks`): a parallel server's every rank has its own Mooncake session,
and a parallel decode server registers each of its ranks' sessions and buffers, so each decode rank
is written by a prefill rank of its own (lanes.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from dsv4_engine.disagg.fingerprint import fingerprint_diff, fingerprint_id
from dsv4_engine.disagg.prefill import PrefillRooms
from dsv4_engine.disagg.protocol import PdError
from dsv4_engine.disagg.room import DecodeSession
from dsv4_engine.memory import StateType

log = logging.getLogger("dsv4.pd.bootstrap")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RankSession(_Body):
    rank: int = Field(ge=1)
    mooncake_session: str
    dst_ptrs: dict[StateType, list[int]]


class SessionBody(_Body):
    mooncake_session: str
    dst_ptrs: dict[StateType, list[int]]
    aux_ptr: int
    fingerprint: dict[str, Any]
    staging_ptr: int | None = None  # a decode without a staging arena only takes direct writes
    draft_ptr: int | None = (
        None  # its MTP window slots (only if /route offered them, so older prefills never see it)
    )
    ranks: list[RankSession] = []  # a parallel decode's other ranks (their state comes direct)


class ClaimBody(_Body):
    decode_id: str
    prompt_digest: str


class StagingSpan(_Body):
    offset: int = Field(ge=0)
    nbytes: int = Field(ge=0)


class TransferBody(_Body):
    decode_id: str
    pages: dict[StateType, list[int]]
    aux_index: int = Field(ge=0)
    staging: StagingSpan | None = None  # where in its arena the decode takes this room's packed pages


class AbortBody(_Body):
    decode_id: str
    reason: str
    message: str = ""


def _error(err: PdError) -> JSONResponse:
    return JSONResponse({"status": "failed", **err.body()}, status_code=err.status)


def create_bootstrap_app(rooms: PrefillRooms) -> FastAPI:
    app = FastAPI(title="dsv4-bootstrap", docs_url=None, redoc_url=None)
    ranks = {0: {"rank": 0, "mooncake_session": rooms.transport.session_id}}
    ranks.update({e.rank: {"rank": e.rank, "mooncake_session": e.session} for e in rooms.endpoints})
    # This process: a prefill restarted on the same address answers with another, so a decode server
    # tells it from the one it registered with (decode_peers.py).
    instance = uuid.uuid4().hex

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok", "instance": instance}

    @app.get("/route")
    async def route() -> dict[str, Any]:
        return {
            "fingerprint": rooms.fingerprint,
            "fingerprint_id": fingerprint_id(rooms.fingerprint),
            "instance": instance,
            "ranks": list(ranks.values()),
            # What a decode needs to take the MTP window with the state (absent when this server
            # does not speculate): its window slots must match.
            **({"draft_window": rooms.draft_offer} if rooms.draft_offer else {}),
        }

    @app.put("/sessions/{decode_id}")
    async def register(decode_id: str, body: SessionBody) -> JSONResponse:
        # Both sides compare: a decode server never takes state from a layout that differs, and a
        # prefill server never writes into one.
        diff = fingerprint_diff(rooms.fingerprint, body.fingerprint)
        if diff is not None:
            rooms.metrics.pd_failures.labels("layout_mismatch").inc()
            return _error(
                PdError("layout_mismatch", f"prefill refuses decode {decode_id}: {diff}", status=409)
            )
        rooms.register(
            DecodeSession(
                decode_id, body.mooncake_session, body.dst_ptrs, body.aux_ptr, body.fingerprint,
                staging_ptr=body.staging_ptr, draft_ptr=body.draft_ptr,
                ranks={r.rank: (r.mooncake_session, r.dst_ptrs) for r in body.ranks},
            )
        )  # fmt: skip
        log.info("decode server %s registered (Mooncake session %s)", decode_id, body.mooncake_session)
        return JSONResponse({"status": "ok", "ranks": list(ranks.values())})

    @app.put("/rooms/{room}")
    async def claim(room: int, body: ClaimBody) -> JSONResponse:
        try:
            r = rooms.claim(room, body.decode_id, body.prompt_digest)
        except PdError as err:
            return _error(err)
        if r.error is not None:
            return _error(r.error)
        return JSONResponse({"status": r.status.name.lower()})

    @app.post("/rooms/{room}/transfer")
    async def transfer(room: int, body: TransferBody, request: Request) -> JSONResponse:
        """Held open until the room's transfer ended; a decode that hangs up fails the room."""
        try:
            span = None if body.staging is None else (body.staging.offset, body.staging.nbytes)
            r = rooms.set_destination(room, body.decode_id, body.pages, body.aux_index, span)
        except PdError as err:
            return _error(err)
        done = asyncio.ensure_future(asyncio.shield(r.result))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not done.done():
            done.cancel()
            rooms.decode_gone(r)
            return JSONResponse({"status": "failed", "reason": "decode_gone"}, status_code=499)
        if done.exception() is not None:
            err = done.exception()
            return _error(err if isinstance(err, PdError) else PdError("transfer_failed", str(err)))
        return JSONResponse(
            {
                "status": "success",
                "bytes": r.bytes_by_type,
                "staged": r.staged,
                "logprobs": r.logprobs,
                "cached_tokens": r.cached_tokens,
                "draft_token_ids": r.draft_token_ids,
                "draft_window_from": r.draft_window_from,
            }
        )

    @app.get("/rooms/{room}")
    async def room_state(room: int, decode_id: str) -> dict[str, Any]:
        """Whether a write of the room may still land in `decode_id`'s pages (its quarantine)."""
        return {"may_land": rooms.may_land(room, decode_id)}

    @app.delete("/rooms/{room}")
    async def abort(room: int, body: AbortBody) -> dict[str, Any]:
        writing = rooms.abort(room, body.decode_id, body.reason, body.message or body.reason)
        return {"status": "aborted", "writing": writing}

    return app


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class BootstrapServer(uvicorn.Server):
    """uvicorn on the API server's loop; signals stay with the API server, which drains both."""

    task: asyncio.Task[None]  # serving; set by serve_bootstrap

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        pass


async def serve_bootstrap(app: FastAPI, host: str, port: int) -> BootstrapServer:
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
                            log_config=None)  # fmt: skip
    server = BootstrapServer(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        if task.done():
            task.result()  # re-raises the bind error
            raise OSError(f"bootstrap server on {host}:{port} stopped before it started")
        await asyncio.sleep(0.01)
    server.task = task
    return server
