"""The prefill's step observer: after every engine step, what the step finished of each started room
becomes a write job for the transfer threads (prefill_writer), its request row pinned until then.

Full-family pages (C4, C128, INDEXER) go as the chunks that complete them do; the SWA window, the
compressor-state tails and the aux slot (first token and the seeded generator's state) go with the
last chunk. Each job takes the path `transfer.choose_write` expects to be fastest for its pages,
among those both sides have room for. A parallel decode server's other ranks get the same pages
directly, decode rank r's from this server's rank r mod P (lanes, written beside the job).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsv4_engine.disagg.base import PdEngine
from dsv4_engine.disagg.faults import FaultHooks
from dsv4_engine.disagg.prefill_writer import Job, Lane, TransferWorker
from dsv4_engine.disagg.protocol import AUX_BYTES, PdError, RoomStatus, logprobs_body, pack_aux
from dsv4_engine.disagg.room import Room
from dsv4_engine.disagg.transfer import (
    PACKING,
    UNPACKING,
    Entries,
    WriteShape,
    choose_write,
    plan_writes,
    split_pieces,
    write_shape,
)
from dsv4_engine.memory import StateComponent, StateType
from dsv4_engine.memory.staging import StagingArena
from dsv4_engine.scheduler import SchedulerOutput, Sequence

# State types whose pages are final as soon as the chunk that filled them is done: compressed rows
# only ever append. The SWA window and the state tails are sent with the last chunk.
_APPEND_ONLY = (StateType.C4, StateType.C128, StateType.INDEXER)

FORCED_PIECES = 4  # pieces of a *_pipelined path a test forces (fewer when the job has fewer pages)
UNREACHABLE = "127.0.0.1:1"  # the session a lane the fault hooks fail writes to: Mooncake refuses it


class ChunkSender:
    """Runs on the engine thread; reads started rooms' destinations and writes only their send
    progress (room.sent_pages, staged_at, staged, logprobs)."""

    def __init__(
        self,
        engine: PdEngine,
        components: list[StateComponent],
        aux: torch.Tensor,
        *,
        staging: StagingArena | None,
        room_of: Callable[[str], Room | None],
        fail_soon: Callable[[Room, PdError], None],
        writer: TransferWorker,
        faults: FaultHooks | None,
        sources: list[list[StateComponent]] | None = None,
        steps_sent: Callable[[], int] = lambda: 0,
        draft: torch.Tensor | None = None,
    ) -> None:
        self.engine = engine
        self.components = components
        # Every rank's PD buffers (index: rank; rank 0's are `components`): the lanes' sources.
        self.sources = sources or [components]
        self.steps_sent = steps_sent  # what a rank must have run before its lane reads the pages
        self.src_types = [c.state_type for c in components]
        self.page_bytes = {c.state_type: sum(c.item_lens) for c in components}
        self.aux = aux  # one slot per request row, registered with the transport
        self.draft = draft  # one MTP window slot per request row, registered too (when speculating)
        self.staging = staging  # only its size matters here: the worker packs
        self.room_of = room_of  # request id -> its room (the loop's map, read here)
        self.fail_soon = fail_soon
        self.writer = writer
        self.faults = faults

    def on_step(self, out: SchedulerOutput, sampled: dict[str, int]) -> None:
        """Queue what this step finished of every started PD room (after sampling)."""
        page = self.engine.layout.page_size
        for chunk in out.chunks:
            room = self.room_of(chunk.seq.request_id)
            if room is None or not room.started or room.status is RoomStatus.FAILED:
                continue
            seq = chunk.seq
            final = chunk.sample
            done_pages = -(-chunk.end // page) if final else chunk.end // page
            try:
                self._queue(room, seq, done_pages, final, sampled.get(seq.request_id))
            except ValueError as err:  # transfer.PayloadMismatch: never truncate, fail the request
                self.fail_soon(room, PdError("payload_mismatch", str(err)))
            except PdError as err:
                self.fail_soon(room, err)

    def _queue(self, room: Room, seq: Sequence, done_pages: int, final: bool, token: int | None) -> None:
        assert room.dst_pages is not None and room.session is not None and seq.req_idx is not None
        # Only the types this step sends are built: a non-final chunk sends the append-only ones,
        # and none at all when it completed no page.
        types = [t for t in self.src_types if final or (t in _APPEND_ONLY and done_pages > room.sent_pages)]
        src_all = self.engine.payloads(seq.req_idx, len(seq.prompt_token_ids), types)
        src: dict[StateType, list[int]] = {}
        dst: dict[StateType, list[int]] = {}
        spans: dict[StateType, tuple[int, int]] = {}
        for t in types:
            s, d = src_all[t], room.dst_pages[t]
            # Page lists of compressed types can be shorter than the prompt's pages (rows [0, n//4)).
            hi = min(done_pages, len(s)) if t in _APPEND_ONLY else len(s)
            lo = min(room.sent_pages, hi) if t in _APPEND_ONLY else 0
            if len(s) != len(d):
                raise PdError(
                    "payload_mismatch", f"{t}: prefill sends {len(s)} pages, decode expects {len(d)}"
                )
            src[t], dst[t], spans[t] = s[lo:hi], d[lo:hi], (lo, hi)
        if self.faults is not None:
            self.faults.before_send(room.room, src, self.engine.kv_pool)
            if self.faults.skipped(room.room):  # the decode's pages are left as they are (poisoned)
                src, dst = {t: [] for t in src}, {t: [] for t in dst}
        room.sent_pages = max(room.sent_pages, done_pages)  # a preempted request's recompute resends nothing
        entries = plan_writes(self.components, room.session.dst_ptrs, src, dst)
        job = Job(room, entries, self._bytes_by_type(src), final, lanes=self._lanes(room, src, dst))
        job.after = self.steps_sent()
        shape = write_shape(self.components, src, dst, len(entries))
        if shape.nbytes:
            self._route(job, shape, [(t, spans[t][0], src[t]) for t in src], src_all)
        if final:
            assert token is not None and room.dst_aux is not None
            slot = self.aux[seq.req_idx]
            pack_aux(slot, token, seq.generator)
            room.cached_tokens = seq.num_cached_tokens or 0
            room.draft_token_ids = list(seq.draft_token_ids)
            self._window(room, seq, job)
            room.logprobs = logprobs_body(
                seq.step_logprobs[0] if seq.params.logprobs is not None and seq.step_logprobs else None,
                list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None,
            )
            job.entries.extend(
                Entries.one(slot.data_ptr(), room.session.aux_ptr + room.dst_aux * AUX_BYTES, AUX_BYTES)
            )
        if len(job.entries) or job.pieces or job.lanes or final:
            # The row's pages (and its aux slot) stay this request's until the write returned: the
            # scheduler preempts no pinned request, and a freed one keeps them until the unpin.
            self.engine.allocator.pin(seq.req_idx)
            job.row = seq.req_idx
            self.writer.put(job)

    def _window(self, room: Room, seq: Sequence, job: Job) -> None:
        """The MTP layer's rows of the prompt's last positions (those the decode's first drafts read
        besides their own: [n - window + 1, n)), into the decode's slot for its row, when it took
        the offer: its drafts then read what a colocated server's would. A parallel decode's rank 0
        hands them to its other ranks (ranks.py)."""
        assert room.session is not None and room.dst_aux is not None and seq.req_idx is not None
        if self.draft is None or room.session.draft_ptr is None or seq.draft_window_from is None:
            return
        n = len(seq.prompt_token_ids)
        start = max(seq.draft_window_from, n - self.draft.shape[1] + 1, 0)
        if start >= n:
            return
        slot = self.draft[seq.req_idx, : n - start]
        slot.copy_(self.engine.draft_window(seq.req_idx, start, n))
        dst = room.session.draft_ptr + room.dst_aux * self.draft[0].nbytes
        job.entries.extend(Entries.one(slot.data_ptr(), dst, slot.nbytes))
        room.draft_window_from = start

    def _lanes(
        self, room: Room, src: dict[StateType, list[int]], dst: dict[StateType, list[int]]
    ) -> list[Lane]:
        """The pages for each other rank of the decode server: decode rank r's straight from this
        server's rank r mod P (the state is replicated, so any rank has it), over that rank's link."""
        assert room.session is not None
        lanes = []
        for peer_rank, (peer, ptrs) in sorted(room.session.ranks.items()):
            rank = peer_rank % len(self.sources)
            entries = plan_writes(self.sources[rank], ptrs, src, dst)
            if self.faults is not None and self.faults.fail_rank.get(room.room) == rank:
                peer = UNREACHABLE
            if len(entries):
                lanes.append(Lane(rank, peer_rank, peer, entries))
        return lanes

    def _route(
        self,
        job: Job,
        shape: WriteShape,
        segments: list[tuple[StateType, int, list[int]]],
        src_all: dict[StateType, list[int]],
    ) -> None:
        """Put the job on the path `_choose` picks: its pieces, and its place in the decode's span."""
        room = job.room
        path, pieces = self._choose(room, shape)
        if path == "direct":
            return
        job.path, job.entries, job.staged_bytes = path, Entries(), shape.nbytes  # aux added after
        job.pieces = split_pieces(segments, self.page_bytes, pieces)
        job.src_pages = {t: src_all[t] for t, _, _ in segments}
        if path in UNPACKING:
            assert room.dst_staging is not None and room.session is not None
            assert room.session.staging_ptr is not None
            job.staged_dst = room.session.staging_ptr + room.dst_staging[0] + room.staged_at
            room.staged_at += shape.nbytes
            room.staged.extend((str(t), lo, hi) for piece in job.pieces for t, lo, hi in piece)

    def _choose(self, room: Room, shape: WriteShape) -> tuple[str, int]:
        """(path, pieces) for one job: the cost model's pick among the paths both sides have room
        for, or the path a test forces (direct when it has no room)."""
        can_pack = self.staging is not None and shape.nbytes <= self.staging.nbytes
        can_unpack = (
            room.dst_staging is not None
            and room.session is not None
            and room.session.staging_ptr is not None
            and room.staged_at + shape.nbytes <= room.dst_staging[1]
        )
        mode = "auto" if self.faults is None else self.faults.stage_mode
        mode = {"always": "staged", "never": "direct"}.get(mode, mode)
        if mode == "auto":
            return choose_write(shape, can_pack=can_pack, can_unpack=can_unpack)
        path = mode.removesuffix("_pipelined")
        if (path in PACKING and not can_pack) or (path in UNPACKING and not can_unpack):
            return "direct", 1
        return path, FORCED_PIECES if mode.endswith("_pipelined") else 1

    def _bytes_by_type(self, pages: dict[StateType, list[int]]) -> dict[str, int]:
        return {
            str(t): sum(1 for p in pages[t] if p) * self.page_bytes[t] for t in self.src_types if t in pages
        }
