"""The Mooncake backend's transport: one TransferEngine, its registered memory, and writes into a
peer's registered memory, each entry submitted as its own batch and polled.

Mooncake is imported when a transport is created, never by importing this module: its NPU and GPU
builds differ, and a server that only plans (or a test) must not need either.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from dsv4_engine.disagg.base import TransferError
from dsv4_engine.disagg.mooncake.config import (
    LATE_MARGIN_SECONDS,
    apply_env_defaults,
    session_host,
    transfer_timeout_s,
)

if TYPE_CHECKING:
    from dsv4_engine.disagg.faults import Hold
    from dsv4_engine.disagg.transfer import Entries

log = logging.getLogger("dsv4.pd.mooncake")

# Entries in flight at once (MooncakeTransport.write waits for each group of this many). The TCP
# transport fails entries beyond the per-peer queued + pending limits (1024 + 1024 unless raised,
# "queue-full", rc -1), and the part it admitted keeps the peer's queue full for ~1 s
# (MC_TCP_ADMISSION_TIMEOUT_MS), failing the writes after it too; 1024 fits even Mooncake's own
# limits. Entries cost ~10-40 us each whatever their size, so groups of 1024 cost nothing measurable
# over one big group (64 per group: ~3% slower).
DEFAULT_MAX_ENTRIES = 1024

# How a write waits. Mooncake's own waits (batch_transfer_sync_write, get_batch_transfer_status)
# spin on the batch's status without yielding: on 2 shared cores that spinning thread takes a core
# from the two TCP threads (sender's and receiver's) that do the copying. So each entry is submitted
# as its own batch (transfer_submit_write) and polled (transfer_check_status, which never blocks),
# sleeping between polls. bench/pd_transfer.py, 2 cores, one 3.92 MiB entry, interleaved: quiet,
# 1.05-1.23 ms polled against 1.21-1.46 ms synchronous (p90 1.7 against 3.0 ms); with another job
# on the machine, 2.0 against 3.9 ms (the sync caller burnt 2.1 ms of CPU, the poller 0.14).
POLL_SECONDS = 50e-6  # ~0.1 ms between polls with Linux's 50 us timer slack; a 4 KiB write ~70 us
# An entry still pending after this long is polled every SLOW_POLL_SECONDS: a stalled peer then
# costs its writer thread ~0.1% of a core instead of ~10%, and a write over 10 ms 1 ms at most.
SLOW_AFTER_SECONDS = 10e-3
SLOW_POLL_SECONDS = 1e-3
# A gap this long between two polls means this process was not running: it does not count against
# the deadline (a prefill stopped mid-write must still land its write once it resumes).
STALL_SECONDS = 0.5


def _status(engine: Any, batch: int | Held) -> int:
    return engine.transfer_check_status(batch) if type(batch) is int else batch.status()


class Held:
    """faults.Hold inside the transport: an entry kept from Mooncake until the test releases it, and
    meanwhile reported as still on the wire, which is what a stalled peer looks like to the writer."""

    def __init__(self, engine: Any, peer: str, src: int, dst: int, n: int, hold: Hold) -> None:
        self.engine, self.peer, self.src, self.dst, self.n, self.hold = engine, peer, src, dst, n, hold
        self.batch = 0
        hold.reached.set()

    def status(self) -> int:
        if not self.batch:
            if not self.hold.release.is_set():
                return 0
            self.batch = self.engine.transfer_submit_write(self.peer, self.src, self.dst, self.n)
            self.hold.submitted_at = time.monotonic()
            if not self.batch:
                self.hold.ended.set()
                return -1
        status = int(self.engine.transfer_check_status(self.batch))
        if status != 0:
            self.hold.ended.set()
        return status


class Pending:
    """One submitted entry: its Mooncake batch (or a held one), bytes, and when Mooncake got it."""

    __slots__ = ("batch", "n", "submitted")

    def __init__(self, batch: int | Held, n: int, submitted: float | None) -> None:
        self.batch, self.n, self.submitted = batch, n, submitted

    def since(self) -> float | None:
        """When Mooncake got it (a held entry: once released), or None while it has not."""
        if type(self.batch) is int:
            return self.submitted
        return self.batch.hold.submitted_at


class LateEntries:
    """Entries a write abandoned at its deadline (base.LateWrites): Mooncake may still move them, so
    their sources stay allocated (and their destinations may still change) until each was reported
    done or failed, or its own transfer timeout plus LATE_MARGIN_SECONDS passed since Mooncake got
    it. Time this process did not run does not count (STALL_SECONDS), as for the write itself."""

    def __init__(self, engine: Any, pending: list[Pending], timeout_s: float) -> None:
        self.engine, self.pending, self.timeout_s = engine, pending, timeout_s
        self._last = time.monotonic()
        self._stalled = 0.0

    def __len__(self) -> int:
        return len(self.pending)

    def ended(self) -> bool:
        now = time.monotonic()
        if now - self._last > STALL_SECONDS:
            self._stalled += now - self._last
        self._last = now
        left = []
        for p in self.pending:
            if _status(self.engine, p.batch) != 0:
                continue  # done or failed: Mooncake freed it
            since = p.since()
            bound = self.timeout_s + LATE_MARGIN_SECONDS + p.n * 1e-9 + self._stalled
            if since is not None and now - since > bound:
                log.warning("a late entry of %d bytes still pending %.0fs after it was submitted; "
                            "giving its source back", p.n, now - since)  # fmt: skip
                continue
            left.append(p)
        self.pending = left
        return not left


class _Flight:
    """Entries submitted one per Mooncake batch, waited for by polling (see POLL_SECONDS)."""

    def __init__(self, engine: Any, peer_session: str, timeout_s: float, hold: Hold | None = None) -> None:
        self.engine, self.peer, self.timeout_s = engine, peer_session, timeout_s
        self.hold = hold  # test hook: the first entry is held (Held)
        self.pending: deque[Pending] = deque()  # in submit order
        self.late: list[Pending] = []  # abandoned at the deadline while still running
        self.submitted = self.failed = self.refused = 0

    @property
    def rc(self) -> int:
        """0: every entry landed; -1: one failed or was refused (as batch_transfer_sync_write reports
        either); -2: one had not ended by the deadline."""
        return -1 if self.failed or self.refused else (-2 if self.late else 0)

    def submit(self, entries: Entries, max_in_flight: int) -> bool:
        """Submit every entry, first waiting for the oldest whenever max_in_flight are pending; False
        once one is refused (the rest are not submitted) or has failed."""
        for src, dst, n in zip(entries.src, entries.dst, entries.lens, strict=True):
            if len(self.pending) >= max_in_flight:
                self.wait(max_in_flight - 1)
            if self.rc:
                return False
            if self.hold is not None:
                batch: int | Held = Held(self.engine, self.peer, src, dst, n, self.hold)
                self.hold = None
            else:
                batch = self.engine.transfer_submit_write(self.peer, src, dst, n)
                if not batch:  # 0: refused (peer unknown or unreachable)
                    self.refused += 1
                    return False
            self.pending.append(Pending(batch, n, time.monotonic()))
            self.submitted += 1
        return True

    def wait(self, leave: int = 0) -> None:
        """Until at most `leave` entries are pending (oldest first: the lanes serve them in order).
        Past the deadline the rest are abandoned to `late`, never freed: Mooncake may still read
        their sources, and freeing a batch it still uses is what its own timeout does wrong."""
        last = head_since = time.monotonic()
        deadline = last + self.timeout_s + sum(p.n for p in self.pending) * 1e-9
        while len(self.pending) > leave:
            status = _status(self.engine, self.pending[0].batch)
            if status == 0:  # still on the wire
                now = time.monotonic()
                if now - last > STALL_SECONDS:
                    # This process did not run meanwhile (stopped, as SIGSTOP does, or starved): the
                    # peer is not to blame for that time, and the TCP threads that were stopped with
                    # us need a moment to move the bytes. Only time spent waiting counts.
                    deadline += now - last
                last = now
                if now > deadline:
                    self._abandon()
                    return
                time.sleep(POLL_SECONDS if now - head_since < SLOW_AFTER_SECONDS else SLOW_POLL_SECONDS)
                continue
            self.pending.popleft()  # 1 or -1: ended, its batch freed by Mooncake
            self.failed += status != 1
            head_since = time.monotonic()

    def _abandon(self) -> None:
        """One last look at every pending entry (a later one may have failed: that is the error to
        report); those still running become `late`."""
        for p in self.pending:
            status = _status(self.engine, p.batch)
            self.failed += status not in (0, 1)
            if status == 0:
                self.late.append(p)
        self.pending.clear()

    def error(self, message: str) -> TransferError:
        late = LateEntries(self.engine, self.late, self.timeout_s) if self.late else None
        return TransferError(message, late)


def _detail(flight: _Flight) -> str:
    parts = [f"{n} {what}" for n, what in ((flight.failed, "failed"), (flight.refused, "refused at submit"),
             (len(flight.late), "still running at the deadline")) if n]  # fmt: skip
    return f" ({', '.join(parts)})" if parts else ""


class MooncakeTransport:
    """One Mooncake TransferEngine: registers local buffers and writes into peers' registered ones.

    write() blocks the calling thread (sleeping between polls: the GIL is free meanwhile); close()
    must not race a write in progress.
    """

    def __init__(self, hostname: str, protocol: str = "tcp", device: str = "") -> None:
        """hostname is initialize()'s local_hostname, i.e. transfer_hostname(host, protocol, ...)."""
        from mooncake.engine import TransferEngine  # here, not at import (module docstring)

        apply_env_defaults()
        self.hostname, self.protocol = hostname, protocol
        self._engine: Any = TransferEngine()
        rc = self._engine.initialize(hostname, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise TransferError(
                f"Mooncake initialize({hostname!r}, protocol={protocol!r}, device={device!r}) returned {rc}"
            )
        self._session_id = f"{session_host(hostname)}:{self._engine.get_rpc_port()}"
        self._registered: dict[int, int] = {}  # pointer -> length
        self._timeout_s = transfer_timeout_s()  # read once, as the engine reads its own

    @property
    def session_id(self) -> str:
        return self._session_id

    def _live_engine(self) -> Any:
        if self._engine is None:
            raise TransferError(f"transport {self._session_id} is closed")
        return self._engine

    def register(self, ptrs: list[int], lens: list[int]) -> None:
        """Make [ptr, ptr + len) regions writable by peers (and readable as sources)."""
        if len(ptrs) != len(lens):
            raise ValueError(f"{len(ptrs)} pointers but {len(lens)} lengths")
        new = {p: n for p, n in zip(ptrs, lens, strict=True) if p not in self._registered}
        if not new:
            return
        rc = self._live_engine().batch_register_memory(list(new), list(new.values()))
        if rc != 0:
            raise TransferError(f"Mooncake batch_register_memory of {len(new)} regions returned {rc}")
        self._registered.update(new)

    def write(
        self,
        peer_session: str,
        entries: Entries,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        *,
        hold: Hold | None = None,
    ) -> None:
        """Copy every entry into the peer's registered memory; returns once all have landed. On a
        failure it raises once every submitted entry has ended or was abandoned at the deadline (the
        error's `late`: base.Transport.write)."""
        engine = self._live_engine()
        for i, part in enumerate(entries.split(max_entries)):
            flight = _Flight(engine, peer_session, self._timeout_s, hold)
            hold = None
            try:
                flight.submit(part, max_in_flight=len(part))
            finally:
                flight.wait()
            if flight.rc:
                raise flight.error(
                    f"Mooncake write to {peer_session} failed (rc {flight.rc}): batch {i + 1} of "
                    f"{-(-len(entries) // max_entries)}, {len(part)} of {len(entries)} entries, "
                    f"{part.nbytes} bytes{_detail(flight)}"
                )

    def write_pipelined(
        self,
        peer_session: str,
        pieces: Iterable[tuple[Callable[[], object], Entries]],
        max_entries: int = DEFAULT_MAX_ENTRIES,
        *,
        hold: Hold | None = None,
    ) -> None:
        """Each piece's prepare() (its pack) runs while the earlier pieces are on the wire, then its
        entries are submitted (at most max_entries in flight); returns once every submitted entry has
        ended or was abandoned at the deadline, and only then raises (a failed submit, a failed
        entry, a prepare that raised). So a caller may free the sources (the arena span, the pages)
        as soon as this returns, except a TransferError's `late` ones."""
        flight = _Flight(self._live_engine(), peer_session, self._timeout_s, hold)
        try:
            for prepare, entries in pieces:
                prepare()
                if not flight.submit(entries, max_in_flight=max_entries):
                    break
        finally:
            # Every entry waited for, failed or not: none may still read its sources once this returns.
            flight.wait()
            if flight.rc:
                raise flight.error(
                    f"Mooncake pipelined write to {peer_session} failed (rc {flight.rc}){_detail(flight)} "
                    f"({flight.submitted} entries submitted)"
                )

    def close(self) -> None:
        """Unregister everything and drop the engine (its threads and sockets go with it)."""
        if self._engine is None:
            return
        engine, self._engine = self._engine, None
        if self._registered:
            engine.batch_unregister_memory(list(self._registered))
            self._registered = {}
        del engine

    def __enter__(self) -> MooncakeTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
