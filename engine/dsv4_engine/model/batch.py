"""What one forward pass runs: new tokens of several requests, flattened."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4_engine.model.cache import SeqCache


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

    @classmethod
    def build(
        cls, chunks: list[tuple[SeqCache, list[int]]], device: torch.device | str = "cpu"
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
        )
