"""Per-rank transfers of a parallel server: every rank runs its own Mooncake transport, rank 0 drives.

DSV4's state is replicated across TP ranks, so decode rank r can take a request's state straight
from prefill rank r mod P (SGLang pairs ranks the same way; one prefill rank per decode rank suffices
for replicated, MLA-like state). Each rank then moves its share over its own link (on A3 every NPU
has its own NIC) instead of everything funnelling through rank 0.

Rank 0 keeps every decision: scheduling, rooms, each job's entries (built from every rank's buffer
pointers, which the ranks report once, `RankLinks.start`). A rank other than 0 only executes writes
it is sent over its link (a pipe from rank 0, `ranks.Workers.links`), each once that rank has run
the step that filled the pages (`after`: the step messages it had handled), and reports each back:
done, failed, or failed with entries still moving (then again when those ended). Rank 0's transfer
thread waits for every rank's part of a job before the job counts as written, so the room's
answer, which the decode waits on before it decodes, comes only when every rank's write finished.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing.connection
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from dsv4_engine.disagg.base import TransferError, Transport
from dsv4_engine.disagg.transfer import Entries
from dsv4_engine.memory import Dsv4TokenToKVPool, StateType
from dsv4_engine.ranks import Progress

log = logging.getLogger("dsv4.pd.lanes")

Link = multiprocessing.connection.Connection
LATE_POLL_SECONDS = 0.01


@dataclass(frozen=True)
class RankEndpoint:
    """One rank's transport and the base pointers of its pools' PD buffers, per state type."""

    rank: int
    session: str
    ptrs: dict[StateType, list[int]]


class RemoteWrite:
    """Rank 0's view of one write a rank runs: done or failed, and whether entries may still move
    (base.LateWrites: ended() once the rank reported they did)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.reported = threading.Event()
        self.error: str | None = None
        self.late = False
        self.late_ended = threading.Event()

    def wait(self, timeout: float) -> None:
        """Until the rank reported; past `timeout` the write counts as failed with late entries."""
        if not self.reported.wait(timeout):
            self.error, self.late = f"rank {self.rank} did not report its write within {timeout:g}s", True

    def ended(self) -> bool:
        return not self.late or self.late_ended.is_set()


class AllEnded:
    """base.LateWrites over several lanes' late entries: ended once every one has."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts

    def ended(self) -> bool:
        return all(p.ended() for p in self.parts)


class RankLinks:
    """Rank 0's end of the links: asks each rank to start its transport, sends writes, reads reports."""

    def __init__(self, links: list[Link], sent: Any) -> None:
        self.links = {rank: link for rank, link in enumerate(links, start=1)}
        self.sent = sent  # () -> step messages rank 0 has broadcast so far
        self._locks = {rank: threading.Lock() for rank in self.links}
        self._ids = itertools.count()
        self._waiting: dict[int, RemoteWrite] = {}
        self._started: dict[int, tuple[Any, threading.Event]] = {}
        for rank, link in self.links.items():
            threading.Thread(
                target=self._read, args=(rank, link), name=f"dsv4-lane-{rank}", daemon=True
            ).start()

    def start(self, host: str, protocol: str, threads: int) -> list[RankEndpoint]:
        """Every other rank's transport, started with its pools registered (blocking, at set-up)."""
        for rank in self.links:
            self._started[rank] = (None, threading.Event())
            self._send(rank, ("start", host, protocol, threads))
        out = []
        for rank, (_, ready) in sorted(self._started.items()):
            if not ready.wait(120):
                raise TransferError(f"rank {rank} did not start its transport within 120s")
            answer = self._started[rank][0]
            if isinstance(answer, str):
                raise TransferError(f"rank {rank} could not start its transport: {answer}")
            out.append(answer)
        return out

    def write(self, rank: int, peer: str, entries: Entries, after: int) -> RemoteWrite:
        """Have `rank` write `entries` into `peer`'s memory once it ran `after` step messages."""
        job = next(self._ids)
        handle = self._waiting[job] = RemoteWrite(rank)
        self._send(rank, ("write", job, peer, entries.src, entries.dst, entries.lens, after))
        return handle

    def _send(self, rank: int, message: tuple[Any, ...]) -> None:
        with self._locks[rank]:
            self.links[rank].send(message)

    def _read(self, rank: int, link: Link) -> None:
        while True:
            try:
                kind, *rest = link.recv()
            except (EOFError, OSError):
                return  # the rank is gone: ranks.Workers fails the server
            if kind == "started":
                self._started[rank] = (rest[0], self._started[rank][1])
                self._started[rank][1].set()
            elif kind == "done":
                job, error, late = rest
                handle = self._waiting[job] if late else self._waiting.pop(job)
                handle.error, handle.late = error, late
                handle.reported.set()
            elif kind == "ended":
                self._waiting.pop(rest[0]).late_ended.set()


# ---- ranks 1..N-1 ---------------------------------------------------------------------------------
def serve(link: Link, kv: Dsv4TokenToKVPool, progress: Progress, rank: int, device: str) -> None:
    """A rank's lane server (its own thread): its transport, started when rank 0 asks, and the
    writes rank 0 sends, each on a thread of its own (at most rank 0's transfer threads at once)."""
    transport: Transport | None = None
    pool: ThreadPoolExecutor | None = None
    lock = threading.Lock()

    def reply(*message: Any) -> None:
        with lock:
            link.send(message)

    def write(job: int, peer: str, entries: Entries, after: int) -> None:
        assert transport is not None
        progress.wait(after)  # the pages hold this step's state only once this rank ran it
        try:
            transport.write(peer, entries)
        except Exception as exc:
            late = exc.late if isinstance(exc, TransferError) else None
            log.warning("rank %d: write of %d bytes to %s failed: %s", rank, entries.nbytes, peer, exc)
            reply("done", job, f"rank {rank}: {exc}", late is not None)
            while late is not None and not late.ended():
                time.sleep(LATE_POLL_SECONDS)
            if late is not None:
                reply("ended", job)
            return
        reply("done", job, None, False)

    while True:
        try:
            kind, *rest = link.recv()
        except (EOFError, OSError):
            return
        if kind == "start":
            host, protocol, threads = rest
            try:
                from dsv4_engine.disagg.mooncake import create_transport

                transport = create_transport(host, protocol, device)
                components = kv.pd_state_components()
                transport.register([p for c in components for p in c.data_ptrs],
                                   [n for c in components for n in c.data_lens])  # fmt: skip
                pool = ThreadPoolExecutor(threads, thread_name_prefix=f"dsv4-rank{rank}-transfer")
                ptrs = {c.state_type: c.data_ptrs for c in components}
                reply("started", RankEndpoint(rank, transport.session_id, ptrs))
                log.info("rank %d: Mooncake session %s", rank, transport.session_id)
            except Exception as exc:
                reply("started", f"{type(exc).__name__}: {exc}")
        elif kind == "write" and pool is not None:
            job, peer, src, dst, lens, after = rest
            pool.submit(write, job, peer, Entries(src, dst, lens), after)
