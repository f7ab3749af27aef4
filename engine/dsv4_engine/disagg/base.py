"""The contracts of PD: what each role's half gives the server, what it needs of the engine, and
what a transport backend does.

  server (server/pd.py) ──PrefillSide──▶ prefill.PrefillRooms ──Transport──▶ (the decode's memory)
  server (server/pd.py) ──DecodeSide───▶ decode.DecodeReceiver
  both halves ──EngineCalls──▶ the engine thread ──PdEngine──▶ pools, tables, scheduler

Data flows one way: the server hands a side each PD sequence and reads back a future or an
exception. A side calls the engine only on the engine thread, through `EngineCalls` or from the
step observer the engine calls after each step; the engine knows nothing of PD beyond that observer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:  # annotations only: importing the contracts pulls in neither torch nor the engine
    import torch
    from prometheus_client import Counter, Histogram

    from dsv4_engine.config import Dsv4Config
    from dsv4_engine.disagg.faults import Hold
    from dsv4_engine.disagg.protocol import PdTarget
    from dsv4_engine.disagg.transfer import Entries
    from dsv4_engine.memory import Dsv4MemoryLayout, Dsv4ReqToTokenPool, Dsv4TokenToKVPool, StateType
    from dsv4_engine.memory.allocator import Dsv4Allocator
    from dsv4_engine.sampler import TokenLogprobs
    from dsv4_engine.sampling_params import SamplingParams
    from dsv4_engine.scheduler import Scheduler, SchedulerOutput

T = TypeVar("T")

# Called on the engine thread after every step's forward and sampling: the step, and the token each
# sampled sequence got (request id -> token).
StepObserver = Callable[["SchedulerOutput", dict[str, int]], None]


class LateWrites(Protocol):
    """Entries a failed write abandoned at its deadline that the transport may still be moving: their
    sources must stay allocated, and their destinations may still change, until `ended()`."""

    def ended(self) -> bool:
        """True once every entry was reported done or failed, or its own transfer timeout plus a
        margin passed since it was submitted. Never blocks."""
        ...


class TransferError(RuntimeError):
    """A transport call failed (initialize, register or a write). `late` is set when some of the
    write's entries were abandoned still running (base.LateWrites)."""

    def __init__(self, message: str, late: LateWrites | None = None) -> None:
        super().__init__(message)
        self.late = late


class Transport(Protocol):
    """Copies bytes from this process's registered memory into a peer's (one backend per folder:
    mooncake/). Both sides register the same buffers in the same order; only the prefill writes."""

    @property
    def session_id(self) -> str:
        """What a peer names this process by in its writes."""
        ...

    def register(self, ptrs: list[int], lens: list[int]) -> None:
        """Make [ptr, ptr + len) regions writable by peers and readable as sources; registering a
        region twice is a no-op. Raises TransferError."""
        ...

    def write(self, peer_session: str, entries: Entries, *, hold: Hold | None = None) -> None:
        """Copy every entry into the peer's registered memory; returns once all have landed. On a
        failure it raises TransferError once every submitted entry has ended, except those still
        running at the deadline: those are the error's `late`, and their sources stay the caller's
        to keep until `late.ended()`. `hold` is a test hook (faults.Hold)."""
        ...

    def write_pipelined(
        self,
        peer_session: str,
        pieces: Iterable[tuple[Callable[[], object], Entries]],
        *,
        hold: Hold | None = None,
    ) -> None:
        """Each piece's prepare() (its pack) runs while the earlier pieces are on the wire, then its
        entries go. Returns, or raises TransferError, as write() does."""
        ...

    def close(self) -> None:
        """Unregister everything; no write may be in progress."""
        ...


class PdEngine(Protocol):
    """What disagg/ needs of the engine. Every method runs on the engine thread (EngineCalls, or
    the step observer); the pools' buffers and pointers are fixed, so any thread may read them, and
    a side may copy into pages only it holds (a reserved row before admission)."""

    kv_pool: Dsv4TokenToKVPool  # pd_state_components(), buffers_by_type(), device
    req_pool: Dsv4ReqToTokenPool  # one aux slot per request row
    layout: Dsv4MemoryLayout
    allocator: Dsv4Allocator  # rows pinned under a write (prefill), pages free and growth (decode)
    scheduler: Scheduler  # the running requests (decode admission's headroom)
    step_observers: list[StepObserver]
    config: Dsv4Config  # the model's (a transferred draft must be one of its token ids)

    def payloads(
        self, req_idx: int, seq_len: int, types: Collection[StateType] | None = None
    ) -> dict[StateType, list[int]]:
        """Page ids per state type of a request row: the same builder on both sides, so the lists
        pair up index by index."""
        ...

    def prealloc(self, prompt_len: int, *, poison: bool = False) -> tuple[int, dict[StateType, list[int]]]:
        """Decode: a request row and every page the prompt needs, before its state arrives; raises
        OutOfPages (nothing held) when the pools or rows are short."""
        ...

    def free_request(self, req_idx: int) -> None:
        """Decode: give back a pre-allocated row that never became a running request."""
        ...

    def draft_geometry(self) -> tuple[int, int, torch.dtype] | None:
        """(window, row width, dtype) of the MTP layer's window rows when this engine speculates."""
        ...

    def draft_window(self, req_idx: int, start: int, end: int) -> torch.Tensor:
        """Prefill: the MTP rows of positions [start, end) of a request row (its window)."""
        ...

    def admit_transferred(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        req_idx: int,
        first_token: int,
        generator_state: torch.Tensor | None,
        *,
        first_logprobs: TokenLogprobs | None = None,
        prompt_logprobs: list[TokenLogprobs] | None = None,
        cached_tokens: int = 0,
        drafts: list[int] | None = None,
        draft_window: tuple[int, torch.Tensor] | None = None,
    ) -> None:
        """Decode: the row's pages hold the request's state; run it from its first token."""
        ...

    def release_held(self, request_id: str) -> None:
        """Prefill: the request's transfer ended; free its pages (held since it finished)."""
        ...


class EngineCalls(Protocol):
    """The one way into the engine from the loop or another thread (server/bridge.EngineBridge)."""

    def call(self, fn: Callable[[PdEngine], object]) -> concurrent.futures.Future[Any]:
        """Run fn(engine) on the engine thread between steps; do not wait."""
        ...

    async def run(self, fn: Callable[[PdEngine], T]) -> T:
        """Run fn(engine) on the engine thread between steps and await its result."""
        ...


class PdMetrics(Protocol):
    """The PD series of server/metrics.ServerMetrics a side updates."""

    pd_failures: Counter  # {reason}
    pd_bytes: Counter  # {state_type}: sent (prefill) or received (decode)
    pd_writes: Counter  # {path}, prefill
    pd_rank_bytes: Counter  # {rank, peer_rank}: bytes each rank of a prefill wrote to each decode rank
    pd_transfer_seconds: Histogram
    pd_handshake_seconds: Histogram  # decode


class PdSide(Protocol):
    """What the server asks of a role's half, whichever role it is."""

    def depths(self) -> dict[str, int]:
        """Queue name -> depth (dsv4_pd_queue_depth{queue})."""
        ...

    def refuse(self, target: PdTarget, reason: str, message: str) -> None:
        """This server refused a request naming `target` before it reached this side (draining,
        queue full): end the room at the other side too, so that leg answers now rather than at its
        own bound. Best effort, never raises."""
        ...

    async def close(self) -> None:
        """At shutdown, once no request is served any more: stop threads, close connections."""
        ...


class PrefillSide(PdSide, Protocol):
    """The prefill server's half: rooms that pair its requests with decode servers' claims."""

    def open(
        self,
        target: PdTarget,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        start: Callable[[], None],
    ) -> asyncio.Future[None]:
        """This server's own request for `target.room`. `start` hands the prompt to the engine (as
        a request whose pages are held after it finishes); it is called on the loop once the
        decode server sent its destination pages, maybe before `open` returns. Returns the room's
        result: done when the transfer ended, or failed with a PdError (then the held pages are
        freed once no write can read them). Raises PdError when the room is already in use."""
        ...

    def cancel_request(self, request_id: str, reason: str, message: str) -> None:
        """The request's client left (or the server drains past its grace): fail its room."""
        ...

    def dead_sessions(self) -> list[str]:
        """Decode servers a write to failed: their rooms fail fast until they register again."""
        ...

    def late_writes(self) -> int:
        """Writes abandoned at their deadline whose entries Mooncake may still be moving."""
        ...


class DecodeSide(PdSide, Protocol):
    """The decode server's half: each PD sequence paired, received and admitted as running."""

    decode_id: str  # how prefill servers know this server's session

    @property
    def queued(self) -> int:
        """Sequences waiting for pages (bounded by --max-waiting with the engine's queue)."""
        ...

    async def receive(
        self, request_id: str, target: PdTarget, prompt_ids: list[int], params: SamplingParams
    ) -> None:
        """Bring the sequence's state over from `target` and admit it in the engine as
        `request_id`, running from its first token; raises PdError (pages already given back, or
        quarantined while a late write may land). Cancelling it aborts the room."""
        ...

    def pages_may_be_free(self) -> None:
        """On the loop after every engine step: sequences queued for pages may try again."""
        ...

    def paired(self) -> list[str]:
        """Addresses of the prefill bootstrap endpoints this server is paired with now."""
        ...
