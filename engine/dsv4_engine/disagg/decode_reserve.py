"""Decode admission: pages for a PD sequence are reserved only where the requests already running (or
reserved) keep room to grow, so a burst queues or is refused instead of preempting them.

SGLang's decode pre-allocation reserves `num_reserved_decode_tokens` (512) per running request for
the same reason (#6860: pre-allocation exhausting memory). Here each running or reserved request
keeps the pages its next `reserve_tokens` tokens need (fewer when its max_tokens ends it sooner),
and a new one is admitted only if its own pages, at the same horizon, fit beside them. What the
horizon does not cover is still served by preemption (recompute, never a failure).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

from dsv4_engine.disagg.base import PdEngine
from dsv4_engine.memory import OutOfPages, StateType
from dsv4_engine.memory.allocator import FAMILIES

RESERVED_TOKENS_ENV = "DSV4_PD_RESERVED_DECODE_TOKENS"
DEFAULT_RESERVED_TOKENS = 512  # SGLang's SGLANG_NUM_RESERVED_DECODE_TOKENS


def reserved_tokens(env: dict[str, str] | os._Environ[str] = os.environ) -> int:
    """Tokens of growth each decoding request keeps room for ($DSV4_PD_RESERVED_DECODE_TOKENS)."""
    value = env.get(RESERVED_TOKENS_ENV, str(DEFAULT_RESERVED_TOKENS))
    try:
        tokens = int(value)
    except ValueError:
        raise ValueError(f"{RESERVED_TOKENS_ENV} must be an integer, got {value!r}") from None
    if tokens < 0:
        raise ValueError(f"{RESERVED_TOKENS_ENV} must be >= 0, got {tokens}")
    return tokens


@dataclass(frozen=True)
class Reservation:
    """A row reserved for a sequence whose state is on its way: it grows to `end` tokens once admitted."""

    row: int
    end: int


def horizon(prompt_len: int, max_tokens: int, reserve: int, max_ctx: int) -> int:
    """How long a request of prompt_len may grow to within the reserve (max_tokens caps it)."""
    return min(prompt_len + min(max_tokens, reserve), max_ctx)


def reserve(
    engine: PdEngine,
    prompt_len: int,
    end: int,
    reserved: list[Reservation],
    reserve_tokens: int,
    *,
    poison: bool,
) -> tuple[int, dict[StateType, list[int]]]:
    """On the engine thread: a row and the pages of a prompt of prompt_len (engine.prealloc), if its
    pages at `end` fit beside what every running and reserved request needs to reach its own horizon;
    else OutOfPages, nothing taken."""
    alloc = engine.allocator
    growth: Counter[str] = Counter()
    for seq in engine.scheduler.running:
        if seq.req_idx is not None:
            now = alloc.seq_len(seq.req_idx)
            limit = len(seq.prompt_token_ids) + seq.params.max_tokens
            growth.update(alloc.growth(seq.req_idx, min(now + reserve_tokens, limit, alloc.max_ctx)))
    for r in list(reserved.values()):
        growth.update(alloc.growth(r.row, r.end))
    now_pages, end_pages = alloc.pages_to_hold(prompt_len), alloc.pages_to_hold(end)
    free = alloc.num_available()  # pages only the prefix cache holds are evicted for it
    short = [f for f in FAMILIES if max(now_pages[f], end_pages[f]) + growth[f] > free[f]]
    if short:
        f = short[0]
        raise OutOfPages(
            f"{f} pool: a prompt of {prompt_len} needs {max(now_pages[f], end_pages[f])} pages up to {end} "
            f"tokens, {free[f]} free of which {growth[f]} are kept for the requests already decoding"
        )
    row, pages = engine.prealloc(prompt_len, poison=poison)
    reserved[row] = Reservation(row, end)
    return row, pages
