"""Runs one scheduled step: the model's forward over the paged pools, then sampling.

The scheduler has already allocated the step: `SchedulerOutput.bundle` holds every slot it writes.
Those out-cache locations drive the pool writes: the prefill chunks' forward runs over the step's
attention metadata built from them (`attention.paged_extend`), and one token is sampled for every
chunk that reaches its request's last known token. Decodes (one
token per request, scheduled first) and prefill chunks run as two forwards, so the decode forward is
one method with a fixed-shape input that a graph runner can take over.

What the forwards need of a step is a `StepPlan`: row indices, positions, token ids and the
step's out-cache locations, no `Sequence`. On a parallel server rank 0 sends it (with its allocator's changes since the last step)
to the other ranks, whose runners run the same `forward` over their shard (ranks.py);
sampling and logprobs are rank 0's alone.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

import torch

from dsv4_engine.attention import buckets_for
from dsv4_engine.attention.paged_extend import paged_extend_batch
from dsv4_engine.grammar import PendingMasks
from dsv4_engine.graph_runner import DECODE_MODES, DecodeGraphRunner, DecodeMode, default_decode_mode
from dsv4_engine.kernels import KernelSet, choose_kernels
from dsv4_engine.memory import Dsv4Allocator, DSV4OutCacheLoc, Dsv4TokenToKVPool, ExtendSpec
from dsv4_engine.memory.out_cache_loc import one_token_steps
from dsv4_engine.memory.state_copies import StateCopy
from dsv4_engine.model import Dsv4ForCausalLM, ForwardBatch
from dsv4_engine.sampler import sample, token_logprobs
from dsv4_engine.scheduler import ScheduledChunk, SchedulerOutput, Sequence
from dsv4_engine.speculative import DraftCache, Drafter, DraftRow, verify, verify_logits

# Prompt logprobs are computed this many positions at a time, so a long chunk never holds its whole
# [chunk, vocab] logits at once.
PROMPT_LOGPROB_ROWS = 256


@dataclass(frozen=True)
class PrefillChunk:
    request_id: str
    req_idx: int
    start: int  # the chunk's first position; the request's cache holds [0, start)
    token_ids: list[int]


@dataclass(frozen=True)
class StepPlan:
    """Every rank's forward of one step: the decode rows (one token each, at `spec.prefix_len`; a
    speculative verify's tokens are one row each, in position order), then the prefill chunks.
    `decode_bundle`: the decode rows' slots; `bundle`: the slots the allocator gave the whole step
    (decode chunks first, then the prefill chunks)."""

    decode_ids: list[str]
    decode_specs: list[ExtendSpec]
    decode_tokens: list[int]
    decode_bundle: DSV4OutCacheLoc
    num_decode_chunks: int
    prefills: list[PrefillChunk]
    bundle: DSV4OutCacheLoc

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepPlan:
        n_dec = 0
        while n_dec < len(out.chunks) and out.chunks[n_dec].is_decode:
            n_dec += 1
        decodes = out.chunks[:n_dec]
        specs, bundle = one_token_steps(out.specs[:n_dec], out.bundle.select(0, n_dec))
        prefills = []
        for c in out.chunks[n_dec:]:
            assert c.seq.req_idx is not None
            prefills.append(PrefillChunk(c.seq.request_id, c.seq.req_idx, c.start, c.token_ids))
        return cls(
            decode_ids=[c.seq.request_id for c in decodes for _ in c.token_ids],
            decode_specs=specs,
            decode_tokens=[t for c in decodes for t in c.token_ids],
            decode_bundle=bundle,
            num_decode_chunks=n_dec,
            prefills=prefills,
            bundle=out.bundle,
        )

    def prefill_specs(self) -> list[ExtendSpec]:
        return [ExtendSpec(c.req_idx, c.start, c.start + len(c.token_ids)) for c in self.prefills]


class Followers(Protocol):
    """The other ranks of a parallel server, as rank 0's runner sees them (ranks.py)."""

    def send(self, journal: list[tuple[str, tuple]], step: StepPlan) -> None: ...

    def replay(self, journal: list[tuple[str, tuple]]) -> None:
        """Have them replay the allocator's changes so far, without a step."""

    def draft(self, rows: list[DraftRow]) -> None:
        """Have them run the MTP layer over the rows too (its modules are sharded like the rest)."""

    def window(self, req_idx: int, start: int, rows: torch.Tensor) -> None:
        """Have them write a PD transfer's MTP window into their rings too."""


class ModelRunner:
    def __init__(
        self,
        model: Dsv4ForCausalLM,
        kv_pool: Dsv4TokenToKVPool,
        allocator: Dsv4Allocator,
        *,
        enforce_eager: bool = True,
        max_num_seqs: int | None = None,
        decode_mode: DecodeMode | None = None,
        kernels: bool = True,
        num_draft_tokens: int = 0,
    ) -> None:
        """decode_mode: how `decode` runs (see there); default from `enforce_eager` and the device
        (`graph_runner.default_decode_mode`). num_draft_tokens: speculative decoding with the model's
        MTP layer drafting that many tokens a step (0: off)."""
        self.model = model
        self.kv_pool = kv_pool
        self.allocator = allocator
        self.device = model.device
        self.decode_mode: DecodeMode = decode_mode or default_decode_mode(self.device, enforce_eager)
        if self.decode_mode not in DECODE_MODES:
            raise ValueError(f"decode_mode must be one of {DECODE_MODES}, got {self.decode_mode!r}")
        # A speculative verify runs one decode row per token: the pending one and its drafts.
        self.decode_buckets = buckets_for(
            None if max_num_seqs is None else max_num_seqs * (1 + num_draft_tokens)
        )
        # The ops every step runs (EngineConfig.kernels: the fused CPU kernels where they serve),
        # chosen once; each step's batch carries it to the modules.
        self.kernels = choose_kernels(self.device, kernels)
        self._decode_runner: DecodeGraphRunner | None = None  # built on first use
        self.drafter: Drafter | None = None
        if num_draft_tokens:
            rows, cfg = allocator.req_pool.req_to_token.shape[0], model.config
            cache = DraftCache(
                rows, cfg.sliding_window, num_draft_tokens, cfg.head_dim, model.dtype, self.device,
                stream_shape=(cfg.hc_mult, cfg.hidden_size),
                snapshot_slots=allocator.snapshot_slots.num_pages,
            )  # fmt: skip
            self.drafter = Drafter(model, cache, num_draft_tokens, self.kernels)
        # Rank 0 of a parallel server: where each step goes before its forward (ranks.py).
        self.followers: Followers | None = None
        # Test hook: request id -> digest of the first logits row the runner computed for it (on a PD
        # decode server, the first decode step's: it shows which state that step read).
        self.logit_probe: dict[str, str] | None = None

    def decode_runner(self) -> DecodeGraphRunner:
        """The batched decode step (not for the `reference` mode), built on first use."""
        assert self.decode_mode != "reference"
        if self._decode_runner is None:
            req_pool = self.allocator.req_pool
            self._decode_runner = DecodeGraphRunner(
                self.model,
                self.kv_pool,
                req_pool,
                req_pool.max_context_len,
                buckets=self.decode_buckets,
                mode=self.decode_mode,
                kernels=self.kernels,
            )
        return self._decode_runner

    def warmup(self) -> int:
        """Compile (CPU) or capture (GPU/NPU) every decode bucket before traffic, so no request waits
        on a compile; the compiled artefacts are cached outside the repo, so a restart mostly loads
        them. Nothing to do in eager mode. Returns the number of buckets warmed."""
        if self.decode_mode in ("eager", "reference"):
            return 0
        with torch.inference_mode():
            self.decode_runner().warmup()
        return len(self.decode_buckets)

    # ---- forwards ------------------------------------------------------------------------------
    def forward(self, step: StepPlan) -> torch.Tensor | None:
        """A follower rank's part of a step (ranks.py): the forwards, then the step's last-layer
        streams (decode rows, then prefill rows), which `draft` reads; None without a drafter."""
        decode_streams = self.decode(step)[1] if step.decode_specs else None
        _, _, extend_streams = self.extend(step)
        return _step_streams(decode_streams, extend_streams) if self.drafter is not None else None

    def draft_window(self, req_idx: int, start: int, end: int) -> torch.Tensor:
        """PD prefill: the MTP rows of positions [start, end) of a request row (its window, which a
        PD decode server's first drafts read)."""
        assert self.drafter is not None
        return self.drafter.cache.read(req_idx, start, end)

    def write_draft_window(self, req_idx: int, start: int, rows: torch.Tensor) -> None:
        """PD decode: the prefill server's MTP rows of positions [start, start + len(rows)) into the
        request row's ring, on every rank."""
        assert self.drafter is not None
        if self.followers is not None:
            # The snapshot copies queued before this write read the row's ring first on every rank.
            self.followers.replay(self.allocator.take_journal())
            self.followers.window(req_idx, start, rows.cpu())
        self.drafter.cache.write(req_idx, start, rows)

    def apply_state_copies(self, copies: list[StateCopy] | None = None) -> None:
        """Copy the C4 state rows the allocator queued (default: take them now) to and from the prefix
        cache's snapshot slots, and the MTP window with them: before a forward (the requests it
        resumes read theirs) and after a step (the snapshots it took, before anything can write
        their rows again). A follower rank runs them at the same points, replaying the journal
        (ranks.py)."""
        if copies is None:
            copies = self.allocator.take_state_copies()
        self.kv_pool.apply_state_copies(copies)
        if self.drafter is not None and copies:
            self.drafter.cache.apply(copies)

    def draft(self, rows: list[DraftRow], streams: torch.Tensor | None) -> dict[str, list[int]]:
        """The MTP layer over the rows (rank 0's choice, every rank runs it): request id -> drafts."""
        assert self.drafter is not None and (streams is not None or not rows)
        return self.drafter.propose(rows, streams)

    def extend(self, step: StepPlan) -> tuple[torch.Tensor | None, ForwardBatch | None, torch.Tensor | None]:
        """The step's extend forward over its prefill chunks: (final hidden states, the batch, the
        last layer's streams), or Nones without prefill chunks."""
        if not step.prefills:
            return None, None, None
        n_dec, n = step.num_decode_chunks, step.num_decode_chunks + len(step.prefills)
        batch = self._extend_batch(
            step.prefill_specs(), step.bundle.select(n_dec, n), [c.token_ids for c in step.prefills]
        )
        streams = self.model.model.streams(batch)
        return self.model.model.head(streams, batch), batch, streams

    def _extend_batch(
        self, specs: list[ExtendSpec], bundle: DSV4OutCacheLoc, token_ids: list[list[int]]
    ) -> ForwardBatch:
        """An extend forward's batch over the pools, from the step's out-cache locations."""
        return paged_extend_batch(
            self.kv_pool, self.allocator.req_pool, specs, bundle, token_ids, self.model.dtype, self.device,
            self.kernels,
        )  # fmt: skip

    def decode(self, step: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step for the step's decode rows (each adds its token at `spec.prefix_len`);
        returns logits `[n, V]` (fp32) and the last layer's streams `[n, hc, hidden]`, row i for
        row i.

        On entry the allocator has already allocated this step: `specs[i]` is row i's
        `prefix_len -> prefix_len + 1`, the step's bundle says where each row writes and the request
        tables (`allocator.req_pool`) map every earlier position to its pool slot. The method writes
        the new token's SWA KV, compressor state and any completed compressed rows there, since
        later steps read them from the pools. Rows of one request (a speculative verify) come in
        position order: each reads what the ones before it wrote.

        `self.decode_mode` (a constructor argument) picks the path: `eager` (default with
        enforce_eager), `compiled` (CPU without it) or `graph` (GPU/NPU without it) run every row
        in one forward from the static decode buffers of the batch's bucket
        (`graph_runner.DecodeGraphRunner`, docs/decode.md); `reference` runs the per-request SeqCache
        forward below, which the batched step is tested against, as does a batch above the largest
        bucket.
        """
        specs, tokens, bundle = step.decode_specs, step.decode_tokens, step.decode_bundle
        if self.decode_mode != "reference" and len(specs) <= self.decode_buckets[-1]:
            return self.decode_runner().run_with_streams(specs, tokens, bundle)
        batch = self._extend_batch(specs, bundle, [[t] for t in tokens])
        streams = self.model.model.streams(batch)
        return self.model.compute_logits(self.model.model.head(streams, batch), self.kernels), streams

    def _probe(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        import hashlib

        assert self.logit_probe is not None
        for seq, row in zip(seqs, logits, strict=True):
            if seq.request_id not in self.logit_probe and len(self.logit_probe) < 4096:
                data = row.float().contiguous().cpu().numpy().tobytes()
                self.logit_probe[seq.request_id] = hashlib.sha256(data).hexdigest()

    # ---- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(
        self, out: SchedulerOutput, eos_token_ids: Collection[int] = (), grammar: PendingMasks | None = None
    ) -> dict[str, list[int]]:
        """Forward the step and sample: request id -> its new tokens, for every chunk with
        sample=True: one, or a speculative verify's kept drafts and one more. `eos_token_ids`: what
        `min_tokens` masks besides a request's stop ids. A request asking for logprobs gets its new
        tokens' in `seq.step_logprobs` (raw logits, before any penalty). `grammar`: the constrained
        requests' masks (a verify's: one per row), computed while the forward runs. With a drafter,
        every request then gets its next drafts in `seq.draft_token_ids`."""
        step = StepPlan.of(out)
        self.apply_state_copies()
        if self.followers is not None:  # the server's other ranks run the same forwards
            self.followers.send(self.allocator.take_journal(), step)
        logits: dict[int, torch.Tensor] = {}  # chunk index -> logits of its rows that need them
        spans: dict[int, int] = {}  # chunk index -> its first row in the step's streams
        decode_streams = None
        if step.decode_specs:
            decode_logits, decode_streams = self.decode(step)
            lo = 0
            for i, c in enumerate(out.chunks[: step.num_decode_chunks]):
                hi = lo + len(c.token_ids)
                logits[i], spans[i] = decode_logits[lo:hi], lo
                lo = hi
        hidden, batch, extend_streams = self.extend(step)
        num_decode_rows = len(step.decode_specs)
        if hidden is not None and batch is not None and extend_streams is not None:
            rows: list[torch.Tensor] = []  # the hidden rows whose logits are needed, in one lm_head call
            needs: list[tuple[int, int]] = []
            for i, (c, s) in enumerate(zip(out.chunks[step.num_decode_chunks :], batch.seqs, strict=True)):
                i += step.num_decode_chunks
                if c.seq.params.prompt_logprobs is not None:  # only requests that ask pay for every row
                    _prompt_logprobs(self.model, self.kernels, c, hidden[s.rows])
                spans[i] = num_decode_rows + s.rows.start
                if c.drafts or c.sample:  # a verify (reference mode) needs every row, a sample its last
                    rows.append(hidden[s.rows] if c.drafts else hidden[s.rows.stop - 1 : s.rows.stop])
                    needs.append((i, len(rows[-1])))
            if rows:
                projected = self.model.compute_logits(torch.cat(rows), self.kernels)
                for (i, _), part in zip(needs, projected.split([n for _, n in needs]), strict=True):
                    logits[i] = part
        new_tokens: dict[str, list[int]] = {}
        sampled: list[ScheduledChunk] = []
        for i, c in enumerate(out.chunks):
            if c.drafts:
                new_tokens[c.seq.request_id] = self._verify(c, logits[i], eos_token_ids, grammar)
            elif c.sample:
                sampled.append(c)
        if sampled:
            last = torch.cat([logits[i][-1:] for i, c in enumerate(out.chunks) if c.sample and not c.drafts])
            self._sample(sampled, last, eos_token_ids, grammar, new_tokens)
        if self.drafter is not None:
            self._draft(out.chunks, spans, _step_streams(decode_streams, extend_streams), new_tokens)
        return new_tokens

    def _sample(
        self,
        sampled_chunks: list[ScheduledChunk],
        all_logits: torch.Tensor,
        eos_token_ids: Collection[int],
        grammar: PendingMasks | None,
        new_tokens: dict[str, list[int]],
    ) -> None:
        """One token for each chunk from its logits row (penalties, grammar, logprobs)."""
        seqs = [c.seq for c in sampled_chunks]
        if self.logit_probe is not None:
            self._probe(seqs, all_logits)
        masks = grammar.wait([s.request_id for s in seqs], tuple(eos_token_ids)) if grammar else None
        tokens = sample(
            all_logits,
            [s.params for s in seqs],
            [s.generator for s in seqs],  # type: ignore[misc]
            prompt_ids=[s.prompt_token_ids for s in seqs],
            output_ids=[s.output_token_ids for s in seqs],
            eos_token_ids=eos_token_ids,
            grammar_mask=masks,
        )
        want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if want:
            rows = torch.tensor(want, dtype=torch.long, device=all_logits.device)
            ks = [seqs[i].params.logprobs or 0 for i in want]
            entries = token_logprobs(all_logits.index_select(0, rows), [tokens[i] for i in want], ks)
            for i, entry in zip(want, entries, strict=True):
                seqs[i].step_logprobs = [entry]
        new_tokens.update({s.request_id: [t] for s, t in zip(seqs, tokens, strict=True)})

    def _verify(
        self,
        chunk: ScheduledChunk,
        logits: torch.Tensor,
        eos_token_ids: Collection[int],
        grammar: PendingMasks | None,
    ) -> list[int]:
        """A verify's tokens from its rows' logits (the sampler's processing and the grammar's mask
        applied row by row), and their logprobs from the raw rows, as one-token steps would report
        them."""
        seq, drafts = chunk.seq, chunk.drafts
        allowed = grammar.rows(seq.request_id, tuple(eos_token_ids)) if grammar else None
        processed = verify_logits(
            logits, drafts, seq.params, seq.prompt_token_ids, seq.output_token_ids, eos_token_ids, allowed
        )
        kept = verify(processed, drafts, seq.params, seq.generator)  # type: ignore[arg-type]
        if seq.params.logprobs is not None:
            seq.step_logprobs = token_logprobs(logits[: len(kept)], kept, [seq.params.logprobs] * len(kept))
        return kept

    def _draft(
        self,
        chunks: list[ScheduledChunk],
        spans: dict[int, int],
        streams: torch.Tensor,
        new_tokens: dict[str, list[int]],
    ) -> None:
        """The MTP layer over every request's positions of this step (each chunk's rows
        start at `spans[i]` in the step's `streams`): what the target computed (for a verify, its kept
        drafts and the token after them), each with the token after it; drafts for the next step of
        those that sampled. A parallel server's other ranks run the same rows (`Followers.draft`)."""
        assert self.drafter is not None
        rows = []
        for i, c in enumerate(chunks):
            seq = c.seq
            if seq.req_idx is None:
                continue
            got = new_tokens.get(seq.request_id, [])
            n = len(got) if c.drafts else len(c.token_ids)  # a verify computed its kept drafts and one more
            known = seq.tokens_between(c.start + 1, c.start + n + 1)
            following = known + got[: n - len(known)]  # got: the tokens after the known ones
            if len(following) < n:  # an unfinished prefill's chunk ends where its prompt does not
                continue
            start, carried = c.start, False
            if seq.draft_window_from is None:  # its first MTP pass on this row
                seq.draft_window_from, carried = self.drafter.cache.first_pass(seq.req_idx, c.start)
                if carried:  # the row of P - 1 too, from the snapshot's stream and this chunk's first token
                    start, following = c.start - 1, [c.token_ids[0], *following]
            window_from = seq.draft_window_from
            rows.append(
                DraftRow(
                    seq.request_id, seq.req_idx, start, spans[i], following, c.sample, window_from, carried
                )
            )
        if self.followers is not None:
            self.followers.draft(rows)
        drafts = self.draft(rows, streams)
        for c in chunks:
            if c.sample:
                c.seq.draft_token_ids = drafts.get(c.seq.request_id, [])


def _step_streams(decode: torch.Tensor | None, extend: torch.Tensor | None) -> torch.Tensor | None:
    """A step's last-layer streams in one tensor: the decode rows, then the prefill rows."""
    parts = [t for t in (decode, extend) if t is not None]
    return parts[0] if len(parts) == 1 else torch.cat(parts) if parts else None


def _prompt_logprobs(
    model: Dsv4ForCausalLM, kernels: KernelSet, chunk: ScheduledChunk, hidden: torch.Tensor
) -> None:
    """Append to `seq.prompt_logprobs` the logprob of each prompt token this chunk predicts
    (position p's logits give token p + 1's), from the chunk's hidden rows; positions done before a
    preemption are skipped."""
    seq, k = chunk.seq, chunk.seq.params.prompt_logprobs
    assert k is not None
    prompt = seq.prompt_token_ids
    lo, hi = max(chunk.start, len(seq.prompt_logprobs)), min(chunk.end, len(prompt) - 1)
    assert lo == len(seq.prompt_logprobs) or lo >= hi, "prompt chunks arrive in order"
    for a in range(lo, hi, PROMPT_LOGPROB_ROWS):
        b = min(a + PROMPT_LOGPROB_ROWS, hi)
        logits = model.compute_logits(hidden[a - chunk.start : b - chunk.start], kernels)
        seq.prompt_logprobs += token_logprobs(logits, prompt[a + 1 : b + 1], [k] * (b - a))
