"""The MTP layer's sliding-window rows: a ring of positions per request row.

A position p of request row r lives at slot `1 + r * ring + p % ring` (slot 0 takes the writes a pass
drops, as the pools' sentinel does). A step's draft passes rewrite
every position from the last accepted one on before reading it, and draft at most k positions past
it, so with `ring >= window + 2k` a stale write never lands on a position a later query still reads.
Positions the request never wrote here (before a prefix-cache hit, or before a PD transfer: the
target's state came from elsewhere) are masked out of the window; they cost the draft context,
never correctness.
"""

from __future__ import annotations

import torch


class DraftCache:
    def __init__(
        self,
        rows: int,
        window: int,
        num_draft_tokens: int,
        dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.window = window
        self.ring = window + 2 * num_draft_tokens + 1
        self.kv = torch.zeros(1 + rows * self.ring, dim, dtype=dtype, device=device)  # flat: slots
        self.device = device
        self._owner: list[str | None] = [None] * rows
        self._written_from = [0] * rows  # the first position the row's current request wrote

    def slots(self, tokens: list[tuple[int, str, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For tokens (request row, request id, position), in a pass's order: the slot each writes
        `[T]`, the slots of its window, oldest first, -1 where masked `[T, window]`, and whether it
        writes at all `[T]`: a pass longer than the ring (a prefill chunk) keeps only each row's last
        `ring` positions, whose slots it would otherwise write twice. Only the last token of a row
        drafts, and its window is all there; earlier tokens of so long a pass read what the ring holds.
        A request new to its row starts the row's written range at its first position."""
        last: dict[int, int] = {}
        for row, request_id, pos in tokens:
            if self._owner[row] != request_id:
                self._owner[row], self._written_from[row] = request_id, pos
            last[row] = max(last.get(row, pos), pos)
        rows = torch.tensor([t[0] for t in tokens], dtype=torch.long)
        pos = torch.tensor([t[2] for t in tokens], dtype=torch.long)
        first = torch.tensor([self._written_from[t[0]] for t in tokens], dtype=torch.long)
        keep = pos > torch.tensor([last[t[0]] for t in tokens], dtype=torch.long) - self.ring
        window = pos[:, None] + torch.arange(1 - self.window, 1)[None, :]
        slots = 1 + rows[:, None] * self.ring + window % self.ring
        slots = torch.where((window >= first[:, None]) & (window >= 0), slots, -1)
        out = 1 + rows * self.ring + pos % self.ring
        return out.to(self.device), slots.to(self.device), keep.to(self.device)
