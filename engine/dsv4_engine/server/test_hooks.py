"""Routes that let tests hold work open deterministically; mounted only when DSV4_TEST_HOOKS=1.

A test that needs a request still in flight (a drain, a disconnect, a transfer killed midway) must not
bet on how fast the engine is: it pauses the engine between steps, does what it needs, and resumes.
The /debug/pd routes drive and read the PD fault hooks (disagg/faults.py), which server/pd.py
installs on a PD server when these routes are mounted.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from dsv4_engine.server.errors import unavailable

if TYPE_CHECKING:
    from dsv4_engine.disagg.faults import FaultHooks

ENV = "DSV4_TEST_HOOKS"
router = APIRouter(prefix="/debug")


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


@router.post("/pause")
async def pause(request: Request) -> JSONResponse:
    """Returns once the engine thread runs no more steps (commands such as aborts still apply)."""
    bridge = request.app.state.ctx.bridge
    if bridge is None:
        raise unavailable("the model is still loading", retry_after=1, code="server_loading")
    paused = await asyncio.to_thread(bridge.pause)
    return JSONResponse({"paused": paused, "steps": bridge.steps, "open": len(bridge.open_handles())})


@router.post("/resume")
async def resume(request: Request) -> JSONResponse:
    bridge = request.app.state.ctx.bridge
    if bridge is not None:
        bridge.resume()
    return JSONResponse({"paused": False})


def _faults(request: Request) -> FaultHooks:
    faults: FaultHooks | None = request.app.state.ctx.faults
    if faults is None:
        raise unavailable("no PD fault hooks on this server (colocated, or still loading)", retry_after=1)
    return faults


@router.post("/pd/corrupt")
async def corrupt(request: Request, state_type: str) -> JSONResponse:
    """Prefill: add 1 to one source page of `state_type` before the next send."""
    from dsv4_engine.memory import StateType

    _faults(request).corrupt_next = StateType(state_type)
    return JSONResponse({"armed": state_type})


@router.post("/pd/deaf")
async def deaf(request: Request, on: bool = True) -> JSONResponse:
    """Prefill: ignore decode aborts and hang-ups (while on), so a stalled prefill's write lands late."""
    _faults(request).deaf = on
    return JSONResponse({"deaf": on})


@router.post("/pd/hold")
async def hold(request: Request, room: int) -> JSONResponse:
    """Prefill: hold the first entry of room `room`'s next write (disagg/faults.Hold) until
    /debug/pd/release: a stalled peer, past the write's deadline if the release comes after it."""
    from dsv4_engine.disagg.faults import Hold

    _faults(request).holds[room] = Hold()
    return JSONResponse({"held": room})


@router.post("/pd/release")
async def release(request: Request, room: int) -> JSONResponse:
    held = _faults(request).holds.get(room)
    if held is None:
        return JSONResponse({"error": f"no hold on room {room}"}, status_code=404)
    held.release.set()
    return JSONResponse({"released": room})


@router.post("/pd/skip")
async def skip(request: Request, room: int) -> JSONResponse:
    """Prefill: never write room `room`'s pages (its aux slot still goes): the decode's poison stays."""
    _faults(request).skip.add(room)
    return JSONResponse({"skipped": room})


@router.post("/pd/fail_rank")
async def fail_rank(request: Request, room: int, rank: int) -> JSONResponse:
    """Prefill: rank `rank`'s writes of room `room` to a parallel decode's other ranks go to a session
    Mooncake refuses, so that rank's part of the transfer fails."""
    _faults(request).fail_rank[room] = rank
    return JSONResponse({"failing": {"room": room, "rank": rank}})


@router.get("/pd/live")
async def live(request: Request) -> JSONResponse:
    """A digest of every page of every running request (disagg/faults.live_digests), taken between
    engine steps: pause the engine first to compare two of them."""
    from dsv4_engine.disagg.faults import live_digests

    _faults(request)
    bridge = request.app.state.ctx.bridge
    return JSONResponse(await bridge.run(live_digests))


@router.post("/pd/staging")
async def staging(request: Request, mode: str) -> JSONResponse:
    """Prefill: write every job on one path (a `dsv4_pd_transfer_writes_total` path label; "always"
    is staged, "never" direct) where both sides have room for it, or by the cost model ("auto")."""
    from dsv4_engine.server.metrics import PD_WRITE_PATHS

    modes = ("auto", "always", "never", *PD_WRITE_PATHS)
    if mode not in modes:
        return JSONResponse(
            {"error": f"mode must be one of {', '.join(modes)}, got {mode!r}"}, status_code=400
        )
    _faults(request).stage_mode = mode
    return JSONResponse({"mode": mode})


@router.get("/pd")
async def pd_state(request: Request) -> JSONResponse:
    ctx = request.app.state.ctx
    faults: FaultHooks | None = ctx.faults
    return JSONResponse(
        {
            "checksums": {str(k): v for k, v in faults.checksums.items()} if faults is not None else {},
            "depths": ctx.pd.depths() if ctx.pd is not None else {},
            "decode_id": ctx.decode.decode_id if ctx.decode is not None else None,
            "paired": ctx.decode.paired() if ctx.decode is not None else [],
            "dead_sessions": ctx.prefill.dead_sessions() if ctx.prefill is not None else [],
            "logits": dict(faults.logits) if faults is not None else {},
            "holds": {str(k): v.state() for k, v in faults.holds.items()} if faults is not None else {},
            "late": ctx.prefill.late_writes() if ctx.prefill is not None else 0,
        }
    )


@router.get("/state")
async def state(request: Request) -> JSONResponse:
    ctx = request.app.state.ctx
    bridge = ctx.bridge
    return JSONResponse(
        {
            "pid": os.getpid(),  # tests check a port answers from the process they started
            "phase": ctx.phase.value,
            "inflight": ctx.inflight,
            "open": len(bridge.open_handles()) if bridge is not None else 0,
            "engine": bridge.metrics() if bridge is not None else {},
        }
    )
