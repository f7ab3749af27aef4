"""What one forward pass runs, and how its modes differ.

`Dsv4Model.forward` is one function for every step; the batch it is given says how each part runs:
- `ForwardBatch` (extend: prefill chunks, any prefix; also the reference decode): new tokens of
  several requests, flattened, each request's state behind its `SeqCache`. Its ops are the modules'
  own forwards (`ExtendOps`), its attention the module's per-request code over the caches.
- `attention.paged_decode.DecodeBatch` (the batched decode step): one token per row, every row from
  the paged pools by static metadata, so it can be compiled or captured; its ops are the decode
  kernel set (`model.decode_ops`) and its attention `paged_decode_attention`.
Both answer `ops`, `attend(attn, x)`, `check_positions`, `advance` and `shared_pack`, so the layers
never ask which mode they run in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from dsv4_engine.model.cache import SeqCache
from dsv4_engine.model.hyper import HyperConnection, expand

if TYPE_CHECKING:
    from torch import nn

    from dsv4_engine.model.attention import Dsv4Attention
    from dsv4_engine.model.moe import MoE, Router
    from dsv4_engine.model.ops import RMSNorm


class StepBatch(Protocol):
    """What the model's forward reads from a batch, whatever the mode."""

    input_ids: torch.Tensor
    memo: dict
    ops: Any  # ExtendOps, or a decode kernel set (model.decode_ops)

    @property
    def positions(self) -> torch.Tensor: ...

    def check_positions(self, max_positions: int) -> None: ...

    def attend(self, attn: Dsv4Attention, x: torch.Tensor) -> torch.Tensor: ...

    def shared_pack(self, layer: int) -> Any: ...

    def advance(self) -> None: ...


class ExtendOps:
    """The ops of an extend step: each module's own forward (which picks its CPU kernel itself), or
    with `kernels=False` the torch code those kernels mirror (`reference`)."""

    def __init__(self, kernels: bool = True) -> None:
        self.kernels = kernels

    def linear(self, m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x)

    grouped_linear = linear

    def norm(self, m: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return m(x)

    def hc_pre(
        self, hc: HyperConnection, streams: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return hc(streams) if self.kernels else hc.reference(streams)

    def hc_post(
        self,
        post: torch.Tensor,
        comb: torch.Tensor,
        out: torch.Tensor,
        streams: torch.Tensor,
        into: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return expand(post, comb, out, streams, into=into)

    def route(
        self, router: Router, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return router(x, input_ids)

    def moe(
        self, moe: MoE, x: torch.Tensor, input_ids: torch.Tensor, shared_pack: Any = None
    ) -> torch.Tensor:
        weights, ids = self.route(moe.gate, x, input_ids)
        experts = moe.experts if self.kernels else moe.experts.reference
        return experts(x, weights, ids).add_(moe.shared_experts(x))


EXTEND_OPS = ExtendOps()


@dataclass
class SeqSlice:
    """One request's new tokens: rows [offset, offset + length) of the batch, positions
    [start, start + length); `cache` holds positions [0, start)."""

    cache: SeqCache
    start: int
    length: int
    offset: int

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.length)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    seqs: list[SeqSlice]
    # Per-forward memo (masks shared by all layers), filled by the model.
    memo: dict = field(default_factory=dict)
    ops: ExtendOps = EXTEND_OPS

    @classmethod
    def build(
        cls,
        chunks: list[tuple[SeqCache, list[int]]],
        device: torch.device | str = "cpu",
        ops: ExtendOps = EXTEND_OPS,
    ) -> ForwardBatch:
        """A batch from (cache, new token ids) pairs; each chunk continues at `cache.num_tokens`."""
        seqs, ids, positions, offset = [], [], [], 0
        for cache, tokens in chunks:
            start = cache.num_tokens
            seqs.append(SeqSlice(cache=cache, start=start, length=len(tokens), offset=offset))
            ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            offset += len(tokens)
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            seqs=seqs,
            ops=ops,
        )

    def check_positions(self, max_positions: int) -> None:
        if len(self.positions) and int(self.positions.max()) >= max_positions:
            raise ValueError(f"position {int(self.positions.max())} exceeds max_positions {max_positions}")

    def attend(self, attn: Dsv4Attention, x: torch.Tensor) -> torch.Tensor:
        """Attention `[T, H, D]` (RoPE undone) over each request's cache."""
        return attn.extend_attention(x, self)

    def shared_pack(self, layer: int) -> Any:
        return None  # the modules' own projections

    def advance(self) -> None:
        """After the forward: every request's cache holds its new tokens too."""
        for seq in self.seqs:
            seq.cache.num_tokens = seq.end
