"""What one scheduled step asks the allocator for and gets back: `ExtendSpec` (one request's
`prefix_len -> seq_len`) and `DSV4OutCacheLoc` (every slot the step writes, over the batch)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ExtendSpec:
    req_idx: int
    prefix_len: int
    seq_len: int


@dataclass
class DSV4OutCacheLoc:
    """Slots a step writes, concatenated over the batch in request order (int64).

    out_full_loc / out_swa_loc: one per new token (positions prefix..seq-1).
    out_c4_loc / out_c128_loc: one per compressed block the step completes (blocks prefix//r ..
      seq//r - 1); the C4 slot is also the indexer slot.
    out_c4_state_loc / out_c128_state_loc: one per position whose compressor state the step leaves
      behind (positions max(prefix, state_alloc_offset(seq)) .. seq-1).
    The *_counts lists split each tensor by request.
    """

    out_full_loc: torch.Tensor
    out_swa_loc: torch.Tensor
    out_c4_loc: torch.Tensor
    out_c128_loc: torch.Tensor
    out_c4_state_loc: torch.Tensor
    out_c128_state_loc: torch.Tensor
    extend_counts: list[int] = field(default_factory=list)
    c4_counts: list[int] = field(default_factory=list)
    c128_counts: list[int] = field(default_factory=list)
    c4_state_counts: list[int] = field(default_factory=list)
    c128_state_counts: list[int] = field(default_factory=list)

    def select(self, lo: int, hi: int) -> DSV4OutCacheLoc:
        """The bundle of requests [lo, hi) of this step (e.g. its decodes, which come first)."""
        pairs = (
            (self.out_full_loc, self.extend_counts),
            (self.out_swa_loc, self.extend_counts),
            (self.out_c4_loc, self.c4_counts),
            (self.out_c128_loc, self.c128_counts),
            (self.out_c4_state_loc, self.c4_state_counts),
            (self.out_c128_state_loc, self.c128_state_counts),
        )
        tensors = [t[sum(c[:lo]) : sum(c[:hi])] for t, c in pairs]
        counts = [
            c[lo:hi]
            for c in (
                self.extend_counts,
                self.c4_counts,
                self.c128_counts,
                self.c4_state_counts,
                self.c128_state_counts,
            )
        ]
        return DSV4OutCacheLoc(*tensors, *counts)
