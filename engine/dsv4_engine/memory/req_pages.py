"""What one request row holds, and the arithmetic over it: which pages a step takes and gives back,
which a request of a given length holds, and the slots a step writes. Pure functions of the pages a
row holds and the memory's geometry; the allocator applies them (allocator.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .out_cache_loc import DSV4OutCacheLoc, ExtendSpec
from .state_tail import (
    cdiv,
    state_alloc_offset,
    state_keep_from,
    state_write_from,
    swa_keep_from,
    swa_window_start,
)

FAMILIES = ("full", "swa", "c4s", "c128s")
STATE_RATIOS = {"c4s": 4, "c128s": 128}


@dataclass(frozen=True)
class Geometry:
    page_size: int
    window: int
    max_ctx: int
    state_families: tuple[str, ...]  # the state families the model has ("c4s", "c128s")


@dataclass
class ReqPages:
    seq_len: int = 0
    full: list[int] = field(default_factory=list)  # page index k -> page, for positions [kP, (k+1)P)
    swa: dict[int, int] = field(default_factory=dict)  # page index -> swa page (window only)
    c4s: dict[int, int] = field(default_factory=dict)  # page index -> c4 state page (tail only)
    c128s: dict[int, int] = field(default_factory=dict)


@dataclass
class Plan:
    """What a step frees and allocates, computed before anything changes (so a step is atomic)."""

    free: dict[str, list[tuple[int, int]]]  # family -> [(page index, page)]
    need: dict[str, list[int]]  # family -> page indices to allocate


def slots(pages: list[int] | dict[int, int], p: int, lo: int, hi: int) -> list[int]:
    """Slots of positions [lo, hi) in pages of size p (`pages[k]` holds positions [kp, (k+1)p))."""
    return [pages[i // p] * p + i % p for i in range(lo, hi)]


def rows(full: list[int], p: int, ratio: int, prefix: int, seq: int) -> list[int]:
    """Compressed-row slots of the blocks a step completes (prefix//ratio .. seq//ratio - 1): a block's
    row lives in the full page of its first token, `p // ratio` rows a page."""
    firsts = range(prefix // ratio * ratio, seq // ratio * ratio, ratio)
    return [full[f // p] * (p // ratio) + (f % p) // ratio for f in firsts]


def pages_in(lo: int, hi: int, p: int) -> range:
    return range(lo // p, cdiv(hi, p)) if hi > lo else range(0)


def plan_step(r: ReqPages, spec: ExtendSpec, g: Geometry) -> Plan:
    """The pages a step `prefix_len -> seq_len` of row r takes and releases."""
    if spec.prefix_len != r.seq_len:
        raise ValueError(
            f"request {spec.req_idx}: prefix_len {spec.prefix_len} != allocated length {r.seq_len}"
        )
    if not spec.prefix_len < spec.seq_len <= g.max_ctx:
        raise ValueError(f"request {spec.req_idx}: need prefix < seq <= {g.max_ctx}, got {spec}")
    p, prefix, seq = g.page_size, spec.prefix_len, spec.seq_len
    free: dict[str, list[tuple[int, int]]] = {f: [] for f in FAMILIES}
    need: dict[str, list[int]] = {f: [] for f in FAMILIES}
    need["full"] = list(range(len(r.full), cdiv(seq, p)))
    # SWA: pages wholly behind what this step can still see are released.
    keep = swa_keep_from(prefix, g.window)
    free["swa"] = [(k, pg) for k, pg in r.swa.items() if (k + 1) * p <= keep]
    need["swa"] = [k for k in pages_in(prefix, seq, p) if k not in r.swa]
    for fam in g.state_families:
        ratio, held = STATE_RATIOS[fam], getattr(r, fam)
        keep = state_keep_from(ratio, prefix, seq)
        free[fam] = [(k, pg) for k, pg in held.items() if (k + 1) * p <= keep]
        lo = state_alloc_offset(ratio, seq)
        for k in pages_in(lo, seq, p):
            if k in held:
                continue
            if max(lo, k * p) < prefix:  # state written by earlier steps must still be resident
                raise AssertionError(f"request {spec.req_idx}: {fam} state page {k} lost before use")
            need[fam].append(k)
        # What the step writes beyond its tail (the block before a page boundary, state_write_from).
        wrote = state_write_from(ratio, prefix, seq, p, spec.keep_len)
        need[fam] += [k for k in pages_in(wrote, lo, p) if k not in held and k not in need[fam]]
        need[fam].sort()
    return Plan(free=free, need=need)


def plan_truncate(r: ReqPages, seq_len: int, g: Geometry) -> dict[str, list[tuple[int, int]]]:
    """The pages a row cut back to seq_len gives up: those wholly at or past it, per family as
    (page index, page)."""
    if not 0 < seq_len <= r.seq_len:
        raise ValueError(f"cannot cut a row of {r.seq_len} positions back to {seq_len}")
    first = cdiv(seq_len, g.page_size)  # the first page index holding no kept position
    free = {"full": [(k, pg) for k, pg in enumerate(r.full) if k >= first]}
    for fam in FAMILIES[1:]:
        free[fam] = [(k, pg) for k, pg in getattr(r, fam).items() if k >= first]
    return free


def hold_plan(seq_len: int, g: Geometry) -> dict[str, list[int]]:
    """Page indices per family a request of seq_len holds to continue: every full page, the SWA
    pages from the window's start, the state tails (what alloc_prealloc takes)."""
    p = g.page_size
    need = {
        "full": list(range(cdiv(seq_len, p))),
        "swa": list(pages_in(swa_window_start(seq_len, g.window, p), seq_len, p)),
    }
    for fam, ratio in STATE_RATIOS.items():
        active = fam in g.state_families
        need[fam] = list(pages_in(state_alloc_offset(ratio, seq_len), seq_len, p)) if active else []
    return need


def bundle(steps: Sequence[tuple[ReqPages, ExtendSpec]], g: Geometry) -> DSV4OutCacheLoc:
    """A step's slots, computed from the pages each request holds (the same values the allocator
    wrote to the tables) rather than read back from them slice by slice."""
    full, swa, c4, c128, c4s, c128s = [], [], [], [], [], []
    out = DSV4OutCacheLoc(*(torch.empty(0, dtype=torch.int64) for _ in range(6)))
    p = g.page_size
    for r, s in steps:
        prefix, seq = s.prefix_len, s.seq_len
        full += slots(r.full, p, prefix, seq)
        swa += slots(r.swa, p, prefix, seq)
        c4 += rows(r.full, p, 4, prefix, seq)
        c128 += rows(r.full, p, 128, prefix, seq)
        lo4 = state_write_from(4, prefix, seq, p, s.keep_len) if "c4s" in g.state_families else seq
        lo128 = state_write_from(128, prefix, seq, p, s.keep_len) if "c128s" in g.state_families else seq
        c4s += slots(r.c4s, p, lo4, seq)
        c128s += slots(r.c128s, p, lo128, seq)
        out.extend_counts.append(seq - prefix)
        out.c4_counts.append(seq // 4 - prefix // 4)
        out.c128_counts.append(seq // 128 - prefix // 128)
        out.c4_state_counts.append(seq - lo4)
        out.c128_state_counts.append(seq - lo128)
    if steps:
        (
            out.out_full_loc,
            out.out_swa_loc,
            out.out_c4_loc,
            out.out_c128_loc,
            out.out_c4_state_loc,
            out.out_c128_state_loc,
        ) = (torch.tensor(x, dtype=torch.int64) for x in (full, swa, c4, c128, c4s, c128s))
    return out
