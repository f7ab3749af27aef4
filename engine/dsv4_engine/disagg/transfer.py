"""Planning a write of a request's paged state, and choosing its path by a cost model.

`plan_writes` pairs the sender's and the receiver's page lists (both built by `dsv4_state_payloads`
on their own request row) index by index and turns them into a transport's three parallel lists, one
entry per contiguous run of pages per buffer; `plan_packed` plans one side's runs against a packed
staging span instead, and `split_pieces` cuts a packed write into pieces. `choose_write`, a cost
model with measured constants (`COSTS`), picks each write's path: direct, staged, pack_only or
unpack_only, pipelined or not. Pure Python: the transport that performs the writes is a backend
(mooncake/).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for annotations: importing this module must not pull in torch
    from dsv4_engine.memory import StateComponent, StateType


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
# wire (Transport.write_pipelined).
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
# loopback, Mooncake 0.3.13.post1 with its env defaults (mooncake/config.py), one torch thread a side,
# 2 cores shared with other jobs (load 1.2-4.1). Ranges: entry 7-29 us; wire 0.72-2.55 GB/s; pack 2.6-3.9 GB/s;
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


class PayloadMismatch(ValueError):
    """Sender and receiver disagree on what a request's state is: a type, a length or a sentinel."""


@dataclass
class Entries:
    """One write's entries, as three parallel lists (source, destination, bytes): Mooncake's batch form."""

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
