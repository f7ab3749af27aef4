"""Fault injection and probes for the PD tests, in one object that is None in production.

server/pd.py installs it when DSV4_TEST_HOOKS=1 and server/test_hooks.py's /debug/pd routes drive
and read it. The PD code only asks whether it is there (`faults is not None`) before using it, so
a production server pays one attribute check where a hook could act. Hooks are armed per room, so
a test acts on the request it means and no other.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dsv4_engine.memory import Dsv4TokenToKVPool, StateType

if TYPE_CHECKING:
    from dsv4_engine.disagg.base import PdEngine
    from dsv4_engine.model_runner import ModelRunner

log = logging.getLogger("dsv4.pd.faults")

# Allocator families -> the state types whose buffers their page ids index.
_FAMILY_TYPES = {
    "full": (StateType.C4, StateType.C128, StateType.INDEXER),
    "swa": (StateType.SWA,),
    "c4s": (StateType.C4_STATE,),
    "c128s": (StateType.C128_STATE,),
}


@dataclass
class Hold:
    """Prefill: the first entry of a room's next write is kept from Mooncake until `release` is set,
    reported as still on the wire meanwhile: a stalled peer, held deliberately. Past the write's
    deadline the entry is abandoned still running, and on release it really goes (a late write)."""

    release: threading.Event = field(default_factory=threading.Event)
    reached: threading.Event = field(default_factory=threading.Event)  # the transport holds it now
    ended: threading.Event = field(default_factory=threading.Event)  # Mooncake reported it done/failed
    submitted_at: float | None = None  # when Mooncake got it (monotonic), after the release

    def state(self) -> dict[str, bool]:
        return {
            "reached": self.reached.is_set(),
            "released": self.release.is_set(),
            "ended": self.ended.is_set(),
        }


def _update(h: Any, buffers: list[torch.Tensor], ids: list[int]) -> None:
    for page in ids:  # page-major: the prefill digests job by job, each a slice of the page list
        if page:
            for buf in buffers:
                h.update(buf[page].contiguous().view(torch.uint8).cpu().numpy().tobytes())


def page_digests(kv_pool: Dsv4TokenToKVPool, pages: dict[StateType, list[int]]) -> dict[str, str]:
    """sha256 per state type of the bytes of `pages` (list order, sentinels skipped, each page in
    every buffer of its type): equal on both sides exactly when the transfer copied every byte."""
    buffers = kv_pool.buffers_by_type()
    out = {}
    for state_type, ids in pages.items():
        h = hashlib.sha256()
        _update(h, buffers[state_type], ids)
        out[str(state_type)] = h.hexdigest()
    return out


def poisoned(kv_pool: Dsv4TokenToKVPool, pages: dict[StateType, list[int]]) -> list[str]:
    """State types some of whose pages still hold NaN (decode.prealloc's poison): pages no write
    reached."""
    buffers = kv_pool.buffers_by_type()
    out = []
    for state_type, ids in pages.items():
        index = torch.tensor([p for p in ids if p], dtype=torch.long)
        if index.numel() and any(
            bool(buf.index_select(0, index.to(buf.device)).isnan().any()) for buf in buffers[state_type]
        ):
            out.append(str(state_type))
    return out


@dataclass
class FaultHooks:
    # Prefill: the write path, "auto" (the cost model), a dsv4_pd_transfer_writes_total path label
    # (that path where both sides have room for it, else direct), "always" (staged) or "never" (direct).
    stage_mode: str = "auto"
    corrupt_next: StateType | None = None  # prefill: add 1 to one page of this type before the next send
    deaf: bool = False  # prefill: ignore the decode's aborts and hang-ups (forces a late write)
    holds: dict[int, Hold] = field(default_factory=dict)  # prefill: room -> its next write's held entry
    skip: set[int] = field(default_factory=set)  # prefill: rooms whose pages are never written (aux is)
    # Prefill: room -> the rank whose lanes (a parallel decode's other ranks) go to a session Mooncake
    # refuses, so that rank's part of the transfer fails.
    fail_rank: dict[int, int] = field(default_factory=dict)
    poison: bool = True  # decode: fill reserved pages with NaN, and fail a request whose pages keep any
    # Room -> sha256 per state type of the bytes sent (prefill, as each job was queued) or received
    # (decode), to compare.
    checksums: dict[int, dict[str, str]] = field(default_factory=dict)
    # Request id -> digest of the first logits row the model runner computed for it (its
    # `logit_probe`): on a decode server, the first decode step's, which shows what state it read.
    logits: dict[str, str] = field(default_factory=dict)
    _sending: dict[int, dict[StateType, Any]] = field(default_factory=dict, repr=False)

    def install(self, runner: ModelRunner) -> None:
        runner.logit_probe = self.logits

    # ---- prefill (engine thread, then a transfer thread) --------------------------------------
    def before_send(self, room: int, pages: dict[StateType, list[int]], kv_pool: Dsv4TokenToKVPool) -> None:
        """A job of `room` is about to be queued with these source pages: digest their bytes now, as
        the write must carry them (a page reused before the write reads it changes what lands)."""
        if self.corrupt_next is not None and self.corrupt_next in pages:
            self._corrupt(kv_pool, self.corrupt_next, pages[self.corrupt_next])
        digests = self._sending.setdefault(room, {})
        buffers = kv_pool.buffers_by_type()
        for t, ids in pages.items():
            _update(digests.setdefault(t, hashlib.sha256()), buffers[t], ids)

    def skipped(self, room: int) -> bool:
        return room in self.skip

    def hold_for(self, room: int) -> Hold | None:
        """The hold armed for `room`'s next write, taken (a later write goes unheld)."""
        hold = self.holds.get(room)
        return hold if hold is not None and not hold.reached.is_set() else None

    def sent(self, room: int) -> None:
        """Every write of `room` landed."""
        self.checksums[room] = {str(t): h.hexdigest() for t, h in self._sending.pop(room, {}).items()}

    def forget(self, room: int) -> None:
        self._sending.pop(room, None)

    def _corrupt(self, kv_pool: Dsv4TokenToKVPool, state_type: StateType, pages: list[int]) -> None:
        page = next((p for p in reversed(pages) if p), None)
        if page is None:
            return
        self.corrupt_next = None
        for buf in kv_pool.buffers_by_type()[state_type]:
            buf[page] += 1.0
        log.warning("test hook: perturbed %s page %d before the send", state_type, page)


def live_digests(engine: PdEngine) -> dict[str, str]:
    """Request id -> sha256 of every page its row holds, of every family, for each running request
    (engine thread): a write landing in a live request's page changes its digest."""
    buffers = engine.kv_pool.buffers_by_type()
    out = {}
    for seq in engine.scheduler.running:
        if seq.req_idx is None:
            continue
        h = hashlib.sha256()
        for family, ids in engine.allocator.pages_of(seq.req_idx).items():
            for state_type in _FAMILY_TYPES[family]:
                _update(h, buffers.get(state_type, []), sorted(ids))
        out[seq.request_id] = h.hexdigest()
    return out
