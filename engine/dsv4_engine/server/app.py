"""The FastAPI app: routes, error shapes, middleware, and loading the engine in the background.

The HTTP port answers from the first moment (503 on /health while loading) so that probes and the
router see a live process; the engine loads in a daemon thread (the one that will step it), then one
warm-up request runs through the whole serving path, and only then does /health answer 200.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from dsv4_engine.server import (
    openai_routes,
    prefix_peers,
    responses,
    sglang_routes,
    test_hooks,
    tokenizer_routes,
)
from dsv4_engine.server.args import ServerSettings
from dsv4_engine.server.bridge import EngineThread
from dsv4_engine.server.errors import install_handlers
from dsv4_engine.server.generation import GenSpec, Lease, outcomes, sampling_params, start
from dsv4_engine.server.metrics import CONTENT_TYPE
from dsv4_engine.server.middleware import ServingMiddleware
from dsv4_engine.server.prefix_file import PrefixCacheFile
from dsv4_engine.server.prefix_peers import PrefixPeers
from dsv4_engine.server.preflight import resolve_device
from dsv4_engine.server.state import Phase, ServerContext

log = logging.getLogger("dsv4.server")

EngineFactory = Callable[[], Any]
WARMUP_PROMPT = "Warm-up."
WARMUP_TOKENS = 2


def default_engine_factory(settings: ServerSettings) -> EngineFactory:
    def build() -> Any:
        from dsv4_engine.engine import LLMEngine

        device = resolve_device(settings.device)  # `auto` means the same here as in `dsv4 serve`
        service = None
        if settings.disaggregation_mode != "null":  # every rank transfers for itself
            from dsv4_engine.disagg.lanes import serve as service
        return LLMEngine(
            settings.model,
            dtype=settings.dtype,
            device=device,
            rank_service=service,
            **settings.engine_kwargs(),
        )

    return build


async def warm_up(ctx: ServerContext) -> None:
    """One short greedy request through the serving path (tokenizer, bridge, engine, detokenizer)."""
    ids = list(ctx.tokenizer.encode(WARMUP_PROMPT)) or [0]
    spec = GenSpec(temperature=0.0)
    handle = start(ctx, ids, sampling_params(spec, WARMUP_TOKENS), arrival=time.monotonic(), observe=False)
    lease = Lease(ctx, [handle], lambda: None)
    try:
        async with contextlib.aclosing(outcomes(ctx, handle, spec)) as items:
            async for _ in items:
                pass
    finally:
        lease.close()


async def _start_serving(
    ctx: ServerContext,
    factory: EngineFactory,
    on_fatal: Callable[[BaseException], None],
    prefix_cache: PrefixCacheFile | None,
) -> None:
    started = time.monotonic()
    try:
        thread = EngineThread()  # builds the engine, then steps it
        try:
            engine = await asyncio.wrap_future(thread.submit(factory))
            ctx.attach(engine, asyncio.get_running_loop(), thread)
        except BaseException:
            thread.close()  # after the step loop, if attach got to start it
            raise
        _stop_when_a_rank_dies(ctx, engine, on_fatal)
        if ctx.settings.disaggregation_mode != "null":
            from dsv4_engine.server import pd

            await pd.setup(ctx, engine)
        log.info("engine loaded in %.1fs; warming up", time.monotonic() - started)
        await warm_up(ctx)
        if prefix_cache is not None:
            await prefix_cache.restore()
        if ctx.peers is not None:
            await ctx.peers.start()
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        log.exception("engine failed to start")
        ctx.load_error = exc
        ctx.set_phase(Phase.DEAD)
        on_fatal(exc)
        return
    if ctx.phase == Phase.LOADING:
        ctx.set_phase(Phase.READY)
        log.info("ready to serve %s after %.1fs", ctx.model_name, time.monotonic() - started)
        if prefix_cache is not None:
            prefix_cache.start_saving()


def _stop_when_a_rank_dies(
    ctx: ServerContext, engine: Any, on_fatal: Callable[[BaseException], None]
) -> None:
    """A parallel server whose rank died cannot serve: /health fails at once and the process exits 1
    (ranks.Workers logs which rank and how)."""
    workers = getattr(engine, "workers", None)
    if workers is None:
        return
    loop = asyncio.get_running_loop()

    def failed(message: str) -> None:  # on the event loop
        ctx.set_phase(Phase.DEAD)
        on_fatal(RuntimeError(message))

    workers.on_failure = lambda message: loop.call_soon_threadsafe(failed, message)


def metrics_app(render: Callable[[], Response]) -> FastAPI:
    """The --metrics-port listener's app: GET /metrics and nothing else (404 for every other path),
    without the API key, so a NetworkPolicy can let a scraper in without opening the API to it."""
    app = FastAPI(title="dsv4-metrics", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/metrics")
    async def metrics() -> Response:
        return render()

    return app


class SideServer(uvicorn.Server):
    """uvicorn on the API server's loop; signals stay with the API server, which stops both."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        pass


async def serve_side_app(app: FastAPI, host: str, port: int) -> SideServer:
    """Start `app` on host:port on this loop; returns once it listens (a bind error raises here)."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            lifespan="off", log_config=None)  # fmt: skip
    server = SideServer(config)
    # Bound here: uvicorn answers a bind error with SystemExit, which asyncio lets out of the loop.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
            raise OSError(f"listener on {host}:{port} stopped before it started")
        await asyncio.sleep(0.01)
    server.task = task  # type: ignore[attr-defined]
    return server


async def stop_side_app(server: SideServer) -> None:
    server.should_exit = True
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await server.task  # type: ignore[attr-defined]


def create_app(
    settings: ServerSettings,
    engine_factory: EngineFactory | None = None,
    *,
    on_fatal: Callable[[BaseException], None] = lambda exc: None,
) -> FastAPI:
    ctx = ServerContext(settings)
    factory = engine_factory or default_engine_factory(settings)
    prefix_cache = PrefixCacheFile(ctx) if settings.prefix_cache_dir is not None else None
    if settings.prefix_cache_peers:
        ctx.peers = PrefixPeers(ctx, settings.prefix_cache_peers, settings.prefix_cache_peer_timeout)

    def render_metrics() -> Response:
        if ctx.pd is not None:
            for queue, depth in ctx.pd.depths().items():
                ctx.metrics.pd_queue.labels(queue).set(depth)
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        side = None
        if settings.metrics_port is not None:  # bound before the engine loads: scrapes see it load
            side = await serve_side_app(metrics_app(render_metrics), settings.host, settings.metrics_port)
        loader = asyncio.create_task(_start_serving(ctx, factory, on_fatal, prefix_cache))
        app.state.loader = loader
        app.state.metrics_server = side
        try:
            yield
        finally:
            if side is not None:
                await stop_side_app(side)
            loader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await loader
            if prefix_cache is not None:
                await prefix_cache.close(drained=ctx.phase == Phase.DRAINING)
            if ctx.peers is not None:
                await ctx.peers.close()
            if settings.disaggregation_mode != "null":
                from dsv4_engine.server import pd

                with contextlib.suppress(Exception):
                    await pd.shutdown(ctx)
            ctx.close()

    app = FastAPI(title="dsv4", version="1", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    install_handlers(app)
    app.add_middleware(ServingMiddleware, api_key=settings.api_key)
    app.include_router(openai_routes.router)
    app.include_router(responses.router)
    app.include_router(sglang_routes.router)
    app.include_router(tokenizer_routes.router)
    app.include_router(prefix_peers.router)
    if test_hooks.enabled():
        app.include_router(test_hooks.router)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if ctx.bridge is not None and ctx.bridge.dead is not None:
            ctx.set_phase(Phase.DEAD)
        status = 200 if ctx.phase == Phase.READY else 503
        return JSONResponse({"status": ctx.phase.value}, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return render_metrics()

    def _model_card() -> dict[str, Any]:
        return {
            "id": ctx.model_name,
            "object": "model",
            "created": int(ctx.started),
            "owned_by": "dsv4",
            "root": settings.model,
            "max_model_len": ctx.facts.max_model_len if ctx.facts else None,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        if model != ctx.model_name:
            raise ctx.model_not_found(model)
        return _model_card()

    return app
