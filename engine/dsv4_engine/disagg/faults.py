"""Fault injection and probes for the PD tests, in one object that is None in production.

server/pd.py installs it when DSV4_TEST_HOOKS=1 and server/test_hooks.py's /debug/pd routes drive
and read it. The PD code only asks whether it is there (`faults is not None`) before using it, so
a production server pays one attribute check where a hook could act.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dsv4_engine.disagg.protocol import page_digests
from dsv4_engine.memory import Dsv4TokenToKVPool, StateType

if TYPE_CHECKING:
    from dsv4_engine.model_runner import ModelRunner

log = logging.getLogger("dsv4.pd.faults")


@dataclass
class FaultHooks:
    # Prefill: the write path, "auto" (the cost model), a dsv4_pd_transfer_writes_total path label
    # (that path where both sides have room for it, else direct), "always" (staged) or "never" (direct).
    stage_mode: str = "auto"
    corrupt_next: StateType | None = None  # prefill: add 1 to one page of this type before the next send
    deaf: bool = False  # prefill: ignore the decode's aborts and hang-ups (forces a late write)
    poison: bool = True  # decode: fill reserved pages with NaN, so a page the transfer missed shows
    # Room -> sha256 per state type of the bytes sent (prefill) or received (decode), to compare.
    checksums: dict[int, dict[str, str]] = field(default_factory=dict)
    # Request id -> digest of the first logits row the model runner computed for it (its
    # `logit_probe`): on a decode server, the first decode step's, which shows what state it read.
    logits: dict[str, str] = field(default_factory=dict)
    _sent: dict[int, dict[StateType, list[int]]] = field(default_factory=dict, repr=False)

    def install(self, runner: ModelRunner) -> None:
        runner.logit_probe = self.logits

    # ---- prefill (engine thread, then the transfer worker) -----------------------------------
    def before_send(self, room: int, pages: dict[StateType, list[int]], kv_pool: Dsv4TokenToKVPool) -> None:
        """A job of `room` is about to be queued with these source pages."""
        if self.corrupt_next is not None and self.corrupt_next in pages:
            self._corrupt(kv_pool, self.corrupt_next, pages[self.corrupt_next])
        sent = self._sent.setdefault(room, {})
        for t, ids in pages.items():
            sent.setdefault(t, []).extend(ids)

    def sent(self, room: int, kv_pool: Dsv4TokenToKVPool) -> None:
        """Every write of `room` landed: digest the bytes of the pages it sent, before they are freed."""
        self.checksums[room] = page_digests(kv_pool, self._sent.pop(room, {}))

    def forget(self, room: int) -> None:
        self._sent.pop(room, None)

    def _corrupt(self, kv_pool: Dsv4TokenToKVPool, state_type: StateType, pages: list[int]) -> None:
        page = next((p for p in reversed(pages) if p), None)
        if page is None:
            return
        self.corrupt_next = None
        for buf in kv_pool.buffers_by_type()[state_type]:
            buf[page] += 1.0
        log.warning("test hook: perturbed %s page %d before the send", state_type, page)
