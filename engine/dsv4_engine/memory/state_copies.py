"""C4 state rows copied to and from prefix-cache snapshot slots: decided by the allocator, executed by
the pools (`Dsv4TokenToKVPool.apply_state_copies`) before the next forward.

A snapshot at page boundary P needs only the C4 state of block [P-4, P) (4 rows per ratio-4 layer, the
overlap half of the block after P), so it keeps those rows in a slot of its own instead of holding the
whole state page. The allocator only edits tables, so it queues the copies here; the model runner
takes them before each forward, on every rank (a tensor-parallel follower replays the allocator's
journal, which queues the same copies, and takes them before the same forward).

Until they are taken, a queued copy holds what it reads: a save holds its source state page (a request
finishing after its snapshot was taken does not hand the page to anyone before the rows are out), a
restore holds its slot (evicting the snapshot does not hand the slot to another). What a queued copy
writes is one owner's: a save's slot is its snapshot's (dropping the snapshot first cancels the save),
a restore's page is its request's (freeing the request first cancels the restore).
"""

from __future__ import annotations

from dataclasses import dataclass

from .page_pool import PagePool

SNAPSHOT_ROWS = 4  # the C4 block [P-4, P) a step resuming at P reads (state_read_range(4, P))


@dataclass(frozen=True)
class StateCopy:
    """Rows [row, row + 4) of every ratio-4 layer's C4 state (attention and indexer; `row` is a state
    slot, page * P + offset) to slot `slot` (save=True: taking a snapshot) or back (save=False:
    resuming from one). `req_idx` is the request row the rows come from (save) or go to (restore), and
    `position` the page boundary P the snapshot resumes at: the model runner copies what else a
    resume at P reads outside the pools with them (the MTP layer's window, speculative/draft_cache.py)."""

    slot: int
    row: int
    save: bool
    req_idx: int
    position: int


class StateCopies:
    def __init__(self, state_pages: PagePool, slots: PagePool, page_size: int) -> None:
        self.state_pages = state_pages
        self.slots = slots
        self.page_size = page_size
        self._queued: list[StateCopy] = []

    def __len__(self) -> int:
        return len(self._queued)

    def save(self, row: int, slot: int, req_idx: int, position: int) -> None:
        """Copy the rows out to a snapshot's slot (after the step that wrote them ran)."""
        self.state_pages.share([row // self.page_size])
        self._queued.append(StateCopy(slot, row, True, req_idx, position))

    def restore(self, slot: int, row: int, req_idx: int, position: int) -> None:
        """Copy a slot back into a resumed request's own state page (before its first step reads it)."""
        self.slots.share([slot])
        self._queued.append(StateCopy(slot, row, False, req_idx, position))

    def _release(self, c: StateCopy) -> None:
        if c.save:
            self.state_pages.free([c.row // self.page_size])
        else:
            self.slots.free([c.slot])

    def cancel_save(self, slot: int) -> None:
        """A snapshot whose save is still queued is dropped: nothing will read its slot, unless a queued
        restore does (it holds the slot), which then still needs the save before it."""
        if any(not c.save and c.slot == slot for c in self._queued):
            return
        self._cancel([c for c in self._queued if c.save and c.slot == slot])

    def cancel_restores(self, req_idx: int) -> None:
        """A request freed before its first step: its page goes back, nothing may write it."""
        self._cancel([c for c in self._queued if not c.save and c.req_idx == req_idx])

    def _cancel(self, gone: list[StateCopy]) -> None:
        for c in gone:
            self._queued.remove(c)
            self._release(c)

    def take(self) -> list[StateCopy]:
        """The queued copies, in order, for the pools to run now (before the forward); their holds go."""
        queued, self._queued = self._queued, []
        for c in queued:
            self._release(c)
        return queued
