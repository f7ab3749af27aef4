"""Drives the single-threaded engine from one background thread; talks to asyncio without blocking it.

The event loop never calls the engine. It appends commands (add, abort) to a deque and notifies a
condition; the engine thread applies them between steps, runs `step()` while there is work, and hands
each step's outputs back with one `loop.call_soon_threadsafe`. An idle engine thread sleeps on the
condition. If `step()` raises, the engine is considered dead: every open request fails and the server
reports unhealthy so that it gets restarted.

The thread that steps the engine is the one that built it (`EngineThread`): torch's OpenMP workers
belong to the thread that first runs a parallel op, so a second computing thread is a second pool, and
with more pool threads than cores libgomp stops its workers spinning between ops. Loading on one
thread and stepping on another (or computing on the main thread first) made a CPU prefill step ~1.5x
slower (a 410-token chunk on 2.4k cached tokens, demo model, 2 cores: 70 ms against 47 ms).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("dsv4.server.bridge")


@dataclass
class TokenEvent:
    """New tokens for one request, as delivered to the event loop."""

    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    time: float
    logprobs: list[Any] | None = None  # the engine's StepOutput fields, when the request asked
    prompt_logprobs: list[Any] | None = None


@dataclass
class ErrorEvent:
    error: BaseException
    kind: str = "refused"  # "refused": add_request raised; "dead": a step raised; "shutdown"


@dataclass
class RequestHandle:
    """Loop-side end of one engine request."""

    request_id: str
    created: float
    queue: asyncio.Queue[TokenEvent | ErrorEvent] = field(default_factory=asyncio.Queue)
    done: bool = False  # the engine no longer holds the request (finished, aborted or failed)
    num_tokens: int = 0
    prompt_len: int = 0
    cached_tokens: int = 0  # prompt tokens the engine resumed from its prefix cache (usage's figure)
    observe: bool = True  # feed the latency histograms (not for warm-up and health probes)
    first_token_time: float | None = None
    last_token_time: float | None = None
    # PD: what `abort` does instead of (or before) aborting in the engine: a prefill fails its room
    # (its pages are freed only after the transfer), a decode cancels the transfer it waits for.
    on_abort: Callable[[], None] | None = None
    pd_wait: asyncio.Future[None] | None = None  # PD prefill: the response ends once this resolves


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: Any
    hold: bool = False


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    future: concurrent.futures.Future[Any]


class EngineThread:
    """One daemon thread running the calls submitted to it in order: the engine's load, then its
    step loop (`EngineBridge.start`). A daemon, so a stuck load never blocks process exit."""

    def __init__(self, name: str = "dsv4-engine") -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._calls.put((fn, future))
        return future

    def close(self) -> None:
        """End the thread once the calls submitted so far have run."""
        self._calls.put(None)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            fn, future = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)


class EngineBridge:
    def __init__(
        self,
        engine: Any,
        *,
        on_tokens: Callable[[RequestHandle, TokenEvent], None] | None = None,
        on_step: Callable[[float], None] | None = None,
    ) -> None:
        self.engine = engine
        self._on_tokens = on_tokens
        self._on_step = on_step  # called on the engine thread with each step's duration
        self._cond = threading.Condition()
        self._commands: deque[_Add | _Abort | _Call] = deque()
        self._pending_adds = 0
        self._handles: dict[str, RequestHandle] = {}
        self._stop = False
        self._running: concurrent.futures.Future[None] | None = None  # the step loop, once started
        self._loop: asyncio.AbstractEventLoop | None = None
        self._snapshot: dict[str, float] = {}
        self.dead: BaseException | None = None
        self.steps = 0
        # Test hook (server/test_hooks.py): while paused the thread applies commands but runs no step,
        # so a test can hold a request in flight for as long as it needs, independent of speed.
        self._paused = False
        self._idle_paused = threading.Event()

    # ---- loop side -------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop, thread: EngineThread | None = None) -> None:
        """Run the step loop on `thread`, the one that built the engine (default: a new thread)."""
        self._loop = loop
        self._refresh_snapshot()
        thread = thread or EngineThread()
        self._running = thread.submit(self._run)
        thread.close()  # nothing runs on it after the loop

    def add(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: Any,
        *,
        arrival: float | None = None,
        hold: bool = False,
        handle: RequestHandle | None = None,
    ) -> RequestHandle:
        """Queue a request; its outputs arrive on the returned handle's queue (`handle`: one made by
        `open` earlier, for a PD request that reaches the engine later)."""
        if handle is None:
            handle = self.open(request_id, arrival)
        if self.dead is not None:
            raise RuntimeError("engine is dead") from self.dead
        with self._cond:
            self._commands.append(_Add(request_id, prompt_ids, params, hold))
            self._pending_adds += 1
            self._cond.notify()
        return handle

    def open(self, request_id: str, arrival: float | None = None) -> RequestHandle:
        """A handle that receives the engine's outputs for request_id, before the request exists."""
        if self.dead is not None:
            raise RuntimeError("engine is dead") from self.dead
        handle = RequestHandle(request_id=request_id, created=arrival or time.monotonic())
        self._handles[request_id] = handle
        return handle

    def forget(self, handle: RequestHandle) -> None:
        """Drop a handle whose request never reached the engine."""
        handle.done = True
        self._handles.pop(handle.request_id, None)

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future[Any]:
        """Run fn(engine) on the engine thread between steps; its result or exception on the future."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if self.dead is not None:
            future.set_exception(RuntimeError("engine is dead"))
            return future
        with self._cond:
            self._commands.append(_Call(fn, future))
            self._cond.notify()
        return future

    async def run(self, fn: Callable[[Any], Any]) -> Any:
        return await asyncio.wrap_future(self.call(fn))

    def abort(self, handle: RequestHandle) -> None:
        """Release the request in the engine (frees its pages). Safe to call more than once."""
        # PD's hook runs even for a request the engine already ended (refused, failed): a prefill
        # room must still fail so its decode side stops waiting. It runs once.
        on_abort, handle.on_abort = handle.on_abort, None
        if on_abort is not None:
            on_abort()
        if handle.done:
            return
        handle.done = True
        self._handles.pop(handle.request_id, None)
        with self._cond:
            self._commands.append(_Abort(handle.request_id))
            self._cond.notify()

    def open_handles(self) -> list[RequestHandle]:
        return list(self._handles.values())

    def waiting(self) -> int:
        """Requests not yet running: queued here plus waiting in the engine (as of its last step)."""
        with self._cond:
            return self._pending_adds + int(self._snapshot.get("num_waiting", 0))

    def metrics(self) -> dict[str, float]:
        return self._snapshot

    def stop(self, timeout: float = 10.0) -> None:
        """Abort every open request (so the engine's pools are whole again) and end the thread."""
        for handle in self.open_handles():
            self.abort(handle)
            handle.queue.put_nowait(ErrorEvent(RuntimeError("server is shutting down"), "shutdown"))
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._running is not None:
            concurrent.futures.wait([self._running], timeout)

    def pause(self, timeout: float = 60.0) -> bool:
        """Stop stepping after the current step; True once the engine thread is between steps."""
        with self._cond:
            self._paused = True
            self._idle_paused.clear()
            self._cond.notify()
        return self._idle_paused.wait(timeout)

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify()

    def _deliver(self, outputs: list[Any], now: float) -> None:
        for out in outputs:
            handle = self._handles.get(out.request_id)
            if handle is None:
                continue  # aborted by us, or the warm-up of another bridge
            event = TokenEvent(
                list(out.new_token_ids),
                bool(out.finished),
                out.finish_reason,
                now,
                getattr(out, "logprobs", None),  # engines without logprobs (tests' fakes) lack them
                getattr(out, "prompt_logprobs", None),
            )
            # Engines without a prefix cache (tests' fakes) lack the field.
            handle.cached_tokens = getattr(out, "cached_tokens", 0)
            if event.finished:
                handle.done = True
                del self._handles[out.request_id]
            if self._on_tokens is not None and event.token_ids:
                self._on_tokens(handle, event)
            handle.num_tokens += len(event.token_ids)
            if event.token_ids:
                handle.first_token_time = handle.first_token_time or now
                handle.last_token_time = now
            handle.queue.put_nowait(event)

    def _fail(self, request_id: str, error: BaseException) -> None:
        handle = self._handles.pop(request_id, None)
        if handle is not None:
            handle.done = True
            handle.queue.put_nowait(ErrorEvent(error))

    def _fail_all(self, error: BaseException) -> None:
        for handle in list(self._handles.values()):
            handle.done = True
            handle.queue.put_nowait(ErrorEvent(error, "dead"))
        self._handles.clear()

    # ---- engine thread ---------------------------------------------------------------------
    def _refresh_snapshot(self) -> None:
        try:
            self._snapshot = dict(self.engine.metrics())
        except Exception:  # metrics are best effort; never kill serving over them
            log.exception("engine.metrics() failed")

    def _apply(self, cmd: _Add | _Abort | _Call) -> None:
        engine = self.engine
        if isinstance(cmd, _Call):
            try:
                result = cmd.fn(engine)
            except Exception as exc:
                cmd.future.set_exception(exc)
            else:
                # A call may change what metrics report (flush_cache frees pages): a scrape made once
                # the caller has its answer must see that.
                self._refresh_snapshot()
                cmd.future.set_result(result)
        elif isinstance(cmd, _Add):
            try:
                if cmd.hold:
                    engine.add_request(cmd.prompt_ids, cmd.params, request_id=cmd.request_id, hold=True)
                else:
                    engine.add_request(cmd.prompt_ids, cmd.params, request_id=cmd.request_id)
            except Exception as exc:  # a request the engine refuses fails alone
                self._post(self._fail, cmd.request_id, exc)
        else:
            try:
                engine.abort_request(cmd.request_id)
            except Exception:  # already finished inside the engine: nothing to free
                log.debug("abort of %s ignored", cmd.request_id, exc_info=True)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed under us at shutdown; nobody is listening any more
            log.debug("event loop closed; dropped %s", getattr(fn, "__name__", fn))

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not self._stop and not self._commands and (self._paused or not engine.has_unfinished()):
                    if self._paused:
                        self._idle_paused.set()
                    self._cond.wait()
                # Apply under the lock so waiting() never misses a request between here and the engine.
                while self._commands:
                    cmd = self._commands.popleft()
                    if isinstance(cmd, _Add):
                        self._pending_adds -= 1
                        if self._stop:
                            continue  # its handle was already failed by stop()
                    self._apply(cmd)
                self._refresh_snapshot()
                if self._stop:
                    return
                if self._paused:
                    self._idle_paused.set()
                    continue
            if not engine.has_unfinished():
                continue
            started = time.perf_counter()
            try:
                outputs = engine.step()
            except BaseException as exc:
                log.exception("engine step failed; the engine is now unusable")
                self.dead = exc
                with self._cond:
                    for cmd in self._commands:
                        if isinstance(cmd, _Call):
                            cmd.future.set_exception(RuntimeError("engine is dead"))
                    self._commands.clear()
                self._post(self._fail_all, exc)
                return
            self.steps += 1
            if self._on_step is not None:
                self._on_step(time.perf_counter() - started)
            self._refresh_snapshot()
            if outputs:
                self._post(self._deliver, outputs, time.monotonic())
