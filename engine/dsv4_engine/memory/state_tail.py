"""Pure position arithmetic shared by the allocator, the metadata builders and the PD payloads.

All positions are raw-token positions on the request's global grid. Ranges are half-open.
"""

from __future__ import annotations

from typing import TypeVar

P = TypeVar("P")  # a position: an int, or a tensor of them (the arithmetic below serves both)

# The seed's state tail is defined against 128-token blocks (the c128 ratio), whatever the page size.
STATE_TAIL_BLOCK = 128
# Watermarks: raw positions of compressor state kept behind the newest position (seed: 8+16, 128+64).
C4_STATE_KEEP = 8 + 16
C128_STATE_KEEP = 128 + 64


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def page_floor(pos: int, page_size: int) -> int:
    return (pos // page_size) * page_size


def c4_state_alloc_len(seq_len: P) -> P:
    """Raw positions at the end of the sequence that keep c4 compressor state (the seed's formula).

    A c4 block borrows the previous block (overlap), so when the partial tail is shorter than one
    block (tail <= 3) the previous 128 positions are kept too. Written as arithmetic, so the one rule
    serves an int and a tensor of positions (the batched decode fill) alike.
    """
    tail = seq_len % STATE_TAIL_BLOCK  # type: ignore[operator]
    return tail + STATE_TAIL_BLOCK * ((tail <= 3) & (seq_len >= STATE_TAIL_BLOCK))  # type: ignore[operator,return-value]


def c128_state_alloc_len(seq_len: P) -> P:
    """Raw positions of the unfinished c128 block: only they need state."""
    return seq_len % STATE_TAIL_BLOCK  # type: ignore[operator,return-value]


def state_alloc_len(ratio: int, seq_len: P) -> P:
    if ratio == 4:
        return c4_state_alloc_len(seq_len)
    if ratio == 128:
        return c128_state_alloc_len(seq_len)
    raise ValueError(f"compress ratio must be 4 or 128, got {ratio}")


def state_alloc_offset(ratio: int, seq_len: P) -> P:
    """First position of the state tail: positions [offset, seq_len) hold compressor state."""
    return seq_len - state_alloc_len(ratio, seq_len)  # type: ignore[operator,return-value]


def state_write_from(
    ratio: int, prefix_len: int, seq_len: int, page_size: int, keep_len: int | None = None
) -> int:
    """First position whose state a step prefix_len -> seq_len writes: its new tail, and for ratio 4
    also the block just before the last page boundary it reaches. A prefix-cache snapshot at that
    boundary needs that block (the next block's overlap half), so a chunk that runs past the boundary
    still leaves it behind; it is released with the step's tail, by the usual watermark.
    keep_len: a step that may be cut back to any length from keep_len on (speculative decoding's
    verify) writes the tail of each; the offset only grows with the length, so keep_len's is lowest."""
    lo = state_alloc_offset(ratio, seq_len if keep_len is None else min(keep_len, seq_len))
    boundary = seq_len // page_size * page_size
    if ratio == 4 and boundary >= page_size:
        lo = min(lo, boundary - 4)
    return max(prefix_len, lo)


def state_keep(ratio: int) -> int:
    return C4_STATE_KEEP if ratio == 4 else C128_STATE_KEEP


def state_keep_from(ratio: int, prefix_len: int, seq_len: int) -> int:
    """Lowest position whose state must survive a step prefix_len -> seq_len.

    The step reads the state of the block(s) open at prefix_len (watermark behind prefix_len) and
    writes the new tail (state_alloc_offset(seq_len)); anything older may be evicted.
    """
    return max(0, min(state_alloc_offset(ratio, seq_len), prefix_len - state_keep(ratio)))


def state_read_range(ratio: int, prefix_len: int) -> tuple[int, int]:
    """Positions whose stored state a step starting at prefix_len reads to finish its first block.

    c4 also reads the previous full block (the overlap half). The start may be negative: those rows
    resolve to the sentinel page (kv 0, score -inf), which is exactly block 0's borrowed fill.
    """
    start = (prefix_len // ratio) * ratio
    if ratio == 4:
        start -= ratio
    return start, prefix_len


def swa_keep_from(prefix_len: int, window: int) -> int:
    """Lowest position a step starting at prefix_len may attend to through the sliding window.

    The first new query sits at prefix_len and sees [prefix_len - window + 1, prefix_len]; one more
    position is kept so a PD payload cut at seq_len - window is always resident.
    """
    return max(0, prefix_len - window)


def swa_window_start(seq_len: int, window: int, page_size: int) -> int:
    """First page-aligned position of the SWA pages a request needs after reaching seq_len."""
    return page_floor(max(0, seq_len - window), page_size)
