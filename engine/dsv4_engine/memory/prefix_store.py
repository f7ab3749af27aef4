"""Prefix-cache snapshots as data: export every resumable prefix to tensors, import them into another
engine's pools (a server writes them to a file while it serves and after it drains, and reads them at
start, behind the layout fingerprint: server/prefix_file.py).

A record is what a request resuming at the prefix's end P reads: the pages a PD transfer of a request
of length P would move (`dsv4_state_payloads`: the full pages of [0, P), the SWA pages of the window
before P, the C4 state page whose rows [P-4, P) the snapshot keeps). Exporting resumes a scratch
request row at P, which maps exactly those pages (and restores the snapshot's C4 rows into a state page
of its own); importing allocates the row as a prefill of [0, P) would, writes the pages, and offers the
row to the cache, which takes its snapshot as after a prefill. Both go through the allocator's own
operations, so ownership and counts stay its own.

Prefixes nest (a chat's turns, a system prompt's junction): a record keeps only the pages of positions
from `base`, the end of the longest earlier record it extends, and is imported after it, resuming there.
Under a size cap the most recently used prefixes go first; a prefix whose parent did not fit extends
the longest one that did.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .allocator import Dsv4Allocator
from .layout import StateType
from .out_cache_loc import ExtendSpec
from .payloads import dsv4_state_payloads
from .pools import Dsv4TokenToKVPool
from .state_tail import swa_window_start

# Page contents to write: per state type, the page ids and one `[pages, *page shape]` tensor per buffer.
PageWrites = dict[StateType, tuple[torch.Tensor, list[torch.Tensor]]]


@dataclass(frozen=True)
class PrefixRecord:
    """One resumable prefix: its tokens (page-aligned) and, per state type and buffer (layer order,
    `buffers_by_type`), the pages of its positions from `base` on, `[pages, *page shape]` on CPU.
    extra: what else a resume at its end reads, kept outside the pools (the MTP layer's window,
    speculative/draft_cache.py), by name."""

    tokens: tuple[int, ...]
    base: int
    pages: dict[StateType, list[torch.Tensor]]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


# (request row, prefix length) -> the extra a row resumed there holds; and its inverse, which puts
# one into a row before the row's snapshot is taken.
ReadExtra = Callable[[int, int], dict[str, torch.Tensor]]
WriteExtra = Callable[[int, int, dict[str, torch.Tensor]], None]


def _entries(
    kv: Dsv4TokenToKVPool, alloc: Dsv4Allocator, row: int, n: int
) -> dict[StateType, list[tuple[int, int]]]:
    """Per state type, (first position it covers, page) of each page a request of length n in `row`
    holds, in payload order (sentinel entries dropped)."""
    p, out = alloc.page_size, {}
    for state_type, build in dsv4_state_payloads(kv, alloc.req_pool, row, n).items():
        lo = swa_window_start(n, kv.layout.window, p) if state_type == StateType.SWA else 0
        out[state_type] = [(lo + j * p, page) for j, page in enumerate(build()) if page]
    return out


# What `_resumed` yields instead of a row: no request row free; the prefix is no longer cached; no C4
# state page to restore its snapshot into.
NO_ROW, GONE, BUSY = -1, -2, -3


@contextlib.contextmanager
def _resumed(alloc: Dsv4Allocator, apply_copies: Callable[[], None], tokens: Sequence[int]) -> Iterator[int]:
    """A scratch request row resumed at the end of tokens (a resumable prefix), as a request resuming
    there holds it, its snapshot's C4 rows restored; freed after. Leaves the cache's LRU order as it
    was."""
    row = alloc.alloc_request()
    if row is None:
        yield NO_ROW
        return
    try:
        state_pages = alloc.num_free().get("c4s", 1)
        if alloc.match_prefix(row, tokens, len(tokens), touch=False).length != len(tokens):
            yield GONE if state_pages else BUSY
            return
        apply_copies()  # the snapshot's C4 rows into the row's own state page
        yield row
    finally:
        alloc.free(row)


def _page_ids(
    kv: Dsv4TokenToKVPool, alloc: Dsv4Allocator, row: int, n: int, base: int
) -> dict[StateType, torch.Tensor]:
    """Per state type, the pages of a row of length n that cover positions from base on."""
    return {
        state_type: torch.tensor([pg for pos, pg in entries if pos >= base], dtype=torch.long)
        for state_type, entries in _entries(kv, alloc, row, n).items()
    }


def _record(
    buffers: dict[StateType, list[torch.Tensor]],
    ids: dict[StateType, torch.Tensor],
    tokens: Sequence[int],
    base: int,
    extra: dict[str, torch.Tensor] | None,
) -> PrefixRecord:
    pages = {t: [b.index_select(0, v.to(b.device)).cpu() for b in buffers[t]] for t, v in ids.items()}
    return PrefixRecord(tuple(tokens), base, pages, extra or {})


def export_prefix(
    alloc: Dsv4Allocator,
    kv: Dsv4TokenToKVPool,
    apply_copies: Callable[[], None],
    read_extra: ReadExtra | None,
    tokens: Sequence[int],
    base: int,
) -> PrefixRecord | None:
    """The record of the longest prefix of tokens the cache can resume at, with the pages of its
    positions from base on (a prefix the importer resumes at already), for a peer server to import
    (server/prefix_peers.py); between steps. None when that prefix is no longer than base, or no
    request row or C4 state page is free to read it through. Leaves the cache's LRU order as it was
    (so the replicated caches of a parallel server stay equal)."""
    cache = alloc.prefix_cache
    if cache is None or base % alloc.page_size:
        return None
    n = cache.match(tokens, len(tokens), touch=False).length
    if n <= base:
        return None
    with _resumed(alloc, apply_copies, tokens[:n]) as row:
        if row < 0:
            return None
        extra = read_extra(row, n) if read_extra is not None else None
        return _record(kv.buffers_by_type(), _page_ids(kv, alloc, row, n, base), tokens[:n], base, extra)


@dataclass(frozen=True)
class PrefixExport:
    """What an export read: the records, shorter first (a record after the one it extends), and how
    many resumable prefixes it left out: for want of a free request row or C4 state page to read them
    through (`busy`; none on an idle engine), for the size cap (`over_cap`), and because the cache
    dropped them while a read in parts went on (`gone`)."""

    records: list[PrefixRecord]
    busy: int = 0
    over_cap: int = 0
    gone: int = 0


class PrefixExporter:
    """Reads the prefixes the cache can resume at, as of its construction, most recently used first
    while they fit in max_bytes (None: all), a part at a time: each `read` runs between two steps, so
    a server saving a large cache while it serves pauses the engine for a part at a time, not for the
    whole read. A record is read whole within one part, so each is what a request resuming there
    reads, whatever the cache did between parts. apply_copies runs the allocator's queued state
    copies on the pools (the model runner's `apply_state_copies`); read_extra reads what else the
    resumed scratch row holds. Reading leaves the cache's LRU order as it was; it borrows a request
    row and a C4 state page for each record and gives them back."""

    def __init__(
        self,
        alloc: Dsv4Allocator,
        kv: Dsv4TokenToKVPool,
        apply_copies: Callable[[], None],
        read_extra: ReadExtra | None = None,
        max_bytes: int | None = None,
    ) -> None:
        self.alloc, self.kv, self.apply_copies, self.read_extra = alloc, kv, apply_copies, read_extra
        self.max_bytes = max_bytes
        cache = alloc.prefix_cache
        self.prefixes = cache.resumable() if cache is not None else []
        prefixes = self.prefixes
        # A prefix is used whenever a longer one is, so its ancestors come before it (ties: shorter first).
        self.order = sorted(
            range(len(prefixes)), key=lambda i: (-prefixes[i].last_used, len(prefixes[i].tokens))
        )
        self.buffers = kv.buffers_by_type()
        self.page_bytes = {
            t: sum(b[0].numel() * b.element_size() for b in bs) for t, bs in self.buffers.items()
        }
        self.records: list[PrefixRecord] = []
        self.exported: set[int] = set()  # indices into prefixes
        self.next = 0  # into order
        self.busy = self.over_cap = self.gone = self.total = 0
        self.longest_part_s = 0.0

    @property
    def done(self) -> bool:
        return self.next >= len(self.order)

    def read(self, budget_s: float | None = None) -> bool:
        """Read records until budget_s seconds have passed (at least one record; None: all); between
        steps. Returns whether every prefix has been tried."""
        started = time.monotonic()
        first = self.next
        while not self.done:
            if budget_s is not None and self.next > first and time.monotonic() - started >= budget_s:
                break
            i = self.order[self.next]
            self.next += 1
            if not self._read_one(i):
                self.busy += len(self.order) - self.next + 1  # no free row: the rest wait too
                self.next = len(self.order)
        self.longest_part_s = max(self.longest_part_s, time.monotonic() - started)
        return self.done

    def _read_one(self, i: int) -> bool:
        """Read prefix i into a record unless it is over the cap or no longer cached; False when no
        request row is free."""
        tokens, parent, _ = self.prefixes[i]
        while parent >= 0 and parent not in self.exported:  # the longest exported prefix of its own
            parent = self.prefixes[parent].parent
        base = len(self.prefixes[parent].tokens) if parent >= 0 else 0
        with _resumed(self.alloc, self.apply_copies, tokens) as row:
            if row == NO_ROW:
                return False
            if row == GONE:  # dropped since the export began
                self.gone += 1
                return True
            if row == BUSY:
                self.busy += 1
                return True
            ids = _page_ids(self.kv, self.alloc, row, len(tokens), base)
            size = sum(len(v) * self.page_bytes[t] for t, v in ids.items()) + 8 * len(tokens)
            if self.max_bytes is not None and self.total + size > self.max_bytes:
                self.over_cap += 1
                return True
            extra = self.read_extra(row, len(tokens)) if self.read_extra is not None else None
            rec = _record(self.buffers, ids, tokens, base, extra)
            self.records.append(rec)
            self.exported.add(i)
            self.total += size + sum(t.numel() * t.element_size() for t in rec.extra.values())
            return True

    def result(self) -> PrefixExport:
        """What was read (once `read` returned True)."""
        return PrefixExport(
            sorted(self.records, key=lambda r: len(r.tokens)), self.busy, self.over_cap, self.gone
        )


def write_pages(kv: Dsv4TokenToKVPool, writes: PageWrites) -> None:
    buffers = kv.buffers_by_type()
    for state_type, (ids, data) in writes.items():
        for b, d in zip(buffers[state_type], data, strict=True):
            b.index_copy_(0, ids.to(b.device), d.to(b.device, b.dtype))


def _fits_free(alloc: Dsv4Allocator, spec: ExtendSpec) -> bool:
    """Whether the step fits in free pages and a free snapshot slot, evicting nothing."""
    need, free = alloc.pages_needed([spec]), alloc.num_free()
    slots = alloc.snapshot_slots
    return all(need[f] <= free[f] for f in need) and not (slots.num_pages and not slots.num_free)


def import_prefixes(
    alloc: Dsv4Allocator,
    kv: Dsv4TokenToKVPool,
    records: Iterable[PrefixRecord],
    apply_copies: Callable[[], None],
    write: Callable[[PageWrites], None] | None = None,
    write_extra: WriteExtra | None = None,
    *,
    evict: bool = False,
) -> int:
    """Cache the records' prefixes, in order, as a prefill of each would have; returns how many. A
    record already cached, or whose base is not (its parent was not imported), is skipped; importing
    stops when the pools have no free pages or snapshot slot for the next one: it never evicts, so a
    file's records do not push out the ones before them, unless `evict` (a prefix a request is about
    to resume at, fetched from a peer: it is the most recently used of all).
    Raises ValueError when a record's pages do not fit this layout (the caller checked the
    fingerprint; a damaged record). write: puts page contents into the pools (default `write_pages`
    on kv; a parallel server's also sends them to its other ranks); write_extra: a record's extra into
    the row, before the cache takes the row's snapshot."""
    if alloc.prefix_cache is None:
        return 0
    write = write if write is not None else lambda w: write_pages(kv, w)
    buffers = kv.buffers_by_type()
    done = 0
    for rec in records:
        n = len(rec.tokens)
        row = alloc.alloc_request()
        if row is None:
            break
        try:
            hit = alloc.match_prefix(row, rec.tokens, n).length
            if hit >= n or hit < rec.base:
                continue
            apply_copies()
            spec = ExtendSpec(row, hit, n)
            # Evicting, only running requests' pages are out of reach (the cache takes a snapshot slot
            # itself); otherwise there is no room without evicting what came before.
            if not (alloc.can_alloc([spec]) if evict else _fits_free(alloc, spec)):
                break
            alloc.alloc_extend([spec])
            writes: PageWrites = {}
            for state_type, entries in _entries(kv, alloc, row, n).items():
                own = [(pos, pg) for pos, pg in entries if pos >= rec.base]  # the record's pages, in order
                data = rec.pages.get(state_type, [])
                if len(data) != len(buffers[state_type]) or any(len(d) != len(own) for d in data):
                    raise ValueError(
                        f"prefix record of {n} tokens: its {state_type.name} pages do not fit this layout"
                    )
                # Pages below the hit are the cache's already (the same positions of the same tokens).
                keep = [i for i, (pos, _) in enumerate(own) if pos >= hit]
                ids = torch.tensor([own[i][1] for i in keep], dtype=torch.long)
                rows = torch.tensor(keep, dtype=torch.long)
                writes[state_type] = (ids, [d.index_select(0, rows) for d in data])
            write(writes)
            if write_extra is not None:
                write_extra(row, n, rec.extra)
            alloc.cache_prefix(row, rec.tokens)
            apply_copies()  # the snapshot's C4 rows, out of the row's state page
            done += 1
        finally:
            alloc.free(row)
    return done
