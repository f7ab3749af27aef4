"""The MTP layer's batch (`model.batch.StepBatch`): one row per token, its window in the draft
ring (`DraftCache`), attention by the decode kernels' `masked_put` and `paged_attention`. Every row's
K=V row is written before any is read, so a token sees the ones before it in the same pass."""

from __future__ import annotations

from typing import Any

import torch

from dsv4_engine.kernels import KernelSet
from dsv4_engine.model.packed import Packed


class DraftBatch:
    def __init__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ring: torch.Tensor,
        out_slots: torch.Tensor,
        window_slots: torch.Tensor,
        keep: torch.Tensor,
        kernels: KernelSet,
        packs: tuple[Packed, Packed] | None = None,
    ) -> None:
        """packs: the MTP layer's packed attention-input and shared-expert projections."""
        self.input_ids, self._positions, self.kernels, self.packs = input_ids, positions, kernels, packs
        self.ring, self.out_slots, self.window_slots = ring, out_slots, window_slots
        self.memo: dict = {}
        self._keep = keep  # rows that write their K=V row (the others: into the ring's slot 0)
        self._no_pages = torch.zeros(len(positions), 1, dtype=torch.long, device=positions.device)

    @property
    def positions(self) -> torch.Tensor:
        return self._positions

    def check_positions(self, max_positions: int) -> None:
        """The drafter's positions are the target's, which its own batch checked."""

    def attention_pack(self, layer: int) -> Packed | None:
        return self.packs[0] if self.packs is not None else None

    def shared_pack(self, layer: int) -> Packed | None:
        return self.packs[1] if self.packs is not None else None

    def compress(self, *args: Any) -> Any:
        raise RuntimeError("the MTP layer is a sliding-window layer: it has no compressor")

    def index_topk(self, *args: Any) -> Any:
        raise RuntimeError("the MTP layer is a sliding-window layer: it has no indexer")

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        kv: torch.Tensor,
        rows: Any,
        picks: Any,
        sinks: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        k = self.kernels
        k.masked_put(self.ring, self.out_slots, kv, self._keep)
        return k.paged_attention(
            q, self.ring, self.window_slots, None, self._no_pages, None, None, 0, 1, sinks, scaling
        )

    def advance(self) -> None:
        """The ring, not a cache, holds the rows: nothing to advance."""
