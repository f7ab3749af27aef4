"""What one forward pass runs, and how its modes differ.

`Dsv4Model.forward` is one function for every step, and every module's `forward` runs in each,
running its ops on the kernel set the batch carries (`kernels.KernelSet`, chosen once per engine; a
decode batch carries the set's decode variant). The batch also brings the attention:
- `ForwardBatch` (extend: prefill chunks, any prefix; also the reference decode): new tokens of
  several requests, flattened, each request's state behind its `SeqCache`; its attention is the
  module's per-request code over the caches.
- `attention.paged_decode.DecodeBatch` (the batched decode step): one token per row, every row from
  the paged pools by static metadata, so it can be compiled or captured; its attention is an
  attention backend's (`attention.paged_decode`), which also owns the pool writes.
Both answer `kernels`, `attend(attn, x)`, `check_positions`, `advance` and `shared_pack`, so the
layers never ask which mode they run in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from dsv4_engine.kernels import KernelSet, choose_kernels
from dsv4_engine.model.cache import SeqCache

if TYPE_CHECKING:
    from dsv4_engine.model.attention import Dsv4Attention


class StepBatch(Protocol):
    """What the model's forward reads from a batch, whatever the mode."""

    input_ids: torch.Tensor
    memo: dict
    kernels: KernelSet  # the ops every module runs in this step

    @property
    def positions(self) -> torch.Tensor: ...

    def check_positions(self, max_positions: int) -> None: ...

    def attend(self, attn: Dsv4Attention, x: torch.Tensor) -> torch.Tensor: ...

    def shared_pack(self, layer: int) -> Any: ...

    def advance(self) -> None: ...


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
    kernels: KernelSet
    # Per-forward memo (masks shared by all layers), filled by the model.
    memo: dict = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        chunks: list[tuple[SeqCache, list[int]]],
        device: torch.device | str = "cpu",
        kernels: KernelSet | None = None,
    ) -> ForwardBatch:
        """A batch from (cache, new token ids) pairs; each chunk continues at `cache.num_tokens`.
        kernels: the engine's set (default: what an engine on `device` runs)."""
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
            kernels=kernels or choose_kernels(device),
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
