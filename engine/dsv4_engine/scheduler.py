"""Continuous batching over the paged DSV4 allocator: pure logic, no model.

Each step:
1. Decodes first: every running request with one token pending gets it, in admission order. When
   the pools cannot take a decode, the most recently admitted running request is preempted by
   recompute (its pages freed, back to the front of the waiting queue; counted in
   `num_preemptions`), until the decode fits or the request preempts itself. A request whose row
   is pinned (a PD transfer still reads its pages) is never the victim: freeing its pages would
   hand them to another request under the transfer.
2. Then prefill chunks under what is left of `max_num_batched_tokens`: unfinished chunked prefills
   first, then waiting requests in arrival order (admission needs a free request row, fewer than
   `max_num_seqs` running, and free full pages for the request's whole context). A chunk is at most
   `chunk_size` tokens; a chunk that does not reach the end of the known tokens ends on a page
   boundary (a budget-limited chunk is rounded down), so only the ratio-4 overlap ever crosses chunks.
   With the prefix cache, an admitted request starts from the longest cached prefix of its tokens,
   and its chunks also end where the cache should get a snapshot (`Sequence.cache_cuts`). A request
   that shares more of its prompt with one still prefilling than the cache holds waits for it
   (n > 1, a burst on one system prompt): that prefill ends a chunk where they part, and the waiting
   request resumes from there instead of prefilling the shared part again.
3. One `alloc_extend` for the whole step returns the bundle the forward writes to.

With speculative decoding a decode carries the request's draft tokens (`Sequence.draft_token_ids`):
its chunk runs the pending token and the drafts, allocated with `keep_len` one past the pending
token, and `postprocess` cuts the row back to what was accepted (`Dsv4Allocator.truncate`).

The caller runs the forward, samples a token for every chunk with `sample=True`, and hands them to
`postprocess`, which appends tokens, finishes requests (EOS / stop ids / max_tokens / max_model_len)
and frees them through the allocator's one free path.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from .memory.allocator import FAMILIES, Dsv4Allocator
from .memory.out_cache_loc import DSV4OutCacheLoc, ExtendSpec
from .memory.state_tail import cdiv
from .sequence import ScheduledChunk, SeqStatus, Sequence

__all__ = ["ScheduledChunk", "Scheduler", "SchedulerConfig", "SchedulerOutput", "SeqStatus", "Sequence"]


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]  # decodes first, then prefill chunks
    specs: list[ExtendSpec]
    bundle: DSV4OutCacheLoc
    preempted: list[str]

    @property
    def num_tokens(self) -> int:
        return sum(c.end - c.start for c in self.chunks)


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int
    max_model_len: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    chunk_size: int | None = None  # per-request cap on a prefill chunk; None: the token budget only
    eos_token_ids: tuple[int, ...] = ()
    num_draft_tokens: int = 0  # speculative decoding: drafts a decode may verify

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < self.page_size:
            raise ValueError("max_num_batched_tokens must be at least one page")
        if self.chunk_size is not None and (
            self.chunk_size < self.page_size or self.chunk_size % self.page_size
        ):
            raise ValueError(f"chunk_size must be a multiple of the page size {self.page_size}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: Dsv4Allocator) -> None:
        """The allocator owns the pools and the request tables; the scheduler only asks it."""
        if allocator.page_size != config.page_size:
            raise ValueError("scheduler and allocator disagree on the page size")
        self.config = config
        self.allocator = allocator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.held: dict[str, Sequence] = {}  # finished PD prefills whose pages a transfer may read
        self.counters = {"num_preemptions": 0, "prompt_tokens_total": 0, "generation_tokens_total": 0}
        self.counters["num_aborted"] = 0
        self.counters["forwarded_tokens_total"] = 0
        self.counters["prefix_cache_queries"] = 0  # prompt tokens of admitted requests (vLLM's counters)
        self.counters["prefix_cache_hits"] = 0  # of which resumed from the cache
        # Speculative decoding (vLLM's spec_decode counters): verify steps with drafts, drafts, kept.
        self.counters["spec_decode_num_drafts"] = 0
        self.counters["spec_decode_num_draft_tokens"] = 0
        self.counters["spec_decode_num_accepted_tokens"] = 0

    # ---- requests ------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        n = len(seq.prompt_token_ids)
        if n == 0:
            raise ValueError(f"request {seq.request_id}: empty prompt")
        if n >= self.config.max_model_len:
            raise ValueError(f"request {seq.request_id}: prompt of {n} tokens >= max_model_len")
        if self._full_pages_for(seq) > self.allocator.pools["full"].num_pages:
            raise ValueError(f"request {seq.request_id}: its context can never fit the full-page pool")
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a waiting or running request, freeing what it holds; None if unknown."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return self._finish(seq, "abort")
        for seq in self.running:
            if seq.request_id == request_id:
                return self._finish(seq, "abort")
        return None

    def admit_resident(self, seq: Sequence) -> Sequence | None:
        """Admit a request whose state is already in the pools (PD decode: transferred) as running,
        its first output token known. Returns it finished when that token already ends it."""
        if seq.req_idx is None or not seq.output_token_ids:
            raise ValueError(f"request {seq.request_id}: a resident request needs its row and first token")
        seq.num_computed = len(seq.prompt_token_ids)
        seq.status = SeqStatus.RUNNING
        seq.prompt_counted = True
        self.counters["prompt_tokens_total"] += len(seq.prompt_token_ids)
        self.counters["generation_tokens_total"] += 1
        self.running.append(seq)
        reason = self._stop_reason(seq, seq.output_token_ids[-1])
        return self._finish(seq, reason) if reason is not None else None

    def release(self, request_id: str) -> bool:
        """Free a held request's pages (its transfer ended); False if it holds none."""
        seq = self.held.pop(request_id, None)
        if seq is None or seq.req_idx is None:
            return False
        self.allocator.free(seq.req_idx)
        seq.req_idx = None
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {"num_running": len(self.running), "num_waiting": len(self.waiting)}
        out["num_held"] = len(self.held)
        out.update({k: float(v) for k, v in self.counters.items()})
        out.update({f"pool_usage/{k}": v for k, v in self.allocator.usage().items()})
        available = self.allocator.num_available()
        for name, pool in self.allocator.pools.items():
            out[f"pool_free/{name}"] = float(pool.num_free)
            out[f"pool_available/{name}"] = float(available[name])
            out[f"pool_total/{name}"] = float(pool.num_pages)
        return out

    # ---- scheduling ----------------------------------------------------------------------------
    def _full_pages_for(self, seq: Sequence) -> int:
        ctx = min(self.config.max_model_len, len(seq.prompt_token_ids) + seq.params.max_tokens)
        return cdiv(ctx, self.config.page_size)

    def _spec(self, seq: Sequence, end: int) -> ExtendSpec:
        assert seq.req_idx is not None
        return ExtendSpec(seq.req_idx, seq.num_computed, end)

    def _drafts(self, seq: Sequence, budget: int) -> list[int]:
        """The drafts a decode of seq verifies: no more than the budget, the context or the tokens it
        may still emit leave room for (the last emitted token is always the target's own)."""
        room = min(
            self.config.num_draft_tokens,
            budget - 1,
            self.config.max_model_len - seq.num_tokens,
            seq.params.max_tokens - len(seq.output_token_ids) - 1,
        )
        return seq.draft_token_ids[: max(room, 0)]

    def _decode_spec(self, seq: Sequence, drafts: list[int]) -> ExtendSpec:
        """The pending token (and drafts): a verify may be cut back to its first token."""
        assert seq.req_idx is not None
        end = seq.num_tokens + len(drafts)
        return ExtendSpec(seq.req_idx, seq.num_computed, end, seq.num_computed + 1 if drafts else None)

    def _fits(self, planned: dict[str, int], spec: ExtendSpec) -> dict[str, int] | None:
        need = self.allocator.pages_needed([spec])
        total = {f: planned[f] + need[f] for f in FAMILIES}
        free = self.allocator.num_available()
        return total if all(total[f] <= free[f] for f in FAMILIES) else None

    def _victims(self, exclude: set[str]) -> list[Sequence]:
        """Running requests that may be preempted, oldest first: not in `exclude`, not pinned."""
        pinned = self.allocator.pinned
        return [s for s in self.running if s.request_id not in exclude and not (s.req_idx is not None
                and pinned(s.req_idx))]  # fmt: skip

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if seq.req_idx is not None:
            self.allocator.free(seq.req_idx)  # the one free path: every page of every family
        seq.req_idx, seq.num_computed, seq.status = None, 0, SeqStatus.WAITING
        seq.draft_token_ids, seq.draft_window_from = [], None
        self.waiting.appendleft(seq)
        self.counters["num_preemptions"] += 1

    def schedule(self) -> SchedulerOutput | None:
        """Pick and allocate the next step; None when there is nothing to run."""
        preempted: list[str] = []
        while True:
            out = self._schedule_once(preempted)
            if out is not None or not self.running:
                return out
            # Running requests exist but none could take a step (pools full of partial prefills):
            # recompute the newest so the older ones can progress; when every one is pinned, wait
            # for a transfer to end instead (the engine steps again).
            victims = self._victims(set())
            if not victims:
                return None
            victim = victims[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)

    def _schedule_once(self, preempted: list[str]) -> SchedulerOutput | None:
        budget = self.config.max_num_batched_tokens
        planned = dict.fromkeys(FAMILIES, 0)
        chunks: list[ScheduledChunk] = []
        specs: list[ExtendSpec] = []

        # 1. decodes (one pending token), preempting the newest running requests when short.
        for seq in [s for s in self.running if s.num_pending == 1]:
            if seq.status is not SeqStatus.RUNNING or budget == 0:
                continue
            drafts = self._drafts(seq, budget)
            while True:
                spec = self._decode_spec(seq, drafts)
                total = self._fits(planned, spec)
                if total is not None:
                    planned = total
                    chunks.append(ScheduledChunk(seq, seq.num_computed, spec.seq_len, drafts))
                    specs.append(spec)
                    budget -= spec.seq_len - spec.prefix_len
                    break
                if drafts:  # short of pages: verify nothing rather than preempt anyone
                    drafts = []
                    continue
                victims = self._victims({c.seq.request_id for c in chunks} | {seq.request_id})
                victim = victims[-1] if victims else seq
                if victim is seq and seq.req_idx is not None and self.allocator.pinned(seq.req_idx):
                    break  # nothing may be preempted for it: it waits a step
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is seq:
                    break

        # 2. prefill chunks: running (partially prefilled) first, then admission from waiting.
        for seq in [s for s in self.running if s.num_pending > 1]:
            if not self._add_chunk(seq, budget, planned, chunks, specs):
                break
            planned = self._planned_after(specs)
            budget -= chunks[-1].end - chunks[-1].start
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if self._awaits_shared_prefill(seq, chunks, specs):
                planned = self._planned_after(specs)  # a chunk of this step may have been cut short
                budget = self.config.max_num_batched_tokens - sum(c.end - c.start for c in chunks)
                continue
            free_full = self.allocator.num_available()["full"] - planned["full"]
            # Admission: the pools must hold every known token of the request (prompt, and the
            # outputs of a preempted one); decode growth is covered by preemption.
            if (
                cdiv(seq.num_tokens, self.config.page_size) > free_full
                or self.allocator.num_free_requests() == 0
            ):
                break
            seq.req_idx = self.allocator.alloc_request()
            hit = self._resume_cached(seq)
            # Resuming shares the cache's pages: a page an earlier chunk releases may now stay taken
            # (it was the cache's alone, so evictable), so what the step's chunks need is counted again.
            planned = self._planned_after(specs)
            if not self._add_chunk(seq, budget, planned, chunks, specs):
                self.allocator.free(seq.req_idx)
                seq.req_idx, seq.num_computed, seq.cache_cuts = None, 0, set()
                break
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = min(hit, len(seq.prompt_token_ids))
                self.counters["prefix_cache_queries"] += len(seq.prompt_token_ids)
                self.counters["prefix_cache_hits"] += seq.num_cached_tokens
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            planned = self._planned_after(specs)
            budget -= chunks[-1].end - chunks[-1].start

        if not chunks:
            return None
        bundle = self.allocator.alloc_extend(specs)
        return SchedulerOutput(chunks=chunks, specs=specs, bundle=bundle, preempted=preempted)

    # ---- the prefix cache ------------------------------------------------------------------------
    def _cache_limit(self, seq: Sequence) -> int:
        """Positions seq may resume from the cache: all but the last known token (its logits are the
        next token's), none when it asks for the prompt's logprobs (every position's logits)."""
        return 0 if seq.params.prompt_logprobs is not None else seq.num_tokens - 1

    def _resume_cached(self, seq: Sequence) -> int:
        """Start a just-admitted request from the longest cached prefix of its tokens; choose where
        its chunks end so the cache gets a snapshot: where its tokens leave the cached pages (a shared
        system prompt's junction). The prompt's last page boundary needs no cut (its final chunk
        leaves the state there, `state_write_from`) unless the prompt ends on it: a request with the
        same prompt (n > 1, a retry) resumes a page earlier, its last token always computed.
        Returns the positions resumed."""
        assert seq.req_idx is not None
        if self.allocator.prefix_cache is None:
            return 0
        p = self.config.page_size
        hit = self.allocator.match_prefix(seq.req_idx, seq.all_token_ids, self._cache_limit(seq))
        seq.num_computed = hit.length
        n = len(seq.prompt_token_ids)
        cuts = (hit.matched, n - p) if n % p == 0 else (hit.matched,)
        seq.cache_cuts = {c for c in cuts if c > hit.length}
        return hit.length

    def _awaits_shared_prefill(
        self, seq: Sequence, chunks: list[ScheduledChunk], specs: list[ExtendSpec]
    ) -> bool:
        """Whether seq should wait for a running prefill that will put more of its prompt in the cache
        than is there now. That prefill gets a chunk end (a snapshot) where the two prompts part; its
        chunk in this step is cut there if it would run past."""
        cache = self.allocator.prefix_cache
        p = self.config.page_size
        limit = self._cache_limit(seq) // p * p
        if cache is None or limit == 0:
            return False
        tokens = seq.all_token_ids
        have = cache.match(tokens, limit, touch=False).length
        for other in self.running:
            if other.num_computed >= len(other.prompt_token_ids) or other.num_computed + p > limit:
                continue  # not prefilling, or already past anything seq could share
            shared = _shared_pages(other.prompt_token_ids, tokens, p, limit // p) * p
            if shared > max(have, other.num_computed):
                other.cache_cuts.add(shared)
                for i, chunk in enumerate(chunks):
                    if chunk.seq is other and chunk.end > shared:
                        chunks[i] = ScheduledChunk(other, chunk.start, shared)
                        specs[i] = self._spec(other, shared)
                return True
        return False

    def _planned_after(self, specs: list[ExtendSpec]) -> dict[str, int]:
        return self.allocator.pages_needed(specs)

    def _add_chunk(
        self,
        seq: Sequence,
        budget: int,
        planned: dict[str, int],
        chunks: list[ScheduledChunk],
        specs: list[ExtendSpec],
    ) -> bool:
        """Append the next prefill chunk of seq if budget and pools allow; False otherwise."""
        p = self.config.page_size
        limit = min(budget, self.config.chunk_size or budget)
        end = seq.num_computed + min(seq.num_pending, limit)
        if end < seq.num_tokens:
            end = (end // p) * p  # non-final chunks end on a page boundary
        end = min((c for c in seq.cache_cuts if seq.num_computed < c < end), default=end)
        if end <= seq.num_computed:
            return False
        if self._fits(planned, self._spec(seq, end)) is None:
            return False
        chunks.append(ScheduledChunk(seq, seq.num_computed, end))
        specs.append(self._spec(seq, end))
        return True

    # ---- after the forward ---------------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, sampled: Mapping[str, int | list[int]]) -> list[Sequence]:
        """Advance every scheduled chunk; `sampled` maps request id -> token (or a verify's tokens:
        its kept drafts, then the target's) for chunks with sample=True (requests aborted meanwhile
        are skipped). Returns the requests that finished."""
        finished = []
        for chunk in out.chunks:
            seq = chunk.seq
            if seq.status is not SeqStatus.RUNNING:
                continue
            seq.num_forwarded += chunk.end - chunk.start
            self.counters["forwarded_tokens_total"] += chunk.end - chunk.start
            if not chunk.sample:
                seq.num_computed = chunk.end
                self._offer_to_cache(seq, chunk.end)
                continue
            got = sampled[seq.request_id]
            tokens = [got] if isinstance(got, int) else got
            seq.num_computed = chunk.end - len(chunk.drafts)
            if chunk.drafts:  # the kept drafts are computed; the rejected ones are cut off the row
                seq.num_computed += len(tokens) - 1
                assert seq.req_idx is not None
                self.allocator.truncate(seq.req_idx, seq.num_computed)
                self.counters["spec_decode_num_drafts"] += 1
                self.counters["spec_decode_num_draft_tokens"] += len(chunk.drafts)
                self.counters["spec_decode_num_accepted_tokens"] += len(tokens) - 1
            if not chunk.is_decode:
                self._offer_to_cache(seq, chunk.end)
            if not seq.prompt_counted:
                seq.prompt_counted = True
                self.counters["prompt_tokens_total"] += len(seq.prompt_token_ids)
            for token in tokens:
                seq.output_token_ids.append(token)
                self.counters["generation_tokens_total"] += 1
                reason = self._stop_reason(seq, token)
                if reason is not None:
                    finished.append(self._finish(seq, reason))
                    break
        return finished

    def _offer_to_cache(self, seq: Sequence, end: int) -> None:
        """After a prefill chunk that ended at `end`: the cache takes the page-aligned computed prefix,
        with a snapshot when `end` itself is page-aligned (every chunk but a prompt's last is)."""
        p = self.config.page_size
        if self.allocator.prefix_cache is not None and seq.req_idx is not None and end >= p:
            self.allocator.cache_prefix(seq.req_idx, seq.all_token_ids[: end // p * p])

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.config.eos_token_ids):
            return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> Sequence:
        if seq in self.running:
            self.running.remove(seq)
        if seq.hold and seq.req_idx is not None:
            self.held[seq.request_id] = seq
        elif seq.req_idx is not None:
            self.allocator.free(seq.req_idx)
            seq.req_idx = None
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        if reason == "abort":
            self.counters["num_aborted"] += 1
        return seq


def _shared_pages(a: list[int], b: list[int], page: int, most: int) -> int:
    """How many leading pages of `page` tokens a and b have in common, at most `most`."""
    n, most = 0, min(most, len(a) // page, len(b) // page)
    while n < most and a[n * page : (n + 1) * page] == b[n * page : (n + 1) * page]:
        n += 1
    return n
