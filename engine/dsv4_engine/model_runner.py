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
from dsv4_engine.model import Dsv4ForCausalLM, ForwardBatch
from dsv4_engine.sampler import sample, token_logprobs
from dsv4_engine.scheduler import ScheduledChunk, SchedulerOutput, Sequence

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
    """Every rank's forward of one step: the decode rows (one token each, at `spec.prefix_len`),
    then the prefill chunks; `bundle`: the slots the allocator gave the step, in that order."""

    decode_ids: list[str]
    decode_specs: list[ExtendSpec]
    decode_tokens: list[int]
    prefills: list[PrefillChunk]
    bundle: DSV4OutCacheLoc

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepPlan:
        n_dec = 0
        while n_dec < len(out.chunks) and out.chunks[n_dec].is_decode:
            n_dec += 1
        decodes, specs = out.chunks[:n_dec], out.specs[:n_dec]
        prefills = []
        for c in out.chunks[n_dec:]:
            assert c.seq.req_idx is not None
            prefills.append(PrefillChunk(c.seq.request_id, c.seq.req_idx, c.start, c.token_ids))
        return cls(
            decode_ids=[c.seq.request_id for c in decodes],
            decode_specs=list(specs),
            decode_tokens=[
                c.seq.all_token_ids[spec.prefix_len] for c, spec in zip(decodes, specs, strict=True)
            ],
            prefills=prefills,
            bundle=out.bundle,
        )

    def prefill_specs(self) -> list[ExtendSpec]:
        return [ExtendSpec(c.req_idx, c.start, c.start + len(c.token_ids)) for c in self.prefills]


class Followers(Protocol):
    """The other ranks of a parallel server, as rank 0's runner sees them (ranks.py)."""

    def send(self, journal: list[tuple[str, tuple]], step: StepPlan) -> None: ...


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
    ) -> None:
        """decode_mode: how `decode` runs (see there); default from `enforce_eager` and the device
        (`graph_runner.default_decode_mode`)."""
        self.model = model
        self.kv_pool = kv_pool
        self.allocator = allocator
        self.device = model.device
        self.decode_mode: DecodeMode = decode_mode or default_decode_mode(self.device, enforce_eager)
        if self.decode_mode not in DECODE_MODES:
            raise ValueError(f"decode_mode must be one of {DECODE_MODES}, got {self.decode_mode!r}")
        self.decode_buckets = buckets_for(max_num_seqs)
        # The ops every step runs (EngineConfig.kernels: the fused CPU kernels where they serve),
        # chosen once; each step's batch carries it to the modules.
        self.kernels = choose_kernels(self.device, kernels)
        self._decode_runner: DecodeGraphRunner | None = None  # built on first use
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
    def forward(self, step: StepPlan) -> tuple[torch.Tensor | None, torch.Tensor | None, ForwardBatch | None]:
        """Every rank's part of a step: (decode logits `[n_dec, V]` fp32, prefill hidden states,
        their batch); None for a part the step does not have."""
        decode_logits = self.decode(step) if step.decode_specs else None
        if not step.prefills:
            return decode_logits, None, None
        n_dec, n = len(step.decode_specs), len(step.decode_specs) + len(step.prefills)
        batch = self._extend_batch(
            step.prefill_specs(), step.bundle.select(n_dec, n), [c.token_ids for c in step.prefills]
        )
        return decode_logits, self.model(batch), batch

    def _extend_batch(
        self, specs: list[ExtendSpec], bundle: DSV4OutCacheLoc, token_ids: list[list[int]]
    ) -> ForwardBatch:
        """An extend forward's batch over the pools, from the step's out-cache locations."""
        return paged_extend_batch(
            self.kv_pool, self.allocator.req_pool, specs, bundle, token_ids, self.model.dtype, self.device,
            self.kernels,
        )  # fmt: skip

    def decode(self, step: StepPlan) -> torch.Tensor:
        """One decode step for the step's decode rows (each adds its token at `spec.prefix_len`);
        returns logits `[n, V]` (fp32), row i for row i.

        On entry the allocator has already allocated this step: `specs[i]` is row i's
        `prefix_len -> prefix_len + 1`, the step's bundle says where each row writes and the request
        tables (`allocator.req_pool`) map every earlier position to its pool slot. The method writes
        the new token's SWA KV, compressor state and any completed compressed rows there, since
        later steps read them from the pools.

        `self.decode_mode` (a constructor argument) picks the path: `eager` (default with
        enforce_eager), `compiled` (CPU without it) or `graph` (GPU/NPU without it) run every request
        in one forward from the static decode buffers of the batch's bucket
        (`graph_runner.DecodeGraphRunner`, docs/decode.md); `reference` runs the per-request SeqCache
        forward below, which the batched step is tested against, as does a batch above the largest
        bucket.
        """
        specs, tokens = step.decode_specs, step.decode_tokens
        bundle = step.bundle.select(0, len(specs))
        if self.decode_mode != "reference" and len(specs) <= self.decode_buckets[-1]:
            return self.decode_runner().run(specs, tokens, bundle)
        batch = self._extend_batch(specs, bundle, [[t] for t in tokens])
        return self.model.compute_logits(self.model(batch), self.kernels)

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
    ) -> dict[str, int]:
        """Forward the step and sample: request id -> next token, for every chunk with sample=True.
        `eos_token_ids`: what `min_tokens` masks besides a request's stop ids. A request asking for
        logprobs gets its sampled token's in `seq.step_logprobs` (raw logits, before any penalty).
        `grammar`: the constrained requests' masks, computed while the forward runs."""
        step = StepPlan.of(out)
        if self.followers is not None:  # the server's other ranks run the same forwards
            self.followers.send(self.allocator.take_journal(), step)
        decode_logits, hidden, batch = self.forward(step)
        n_dec = len(step.decode_specs)
        sampled_chunks: list[ScheduledChunk] = []
        logits: list[torch.Tensor] = []
        if decode_logits is not None:
            logits.append(decode_logits)
            sampled_chunks += out.chunks[:n_dec]
        if hidden is not None and batch is not None:
            prefills = out.chunks[n_dec:]
            for c, s in zip(prefills, batch.seqs, strict=True):
                if c.seq.params.prompt_logprobs is not None:  # only requests that ask pay for every row
                    _prompt_logprobs(self.model, self.kernels, c, hidden[s.offset : s.offset + s.length])
            last = [s.offset + s.length - 1 for c, s in zip(prefills, batch.seqs, strict=True) if c.sample]
            if last:
                rows = torch.tensor(last, dtype=torch.long, device=self.device)
                logits.append(self.model.compute_logits(hidden.index_select(0, rows), self.kernels))
            sampled_chunks += [c for c in prefills if c.sample]
        if not sampled_chunks:
            return {}
        seqs = [c.seq for c in sampled_chunks]
        all_logits = torch.cat(logits)
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
                seqs[i].step_logprobs = entry
        return {s.request_id: t for s, t in zip(seqs, tokens, strict=True)}


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
