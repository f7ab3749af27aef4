"""Moving a request's paged state between PD peers: write plans and the Mooncake transport.

`plan_writes` pairs the sender's and the receiver's page lists (both built by `dsv4_state_payloads`
on their own request row) index by index and turns them into Mooncake's three parallel lists, one
entry per contiguous run of pages per buffer; `plan_packed` plans one side's runs against a packed
staging span instead, and `split_pieces` cuts a packed write into pieces. `choose_write`, a cost
model with measured constants (`COSTS`), picks each write's path: direct, staged, pack_only or
unpack_only, pipelined or not. `MooncakeTransport` registers the pools and performs the writes over
Mooncake's TransferEngine (P2P handshake: no metadata server).
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only for annotations: importing this module must not pull in torch
    from dsv4_engine.memory import StateComponent, StateType

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
# A gap this long between two polls means this process was not running: it does not count against
# the deadline (a prefill stopped mid-write must still land its write once it resumes).
STALL_SECONDS = 0.5

# Set before the engine exists, only where the user has not (TcpTransport reads them when created;
# the slice size once per process). bench/pd_transfer.py, small preset, one 4096-token request
# (3.9 MiB), 2 shared cores, loopback, 0.3.13.post1:
# - lanes (connections per peer, 1..16, default 4), all interleaved in one run: fragmented pools
#   (302 entries) 0.48 / 0.59 / 0.63 GB/s for 1 / 4 / 16 lanes; fresh pools (23 entries) the same
#   within noise (1.8-2.3 GB/s, two runs);
# - slice (bytes a lane sends before the next, default 64 KiB): fresh pools 1.6 GB/s at 64 KiB,
#   2.3 at 1 MiB, 2.1 at 4 MiB (three alternated runs each); peers with different slices interoperate;
# - queue limits: 8 concurrent batches of DEFAULT_MAX_ENTRIES to one peer instead of 2.
MOONCAKE_ENV_DEFAULTS: dict[str, str] = {
    "MC_TCP_LANES_PER_PEER": "16",
    "MC_TCP_SLICE_SIZE": str(1 << 20),
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "8192",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "8192",
}


# ---- the cost model: which path one write takes --------------------------------------------------
#
# One write moves `nbytes` of a request's pages. The paths differ in who packs and in how many
# entries Mooncake pays for (bench/pd_transfer.py measures each side by side):
#   direct       an entry per run where both sides' pages step by one, per layer buffer;
#   staged       the prefill packs (memory/staging.py's layout), one entry into the decode's staging
#                span, the decode unpacks;
#   pack_only    the prefill packs, then an entry per run of the *decode's* pages (the packed side is
#                contiguous, so only the destination's jumps split it): the destination is contiguous;
#   unpack_only  an entry per run of the *prefill's* pages into the decode's span, the decode
#                unpacks: the source is contiguous.
# A path that packs can be pipelined: cut into pieces, piece k+1 is packed while piece k is on the
# wire (MooncakeTransport.write_pipelined).
PATHS = ("direct", "staged", "pack_only", "unpack_only")
PACKING = ("staged", "pack_only")  # the prefill packs: needs its arena
UNPACKING = ("staged", "unpack_only")  # the decode unpacks: needs a staging span of its own
PIECES = (1, 2, 4)


@dataclass(frozen=True)
class Costs:
    """Seconds per unit of each part of a write (the constants: COSTS)."""

    entry: float  # per entry past the first (TCP: per-entry bookkeeping, whatever its size)
    wire: float  # per byte, moved as one large entry
    pack: float  # per byte packed by the prefill (kernels/pages.cpp gather)
    unpack: float  # per byte unpacked by the decode (scatter into pages that are cold in cache)
    piece: float  # per piece past the first: its submit and its wait
    overlap: float  # share of the shorter stage a pipeline hides (1: perfect, 0: none)


# Medians of eight runs of bench/pd_transfer.py with the polled write (its "cost model" table), overlap
# kept from the runs before it (0.4, of five): small preset, one 4096-token request (3.92 MiB),
# loopback, Mooncake 0.3.13.post1 with MOONCAKE_ENV_DEFAULTS, one torch thread a side, 2 cores shared
# with other jobs (load 1.2-4.1). Ranges: entry 7-29 us; wire 0.72-2.55 GB/s; pack 2.6-3.9 GB/s;
# unpack 2.9-4.1 GB/s; piece 0-70 us; overlap 0-1 (on loopback the "wire" is CPU work too, on the
# same two cores the pack runs on, so how much a pipeline hides swings with the load: 0 in six of
# these eight loaded runs, 1 in a quiet one).
COSTS = Costs(entry=19e-6, wire=1 / 2.17e9, pack=1 / 3.53e9, unpack=1 / 3.56e9, piece=11e-6, overlap=0.4)


@dataclass(frozen=True)
class WriteShape:
    """What the cost model needs of one write: its bytes, and its entries on each path."""

    nbytes: int
    direct: int  # runs on both sides, per buffer
    source_runs: int  # runs of the prefill's pages, per buffer (unpack_only)
    destination_runs: int  # runs of the decode's pages, per buffer (pack_only)

    def entries(self, path: str, pieces: int = 1) -> int:
        # A cut between pieces can split a run in two: at most one more entry per extra piece.
        return {
            "direct": self.direct,
            "staged": pieces,
            "pack_only": self.destination_runs + pieces - 1,
            "unpack_only": self.source_runs,
        }[path]


def write_seconds(shape: WriteShape, path: str, pieces: int = 1, costs: Costs = COSTS) -> float:
    """The model's time for one write on `path`, packing (if it packs) in `pieces` pieces.

    Packing and sending form a two-stage pipeline of `pieces` equal steps: each overlapped step costs
    the longer stage plus the part of the shorter one overlapping does not hide."""
    if path not in PATHS:
        raise ValueError(f"unknown write path {path!r}; one of {PATHS}")
    if pieces < 1 or (pieces > 1 and path not in PACKING):
        raise ValueError(f"{path} cannot be cut into {pieces} pieces")
    send = max(shape.entries(path, pieces) - 1, 0) * costs.entry + shape.nbytes * costs.wire
    unpack = shape.nbytes * costs.unpack if path in UNPACKING else 0.0
    if path not in PACKING:
        return send + unpack
    a, b = shape.nbytes * costs.pack / pieces, send / pieces
    step = max(a, b) + (1 - costs.overlap) * min(a, b) + costs.piece
    return a + b + (pieces - 1) * step + unpack


def choose_write(
    shape: WriteShape, *, can_pack: bool, can_unpack: bool, costs: Costs = COSTS
) -> tuple[str, int]:
    """(path, pieces) the model expects to be fastest among those both sides have room for; direct
    wins ties (it needs neither arena)."""
    best, best_s = ("direct", 1), write_seconds(shape, "direct", 1, costs)
    for path in PATHS[1:]:
        if (path in PACKING and not can_pack) or (path in UNPACKING and not can_unpack):
            continue
        for pieces in PIECES if path in PACKING else (1,):
            seconds = write_seconds(shape, path, pieces, costs)
            if seconds < best_s:
                best, best_s = (path, pieces), seconds
    return best


def path_label(path: str, pieces: int) -> str:
    """The `path` label of dsv4_pd_transfer_writes_total (server/metrics.PD_WRITE_PATHS)."""
    return f"{path}_pipelined" if pieces > 1 else path


class TransferError(RuntimeError):
    """A Mooncake call failed (initialize, register or a write)."""


class PayloadMismatch(ValueError):
    """Sender and receiver disagree on what a request's state is: a type, a length or a sentinel."""


@dataclass
class Entries:
    """One write's entries, as Mooncake's three parallel lists (source, destination, bytes)."""

    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)

    @classmethod
    def one(cls, src: int, dst: int, n: int) -> Entries:
        """A single contiguous region of n bytes (e.g. the aux block: first token, sampler state)."""
        if n <= 0:
            raise ValueError(f"an entry must move at least one byte, got {n}")
        return cls([src], [dst], [n])

    def __len__(self) -> int:
        return len(self.lens)

    @property
    def nbytes(self) -> int:
        return sum(self.lens)

    def add(self, src: int, dst: int, n: int) -> None:
        self.src.append(src)
        self.dst.append(dst)
        self.lens.append(n)

    def extend(self, other: Entries) -> None:
        self.src.extend(other.src)
        self.dst.extend(other.dst)
        self.lens.extend(other.lens)

    def split(self, max_entries: int) -> list[Entries]:
        """Consecutive slices of at most max_entries entries (none for an empty write)."""
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        return [
            Entries(
                self.src[i : i + max_entries], self.dst[i : i + max_entries], self.lens[i : i + max_entries]
            )
            for i in range(0, len(self), max_entries)
        ]


# ---- planning ----------------------------------------------------------------------------------


def contiguous_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first src page, first dst page, pages) of runs where both sides step by one.

    Pairs whose pages are both 0 (the sentinel: nothing to send) are left out; they never merge two
    runs that are not contiguous on both sides, since contiguity compares page ids.
    """
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if s == 0 and d == 0:
            continue
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def _check_pages(state_type: StateType, src: list[int], dst: list[int], num_pages: int) -> None:
    if len(src) != len(dst):
        raise PayloadMismatch(f"{state_type}: prefill sends {len(src)} pages, decode expects {len(dst)}")
    for i, (s, d) in enumerate(zip(src, dst, strict=True)):
        if (s == 0) != (d == 0):
            raise PayloadMismatch(
                f"{state_type}: index {i} of {len(src)} is page {s} on prefill and page {d} on decode "
                "(exactly one is the sentinel 0)"
            )
        if not 0 <= s < num_pages:
            raise PayloadMismatch(f"{state_type}: index {i}: prefill page {s} outside its {num_pages} pages")
        if d < 0:
            raise PayloadMismatch(f"{state_type}: index {i}: decode page {d} is negative")


def _check_types(
    src: list[StateComponent],
    dst_ptrs: dict[StateType, list[int]],
    src_pages: dict[StateType, list[int]],
    dst_pages: dict[StateType, list[int]],
) -> dict[StateType, StateComponent]:
    for t in (*src_pages, *dst_pages):
        if t not in src_pages:
            raise PayloadMismatch(f"{t}: decode expects {len(dst_pages[t])} pages, prefill sends none")
        if t not in dst_pages:
            raise PayloadMismatch(f"{t}: prefill sends {len(src_pages[t])} pages, decode expects none")
    comps = {c.state_type: c for c in src}
    for t in (*comps, *dst_ptrs):
        n_src = len(comps[t].data_ptrs) if t in comps else 0
        n_dst = len(dst_ptrs.get(t, ()))
        if n_src != n_dst:
            raise PayloadMismatch(f"{t}: prefill has {n_src} buffers, decode registered {n_dst}")
    for t in src_pages:
        if t not in comps:
            raise PayloadMismatch(f"{t}: {len(src_pages[t])} pages listed but neither side has its buffers")
    return comps


def plan_writes(
    src: list[StateComponent],
    dst_ptrs: dict[StateType, list[int]],
    src_pages: dict[StateType, list[int]],
    dst_pages: dict[StateType, list[int]],
) -> Entries:
    """Every entry that copies the sender's pages onto the receiver's, by exact index match.

    src are the sender's pd_state_components(); dst_ptrs the receiver's buffer base pointers per type
    (same order and count as src's, so item lengths are the same on both sides); the page lists come
    from dsv4_state_payloads on each side. Raises PayloadMismatch rather than truncate anything.
    """
    comps = _check_types(src, dst_ptrs, src_pages, dst_pages)
    out = Entries()
    for comp in src:  # STATE_TYPE_ORDER, buffers in layer order
        t = comp.state_type
        if t not in src_pages:
            continue
        num_pages = min(n // item for n, item in zip(comp.data_lens, comp.item_lens, strict=True))
        _check_pages(t, src_pages[t], dst_pages[t], num_pages)
        runs = contiguous_runs(src_pages[t], dst_pages[t])
        for src_ptr, dst_ptr, item in zip(comps[t].data_ptrs, dst_ptrs[t], comp.item_lens, strict=True):
            for s, d, n in runs:
                out.add(src_ptr + s * item, dst_ptr + d * item, n * item)
    return out


def side_runs(pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first page, first packed index, pages) of runs of one side's pages alone.

    The packed index counts the non-sentinel pages before it (memory/staging.py's layout skips
    sentinels), so a run is contiguous both in that side's buffers and in the packed span."""
    runs: list[tuple[int, int, int]] = []
    i = 0
    for p in pages:
        if p == 0:
            continue
        if runs and p == runs[-1][0] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((p, i, 1))
        i += 1
    return runs


Segments = list[tuple["StateType", list[int]]]  # (state type, its page list slice) in span order


def plan_packed(
    components: list[StateComponent], ptrs: dict[StateType, list[int]], segments: Segments, packed: int,
    *, into_packed: bool,
) -> Entries:  # fmt: skip
    """Entries between one side's pages and a packed span at address `packed` (segments one after
    another in memory/staging.py's layout): pages -> span if into_packed (unpack_only: the prefill's
    pages into the decode's span), else span -> pages (pack_only: the prefill's arena into the
    decode's pages). `ptrs` are that side's buffer bases per type, in `components`' buffer order."""
    items = {c.state_type: c.item_lens for c in components}
    out, at = Entries(), packed
    for state_type, pages in segments:
        runs = side_runs(pages)
        n = sum(r[2] for r in runs)
        for base, item in zip(ptrs[state_type], items[state_type], strict=True):
            for page, index, count in runs:
                src, dst = base + page * item, at + index * item
                out.add(*((src, dst) if into_packed else (dst, src)), count * item)
            at += n * item
    return out


def write_shape(
    components: list[StateComponent], src: dict[StateType, list[int]], dst: dict[StateType, list[int]],
    direct: int,
) -> WriteShape:  # fmt: skip
    """The cost model's view of one write: `direct` is len(plan_writes(...)) of the same pages."""
    buffers = {c.state_type: c.item_lens for c in components}
    nbytes = sum(sum(1 for p in pages if p) * sum(buffers[t]) for t, pages in src.items())
    one_side = [sum(len(side_runs(pages[t])) * len(buffers[t]) for t in pages) for pages in (src, dst)]
    return WriteShape(nbytes, direct, *one_side)


def split_pieces(
    segments: list[tuple[StateType, int, list[int]]], page_bytes: dict[StateType, int], pieces: int
) -> list[list[tuple[StateType, int, int]]]:
    """Cut (state type, first position, page list slice) segments into at most `pieces` pieces of
    about equal bytes, at page boundaries, each a list of (type, lo, hi) positions in span order.
    Sub-segments without a real page are dropped (they pack to nothing)."""
    total = sum(sum(1 for p in pages if p) * page_bytes[t] for t, _, pages in segments)
    out: list[list[tuple[StateType, int, int]]] = [[]]
    done, target = 0, total / max(pieces, 1)
    for t, lo, pages in segments:
        start, real = 0, False
        for k, p in enumerate(pages):
            if not p:
                continue
            if done >= target * len(out) and len(out) < pieces and (out[-1] or real):
                if real:
                    out[-1].append((t, lo + start, lo + k))
                out.append([])
                start, real = k, False
            done += page_bytes[t]
            real = True
        if real:
            out[-1].append((t, lo + start, lo + len(pages)))
    return [piece for piece in out if piece]


# ---- transport ---------------------------------------------------------------------------------


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def transfer_hostname(
    host: str, protocol: str, npu_phy_id: int | None = None, *, port: int | None = None
) -> str:
    """The local_hostname Mooncake's initialize() takes for this protocol.

    "ascend" (Mooncake over the Ascend transport, SGLang's ENABLE_ASCEND_TRANSFER_WITH_MOONCAKE) wants
    "<host>:<port>:npu_<physical id>", port a free one on host (picked here unless given, the only
    impure case); every other protocol takes the host as is. Peers dial "<host>:<rpc port>" either
    way (MooncakeTransport.session_id).
    """
    if protocol != "ascend":
        return host
    if npu_phy_id is None or npu_phy_id < 0:
        raise ValueError(f"protocol 'ascend' needs the NPU's physical id, got {npu_phy_id}")
    return f"{host}:{_free_port(host) if port is None else port}:npu_{npu_phy_id}"


_ASCEND_SUFFIX = re.compile(r":\d+:npu_\d+$")


def session_host(hostname: str) -> str:
    """The host part of a transfer_hostname(): what a session id starts with (IPv6 in brackets)."""
    host = _ASCEND_SUFFIX.sub("", hostname)
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def apply_env_defaults(env: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, str]:
    """Set MOONCAKE_ENV_DEFAULTS where unset; returns the values in effect."""
    for key, value in MOONCAKE_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    return {key: env[key] for key in MOONCAKE_ENV_DEFAULTS}


def _transfer_timeout_s(env: dict[str, str] | os._Environ[str] = os.environ) -> float:
    """Mooncake's synchronous-write timeout (MC_TRANSFER_TIMEOUT, at least 5 s, default 30 s): a write
    waits this long plus 1 ns a byte, as batch_transfer_sync_write would."""
    value = env.get("MC_TRANSFER_TIMEOUT")
    try:
        return float(max(5, int(value))) if value else 30.0
    except ValueError:
        return 30.0


class _Flight:
    """Entries submitted one per Mooncake batch, waited for by polling (see POLL_SECONDS)."""

    def __init__(self, engine: Any, peer_session: str, timeout_s: float) -> None:
        self.engine, self.peer, self.timeout_s = engine, peer_session, timeout_s
        self.pending: deque[tuple[int, int]] = deque()  # (batch id, bytes), in submit order
        self.submitted = self.failed = self.refused = self.abandoned = 0

    @property
    def rc(self) -> int:
        """0: every entry landed; -1: one failed or was refused (as batch_transfer_sync_write reports
        either); -2: one had not ended by the deadline."""
        return -1 if self.failed or self.refused else (-2 if self.abandoned else 0)

    def submit(self, entries: Entries, max_in_flight: int) -> bool:
        """Submit every entry, first waiting for the oldest whenever max_in_flight are pending; False
        once one is refused (the rest are not submitted) or has failed."""
        for src, dst, n in zip(entries.src, entries.dst, entries.lens, strict=True):
            if len(self.pending) >= max_in_flight:
                self.wait(max_in_flight - 1)
            if self.rc:
                return False
            batch = self.engine.transfer_submit_write(self.peer, src, dst, n)
            if not batch:  # 0: refused (peer unknown or unreachable)
                self.refused += 1
                return False
            self.pending.append((batch, n))
            self.submitted += 1
        return True

    def wait(self, leave: int = 0) -> None:
        """Until at most `leave` entries are pending (oldest first: the lanes serve them in order).
        Past the deadline the rest are abandoned, never freed: Mooncake may still read their
        sources, and freeing a batch it still uses is what its own timeout does wrong."""
        last = time.monotonic()
        deadline = last + self.timeout_s + sum(n for _, n in self.pending) * 1e-9
        while len(self.pending) > leave:
            status = self.engine.transfer_check_status(self.pending[0][0])
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
                time.sleep(POLL_SECONDS)
                continue
            self.pending.popleft()  # 1 or -1: ended, its batch freed by Mooncake
            self.failed += status != 1

    def _abandon(self) -> None:
        """One last look at every pending entry (a later one may have failed: that is the error to
        report), then forget those still running."""
        for batch, _ in self.pending:
            status = self.engine.transfer_check_status(batch)
            self.failed += status not in (0, 1)
            self.abandoned += status == 0
        self.pending.clear()


def _detail(flight: _Flight) -> str:
    parts = [f"{n} {what}" for n, what in ((flight.failed, "failed"), (flight.refused, "refused at submit"),
             (flight.abandoned, "still running at the deadline")) if n]  # fmt: skip
    return f" ({', '.join(parts)})" if parts else ""


class MooncakeTransport:
    """One Mooncake TransferEngine: registers local buffers and writes into peers' registered ones.

    write() blocks the calling thread (sleeping between polls: the GIL is free meanwhile); close()
    must not race a write in progress.
    """

    def __init__(self, hostname: str, protocol: str = "tcp", device: str = "") -> None:
        """hostname is initialize()'s local_hostname, i.e. transfer_hostname(host, protocol, ...)."""
        # Imported here: the NPU and GPU builds of Mooncake differ, and importing this module must
        # not need either.
        from mooncake.engine import TransferEngine

        apply_env_defaults()
        self.hostname, self.protocol = hostname, protocol
        self._engine: Any = TransferEngine()
        rc = self._engine.initialize(hostname, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise TransferError(f"Mooncake initialize({hostname!r}, protocol={protocol!r}) returned {rc}")
        self._session_id = f"{session_host(hostname)}:{self._engine.get_rpc_port()}"
        self._registered: dict[int, int] = {}  # pointer -> length
        self._timeout_s = _transfer_timeout_s()  # read once, as the engine reads its own

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

    def write(self, peer_session: str, entries: Entries, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        """Copy every entry into the peer's registered memory; returns once all have landed (or, on a
        failure, once every submitted entry has ended or its deadline passed)."""
        engine = self._live_engine()
        for i, part in enumerate(entries.split(max_entries)):
            flight = _Flight(engine, peer_session, self._timeout_s)
            try:
                flight.submit(part, max_in_flight=len(part))
            finally:
                flight.wait()
            if flight.rc:
                raise TransferError(
                    f"Mooncake write to {peer_session} failed (rc {flight.rc}): batch {i + 1} of "
                    f"{-(-len(entries) // max_entries)}, {len(part)} of {len(entries)} entries, "
                    f"{part.nbytes} bytes{_detail(flight)}"
                )

    def write_pipelined(
        self,
        peer_session: str,
        pieces: Iterable[tuple[Callable[[], None], Entries]],
        max_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> None:
        """Each piece's prepare() (its pack) runs while the earlier pieces are on the wire, then its
        entries are submitted (at most max_entries in flight); returns once every submitted entry has
        ended, and only then raises (a failed submit, a failed entry, a prepare that raised). So a
        caller may free the sources (the arena span, the pages) as soon as this returns, whatever
        happened."""
        flight = _Flight(self._live_engine(), peer_session, self._timeout_s)
        try:
            for prepare, entries in pieces:
                prepare()
                if not flight.submit(entries, max_in_flight=max_entries):
                    break
        finally:
            # Every entry waited for, failed or not: none may still read its sources once this returns.
            flight.wait()
            if flight.rc:
                raise TransferError(
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
