"""Fill a bucket's static decode buffers from the step's out-cache locations and the request tables,
vectorised over the batch.

The same fields `build_decode_metadata` + `DecodeBuffers.refresh` produce (the tests check every
field), in about two tensor ops per field instead of a Python loop per request: on a dispatch-bound
decode step the metadata must cost far less than the forward. What the step writes, and where, is
the allocator's (`alloc_decode`'s bundle, one slot per row in `DecodeLocs`: a row writes where its
slot is not the sentinel 0); what it reads comes from the tables.
"""

from __future__ import annotations

import functools

import torch

from ..memory.out_cache_loc import DSV4OutCacheLoc
from ..memory.req_to_token import Dsv4ReqPool
from .metadata import AttentionMetadata, CompressMetadata

I64 = torch.int64


class DecodeLocs:
    """Where each row of a decode step writes, one int64 slot per row (0, the sentinel slot, where it
    writes nothing): its SWA row, and per ratio its completed block's row and its state row. One
    `[5, bucket]` tensor (`slots`, one host copy a step), its rows named by `KINDS`."""

    KINDS = ("swa", "c4", "c4_state", "c128", "c128_state")

    def __init__(self, slots: torch.Tensor) -> None:
        if slots.dim() != 2 or slots.shape[0] != len(self.KINDS):
            raise ValueError(f"DecodeLocs holds {len(self.KINDS)} rows of slots, got {tuple(slots.shape)}")
        self.slots = slots
        self.swa, self.c4, self.c4_state, self.c128, self.c128_state = slots.unbind(0)

    @classmethod
    def zeros(cls, bucket: int, device: torch.device | str = "cpu") -> DecodeLocs:
        return cls(torch.zeros(len(cls.KINDS), bucket, dtype=I64, device=device))

    @classmethod
    def of(cls, bundle: DSV4OutCacheLoc, bucket: int) -> DecodeLocs:
        """A decode step's bundle (one token per request, so at most one slot of each kind per row)
        as one slot per row, padded to the bucket."""
        return cls(torch.tensor(cls.rows(bundle, bucket), dtype=I64).view(len(cls.KINDS), bucket))

    @classmethod
    def rows(cls, bundle: DSV4OutCacheLoc, bucket: int) -> list[int]:
        """`of`'s slots as one flat list, kind after kind (a host tensor built with other inputs)."""
        n = len(bundle.extend_counts)
        if bundle.extend_counts != [1] * n:
            raise ValueError("a decode step's bundle has one new token per request")
        pad = [0] * (bucket - n)
        rows: list[int] = []
        for values, counts in (
            (bundle.out_swa_loc, bundle.extend_counts),
            (bundle.out_c4_loc, bundle.c4_counts),
            (bundle.out_c4_state_loc, bundle.c4_state_counts),
            (bundle.out_c128_loc, bundle.c128_counts),
            (bundle.out_c128_state_loc, bundle.c128_state_counts),
        ):
            slots = values.tolist()
            if any(c > 1 for c in counts) or sum(counts) != len(slots):
                raise ValueError(f"a decode step writes at most one slot of a kind per row, got {counts}")
            if len(slots) == n:  # every row writes one (always true of swa)
                rows += slots
            else:
                it = iter(slots)
                rows += [next(it) if c else 0 for c in counts]
            rows += pad
        return rows


def _put(dst: torch.Tensor, value: torch.Tensor, valid: torch.Tensor, pad: int = 0) -> None:
    """dst = value on valid rows, `pad` on padding rows (one where + one copy, whatever the batch)."""
    keep = valid.view(-1, *([1] * (dst.dim() - 1)))
    dst.copy_(torch.where(keep, value, pad).to(dst.dtype))


def _gather(table: torch.Tensor, req: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    return table[req, cols.clamp(0, table.shape[1] - 1)].to(I64)


def _fill_compress(
    cm: CompressMetadata, state_table: torch.Tensor, block_loc: torch.Tensor, state_loc: torch.Tensor,
    req: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, rows: torch.Tensor,
) -> None:  # fmt: skip
    r = cm.ratio
    seq = pos + 1
    complete = block_loc > 0
    block = pos // r
    cm.block_req.copy_(rows)
    cm.state_write_token.copy_(rows)
    _put(cm.block_positions, torch.where(complete, block * r, 0), valid)
    _put(cm.block_loc, block_loc, valid)
    _put(cm.block_mask, complete, valid)
    start = block * r - (r if r == 4 else 0)  # c4 also reads the previous block (overlap)
    _put(cm.state_read_start, start, valid)
    _put(cm.state_read_len, pos - start, valid)
    cols = start[:, None] + torch.arange(cm.state_read_slots.shape[1], device=pos.device)[None, :]
    stored = (cols >= 0) & (cols < pos[:, None])
    _put(cm.state_read_slots, torch.where(stored, _gather(state_table, req[:, None], cols), 0), valid)
    _put(cm.state_write_pos, pos, valid)
    _put(cm.state_write_loc, state_loc, valid)
    _put(cm.state_write_mask, state_loc > 0, valid)
    _put(cm.visible, seq // r, valid)


def fill_decode_buffers(
    buf: AttentionMetadata,
    req_pool: Dsv4ReqPool,
    page_size: int,
    req: torch.Tensor,
    pos: torch.Tensor,
    valid: torch.Tensor,
    locs: DecodeLocs,
) -> None:
    """Write one decode step into `buf` in place: `req`, `pos`, `valid` are `[bucket]` tensors (the
    request row, the position it decodes, False on padding rows, which must come last), `locs`
    where each row writes. Static shapes and no host reads, so it may run inside a compiled or
    captured step."""
    bs = buf.positions.shape[0]
    req = torch.where(valid, req, 0)
    pos = torch.where(valid, pos, 0)
    seq = pos + 1
    rows = torch.arange(bs, dtype=I64, device=pos.device)
    _put(buf.req_indices, req, valid)
    _put(buf.prefix_lens, pos, valid)
    _put(buf.seq_lens, seq, valid)
    _put(buf.extend_lens, torch.ones_like(pos), valid)
    buf.cu_extend[0] = 0
    buf.cu_extend[1:].copy_(torch.cumsum(valid.to(I64), dim=0))
    _put(buf.positions, pos, valid)
    buf.token_req.copy_(rows)
    swa_table = req_pool.req_to_token_swa
    _put(buf.out_swa_loc, locs.swa, valid)
    window = buf.swa_slots.shape[1]
    keys = pos[:, None] - torch.arange(window - 1, -1, -1, device=pos.device)[None, :]
    _put(buf.swa_slots, torch.where(keys >= 0, _gather(swa_table, req[:, None], keys), -1), valid, pad=-1)
    pages = torch.arange(buf.page_table.shape[1], device=pos.device)[None, :]
    first = _gather(req_pool.req_to_token, req[:, None], pages * page_size) // page_size
    held = pages < (seq[:, None] + page_size - 1) // page_size
    _put(buf.page_table, torch.where(held, first, 0), valid)
    if buf.c4 is not None:
        _fill_compress(buf.c4, req_pool.req_to_token_c4_state, locs.c4, locs.c4_state, req, pos, valid, rows)
    if buf.c128 is not None:
        table = req_pool.req_to_token_c128_state
        _fill_compress(buf.c128, table, locs.c128, locs.c128_state, req, pos, valid, rows)


@functools.cache
def _kernel_fields() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The buffer names `dsv4::fill_decode` takes, in its order: the kernel defines them, so Python and
    C++ cannot disagree on which list position is which field."""
    main, compress = torch.ops.dsv4.fill_decode_fields()
    return tuple(main), tuple(compress)


def fill_decode_buffers_kernel(
    buf: AttentionMetadata,
    req_pool: Dsv4ReqPool,
    page_size: int,
    req: torch.Tensor,
    pos: torch.Tensor,
    valid: torch.Tensor,
    locs: DecodeLocs,
) -> None:
    """`fill_decode_buffers` as one `dsv4::fill_decode` CPU kernel call (about 230 eager ops
    otherwise). It reads the inputs on the host, so it is for eager CPU steps only."""
    main_fields, compress_fields = _kernel_fields()
    fields = [getattr(buf, name) for name in main_fields]
    c4 = [getattr(buf.c4, name) for name in compress_fields] if buf.c4 is not None else []
    c128 = [getattr(buf.c128, name) for name in compress_fields] if buf.c128 is not None else []
    torch.ops.dsv4.fill_decode(
        req, pos, valid, req_pool.req_to_token_swa, req_pool.req_to_token,
        req_pool.req_to_token_c4_state, req_pool.req_to_token_c128_state, page_size,
        locs.swa, locs.c4, locs.c4_state, locs.c128, locs.c128_state, fields, c4, c128,
    )  # fmt: skip
