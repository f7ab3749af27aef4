"""`LLMEngine`: requests in, tokens out, one `step()` at a time.

Paged continuous batching: the scheduler picks a step (decodes first, then chunked prefill under
the token budget; admission by pool capacity; preemption by recompute) and allocates it in the
paged pools; the model runner runs the forward over those pools and samples; the scheduler then
appends the tokens and frees finished requests. See docs/engine.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsv4_engine import grammar
from dsv4_engine.config import Dsv4Config
from dsv4_engine.device import keep_freed_host_memory
from dsv4_engine.engine_config import EngineConfig
from dsv4_engine.memory import Dsv4MemoryLayout, OutOfPages, StateType, dsv4_state_payloads
from dsv4_engine.memory.prefix_store import (
    PageWrites,
    PrefixExport,
    PrefixExporter,
    PrefixRecord,
    ReadExtra,
    export_prefix,
    import_prefixes,
    write_pages,
)
from dsv4_engine.memory.sizing import pool_bytes
from dsv4_engine.options import split as split_options
from dsv4_engine.parallel.groups import SINGLE, init_groups, rank_device
from dsv4_engine.parallel.groups import prewarm as prewarm_groups
from dsv4_engine.parallel.shard import check_sizes
from dsv4_engine.ranks import (
    RankService,
    StepBroadcast,
    Workers,
    build_rank,
    load_model,
    share_sizes,
    threads_per_rank,
)
from dsv4_engine.sampler import TokenLogprobs
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.scheduler import Scheduler, SchedulerOutput, Sequence

log = logging.getLogger(__name__)


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    # For requests whose SamplingParams ask: one entry per new token, and (with the first token) the
    # prompt's, entry i for prompt token i (None for the first, which nothing predicts).
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    cached_tokens: int = 0  # prompt tokens resumed from the prefix cache (usage's cached_tokens)


class LLMEngine:
    def __init__(
        self,
        model_path: str | Path,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "cpu",
        *,
        tokenizer: object | None = None,
        rank_service: RankService | None = None,
        **options: Any,
    ) -> None:
        """`options`: `EngineOptions`' fields (options.py), by name; others are logged and ignored.
        `rank_service`: what each other rank of a parallel server runs beside its steps (a PD
        server's own transport per rank: disagg/lanes.serve), passed in by the server."""
        known, ignored = split_options(options)
        if ignored:
            log.info("LLMEngine ignores options it does not use yet: %s", sorted(ignored))
        self.config = Dsv4Config.from_pretrained(model_path)
        cfg = self.engine_config = EngineConfig.build(
            model_path, dtype, device, max_position_embeddings=self.config.max_position_embeddings, **known
        )
        if cfg.device.type == "cpu":
            keep_freed_host_memory()  # page faults on reused temporaries cost up to ~10% of a step
        # A parallel server: ranks 1..N-1 start now and load beside this one (ranks.py).
        self.workers: Workers | None = None
        self._broadcast: StepBroadcast | None = None
        self.parallel, self.prewarm_seconds = SINGLE, 0.0
        if cfg.tp_size > 1:
            check_sizes(self.config, cfg.tp_size, cfg.ep_size)  # before any rank starts
            cfg = self.engine_config = dataclasses.replace(cfg, device=rank_device(cfg.device, 0))
            if cfg.device.type == "cpu":
                torch.set_num_threads(threads_per_rank(cfg.tp_size))
            self.workers = Workers(cfg, rank_service)
            try:
                self.parallel = init_groups(0, cfg.tp_size, cfg.ep_size, self.workers.init_method, cfg.device)
                if cfg.prewarm:
                    self.prewarm_seconds = prewarm_groups(self.parallel, cfg.device)
            except BaseException:
                self.workers.close(None)
                raise
        try:
            self._build(cfg, tokenizer)
        except BaseException:
            self.close()
            raise

    def _build(self, cfg: EngineConfig, tokenizer: object | None) -> None:
        self.model = load_model(
            cfg.model,
            cfg.dtype,
            cfg.device,
            cfg.max_model_len,
            self.parallel,
            mtp=cfg.speculative_num_steps > 0,
        )
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(cfg.model))
        self.tokenizer = tokenizer

        layout = Dsv4MemoryLayout.from_config(self.config, page_size=cfg.page_size, kv_dtype=cfg.dtype)
        self.pool_sizes = share_sizes(self.parallel, cfg.pool_sizes(layout))
        rank = build_rank(cfg, self.model, self.pool_sizes)
        self.layout, memory, self.runner = rank.layout, rank.memory, rank.runner
        self.kv_pool, self.req_pool, self.allocator = memory.kv, memory.req_pool, memory.allocator
        self.scheduler = Scheduler(cfg.scheduler_config(tuple(self.config.eos_token_ids)), self.allocator)
        if self.workers is not None:
            self.allocator.record()  # the other ranks replay its changes
            self._broadcast = self.runner.followers = StepBroadcast(self.parallel)
        t0 = time.perf_counter()
        if warmed := self.runner.warmup():
            log.info("decode: %d batch-size buckets warmed in %.1f s", warmed, time.perf_counter() - t0)
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        # Called on the engine thread after every step's forward and sampling (PD prefill queues the
        # pages the step finished); outputs of requests admitted between steps (PD decode's first
        # token) go out with the next step.
        self.step_observers: list[Callable[[SchedulerOutput, dict[str, int]], None]] = []
        self._pending: list[StepOutput] = []
        self._grammar: grammar.GrammarBackend | None = None
        log.info(
            "paged pools: %s, %.1f MiB; page %d, max_model_len %d, max_num_seqs %d, token budget %d",
            self.pool_sizes,
            pool_bytes(self.layout, self.pool_sizes) / 2**20,
            cfg.page_size,
            cfg.max_model_len,
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
        )

    # The settings the engine's users read, from their one owner.
    @property
    def device(self) -> torch.device:
        return self.engine_config.device

    @property
    def dtype(self) -> torch.dtype:
        return self.engine_config.dtype

    @property
    def max_model_len(self) -> int:
        return self.engine_config.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.engine_config.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self.engine_config.max_num_batched_tokens

    @property
    def chunked_prefill_size(self) -> int | None:
        return self.engine_config.chunked_prefill_size

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self.scheduler.config.eos_token_ids)

    @eos_token_ids.setter
    def eos_token_ids(self, ids: set[int]) -> None:
        self.scheduler.config = dataclasses.replace(self.scheduler.config, eos_token_ids=tuple(ids))

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str | None = None,
        *,
        hold: bool = False,
    ) -> str:
        """Queue a prompt. `hold`: keep its pages after it finishes or is aborted, until
        `release_held` (PD prefill: a transfer may still be reading them)."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_token_ids)} tokens does not fit max_model_len={self.max_model_len}"
            )
        bad = [t for t in prompt_token_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.config.vocab_size}): {bad[:5]}")
        bad = [t for t in sampling_params.logit_bias or () if t >= self.config.vocab_size]
        if bad:  # the sampler indexes the logits with them
            raise ValueError(f"logit_bias token ids out of range [0, {self.config.vocab_size}): {bad[:5]}")
        seq = Sequence(request_id, list(prompt_token_ids), sampling_params, hold=hold)
        seq.generator = self._generator(sampling_params)
        if sampling_params.grammar is not None:
            seq.grammar = self.grammar_backend().matcher(sampling_params.grammar)
        self.scheduler.add(seq)  # raises if its context could never fit the pools
        self.requests[request_id] = seq
        return request_id

    def abort_request(self, request_id: str) -> None:
        if self.requests.pop(request_id, None) is not None:
            self.scheduler.abort(request_id)

    def grammar_backend(self) -> grammar.GrammarBackend:
        """llguidance's view of the tokenizer, built on the first constrained request."""
        if self._grammar is None:
            self._grammar = grammar.GrammarBackend(self.tokenizer, self.config.vocab_size)
        return self._grammar

    def _generator(self, params: SamplingParams, state: torch.Tensor | None = None) -> torch.Generator | None:
        if params.seed is None:
            return None
        generator = torch.Generator(device=self.device).manual_seed(params.seed)
        if state is not None:
            generator.set_state(state)
        return generator

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # ---- PD (disagg/): every call on the engine thread -----------------------------------------
    def payloads(
        self, req_idx: int, seq_len: int, types: Collection[StateType] | None = None
    ) -> dict[StateType, list[int]]:
        """Page ids per state type (all present, or only `types`) of a request of seq_len: the same
        builder on both sides."""
        builders = dsv4_state_payloads(self.kv_pool, self.req_pool, req_idx, seq_len)
        return {t: f() for t, f in builders.items() if types is None or t in types}

    def prealloc(self, prompt_len: int, *, poison: bool = False) -> tuple[int, dict[StateType, list[int]]]:
        """PD decode: a request row and every page a prompt of prompt_len needs to continue, before
        its state arrives; raises OutOfPages (nothing held) when the pools or rows are short.
        `poison` fills those pages with NaN, so a page the transfer missed cannot pass unseen."""
        if prompt_len >= self.max_model_len:
            raise ValueError(f"prompt of {prompt_len} tokens does not fit max_model_len={self.max_model_len}")
        req_idx = self.allocator.alloc_request()
        if req_idx is None:
            raise OutOfPages("no free request row")
        try:
            self.allocator.alloc_prealloc(req_idx, prompt_len)
        except BaseException:
            self.allocator.free(req_idx)
            raise
        pages = self.payloads(req_idx, prompt_len)
        if poison:
            buffers = self.kv_pool.buffers_by_type()
            for state_type, ids in pages.items():
                index = torch.tensor([p for p in ids if p], dtype=torch.long)
                for buf in buffers[state_type]:
                    buf.index_fill_(0, index.to(buf.device), float("nan"))
        return req_idx, pages

    def free_request(self, req_idx: int) -> None:
        """Give back a pre-allocated row that never became a running request."""
        self.allocator.free(req_idx)

    def draft_geometry(self) -> tuple[int, int, torch.dtype] | None:
        """(window, row width, dtype) of the MTP layer's window rows when this engine speculates."""
        drafter = self.runner.drafter
        if drafter is None:
            return None
        return drafter.cache.window, drafter.cache.kv.shape[1], drafter.cache.kv.dtype

    def draft_window(self, req_idx: int, start: int, end: int) -> torch.Tensor:
        """PD prefill: the MTP rows of positions [start, end) of a request row (its window)."""
        return self.runner.draft_window(req_idx, start, end)

    def admit_transferred(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        req_idx: int,
        first_token: int,
        generator_state: torch.Tensor | None,
        *,
        first_logprobs: TokenLogprobs | None = None,
        prompt_logprobs: list[TokenLogprobs] | None = None,
        cached_tokens: int = 0,
        drafts: list[int] | None = None,
        draft_window: tuple[int, torch.Tensor] | None = None,
    ) -> None:
        """PD decode: the request's state is in `req_idx`'s pages, on every rank (each had it written
        by a prefill rank of its own: disagg/lanes.py); run it from its first token.
        The logprobs the prefill computed come out with that token, as a colocated server's would,
        and so does its prefix-cache hit (`cached_tokens`). `drafts`: the prefill's MTP drafts after
        the first token, which the first decode step verifies when this engine speculates;
        `draft_window`: (first position, rows) of the prefill's MTP window, which its drafts after
        that step read as a colocated server's would."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not 0 <= first_token < self.config.vocab_size:
            self.allocator.free(req_idx)
            raise ValueError(f"transferred first token {first_token} is outside the vocabulary")
        seq = Sequence(request_id, list(prompt_token_ids), sampling_params, req_idx=req_idx)
        seq.output_token_ids.append(first_token)
        if sampling_params.grammar is not None:
            # The prefill server sampled the first token under the same grammar: rebuild the matcher
            # from the request and advance it past that token.
            try:
                seq.grammar = self.grammar_backend().matcher(sampling_params.grammar)
            except ValueError:
                self.allocator.free(req_idx)
                raise
            grammar.advance(seq.grammar, first_token)
        seq.generator = self._generator(sampling_params, generator_state)
        seq.num_cached_tokens = cached_tokens
        if self.engine_config.speculative_num_steps:
            seq.draft_token_ids = list(drafts or ())
            if draft_window is not None:
                self.runner.write_draft_window(req_idx, *draft_window)
                seq.draft_window_from = draft_window[0]
        first = StepOutput(request_id, [first_token], False, None, cached_tokens=cached_tokens)
        if sampling_params.logprobs is not None and first_logprobs is not None:
            first.logprobs = [first_logprobs]
        if sampling_params.prompt_logprobs is not None and prompt_logprobs is not None:
            seq.prompt_logprobs = list(prompt_logprobs)  # a preempted recompute need not redo them
            first.prompt_logprobs = [None, *prompt_logprobs]
        done = self.scheduler.admit_resident(seq)
        if done is None:
            self.requests[request_id] = seq
        first.finished, first.finish_reason = done is not None, seq.finish_reason
        self._pending.append(first)

    def release_held(self, request_id: str) -> None:
        """PD prefill: the request's transfer ended; free its pages (aborting it first if it runs)."""
        self.abort_request(request_id)
        self.scheduler.release(request_id)

    def metrics(self) -> dict[str, float]:
        """Counters and gauges: num_running, num_waiting, num_preemptions, num_aborted,
        prompt_tokens_total, generation_tokens_total, prefix_cache_queries and prefix_cache_hits
        (prompt tokens admitted, and of those resumed from the cache), prefix_cache_nodes and
        prefix_cache_snapshots, and per page family (full, swa, c4s, c128s) pool_usage/<f> (fraction
        held by requests), pool_free/<f>, pool_available/<f> (free, or held by the prefix cache
        alone: what requests can take) and pool_total/<f> (pages)."""
        out = {k: float(v) for k, v in self.scheduler.metrics().items()}
        cache = self.allocator.prefix_cache
        out["prefix_cache_nodes"] = float(cache.num_nodes if cache else 0)
        out["prefix_cache_snapshots"] = float(cache.num_snapshots if cache else 0)
        return out

    def flush_cache(self) -> None:
        """Empty the prefix cache; what running requests hold stays theirs."""
        self.allocator.flush_cache()

    def prefix_cache_version(self) -> int:
        """How many times the prefix cache changed (entries added or dropped): a copy of it saved at
        one count is current while the count stays."""
        cache = self.allocator.prefix_cache
        return cache.changes if cache is not None else 0

    def export_prefix_cache(self, max_bytes: int | None = None) -> PrefixExport:
        """The prefixes the cache can resume at, most recently used first up to max_bytes, as the pages
        a request resuming there reads (for another engine of the same layout: `import_prefix_cache`),
        in one read; `prefix_exporter` reads them in parts."""
        exporter = self.prefix_exporter(max_bytes)
        exporter.read()
        return exporter.result()

    def prefix_exporter(self, max_bytes: int | None = None) -> PrefixExporter:
        """`export_prefix_cache` in parts: each `read(budget_s)` between two steps, also while requests
        run. A parallel server's ranks hold the same pages (its state is replicated), so rank 0's are
        read; the reads' row changes reach the other ranks through the journal as any step's do."""
        return PrefixExporter(
            self.allocator, self.kv_pool, self.runner.apply_state_copies, self._read_draft_window, max_bytes
        )

    def import_prefix_cache(self, records: Iterable[PrefixRecord], *, evict: bool = False) -> int:
        """Cache what `export_prefix_cache` or `export_prefix` gave (an engine whose layout fingerprint
        is this one's, docs/memory.md "Persistent snapshots"), as long as free pages last (evict: or
        evictable ones); returns how many prefixes. Between steps. On a parallel server every rank
        writes the same pages: the allocator's changes reach the others through its journal, the
        contents in a message of their own."""
        write_extra = self._write_draft_window if self.runner.drafter is not None else None
        return import_prefixes(
            self.allocator, self.kv_pool, records, self.runner.apply_state_copies, self._write_pages,
            write_extra, evict=evict,
        )  # fmt: skip

    def export_prefix(self, tokens: list[int], base: int) -> PrefixRecord | None:
        """The longest prefix of tokens the cache can resume at, as a record of its pages from base
        on (`prefix_store.export_prefix`), for a peer that resumes at base already; between steps."""
        return export_prefix(
            self.allocator,
            self.kv_pool,
            self.runner.apply_state_copies,
            self._read_draft_window,
            tokens,
            base,
        )

    @property
    def _read_draft_window(self) -> ReadExtra | None:
        """What else a record keeps with speculation on: the MTP layer's window rows."""
        drafter = self.runner.drafter
        return drafter.cache.export_window if drafter is not None else None

    def resumable_length(self, tokens: list[int]) -> int:
        """How long a prefix of tokens the cache could resume at now: a hint any thread may ask
        (`PrefixCache.resumable_length`)."""
        cache = self.allocator.prefix_cache
        return cache.resumable_length(tokens) if cache is not None else 0

    def _write_draft_window(self, row: int, n: int, window: dict[str, torch.Tensor]) -> None:
        """An imported prefix's MTP window (none: {}) into the row, on every rank, before the
        snapshot that keeps it is taken."""
        assert self.runner.drafter is not None
        if self._broadcast is not None:
            self._broadcast.replay(self.allocator.take_journal())
            self._broadcast.prefix_window(row, n, window)
        self.runner.drafter.cache.import_window(row, n, window)

    def _write_pages(self, writes: PageWrites) -> None:
        if self._broadcast is not None:
            self._broadcast.replay(self.allocator.take_journal())  # the pages are allocated there first
            self._broadcast.pages(writes)
        write_pages(self.kv_pool, writes)

    def steps_sent(self) -> int:
        """Step messages rank 0 has sent its other ranks (0 on one rank): a rank's PD write of a
        step's pages waits until it ran as many (disagg/lanes.py)."""
        return self._broadcast.sent if self._broadcast is not None else 0

    def close(self) -> None:
        """Stop the other ranks of a parallel server (nothing to do on one rank); idempotent."""
        if self.workers is not None:
            self.workers.close(self._broadcast)

    def step(self) -> list[StepOutput]:
        if self.workers is not None and self.workers.failure is not None:
            raise RuntimeError(self.workers.failure)
        outputs, self._pending = self._pending, []
        out = self.scheduler.schedule()
        if out is None:
            if self.scheduler.has_unfinished() and not self.scheduler.running and not self.scheduler.held:
                raise RuntimeError("requests are waiting but none can be admitted with empty pools")
            return outputs
        constrained = {c.seq.request_id: c.seq.grammar for c in out.chunks if c.sample and c.seq.grammar}
        drafts = {c.seq.request_id: c.drafts for c in out.chunks if c.sample and c.seq.grammar and c.drafts}
        masks = self.grammar_backend().start_masks(constrained, drafts) if constrained else None
        new_tokens = self.runner.run(out, self.scheduler.config.eos_token_ids, masks)
        for rid in constrained:  # every token the step gave (a verify's kept drafts and one more)
            for token in new_tokens.get(rid, []):
                grammar.advance(constrained[rid], token)
        first = {rid: tokens[0] for rid, tokens in new_tokens.items()}
        for observe in self.step_observers:
            observe(out, first)
        had = {c.seq.request_id: len(c.seq.output_token_ids) for c in out.chunks}
        finished = {seq.request_id for seq in self.scheduler.postprocess(out, new_tokens)}
        self.runner.apply_state_copies()  # the snapshots postprocess took: their rows, now
        for chunk in out.chunks:
            seq = chunk.seq
            rid = seq.request_id
            if rid not in new_tokens or rid not in self.requests:
                continue
            done = rid in finished
            # What postprocess kept: a verify's tokens stop at the one that ends the request.
            step = StepOutput(
                rid, seq.output_token_ids[had[rid] :], done, seq.finish_reason if done else None
            )
            step.cached_tokens = seq.num_cached_tokens or 0
            if seq.params.logprobs is not None and seq.step_logprobs:
                step.logprobs = seq.step_logprobs[: len(step.new_token_ids)]
            if seq.params.prompt_logprobs is not None and len(seq.output_token_ids) == 1:
                step.prompt_logprobs = [None, *seq.prompt_logprobs]  # with the first token, once
            outputs.append(step)
            if done:
                del self.requests[rid]
        return outputs
