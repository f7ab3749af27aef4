"""Attention metadata for a step (chunked prefill, whole prefill or decode) over the paged pools.

Compressed blocks stay on the GLOBAL position grid: block j of ratio r covers positions
[j*r, (j+1)*r) of the request, whatever chunk they arrive in. A step prefix -> seq completes blocks
prefix//r .. seq//r - 1; the first of them may start before prefix, and its earlier rows come from
the compressor state pool (state_read_*). With page-aligned non-final chunks (multiples of 128)
only the ratio-4 overlap (the previous block's 4 rows) crosses a chunk boundary.

Decode is the same step with one token (prefix = seq - 1); the decode builder emits fixed-shape,
per-request fields (masks instead of ragged lists) so DecodeBuffers can hold them in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from ..memory.layout import Dsv4MemoryLayout
from ..memory.out_cache_loc import DSV4OutCacheLoc, ExtendSpec
from ..memory.req_to_token import Dsv4ReqPool
from ..memory.state_tail import cdiv, state_read_range

I64 = torch.int64


@dataclass
class CompressMetadata:
    """Per-ratio compressor and compressed-attention fields.

    block_*: one entry per completed block (extend) or per request (decode, masked by block_mask).
      block_positions is the block's first global position (RoPE position of the compressed row),
      block_req its batch row, block_loc the row slot to write (0 where block_mask is False).
    state_read_*: per request, the stored state rows of positions [start, start + width) with
      start = state_read_range(r, prefix)[0] (may be negative: those columns are sentinel slot 0,
      kv 0 / score -inf, the block-0 overlap fill); columns at or after prefix come from the step's
      own tokens, not from the pool (state_read_len says how many columns are stored).
    state_write_*: positions whose state the step leaves behind (the state tail), the flattened token
      index holding them, and their slots; state_write_mask is False for padding.
    visible: compressed rows each token may attend to, (pos + 1) // r (indexer top-k for ratio 4).
    """

    ratio: int
    block_positions: torch.Tensor
    block_req: torch.Tensor
    block_loc: torch.Tensor
    block_mask: torch.Tensor
    state_read_start: torch.Tensor
    state_read_len: torch.Tensor
    state_read_slots: torch.Tensor
    state_write_pos: torch.Tensor
    state_write_token: torch.Tensor
    state_write_loc: torch.Tensor
    state_write_mask: torch.Tensor
    visible: torch.Tensor

    def to(self, device: torch.device) -> CompressMetadata:
        return replace(
            self, **{f.name: getattr(self, f.name).to(device) for f in fields(self) if f.name != "ratio"}
        )


@dataclass
class AttentionMetadata:
    """Everything a forward over the paged pools needs, for B requests and T new tokens.

    positions / token_req: global position and batch row of each new token.
    out_swa_loc: SWA slot each token's KV is written to (before attention reads).
    swa_slots [T, window]: SWA slots of the window of each token, oldest first, -1 where the
      position is < 0 (masked).
    page_table [B, pages]: full page ids of each request; compressed row j of ratio r lives in slot
      page_table[b, j // (P/r)] * (P/r) + j % (P/r) of the C4 / indexer / C128 pool (see row_slots).
    """

    req_indices: torch.Tensor
    prefix_lens: torch.Tensor
    seq_lens: torch.Tensor
    extend_lens: torch.Tensor
    cu_extend: torch.Tensor
    positions: torch.Tensor
    token_req: torch.Tensor
    out_swa_loc: torch.Tensor
    swa_slots: torch.Tensor
    page_table: torch.Tensor
    c4: CompressMetadata | None
    c128: CompressMetadata | None
    is_decode: bool = False

    def to(self, device: torch.device) -> AttentionMetadata:
        """This metadata on `device`. It is built on the host, where the step's lists are; only the
        request tables it reads live on the device (one row copied back per request and table)."""
        if device.type == "cpu":
            return self
        moved = {
            f.name: value.to(device)
            for f in fields(self)
            if isinstance(value := getattr(self, f.name), torch.Tensor | CompressMetadata)
        }
        return replace(self, **moved)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor by dotted name (used by DecodeBuffers and the data_ptr checks)."""
        out: dict[str, torch.Tensor] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                out[f.name] = value
            elif isinstance(value, CompressMetadata):
                for g in fields(value):
                    sub = getattr(value, g.name)
                    if isinstance(sub, torch.Tensor):
                        out[f"{f.name}.{g.name}"] = sub
        return out


def row_slots(page_table_row: torch.Tensor, rows: torch.Tensor, ratio: int, page_size: int) -> torch.Tensor:
    """Pool slots of compressed rows `rows` of one request (ratio 4 or 128)."""
    per_page = page_size // ratio
    return page_table_row.to(I64)[rows // per_page] * per_page + rows % per_page


def _read_width(ratio: int) -> int:
    return 2 * ratio if ratio == 4 else ratio  # c4: previous block + partial block; c128: partial


def _page_table(req_pool: Dsv4ReqPool, reqs: list[int], seqs: list[int], pages: int, p: int) -> torch.Tensor:
    table = torch.zeros((len(reqs), pages), dtype=torch.int32)
    for b, (i, s) in enumerate(zip(reqs, seqs, strict=True)):
        n = cdiv(s, p)
        table[b, :n] = req_pool.req_to_token[i, 0 : n * p : p].cpu() // p
    return table


def _swa_slots(req_pool: Dsv4ReqPool, req: int, pos: torch.Tensor, window: int) -> torch.Tensor:
    keys = pos[:, None] - torch.arange(window - 1, -1, -1)[None, :]
    slots = req_pool.req_to_token_swa[req].cpu()[keys.clamp(min=0)].to(I64)
    return torch.where(keys >= 0, slots, torch.full_like(slots, -1))


def _state_read(
    state_table: torch.Tensor, req: int, ratio: int, prefix: int
) -> tuple[int, int, torch.Tensor]:
    start, stop = state_read_range(ratio, prefix)
    width = _read_width(ratio)
    cols = torch.arange(start, start + width)
    stored = (cols >= 0) & (cols < stop)
    slots = state_table[req].cpu()[cols.clamp(min=0, max=state_table.shape[1] - 1)].to(I64)
    return start, stop - start, torch.where(stored, slots, torch.zeros_like(slots))


def _compress_extend(
    ratio: int,
    req_pool: Dsv4ReqPool,
    specs: Sequence[ExtendSpec],
    bundle: DSV4OutCacheLoc,
    positions: torch.Tensor,
    cu: list[int],
) -> CompressMetadata:
    table = req_pool.req_to_token_c4_state if ratio == 4 else req_pool.req_to_token_c128_state
    block_loc = bundle.out_c4_loc if ratio == 4 else bundle.out_c128_loc
    state_loc = bundle.out_c4_state_loc if ratio == 4 else bundle.out_c128_state_loc
    written = bundle.c4_state_counts if ratio == 4 else bundle.c128_state_counts
    bpos, breq, rstart, rlen, rslots, wpos, wtok = [], [], [], [], [], [], []
    for b, s in enumerate(specs):
        blocks = torch.arange(s.prefix_len // ratio, s.seq_len // ratio)
        bpos.append(blocks * ratio)
        breq.append(torch.full_like(blocks, b))
        start, n, slots = _state_read(table, s.req_idx, ratio, s.prefix_len)
        rstart.append(start)
        rlen.append(n)
        rslots.append(slots)
        lo = s.seq_len - written[b]  # the step's state writes: the bundle decides them
        wpos.append(torch.arange(lo, s.seq_len))
        wtok.append(torch.arange(lo, s.seq_len) - s.prefix_len + cu[b])
    n_blocks = sum(len(x) for x in bpos)
    if n_blocks != block_loc.numel():
        raise ValueError(f"c{ratio}: bundle has {block_loc.numel()} rows, step completes {n_blocks} blocks")
    write_pos = torch.cat(wpos)
    if write_pos.numel() != state_loc.numel():
        raise ValueError(
            f"c{ratio}: bundle has {state_loc.numel()} state slots, step writes {write_pos.numel()}"
        )
    return CompressMetadata(
        ratio=ratio,
        block_positions=torch.cat(bpos),
        block_req=torch.cat(breq),
        block_loc=block_loc.to(I64),
        block_mask=torch.ones(n_blocks, dtype=torch.bool),
        state_read_start=torch.tensor(rstart, dtype=I64),
        state_read_len=torch.tensor(rlen, dtype=I64),
        state_read_slots=torch.stack(rslots),
        state_write_pos=write_pos,
        state_write_token=torch.cat(wtok),
        state_write_loc=state_loc.to(I64),
        state_write_mask=torch.ones(write_pos.numel(), dtype=torch.bool),
        visible=(positions + 1) // ratio,
    )


def build_extend_metadata(
    layout: Dsv4MemoryLayout,
    req_pool: Dsv4ReqPool,
    specs: Sequence[ExtendSpec],
    bundle: DSV4OutCacheLoc,
    *,
    num_pages: int | None = None,
) -> AttentionMetadata:
    """Metadata for an extend step (any prefix: chunked prefill is a prefix > 0), after alloc_extend,
    on the request tables' device."""
    host = _extend_metadata(layout, req_pool, specs, bundle, num_pages=num_pages)
    return host.to(req_pool.req_to_token.device)


def _extend_metadata(
    layout: Dsv4MemoryLayout,
    req_pool: Dsv4ReqPool,
    specs: Sequence[ExtendSpec],
    bundle: DSV4OutCacheLoc,
    *,
    num_pages: int | None = None,
) -> AttentionMetadata:
    """`build_extend_metadata` on the host."""
    p = layout.page_size
    reqs = [s.req_idx for s in specs]
    seqs = [s.seq_len for s in specs]
    cu = [0]
    for s in specs:
        cu.append(cu[-1] + s.seq_len - s.prefix_len)
    positions = torch.cat([torch.arange(s.prefix_len, s.seq_len) for s in specs])
    token_req = torch.cat(
        [torch.full((s.seq_len - s.prefix_len,), b, dtype=I64) for b, s in enumerate(specs)]
    )
    swa = torch.cat(
        [_swa_slots(req_pool, s.req_idx, torch.arange(s.prefix_len, s.seq_len), layout.window) for s in specs]
    )
    pages = num_pages if num_pages is not None else cdiv(max(seqs), p)
    has4, has128 = bool(layout.c4_layers), bool(layout.c128_layers)
    return AttentionMetadata(
        req_indices=torch.tensor(reqs, dtype=I64),
        prefix_lens=torch.tensor([s.prefix_len for s in specs], dtype=I64),
        seq_lens=torch.tensor(seqs, dtype=I64),
        extend_lens=torch.tensor([s.seq_len - s.prefix_len for s in specs], dtype=I64),
        cu_extend=torch.tensor(cu, dtype=I64),
        positions=positions,
        token_req=token_req,
        out_swa_loc=bundle.out_swa_loc.to(I64),
        swa_slots=swa,
        page_table=_page_table(req_pool, reqs, seqs, pages, p),
        c4=_compress_extend(4, req_pool, specs, bundle, positions, cu) if has4 else None,
        c128=_compress_extend(128, req_pool, specs, bundle, positions, cu) if has128 else None,
    )


def _compress_decode(ratio: int, ext: CompressMetadata, specs: Sequence[ExtendSpec]) -> CompressMetadata:
    # One token per request: spread the ragged block / state-write lists onto per-request rows.
    bsz = len(specs)
    bpos = torch.zeros(bsz, dtype=I64)
    bloc = torch.zeros(bsz, dtype=I64)
    bmask = torch.zeros(bsz, dtype=torch.bool)
    bpos[ext.block_req] = ext.block_positions
    bloc[ext.block_req] = ext.block_loc
    bmask[ext.block_req] = True
    wpos = torch.tensor([s.prefix_len for s in specs], dtype=I64)
    wloc = torch.zeros(bsz, dtype=I64)
    wmask = torch.zeros(bsz, dtype=torch.bool)
    wloc[ext.state_write_token] = ext.state_write_loc
    wmask[ext.state_write_token] = True
    return CompressMetadata(
        ratio=ratio,
        block_positions=bpos,
        block_req=torch.arange(bsz, dtype=I64),
        block_loc=bloc,
        block_mask=bmask,
        state_read_start=ext.state_read_start,
        state_read_len=ext.state_read_len,
        state_read_slots=ext.state_read_slots,
        state_write_pos=wpos,
        state_write_token=torch.arange(bsz, dtype=I64),
        state_write_loc=wloc,
        state_write_mask=wmask,
        visible=ext.visible,
    )


def build_decode_metadata(
    layout: Dsv4MemoryLayout,
    req_pool: Dsv4ReqPool,
    specs: Sequence[ExtendSpec],
    bundle: DSV4OutCacheLoc,
    *,
    num_pages: int | None = None,
) -> AttentionMetadata:
    """Decode metadata (every spec adds exactly one token), fixed shape per request, after alloc_decode."""
    if any(s.seq_len - s.prefix_len != 1 for s in specs):
        raise ValueError("decode steps add exactly one token per request")
    ext = _extend_metadata(layout, req_pool, specs, bundle, num_pages=num_pages)
    ext.is_decode = True
    if ext.c4 is not None:
        ext.c4 = _compress_decode(4, ext.c4, specs)
    if ext.c128 is not None:
        ext.c128 = _compress_decode(128, ext.c128, specs)
    return ext.to(req_pool.req_to_token.device)
