"""What the request handlers share: the engine bridge, tokenizer, model facts, and the lifecycle.

Phases: loading -> ready -> draining (after SIGTERM) -> stopped; `dead` if the engine failed. Only
`ready` admits requests; everything else answers 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from dsv4_engine.server.args import ServerSettings
from dsv4_engine.server.bridge import EngineBridge, EngineThread, RequestHandle, TokenEvent
from dsv4_engine.server.errors import ApiError, unavailable
from dsv4_engine.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from dsv4_engine.disagg.base import DecodeSide, PdSide, PrefillSide, Transport
    from dsv4_engine.disagg.bootstrap import BootstrapServer
    from dsv4_engine.disagg.faults import FaultHooks
    from dsv4_engine.server.prefix_peers import PrefixPeers

log = logging.getLogger("dsv4.server")


ROUTER_DEFAULT_MODEL = "unknown"


class Phase(StrEnum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    DEAD = "dead"


@dataclass
class ModelFacts:
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    model_type: str
    architectures: list[str]


def model_facts(engine: Any) -> ModelFacts:
    config = engine.config
    tokenizer = engine.tokenizer
    eos = getattr(engine, "eos_token_ids", None) or getattr(config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else sorted(eos or [])
    vocab = int(getattr(config, "vocab_size", 0) or len(tokenizer))
    return ModelFacts(
        max_model_len=int(engine.max_model_len),
        vocab_size=vocab,
        eos_token_ids=eos_ids,
        model_type=str(getattr(config, "model_type", "deepseek_v4")),
        architectures=list(getattr(config, "architectures", None) or ["DeepseekV4ForCausalLM"]),
    )


class ServerContext:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.phase = Phase.LOADING
        self.engine: Any = None
        self.tokenizer: Any = None
        self.facts: ModelFacts | None = None
        self.bridge: EngineBridge | None = None
        mode = settings.disaggregation_mode
        self.metrics = ServerMetrics(
            self._engine_snapshot,
            model_name=settings.model_name,
            role="colocated" if mode == "null" else mode,
        )
        self.started = time.time()
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.load_error: BaseException | None = None
        # The layout fingerprint: PD's setup computes it, or the first prefix-cache file or peer
        # that needs it (prefix_file.server_fingerprint).
        self.fingerprint: dict[str, Any] | None = None
        # --prefix-cache-peers: the servers whose caches this one fetches from (prefix_peers.py).
        self.peers: PrefixPeers | None = None
        # PD (server/pd.py sets these up): the role's half of the protocol (one of the two, by
        # --disaggregation-mode), the transport, the prefill's bootstrap endpoint, and the fault
        # hooks (DSV4_TEST_HOOKS=1 only).
        self.prefill: PrefillSide | None = None
        self.decode: DecodeSide | None = None
        self.transport: Transport | None = None
        self.bootstrap_server: BootstrapServer | None = None
        self.faults: FaultHooks | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- wiring ----------------------------------------------------------------------------
    def _engine_snapshot(self) -> dict[str, float]:
        return self.bridge.metrics() if self.bridge is not None else {}

    def attach(
        self, engine: Any, loop: asyncio.AbstractEventLoop, thread: EngineThread | None = None
    ) -> None:
        """Serve `engine`, stepping it on `thread`: the one that built it (bridge.py says why)."""
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.facts = model_facts(engine)
        self.metrics.prewarm.set(float(getattr(engine, "prewarm_seconds", 0.0)))
        self.bridge = EngineBridge(engine, on_tokens=self._on_tokens, on_step=self._on_step)
        self._loop = loop
        self.bridge.start(loop, thread)

    @property
    def pd(self) -> PdSide | None:
        """The role's half of PD, whichever role this server has (None when colocated or loading)."""
        return self.prefill if self.prefill is not None else self.decode

    def _on_step(self, seconds: float) -> None:  # engine thread
        self.metrics.step.observe(seconds)
        decode = self.decode
        if decode is not None:
            with contextlib.suppress(RuntimeError, AttributeError):  # the loop closed at shutdown
                self._loop.call_soon_threadsafe(decode.pages_may_be_free)  # type: ignore[union-attr]

    def pd_waiting(self) -> int:
        """Decode: sequences waiting for pages before their transfer (bounded by --max-waiting)."""
        return self.decode.queued if self.decode is not None else 0

    def _on_tokens(self, handle: RequestHandle, event: TokenEvent) -> None:
        if not handle.observe:
            return
        if handle.first_token_time is None:
            self.metrics.ttft.observe(event.time - handle.created)
        elif handle.last_token_time is not None:
            gap = (event.time - handle.last_token_time) / len(event.token_ids)
            for _ in event.token_ids:
                self.metrics.itl.observe(gap)

    def set_phase(self, phase: Phase) -> None:
        if self.phase != phase:
            log.info("server phase: %s -> %s", self.phase, phase)
        self.phase = phase
        self.metrics.ready.set(1 if phase == Phase.READY else 0)

    @property
    def model_name(self) -> str:
        return self.settings.model_name

    # ---- admission ---------------------------------------------------------------------------
    def check_admission(self, n: int = 1) -> None:
        """Raise the 503 a client should see if the server cannot take n more requests now."""
        if self.bridge is not None and self.bridge.dead is not None and self.phase != Phase.DEAD:
            self.set_phase(Phase.DEAD)
        if self.phase != Phase.READY:
            self.metrics.rejected.labels(self.phase.value).inc()
            messages = {
                Phase.LOADING: ("the model is still loading", 5),
                Phase.DRAINING: ("the server is shutting down", 1),
                Phase.STOPPED: ("the server is shutting down", 1),
                Phase.DEAD: ("the engine failed; the server must be restarted", 5),
            }
            message, retry = messages[self.phase]
            raise unavailable(message, retry_after=retry, code=f"server_{self.phase.value}")
        assert self.bridge is not None
        if self.bridge.waiting() + self.pd_waiting() + n > self.settings.max_waiting:
            self.metrics.rejected.labels("queue_full").inc()
            raise unavailable(
                f"too many requests waiting (limit {self.settings.max_waiting}); retry later",
                retry_after=1,
                code="queue_full",
            )

    def require_ready(self) -> None:
        """Raise the 503 of a server that is not serving (loading, draining, stopped or dead), for
        the routes that use the engine without admitting a request."""
        if self.phase != Phase.READY:
            raise unavailable(f"server is {self.phase.value}", code=f"server_{self.phase.value}")

    async def run_engine(self, fn: Callable[[Any], Any]) -> Any:
        """fn(engine) on the engine thread between steps, on a ready server; a dead engine is the
        client's 503."""
        assert self.bridge is not None
        try:
            return await self.bridge.run(fn)
        except RuntimeError as exc:  # the bridge's "engine is dead", or fn's own error
            if self.bridge.dead is None:
                raise
            raise unavailable("the engine failed; the server must be restarted", retry_after=5) from exc

    def require_model(self, name: str | None) -> None:
        # sglang-router fills in "unknown" when the client sent no model: that means "the default".
        if name is not None and name != self.model_name and name != ROUTER_DEFAULT_MODEL:
            raise self.model_not_found(name)

    def model_not_found(self, name: str) -> ApiError:
        return ApiError(
            404,
            f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
            param="model",
            code="model_not_found",
        )

    def enter(self) -> Callable[[], None]:
        """Count a request as in flight; returns an idempotent release (drain waits for zero)."""
        self.inflight += 1
        self.metrics.inflight.set(self.inflight)
        self._idle.clear()
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            self.inflight -= 1
            self.metrics.inflight.set(self.inflight)
            if self.inflight == 0:
                self._idle.set()

        return release

    # ---- shutdown ----------------------------------------------------------------------------
    async def drain(self, grace: float) -> None:
        """Stop admitting, let in-flight requests finish for up to `grace` seconds, abort the rest."""
        if self.phase in (Phase.READY, Phase.LOADING):
            self.set_phase(Phase.DRAINING)
        log.info("draining: %d request(s) in flight, grace period %.1fs", self.inflight, grace)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=grace)
            log.info("drained: all in-flight requests finished")
        except TimeoutError:
            log.warning("grace period over: aborting %d request(s)", self.inflight)
            if self.bridge is not None:
                for handle in self.bridge.open_handles():
                    self.bridge.abort(handle)
                    handle.queue.put_nowait(
                        TokenEvent([], True, "abort", time.monotonic())  # ends the waiting handler
                    )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout=5.0)

    def close(self) -> None:
        self.set_phase(Phase.STOPPED)
        if self.bridge is not None:
            self.bridge.stop()
        close = getattr(self.engine, "close", None)  # a parallel engine stops its other ranks
        if close is not None:
            close()
