"""The HTTP side of PD: the bootstrap fields of a request, and starting its sequences by role.

A prefill or decode server takes the same body the router sends to both. Here the three bootstrap
fields become one `PdTarget` per prompt (400 naming the field when they are missing or malformed);
`start` hands each prompt to the role's half of the protocol (disagg/prefill.py, disagg/decode.py)
instead of straight to the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import uuid
from typing import TYPE_CHECKING, Any

from dsv4_engine.disagg.protocol import MAX_ROOM, PdError, PdTarget, quarantine_seconds
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.server import test_hooks
from dsv4_engine.server.args import ServerSettings
from dsv4_engine.server.bridge import EngineBridge, ErrorEvent, RequestHandle
from dsv4_engine.server.errors import ApiError, bad_request
from dsv4_engine.server.native_protocol import GenerateRequest
from dsv4_engine.server.protocol import ChatCompletionRequest, CompletionRequest
from dsv4_engine.server.state import ServerContext

if TYPE_CHECKING:
    from dsv4_engine.disagg.base import DecodeSide, PrefillSide
    from dsv4_engine.engine import LLMEngine

log = logging.getLogger("dsv4.server.pd")

DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default
# The requests that carry the three bootstrap fields.
PdRequest = CompletionRequest | ChatCompletionRequest | GenerateRequest


def _items(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise bad_request(
                f"'{name}' has {len(value)} entries for {n} sequence(s); give one per sequence", name
            )
        return value
    if n > 1:
        raise bad_request(f"'{name}' must be a list with one entry per sequence for a batch of {n}", name)
    return [value]


def targets(ctx: ServerContext, req: PdRequest, prompts: int, n: int = 1) -> list[PdTarget] | None:
    """One PdTarget per sequence (prompt-major: prompt i, choice j is i * n + j) on a PD server; None
    on a colocated one (whose fields check rejects)."""
    mode = ctx.settings.disaggregation_mode
    if mode == "null":
        return None
    for name in ("bootstrap_host", "bootstrap_room"):
        if getattr(req, name) is None:
            raise bad_request(
                f"a {mode} server needs '{name}' (sglang-router adds bootstrap_host, bootstrap_port and "
                "bootstrap_room to every request it sends)",
                name,
                "missing_parameter",
            )
    count = prompts * n
    given = len(req.bootstrap_room) if isinstance(req.bootstrap_room, list) else 1
    if n > 1 and given != count:
        # Each choice is its own prefill and transfer, so it needs its own room.
        raise bad_request(
            f"'n' = {n} on a PD {mode} server needs one bootstrap room per choice ({count}), and the "
            f"request has {given}: sglang-router 0.3.2 sends one room per choice for "
            "/v1/chat/completions but one per prompt for /v1/completions and /generate; there, send "
            "n requests (each with its own seed) or use chat completions",
            "n",
            "unsupported_parameter",
        )
    hosts = _items(req.bootstrap_host, count, "bootstrap_host")
    ports = _items(req.bootstrap_port, count, "bootstrap_port")
    rooms = _items(req.bootstrap_room, count, "bootstrap_room")
    out = []
    own = ctx.settings.bootstrap_port or DEFAULT_BOOTSTRAP_PORT
    for host, port, room in zip(hosts, ports, rooms, strict=True):
        if not isinstance(host, str) or not host or any(c in host for c in "/ ?#@"):
            raise bad_request(
                f"bootstrap_host must be a host name or address, got {host!r}", "bootstrap_host"
            )
        if port is None:
            port = own  # as SGLang: null means this server's own --bootstrap-port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise bad_request(
                f"bootstrap_port must be an integer in [1, 65535], got {port!r}", "bootstrap_port"
            )
        if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < MAX_ROOM:
            raise bad_request(
                f"bootstrap_room must be an integer in [0, 2**64), got {room!r}", "bootstrap_room"
            )
        out.append(PdTarget(host.strip("[]"), port, room))
    if len({t.room for t in out}) != len(out):
        raise bad_request("bootstrap_room must differ between the sequences of one request", "bootstrap_room")
    return out


def pd_error(err: PdError) -> ApiError:
    headers = {"Retry-After": str(err.retry_after)} if err.retry_after is not None else None
    kind = (
        "invalid_request_error"
        if err.status == 400
        else "service_unavailable"
        if err.status == 503
        else "server_error"
    )
    param = {"room_in_use": "bootstrap_room", "prompt_mismatch": "prompt"}.get(err.reason)
    return ApiError(err.status, err.message, type=kind, param=param, code=f"pd_{err.reason}", headers=headers)


def _fail_handle(bridge: EngineBridge, handle: RequestHandle, err: BaseException) -> None:
    if not handle.done:
        bridge.forget(handle)
        handle.queue.put_nowait(ErrorEvent(err, "pd"))


def start(
    ctx: ServerContext,
    prompt_ids: list[int],
    params: SamplingParams,
    target: PdTarget,
    *,
    arrival: float,
    observe: bool,
) -> RequestHandle:
    """One PD sequence: a handle whose events arrive once the role's half of the protocol runs."""
    bridge = ctx.bridge
    assert bridge is not None and ctx.pd is not None
    rid = f"pd-{target.room}-{uuid.uuid4().hex[:8]}"  # the room in the id: logs and test hooks find it
    handle = bridge.open(rid, arrival)
    handle.prompt_len, handle.observe = len(prompt_ids), observe
    if ctx.prefill is not None:
        _start_prefill(ctx.prefill, bridge, handle, prompt_ids, params, target)
    else:
        assert ctx.decode is not None
        _start_decode(ctx.decode, bridge, handle, prompt_ids, params, target)
    return handle


def _start_prefill(
    rooms: PrefillSide,
    bridge: EngineBridge,
    handle: RequestHandle,
    ids: list[int],
    params: SamplingParams,
    target: PdTarget,
) -> None:
    rid = handle.request_id
    # The prefill computes the first token only (sampled as a colocated server would: penalties,
    # logit_bias, min_p and min_tokens apply to it here); the decode server goes on from it with the
    # same settings, its prompt and that token as history.
    first = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))

    def go() -> None:
        bridge.add(rid, ids, first, hold=True, handle=handle)

    try:
        result = rooms.open(target, rid, ids, params, go)
    except PdError as err:
        bridge.forget(handle)
        raise pd_error(err) from err
    handle.pd_wait = result
    handle.on_abort = lambda: rooms.cancel_request(
        rid, "client_gone", f"the prefill's client left room {target.room}"
    )

    def ended(f: asyncio.Future[None]) -> None:
        if not f.cancelled() and (err := f.exception()) is not None:
            _fail_handle(bridge, handle, err)

    result.add_done_callback(ended)


def _start_decode(
    receiver: DecodeSide,
    bridge: EngineBridge,
    handle: RequestHandle,
    ids: list[int],
    params: SamplingParams,
    target: PdTarget,
) -> None:
    task = asyncio.ensure_future(receiver.receive(handle.request_id, target, ids, params))

    def ended(t: asyncio.Task[None]) -> None:
        if not t.cancelled() and (err := t.exception()) is not None:
            _fail_handle(bridge, handle, err)

    task.add_done_callback(ended)
    handle.on_abort = lambda: None if task.done() else task.cancel()


def abort_rooms(ctx: ServerContext, rooms: list[PdTarget], reason: str, message: str) -> None:
    """A PD server refusing a request before any handle exists tells the other side (best effort): a
    decode server aborts each room at its prefill, a prefill server fails each room so the decode's
    claim ends. sglang-router waits for both legs' headers, so a silent refusal would hold the client
    until the router's request timeout (or the peer's own bootstrap/waiting bound)."""
    side = ctx.pd
    if side is None:
        return
    for target in rooms:
        side.refuse(target, reason, message)


def check_admission(ctx: ServerContext, req: PdRequest) -> None:
    """The routes' first admission check (draining, loading, dead, queue full): on a PD server a
    refusal also ends the rooms the request names, as `start_all` does for a later refusal."""
    try:
        ctx.check_admission(0)
    except ApiError as err:
        if ctx.settings.disaggregation_mode != "null" and ctx.pd is not None:
            room = req.bootstrap_room
            try:
                rooms = targets(ctx, req, len(room) if isinstance(room, list) else 1)
            except ApiError:
                rooms = None  # malformed fields: nothing to tell anyone
            if rooms:
                abort_rooms(ctx, rooms, err.code or "refused", err.message)
        raise


# ---- set-up ------------------------------------------------------------------------------------
# Environment read here until each becomes a `dsv4 serve` flag.
TRANSFER_THREADS_ENV = "DSV4_PD_TRANSFER_THREADS"  # prefill: rooms written at once (default 4)


def check_transport(settings: ServerSettings) -> None:
    """Before the model loads: what the transport needs of this host is there (the NPU's physical id
    for `ascend`, a valid protocol), and the PD environment parses. ValueError naming what is wrong."""
    from dsv4_engine.disagg.decode_reserve import reserved_tokens
    from dsv4_engine.disagg.mooncake import engine_device

    engine_device(settings.transfer_protocol, str(settings.device))
    transfer_threads()
    reserved_tokens()


def transfer_threads() -> int:
    value = os.environ.get(TRANSFER_THREADS_ENV, "4")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{TRANSFER_THREADS_ENV} must be an integer >= 1, got {value!r}")
    return int(value)


def transfer_host(settings: ServerSettings) -> str:
    """The transport's hostname: the pod IP when the operator sets POD_IP, else --host, else this host."""
    host = os.environ.get("POD_IP") or settings.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostbyname(socket.gethostname())
    return host


async def setup(ctx: ServerContext, engine: LLMEngine) -> None:
    """Build the role's half after the engine loaded: transport, fingerprint, bootstrap or receiver."""
    from dsv4_engine.disagg.checkpoint import checkpoint_digest
    from dsv4_engine.disagg.decode_reserve import reserved_tokens
    from dsv4_engine.disagg.fingerprint import layout_fingerprint
    from dsv4_engine.disagg.mooncake import create_transport

    s = ctx.settings
    digest = await asyncio.to_thread(checkpoint_digest, s.model)
    fingerprint = layout_fingerprint(engine.layout, engine.kv_pool.pd_state_components(), digest)
    ctx.fingerprint = fingerprint
    transport = ctx.transport = create_transport(transfer_host(s), s.transfer_protocol, str(s.device))
    staging = None
    if s.staging_mib:
        from dsv4_engine.memory.staging import StagingArena

        staging = StagingArena(s.staging_mib << 20, engine.kv_pool.device)
    # A parallel server: every other rank starts its own transport over its pools (disagg/lanes.py).
    links, endpoints = None, []
    if engine.workers is not None:
        from dsv4_engine.disagg.lanes import RankLinks

        links = RankLinks(engine.workers.links, engine.steps_sent)
        endpoints = await asyncio.to_thread(
            links.start, transfer_host(s), s.transfer_protocol, transfer_threads()
        )
    faults = None
    if test_hooks.enabled():
        from dsv4_engine.disagg.faults import FaultHooks

        faults = ctx.faults = FaultHooks()
        faults.install(engine.runner)
    assert ctx.bridge is not None
    if s.disaggregation_mode == "prefill":
        from dsv4_engine.disagg.bootstrap import create_bootstrap_app, serve_bootstrap
        from dsv4_engine.disagg.prefill import PrefillRooms

        rooms = ctx.prefill = PrefillRooms(
            engine, ctx.bridge, transport, asyncio.get_running_loop(), fingerprint=fingerprint,
            bootstrap_timeout=s.bootstrap_timeout, metrics=ctx.metrics, staging=staging, faults=faults,
            threads=transfer_threads(), links=links, endpoints=endpoints,
        )  # fmt: skip
        port = s.bootstrap_port or DEFAULT_BOOTSTRAP_PORT
        ctx.bootstrap_server = await serve_bootstrap(create_bootstrap_app(rooms), s.host, port)
        log.info("bootstrap endpoint on %s:%d, Mooncake sessions %s", s.host, port,
                 [transport.session_id] + [e.session for e in endpoints])  # fmt: skip
    else:
        from dsv4_engine.disagg.decode import DecodeReceiver

        bridge = ctx.bridge

        def may_queue() -> bool:
            """One more sequence may wait for pages: --max-waiting bounds these with the engine's."""
            if bridge.waiting() + ctx.pd_waiting() + 1 <= s.max_waiting:
                return True
            ctx.metrics.rejected.labels("queue_full").inc()
            return False

        receiver = ctx.decode = DecodeReceiver(
            engine, ctx.bridge, transport, fingerprint=fingerprint, waiting_timeout=s.waiting_timeout,
            heartbeat_interval=s.heartbeat_interval, heartbeat_failures=s.heartbeat_failures,
            quarantine=quarantine_seconds(dict(os.environ)), metrics=ctx.metrics, may_queue=may_queue,
            reserve_tokens=reserved_tokens(), staging=staging, faults=faults, endpoints=endpoints,
        )  # fmt: skip
        log.info("decode receiver %s, Mooncake sessions %s", receiver.decode_id,
                 [transport.session_id] + [e.session for e in endpoints])  # fmt: skip


async def shutdown(ctx: ServerContext) -> None:
    server = ctx.bootstrap_server
    if server is not None:
        server.should_exit = True
        await asyncio.wait({server.task}, timeout=5)
    if ctx.pd is not None:
        await ctx.pd.close()
    if ctx.transport is not None:
        ctx.transport.close()
