"""What one scheduled step asks the allocator for and gets back: `ExtendSpec` (one request's
`prefix_len -> seq_len`) and `DSV4OutCacheLoc` (every slot the step writes, over the batch)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ExtendSpec:
    """One request's step `prefix_len -> seq_len`. keep_len: the shortest length the step may be
    cut back to afterwards (`Dsv4Allocator.truncate`; a speculative verify keeps at least its first
    token): the step also writes the compressor state of that length's tail. None: seq_len."""

    req_idx: int
    prefix_len: int
    seq_len: int
    keep_len: int | None = None


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


def one_token_steps(
    specs: list[ExtendSpec], bundle: DSV4OutCacheLoc
) -> tuple[list[ExtendSpec], DSV4OutCacheLoc]:
    """A step of a few tokens per request (a speculative verify) as one-token steps in position
    order, with the same slots: what the batched decode step runs. A decode writes every pool before
    it reads one, row after row, so a token reads the state its request's earlier tokens wrote in the
    same step. Each block row goes to the token that completes it, each state row to its position.
    keep_len carries over."""
    steps: list[ExtendSpec] = []
    counts: list[list[int]] = [[], [], [], [], []]
    for i, s in enumerate(specs):
        lo4, lo128 = s.seq_len - bundle.c4_state_counts[i], s.seq_len - bundle.c128_state_counts[i]
        for p in range(s.prefix_len, s.seq_len):
            steps.append(ExtendSpec(s.req_idx, p, p + 1, s.keep_len))
            counts[0].append(1)
            counts[1].append(int((p + 1) % 4 == 0))
            counts[2].append(int((p + 1) % 128 == 0))
            counts[3].append(int(p >= lo4))
            counts[4].append(int(p >= lo128))
    tensors = (
        bundle.out_full_loc,
        bundle.out_swa_loc,
        bundle.out_c4_loc,
        bundle.out_c128_loc,
        bundle.out_c4_state_loc,
        bundle.out_c128_state_loc,
    )
    return steps, DSV4OutCacheLoc(*tensors, *counts)
