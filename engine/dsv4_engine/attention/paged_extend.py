"""An extend step (prefill chunks, a whole prompt, the reference decode) over the paged pools, driven
by the step's attention metadata (`metadata.build_extend_metadata`, built from the allocator's
out-cache locations).

The model's extend attention reads and writes one request at a time through `SeqCache`
(model/cache.py); `PagedSeqCache` is that view of request b of the step's metadata:
- writes go exactly where the allocator put them: the new tokens' SWA rows at `out_swa_loc`, the
  compressor and indexer state tail at `state_write_loc`, completed blocks at `block_loc` (the C4
  slot is also the indexer's);
- reads go through what the metadata resolved from the request tables: the window before the chunk
  from the first new token's `swa_slots`, the open blocks' stored state from `state_read_slots`,
  compressed rows through the `page_table`.
A read or write outside what the step resolved is an error naming it, never a table lookup of
its own: the metadata is the one source of slots for the step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kernels import KernelSet
from ..memory.out_cache_loc import DSV4OutCacheLoc, ExtendSpec
from ..memory.pools import Dsv4TokenToKVPool
from ..memory.req_to_token import Dsv4ReqPool
from ..model.extend import ForwardBatch
from .metadata import AttentionMetadata, CompressMetadata, build_extend_metadata, row_slots


class PagedSeqCache:
    """Request b of an extend step, as a `SeqCache`. state_dtypes: the (kv, score) dtypes the model
    computes state in, which state reads return (the pools may hold another)."""

    def __init__(
        self,
        kv_pool: Dsv4TokenToKVPool,
        meta: AttentionMetadata,
        b: int,
        state_dtypes: tuple[torch.dtype, torch.dtype],
    ) -> None:
        self.kv = kv_pool
        self.meta = meta
        self.b = b
        self.state_dtypes = state_dtypes
        self.req_idx = int(meta.req_indices[b])
        self.prefix = int(meta.prefix_lens[b])
        self.num_tokens = self.prefix  # the cache holds positions [0, prefix)
        self.page_size = kv_pool.layout.page_size
        self.window = kv_pool.layout.window
        self._ratios = kv_pool.layout.compress_ratios
        lo, hi = int(meta.cu_extend[b]), int(meta.cu_extend[b + 1])
        self._tokens = slice(lo, hi)
        self._own: dict[int, tuple[slice, slice]] = {}  # ratio -> its (block, state write) entries
        for cm in (meta.c4, meta.c128):
            if cm is not None:
                self._own[cm.ratio] = (_entries(cm.block_req, b), _entries(cm.state_write_token, lo, hi))
        self._rows: dict[tuple[int, int], torch.Tensor] = {}  # (ratio, end) -> row slots

    # ---- where ---------------------------------------------------------------------------------
    def _compress(self, ratio: int) -> CompressMetadata:
        cm = self.meta.c4 if ratio == 4 else self.meta.c128
        assert cm is not None
        return cm

    def _state_pool(self, layer: int, name: str) -> tuple[torch.Tensor, int]:
        ratio = self._ratios[layer]
        if name == "indexer":
            buf = self.kv.c4_index_state[layer]
        else:
            buf = (self.kv.c4_state if ratio == 4 else self.kv.c128_state)[layer]
        return buf.view(-1, buf.shape[-1]), ratio

    def _rows_pool(self, layer: int, name: str) -> tuple[torch.Tensor, int]:
        ratio = self._ratios[layer]
        if name == "indexer":
            buf = self.kv.indexer_kv[layer]
        else:
            buf = (self.kv.c4_kv if ratio == 4 else self.kv.c128_kv)[layer]
        return buf.view(-1, buf.shape[-1]), ratio

    def _check_new(self, what: str, start: int, n: int, expected: int) -> None:
        if start != self.prefix or n != expected:
            raise IndexError(
                f"{what} [{start}, {start + n}) of request {self.req_idx}: the step writes "
                f"{expected} from position {self.prefix}"
            )

    # ---- SeqCache ------------------------------------------------------------------------------
    def read_swa(self, layer: int, start: int, end: int) -> torch.Tensor:
        """Positions [start, end) before the chunk: the tail of its first token's window."""
        first = self.meta.swa_slots[self._tokens.start]  # positions prefix - window + 1 .. prefix
        base = self.prefix - self.window + 1
        if start < base or end > self.prefix:
            raise IndexError(f"SWA [{start}, {end}) of request {self.req_idx} is outside the step's window")
        slots = first[start - base : end - base]
        if bool((slots <= 0).any()):  # -1: before position 0; 0: the sentinel (a released page)
            raise IndexError(f"SWA [{start}, {end}) of request {self.req_idx} is not resident")
        buf = self.kv.swa_kv[layer]
        return buf.view(-1, buf.shape[-1]).index_select(0, slots)

    def write_swa(self, layer: int, start: int, rows: torch.Tensor) -> None:
        slots = self.meta.out_swa_loc[self._tokens]
        self._check_new("SWA", start, len(rows), len(slots))
        buf = self.kv.swa_kv[layer]
        buf.view(-1, buf.shape[-1]).index_copy_(0, slots, rows.to(buf.dtype))

    def read_state(self, layer: int, name: str, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored state of positions [start, end), the open blocks the step finishes."""
        flat, ratio = self._state_pool(layer, name)
        cm = self._compress(ratio)
        first = int(cm.state_read_start[self.b])
        stored = first + int(cm.state_read_len[self.b])
        if start < max(first, 0) or end > stored:
            raise IndexError(
                f"{name} state [{start}, {end}) of request {self.req_idx}: the step reads [{first}, {stored})"
            )
        rows = flat.index_select(0, cm.state_read_slots[self.b, start - first : end - first])
        half = flat.shape[-1] // 2
        kv_dtype, score_dtype = self.state_dtypes
        return rows[:, :half].to(kv_dtype), rows[:, half:].to(score_dtype)

    def write_state(self, layer: int, name: str, start: int, kv: torch.Tensor, score: torch.Tensor) -> None:
        """The new tokens' state; only the step's state tail (`state_write_pos`) is kept."""
        flat, ratio = self._state_pool(layer, name)
        cm = self._compress(ratio)
        self._check_new(f"{name} state", start, len(kv), self._tokens.stop - self._tokens.start)
        entries = self._own[ratio][1]
        if entries.start == entries.stop:
            return
        lo = int(cm.state_write_pos[entries.start]) - start
        hi = int(cm.state_write_pos[entries.stop - 1]) - start + 1
        rows = torch.cat([kv[lo:hi], score[lo:hi]], dim=-1).to(flat.dtype)
        flat.index_copy_(0, cm.state_write_loc[entries], rows)

    def read_rows(self, layer: int, name: str, end: int) -> torch.Tensor:
        flat, ratio = self._rows_pool(layer, name)
        slots = self._rows.get((ratio, end))
        if slots is None:
            pages = self.meta.page_table[self.b]
            used = pages[: -(-end // (self.page_size // ratio))]
            if bool((used == 0).any()):
                raise IndexError(f"{name} rows [0, {end}) of request {self.req_idx} are not resident")
            slots = row_slots(pages, torch.arange(end, device=pages.device), ratio, self.page_size)
            self._rows[(ratio, end)] = slots
        return flat.index_select(0, slots)

    def write_rows(self, layer: int, name: str, start: int, rows: torch.Tensor) -> None:
        """The blocks the step completes, from `start` (prefix // ratio)."""
        flat, ratio = self._rows_pool(layer, name)
        cm = self._compress(ratio)
        entries = self._own[ratio][0]
        if start != self.prefix // ratio or len(rows) != entries.stop - entries.start:
            raise IndexError(
                f"{name} rows [{start}, {start + len(rows)}) of request {self.req_idx}: the step completes "
                f"{entries.stop - entries.start} from {self.prefix // ratio}"
            )
        flat.index_copy_(0, cm.block_loc[entries], rows.to(flat.dtype))

    def free(self) -> None:
        raise RuntimeError("a step's view frees nothing: the allocator frees the request's row")


def _entries(owner: torch.Tensor, lo: int, hi: int | None = None) -> slice:
    """The contiguous run of entries whose owner is in [lo, hi) (lo alone: equal to lo); entries are
    ordered by owner (the builders concatenate requests in order)."""
    hi = lo + 1 if hi is None else hi
    first = int(torch.searchsorted(owner, torch.tensor(lo, dtype=owner.dtype)))
    last = int(torch.searchsorted(owner, torch.tensor(hi, dtype=owner.dtype)))
    return slice(first, last)


def state_dtypes(model_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """The dtypes a model computes compressor state in: kv in its own, the score promoted with the
    fp32 position bias (model.FP32_NAMES)."""
    return model_dtype, torch.promote_types(model_dtype, torch.float32)


def paged_extend_batch(
    kv_pool: Dsv4TokenToKVPool,
    req_pool: Dsv4ReqPool,
    specs: Sequence[ExtendSpec],
    bundle: DSV4OutCacheLoc,
    token_ids: Sequence[list[int]],
    model_dtype: torch.dtype,
    device: torch.device | str = "cpu",
    kernels: KernelSet | None = None,
) -> ForwardBatch:
    """The extend step's batch over the pools, after `alloc_extend(specs)` returned `bundle`: its
    metadata, and request b's tokens `token_ids[b]` (positions prefix_len .. seq_len - 1) over its
    `PagedSeqCache`; kernels: the engine's set (default: what an engine on `device` runs)."""
    meta = build_extend_metadata(kv_pool.layout, req_pool, specs, bundle)
    dtypes = state_dtypes(model_dtype)
    caches = [PagedSeqCache(kv_pool, meta, b, dtypes) for b in range(len(specs))]
    return ForwardBatch.build(list(zip(caches, token_ids, strict=True)), device=device, kernels=kernels)
