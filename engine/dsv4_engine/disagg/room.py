"""A prefill server's room: the two halves of one PD request, met in either order, and its progress.

The loop (prefill.PrefillRooms) creates rooms, fills both halves and ends them; once a room has
started, the engine thread (prefill_send) and the transfer threads (prefill_writer) read its
destination and write only the progress fields marked as theirs (the worker's under the rooms' lock).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dsv4_engine.disagg.protocol import PdError, RoomStatus
from dsv4_engine.memory import StateType
from dsv4_engine.sampling_params import SamplingParams


@dataclass
class DecodeSession:
    """What one decode server registered: where its buffers are, and its layout fingerprint."""

    decode_id: str
    mooncake_session: str
    dst_ptrs: dict[StateType, list[int]]
    aux_ptr: int
    fingerprint: dict[str, Any]
    staging_ptr: int | None = None  # its staging arena, when it has one
    draft_ptr: int | None = None  # its MTP window slots, when it takes this prefill's window
    # Its other ranks (a parallel decode server): rank -> (Mooncake session, buffer pointers per type).
    ranks: dict[int, tuple[str, dict[StateType, list[int]]]] = field(default_factory=dict)
    dead: bool = False  # a write to it failed (worker): later rooms fail fast until it registers again


@dataclass
class Room:
    room: int
    created: float
    deadline: float  # until the decode sends its pages; each claim (renewed while it queues) extends it
    result: asyncio.Future[None]  # done when the transfer ended; a PdError when the room failed
    status: RoomStatus = RoomStatus.BOOTSTRAPPING
    # the prefill's own request
    request_id: str | None = None
    prompt_ids: list[int] | None = None
    params: SamplingParams | None = None
    digest: str | None = None
    start: Callable[[], None] | None = None  # hands the prompt to the engine (loop side)
    # the decode's half
    session: DecodeSession | None = None
    claim_digest: str | None = None
    dst_pages: dict[StateType, list[int]] | None = None
    dst_aux: int | None = None
    dst_staging: tuple[int, int] | None = None  # (offset, bytes) of the decode's span for this room
    # progress: the engine thread's
    sent_pages: int = 0  # full-family pages [0, sent_pages) are queued
    staged_at: int = 0  # bytes of the decode's span the queued staged jobs fill
    staged: list[tuple[str, int, int]] = field(default_factory=list)  # (type, lo, hi) in span order
    logprobs: dict[str, Any] | None = None  # protocol.logprobs_body, sent with the transfer's answer
    cached_tokens: int = 0  # prompt tokens the prefill resumed from its prefix cache (for usage)
    draft_token_ids: list[int] = field(default_factory=list)  # its MTP layer's drafts after the first token
    draft_window_from: int | None = None  # the first position of the MTP window rows sent with it
    # progress: the worker's
    writing: bool = False  # a write of this room is in the transport right now
    late: int = 0  # writes that abandoned entries Mooncake may still move (into the decode's pages)
    close_requested: bool = False  # closed once `late` is back at 0
    closed: bool = False  # every write has ended and the engine was told to free the pages
    bytes_by_type: dict[str, int] = field(default_factory=dict)
    lane_bytes: dict[tuple[int, int], int] = field(default_factory=dict)  # (rank, decode rank) -> bytes
    # the loop's
    started: bool = False
    error: PdError | None = None
    transfer_started: float | None = None

    @property
    def may_land(self) -> bool:
        """A write of this room may still change the decode's pages (read it under the rooms' lock):
        one is in the transport, entries one abandoned may still move, or the room is still going
        (started, neither failed nor closed: more of its jobs may come)."""
        going = self.started and not self.closed and self.status is not RoomStatus.FAILED
        return self.writing or self.late > 0 or going
