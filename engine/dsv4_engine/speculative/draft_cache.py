"""The MTP layer's sliding-window rows: a ring of positions per request row.

A position p of request row r lives at slot `1 + r * ring + p % ring` (slot 0 takes the writes a pass
drops, as the pools' sentinel does). A step's draft passes rewrite
every position from the last accepted one on before reading it, and draft at most k positions past
it, so with `ring >= window + 2k` a stale write never lands on a position a later query still reads.
Each pass says which positions hold its request's rows (`Sequence.draft_window_from`, carried by
`DraftRow.window_from`): those before are masked out of the window; they cost the draft context,
never correctness. A PD decode server's rows start at the window the prefill server sent with the
state (`write`).

Prefix-cache snapshots carry the window too (`apply`). A request resumed at page boundary P drafts
from position P - 1 on, whose row reads the window before it: the snapshot keeps the rows of
[P - window, P - 1), which depend on the cached tokens only, and the target's last-layer stream at
P - 1 (`tail`), from which the resumed request's first pass computes row P - 1 with its own token at
P (`resumed`, `DraftRow.carried`). Its drafts are then what they would be had it prefilled [0, P)
itself.
"""

from __future__ import annotations

import torch

from dsv4_engine.memory.state_copies import StateCopy


class DraftCache:
    def __init__(
        self,
        rows: int,
        window: int,
        num_draft_tokens: int,
        dim: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        stream_shape: tuple[int, int],
        snapshot_slots: int = 0,
    ) -> None:
        """stream_shape: one position's last-layer streams (hc, hidden); snapshot_slots: the prefix
        cache's (`Dsv4Allocator.snapshot_slots`), each keeping a window here."""
        self.window = window
        self.ring = window + 2 * num_draft_tokens + 1
        self.kv = torch.zeros(1 + rows * self.ring, dim, dtype=dtype, device=device)  # flat: slots
        self.device = device
        # Per request row: the target's stream at the last position its latest first pass covered.
        self.tail = torch.zeros(rows, *stream_shape, dtype=dtype, device=device)
        # row -> (first position its ring holds, position of its tail), for the rows of the latest
        # step's first pass (`Drafter.propose` sets it): what a snapshot taken after that step keeps.
        self.held: dict[int, tuple[int, int]] = {}
        # Per snapshot slot (id 0 unused): the rows of [P - window, P - 1), the tail at P - 1, and
        # the first position whose row is valid (None: the slot keeps no window).
        self.snap_kv = torch.zeros(1 + snapshot_slots, window - 1, dim, dtype=dtype, device=device)
        self.snap_tail = torch.zeros(1 + snapshot_slots, *stream_shape, dtype=dtype, device=device)
        self.snap_from: list[int | None] = [None] * (1 + snapshot_slots)
        # row -> (P, first valid position): restored from a snapshot, its first pass not run yet.
        self.resumed: dict[int, tuple[int, int]] = {}

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
        self.resumed.pop(row, None)

    def first_pass(self, row: int, start: int) -> tuple[int, bool]:
        """A request's first pass on `row`, from position `start`: the first position its window
        holds, and whether the row was restored from a snapshot at `start` (the pass then computes
        row start - 1 first, `DraftRow.carried`)."""
        resumed = self.resumed.get(row)
        if resumed is not None and resumed[0] == start:
            return resumed[1], True
        return start, False

    def apply(self, copies: list[StateCopy]) -> None:
        """The prefix cache's snapshot copies (state_copies.py), beside the pools' C4 rows: a save
        keeps the row's window before P, if its latest pass ended at P - 1; a restore puts it back
        into the resumed row. Saves first, as the pools run them."""
        for c in sorted(copies, key=lambda c: not c.save):
            p = c.position
            slots = self._slots(c.req_idx, torch.arange(p - self.window, p - 1)).to(self.device)
            if c.save:
                first, last = self.held.pop(c.req_idx, (p, -1))
                self.snap_from[c.slot] = max(first, p - self.window, 0) if last == p - 1 else None
                self.snap_kv[c.slot] = self.kv.index_select(0, slots)
                self.snap_tail[c.slot] = self.tail[c.req_idx]
                continue
            first = self.snap_from[c.slot]
            if first is None:
                self.resumed.pop(c.req_idx, None)
                continue
            self.kv.index_copy_(0, slots, self.snap_kv[c.slot])
            self.tail[c.req_idx] = self.snap_tail[c.slot]
            self.resumed[c.req_idx] = (p, first)

    def export_window(self, row: int, n: int) -> dict[str, torch.Tensor]:
        """What a snapshot at n restored into `row` holds (none: {}), for a prefix-cache file
        (memory/prefix_store.py): the first valid position, the rows of [n - window, n - 1), the
        stream at n - 1."""
        resumed = self.resumed.get(row)
        if resumed is None or resumed[0] != n:
            return {}
        return {
            "mtp_from": torch.tensor(resumed[1]),
            "mtp_rows": self.read(row, n - self.window, n - 1).cpu(),
            "mtp_tail": self.tail[row].to("cpu", copy=True),  # not a view of the live buffer
        }

    def import_window(self, row: int, n: int, window: dict[str, torch.Tensor]) -> None:
        """Put an exported window into `row` as if its last pass had ended at n - 1, so the snapshot
        the row is about to give the cache at n keeps it; {} leaves none to keep."""
        self.held.pop(row, None)
        if not window:
            return
        self.write(row, n - self.window, window["mtp_rows"])
        self.tail[row] = window["mtp_tail"].to(self.tail.device, self.tail.dtype)
        self.held[row] = (int(window["mtp_from"]), n - 1)

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
