"""`dsv4 serve`: one model, one process, uvicorn on the given host and port.

The checkpoint directory, the device and the engine's settings are checked before the port is
bound: a bad one exits 2 with one line naming the flag.

SIGTERM (or the first SIGINT) drains instead of stopping at once: /health and new requests get 503
while the listening socket stays open, in-flight requests finish (up to --grace-period, then they are
aborted), and the process exits 0. A second signal stops immediately.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from types import FrameType

import uvicorn

from dsv4_engine.server.app import create_app
from dsv4_engine.server.args import ServerSettings, parse
from dsv4_engine.server.preflight import SettingsError, check
from dsv4_engine.server.state import ServerContext

log = logging.getLogger("dsv4.server")


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose exit signal drains the app's requests before the server stops."""

    def __init__(self, config: uvicorn.Config, settings: ServerSettings, ctx: ServerContext) -> None:
        super().__init__(config)
        self.settings = settings
        self.ctx = ctx
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def startup(self, sockets: list | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's handler: it would re-raise the signal after shutdown (exit status -15).
        if self._draining or self._loop is None:
            log.warning("second signal %s: stopping now", signal.Signals(sig).name)
            self.should_exit = True
            self.force_exit = self._draining
            return
        self._draining = True
        log.info(
            "signal %s: draining (grace period %.1fs)", signal.Signals(sig).name, self.settings.grace_period
        )
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        try:
            await self.ctx.drain(self.settings.grace_period)
        finally:
            self.should_exit = True

    def fail(self, exc: BaseException) -> None:
        """The engine could not start: exit non-zero so the supervisor sees the failure."""
        self.exit_code = 1
        self.should_exit = True


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per PD control call otherwise


def main(argv: list[str]) -> int:
    settings = parse(argv)
    _configure_logging(settings.log_level)
    asked = settings.device
    try:
        settings = check(settings)
        if settings.disaggregation_mode != "null":
            from dsv4_engine.server.pd import check_transport

            check_transport(settings)  # a missing NPU id or bad PD setting, before the model loads
    except (SettingsError, ValueError) as exc:
        print(f"dsv4 serve: error: {exc}", file=sys.stderr)
        return 2
    log.info("device: %s%s", settings.device, " (from --device auto)" if asked == "auto" else "")
    holder: dict[str, DrainingServer] = {}
    app = create_app(settings, on_fatal=lambda exc: holder["server"].fail(exc))
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,  # ServingMiddleware logs each request with its x-request-id
        log_config=None,  # uvicorn's loggers go through the root handler configured above
        timeout_graceful_shutdown=5,
        lifespan="on",
    )
    server = DrainingServer(config, settings, app.state.ctx)
    holder["server"] = server
    server.run()
    log.info("server stopped (exit code %d)", server.exit_code)
    return server.exit_code
