"""Per-resource wake-up flags: child and resource events poke them, each reconcile loop waits on its own
(or for the resync period). Pokes that arrive while a reconcile runs coalesce into one more pass."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


class Wakeups:
    def __init__(self) -> None:
        self._events: dict[tuple[str | None, str], asyncio.Event] = {}
        self.rounds: dict[tuple[str | None, str], int] = {}  # completed waits per resource (for tests)

    def _event(self, namespace: str | None, name: str) -> asyncio.Event:
        return self._events.setdefault((namespace, name), asyncio.Event())

    def poke(self, namespace: str | None, name: str) -> None:
        self._event(namespace, name).set()

    def poke_all(self) -> None:
        for event in self._events.values():
            event.set()

    async def wait(
        self, namespace: str | None, name: str, timeout: float, stopped: Any = None, settle: float = 0.0
    ) -> bool:
        """True when poked, False on timeout or stop. Clears the flag, so the next wait is fresh.
        `settle`: after a poke, gather the burst that usually follows (one apply wakes many watchers)."""
        event = self._event(namespace, name)
        waits = [asyncio.ensure_future(event.wait())]
        if stopped is not None:
            waits.append(asyncio.ensure_future(stopped.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await w
        poked = event.is_set()
        if poked and settle > 0 and not (stopped is not None and stopped):
            await asyncio.sleep(settle)
        event.clear()
        self.rounds[(namespace, name)] = self.rounds.get((namespace, name), 0) + 1
        return poked

    def forget(self, namespace: str | None, name: str) -> None:
        self._events.pop((namespace, name), None)
