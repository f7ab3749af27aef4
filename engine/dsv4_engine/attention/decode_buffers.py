"""Static decode metadata per batch-size bucket, refreshed in place.

A graph backend (aclgraph on NPU, CUDA graphs on GPU) captures a decode step once per bucket against
these tensors; every later step copies fresh metadata into the same storage (data_ptr never changes)
and replays. Padding rows are inert: no compressed block, no state write, every SWA key masked, seq 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..memory.layout import Dsv4MemoryLayout
from ..memory.state_tail import cdiv
from .metadata import AttentionMetadata, CompressMetadata, _read_width

I64 = torch.int64
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def buckets_for(max_batch: int | None) -> tuple[int, ...]:
    """The default buckets up to the first that holds `max_batch` (every bucket costs buffers, and a
    compile or capture at warm-up); all of them when it is None or larger than the last."""
    if max_batch is None or max_batch > DEFAULT_BUCKETS[-1]:
        return DEFAULT_BUCKETS
    holds = next(b for b in DEFAULT_BUCKETS if b >= max_batch)
    return tuple(b for b in DEFAULT_BUCKETS if b <= holds)


# Pad value per field: -1 masks an SWA key; 0 elsewhere is the sentinel slot / no-op.
_PAD = {"swa_slots": -1}


def _compress_buffers(ratio: int, bs: int, device: torch.device) -> CompressMetadata:
    z = lambda: torch.zeros(bs, dtype=I64, device=device)  # noqa: E731
    f = lambda: torch.zeros(bs, dtype=torch.bool, device=device)  # noqa: E731
    return CompressMetadata(
        ratio=ratio,
        block_positions=z(), block_req=z(), block_loc=z(), block_mask=f(),
        state_read_start=z(), state_read_len=z(),
        state_read_slots=torch.zeros((bs, _read_width(ratio)), dtype=I64, device=device),
        state_write_pos=z(), state_write_token=z(), state_write_loc=z(), state_write_mask=f(),
        visible=z(),
    )  # fmt: skip


class DecodeBuffers:
    def __init__(
        self,
        layout: Dsv4MemoryLayout,
        max_context_len: int,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        device: str | torch.device = "cpu",
    ) -> None:
        self.layout = layout
        self.buckets = tuple(sorted(buckets))
        self.num_pages = cdiv(max_context_len, layout.page_size)
        dev = torch.device(device)
        self._bufs: dict[int, AttentionMetadata] = {}
        for bs in self.buckets:
            z = lambda n=bs: torch.zeros(n, dtype=I64, device=dev)  # noqa: E731
            self._bufs[bs] = AttentionMetadata(
                req_indices=z(), prefix_lens=z(), seq_lens=z(), extend_lens=z(),
                cu_extend=torch.zeros(bs + 1, dtype=I64, device=dev),
                positions=z(), token_req=z(), out_swa_loc=z(),
                swa_slots=torch.full((bs, layout.window), -1, dtype=I64, device=dev),
                page_table=torch.zeros((bs, self.num_pages), dtype=torch.int32, device=dev),
                c4=_compress_buffers(4, bs, dev) if layout.c4_layers else None,
                c128=_compress_buffers(128, bs, dev) if layout.c128_layers else None,
                is_decode=True,
            )  # fmt: skip

    def bucket_for(self, batch_size: int) -> int:
        for bs in self.buckets:
            if bs >= batch_size:
                return bs
        raise ValueError(f"batch size {batch_size} exceeds the largest bucket {self.buckets[-1]}")

    def buffers(self, bucket: int) -> AttentionMetadata:
        return self._bufs[bucket]

    def refresh(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Copy decode metadata into its bucket's buffers (padding the tail) and return the buffers."""
        if not meta.is_decode:
            raise ValueError("DecodeBuffers takes decode metadata (build_decode_metadata)")
        n = int(meta.req_indices.numel())
        buf = self._bufs[self.bucket_for(n)]
        src, dst = meta.tensors(), buf.tensors()
        for name, out in dst.items():
            value = src[name]
            base = name.rsplit(".", 1)[-1]
            if base == "cu_extend":
                out.copy_(torch.arange(out.numel(), dtype=I64).clamp(max=n))  # one token per row
                continue
            if base in ("block_req", "state_write_token", "token_req"):
                out.copy_(torch.arange(out.shape[0], dtype=I64))
                continue
            out.fill_(_PAD.get(base, 0))
            if base == "page_table":
                out[:n, : value.shape[1]].copy_(value[:, : out.shape[1]])
            else:
                out[:n].copy_(value)
        return buf
