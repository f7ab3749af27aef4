"""The allocator's journal: a tensor-parallel server's other ranks mirror rank 0's pages by replaying
every change rank 0's allocator made (ranks.py), in order. The allocator is deterministic, so the same
calls with the same arguments leave the same pages, tables and prefix cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .state_copies import StateCopy

# Entries replayed by calling the same method with the same arguments.
_REPLAYED = frozenset(
    {"alloc_extend", "alloc_prealloc", "truncate", "free", "match_prefix", "cache_prefix", "flush_cache"}
)


class Journaled:
    """The allocator's replication half (a base class of `Dsv4Allocator`)."""

    _journal: list[tuple[str, tuple]] | None = None

    def record(self) -> None:
        """From now on, keep every change (the calls that succeeded, in order) for `take_journal`."""
        self._journal = []

    def take_journal(self) -> list[tuple[str, tuple]]:
        """The changes since the last call; another allocator of the same sizes that `replay`s every
        journal holds the same pages and tables (the allocator is deterministic)."""
        assert self._journal is not None, "record() was not called"
        journal, self._journal = self._journal, []
        return journal

    def replay(
        self, journal: list[tuple[str, tuple]], apply: Callable[[list[StateCopy]], None] | None = None
    ) -> None:
        """apply: runs the C4 state copies rank 0 took (`take_state_copies`), at the same point."""
        me: Any = self
        for name, args in journal:
            if name == "alloc_request":
                row = me.alloc_request()
                if row != args[0]:
                    raise RuntimeError(f"replicated allocator diverged: row {row}, rank 0 had {args[0]}")
            elif name == "take_state_copies":
                copies = me.take_state_copies()
                if apply is not None:
                    apply(copies)
            elif name in _REPLAYED:
                getattr(me, name)(*args)
            else:
                raise ValueError(f"unknown journal entry {name!r}")

    def _log(self, name: str, *args: object) -> None:
        if self._journal is not None:
            self._journal.append((name, args))
