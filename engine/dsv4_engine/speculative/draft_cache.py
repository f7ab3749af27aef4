"""The MTP layer's sliding-window rows: a ring of positions per request row.

A position p of request row r lives at slot `1 + r * ring + p % ring` (slot 0 takes the writes a pass
drops, as the pools' sentinel does). A step's draft passes rewrite
every position from the last accepted one on before reading it, and draft at most k positions past
it, so with `ring >= window + 2k` a stale write never lands on a position a later query still reads.
Each pass says which positions hold its request's rows (`Sequence.draft_window_from`, carried by
`DraftRow.window_from`): those before are masked out of the window (before a prefix-cache hit the
target's state came from the cache); they cost the draft context, never correctness. A PD decode
server's rows start at the window the prefill server sent with the state (`write`).
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

    def _slots(self, rows: int | torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return 1 + rows * self.ring + positions % self.ring

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """Positions [start, end) of request row `row`, oldest first (end - start <= ring)."""
        return self.kv.index_select(0, self._slots(row, torch.arange(start, end)).to(self.device))

    def write(self, row: int, start: int, rows: torch.Tensor) -> None:
        """Rows `rows` as positions [start, start + len(rows)) of request row `row` (a PD transfer's
        window: the prefill server computed them)."""
        slots = self._slots(row, torch.arange(start, start + len(rows))).to(self.device)
        self.kv.index_copy_(0, slots, rows.to(self.kv.dtype).to(self.device))

    def slots(self, tokens: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For tokens (request row, the first position the row holds for its request, position), in
        a pass's order: the slot each writes `[T]`, the slots of its window, oldest first, -1 where
        masked `[T, window]`, and whether it writes at all `[T]`: a pass longer than the ring (a
        prefill chunk) keeps only each row's last `ring` positions, whose slots it would otherwise
        write twice. Only the last token of a row drafts, and its window is all there; earlier tokens
        of so long a pass read what the ring holds."""
        last: dict[int, int] = {}
        for row, _, pos in tokens:
            last[row] = max(last.get(row, pos), pos)
        rows = torch.tensor([t[0] for t in tokens], dtype=torch.long)
        first = torch.tensor([t[1] for t in tokens], dtype=torch.long)
        pos = torch.tensor([t[2] for t in tokens], dtype=torch.long)
        keep = pos > torch.tensor([last[t[0]] for t in tokens], dtype=torch.long) - self.ring
        window = pos[:, None] + torch.arange(1 - self.window, 1)[None, :]
        slots = torch.where(
            (window >= first[:, None]) & (window >= 0), self._slots(rows[:, None], window), -1
        )
        return self._slots(rows, pos).to(self.device), slots.to(self.device), keep.to(self.device)
