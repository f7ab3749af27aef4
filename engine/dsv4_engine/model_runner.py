"""Runs one scheduled step: the model's forward over the paged pools, then sampling.

The scheduler has already allocated the step (`SchedulerOutput.bundle`); here each request gets a
`PagedSeqCache` over its request-table row, the forward reads and writes the pools through it, and
one token is sampled for every chunk that reaches its request's last known token. Decodes (one
token per request, scheduled first) and prefill chunks run as two forwards, so the decode forward is
one method with a fixed-shape input that a graph runner can take over.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from dsv4_engine.attention import buckets_for
from dsv4_engine.graph_runner import DECODE_MODES, DecodeGraphRunner, DecodeMode, default_decode_mode
from dsv4_engine.memory import Dsv4Allocator, DSV4OutCacheLoc, Dsv4TokenToKVPool, ExtendSpec
from dsv4_engine.memory.seq_cache import PagedSeqCache
from dsv4_engine.model import Dsv4ForCausalLM, ForwardBatch
from dsv4_engine.model.batch import ExtendOps
from dsv4_engine.sampler import sample, token_logprobs
from dsv4_engine.scheduler import ScheduledChunk, SchedulerOutput, Sequence

# Prompt logprobs are computed this many positions at a time, so a long chunk never holds its whole
# [chunk, vocab] logits at once.
PROMPT_LOGPROB_ROWS = 256


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
        # Whether steps may use the fused CPU kernels (EngineConfig.kernels): both kinds of step.
        self.kernels = kernels
        self.extend_ops = ExtendOps(kernels=kernels)
        self._decode_runner: DecodeGraphRunner | None = None  # built on first use
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

    # ---- caches --------------------------------------------------------------------------------
    def _cache(self, seq: Sequence, start: int) -> PagedSeqCache:
        """The request's view of its pages, positioned at `start` (a fresh one after (re)admission)."""
        assert seq.req_idx is not None
        cache = seq.cache
        if not isinstance(cache, PagedSeqCache) or start == 0 or cache.req_idx != seq.req_idx:
            cache = PagedSeqCache(self.kv_pool, self.allocator, seq.req_idx)
            seq.cache = cache
        cache.num_tokens = start
        cache.new_step()
        return cache

    # ---- forwards ------------------------------------------------------------------------------
    def prefill(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Run prefill chunks (any prefix: chunked prefill continues at `chunk.start`) in one
        forward; logits `[n, V]` (fp32) of the last token of each chunk with `sample=True`, in order."""
        batch = ForwardBatch.build(
            [(self._cache(c.seq, c.start), c.token_ids) for c in chunks],
            device=self.device,
            ops=self.extend_ops,
        )
        hidden = self.model(batch)
        for c, s in zip(chunks, batch.seqs, strict=True):
            if c.seq.params.prompt_logprobs is not None:  # only requests that ask pay for every row
                _prompt_logprobs(self.model, c, hidden[s.offset : s.offset + s.length])
        last = [s.offset + s.length - 1 for c, s in zip(chunks, batch.seqs, strict=True) if c.sample]
        if not last:
            return hidden.new_empty(0, self.model.config.vocab_size, dtype=torch.float32)
        rows = torch.tensor(last, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, rows))

    def decode(self, seqs: list[Sequence], specs: list[ExtendSpec], bundle: DSV4OutCacheLoc) -> torch.Tensor:
        """One decode step for `seqs` (each adds its last token at position `spec.prefix_len`);
        returns logits `[len(seqs), V]` (fp32), row i for seqs[i].

        On entry the allocator has already allocated this step: `specs[i]` is seqs[i]'s
        `prefix_len -> prefix_len + 1` and `bundle` holds exactly these requests' slots (the
        out-cache locations, in the same order); the request tables (`allocator.req_pool`) map every
        position to its pool slot. The method writes the new token's SWA KV, compressor state and
        any completed compressed rows into the pools, since later steps read them from there.
        `seq.cache` need not be kept in sync: every step repositions it.

        `self.decode_mode` (a constructor argument) picks the path: `eager` (default with
        enforce_eager), `compiled` (CPU without it) or `graph` (GPU/NPU without it) run every request
        in one forward from the static decode buffers of the batch's bucket
        (`graph_runner.DecodeGraphRunner`, docs/decode.md); `reference` runs the per-request SeqCache
        forward below, which the batched step is tested against, as does a batch above the largest
        bucket.
        """
        if self.decode_mode != "reference" and len(seqs) <= self.decode_buckets[-1]:
            tokens = [seq.all_token_ids[spec.prefix_len] for seq, spec in zip(seqs, specs, strict=True)]
            return self.decode_runner().run(specs, tokens)
        del bundle  # the reference path writes through the request tables
        chunks = [
            (self._cache(seq, spec.prefix_len), [seq.all_token_ids[spec.prefix_len]])
            for seq, spec in zip(seqs, specs, strict=True)
        ]
        batch = ForwardBatch.build(chunks, device=self.device, ops=self.extend_ops)
        return self.model.compute_logits(self.model(batch))

    def _probe(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        import hashlib

        assert self.logit_probe is not None
        for seq, row in zip(seqs, logits, strict=True):
            if seq.request_id not in self.logit_probe and len(self.logit_probe) < 4096:
                data = row.float().contiguous().cpu().numpy().tobytes()
                self.logit_probe[seq.request_id] = hashlib.sha256(data).hexdigest()

    # ---- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, out: SchedulerOutput, eos_token_ids: Collection[int] = ()) -> dict[str, int]:
        """Forward the step and sample: request id -> next token, for every chunk with sample=True.
        `eos_token_ids`: what `min_tokens` masks besides a request's stop ids. A request asking for
        logprobs gets its sampled token's in `seq.step_logprobs` (raw logits, before any penalty)."""
        n_dec = 0
        while n_dec < len(out.chunks) and out.chunks[n_dec].is_decode:
            n_dec += 1
        sampled_chunks: list[ScheduledChunk] = []
        logits: list[torch.Tensor] = []
        if n_dec:
            decodes = out.chunks[:n_dec]
            logits.append(
                self.decode([c.seq for c in decodes], out.specs[:n_dec], out.bundle.select(0, n_dec))
            )
            sampled_chunks += decodes
        if n_dec < len(out.chunks):
            prefills = out.chunks[n_dec:]
            logits.append(self.prefill(prefills))
            sampled_chunks += [c for c in prefills if c.sample]
        if not sampled_chunks:
            return {}
        seqs = [c.seq for c in sampled_chunks]
        all_logits = torch.cat(logits)
        if self.logit_probe is not None:
            self._probe(seqs, all_logits)
        tokens = sample(
            all_logits,
            [s.params for s in seqs],
            [s.generator for s in seqs],  # type: ignore[misc]
            prompt_ids=[s.prompt_token_ids for s in seqs],
            output_ids=[s.output_token_ids for s in seqs],
            eos_token_ids=eos_token_ids,
        )
        want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if want:
            rows = torch.tensor(want, dtype=torch.long, device=all_logits.device)
            ks = [seqs[i].params.logprobs or 0 for i in want]
            entries = token_logprobs(all_logits.index_select(0, rows), [tokens[i] for i in want], ks)
            for i, entry in zip(want, entries, strict=True):
                seqs[i].step_logprobs = entry
        return {s.request_id: t for s, t in zip(seqs, tokens, strict=True)}


def _prompt_logprobs(model: Dsv4ForCausalLM, chunk: ScheduledChunk, hidden: torch.Tensor) -> None:
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
        logits = model.compute_logits(hidden[a - chunk.start : b - chunk.start])
        seq.prompt_logprobs += token_logprobs(logits, prompt[a + 1 : b + 1], [k] * (b - a))
