"""Decode for all running requests in one forward per step, replayable per batch-size bucket.

`DecodeGraphRunner` owns the static decode state of every bucket: small step inputs (token ids,
request rows, positions, validity, and where each row writes: the allocator's out-cache locations,
`DecodeLocs`), the bucket's `DecodeBuffers` metadata and (graph mode) the output logits. The host
pads a step to its bucket and copies the inputs; the step refreshes the metadata in place from them
and the request tables, then runs the forward over the paged pools. Every one of
these tensors keeps its `data_ptr()` for the runner's life, and the step reads nothing else but the
weights, the tables and the pools:

- `eager`: `Dsv4ForCausalLM.forward` over the bucket's `DecodeBatch`, run as it is (the same code
  every other mode compiles or captures, and the model's one forward for every step);
- `compiled`: `torch.compile(fullgraph=True, dynamic=False)` once per bucket; artefacts go to
  `TORCHINDUCTOR_CACHE_DIR` (default `$XDG_CACHE_HOME/dsv4/inductor`, i.e. `~/.cache/dsv4/inductor`),
  never into the repository; `num_compiles` counts compile events (zero after warm-up);
- `graph`: a device graph captured once per bucket and replayed (CUDA graphs on GPU, aclgraph on
  Ascend through `device.graph_api`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import torch

from dsv4_engine.attention.decode_buffers import DEFAULT_BUCKETS, DecodeBuffers
from dsv4_engine.attention.decode_fill import DecodeLocs
from dsv4_engine.attention.paged_decode import DecodeBatch, PoolViews
from dsv4_engine.kernels import KernelSet, choose_kernels
from dsv4_engine.memory.out_cache_loc import DSV4OutCacheLoc, ExtendSpec
from dsv4_engine.memory.pools import Dsv4TokenToKVPool
from dsv4_engine.memory.req_to_token import Dsv4ReqPool
from dsv4_engine.model.model import Dsv4ForCausalLM
from dsv4_engine.model.packed import decode_packs

log = logging.getLogger(__name__)

Mode = Literal["eager", "compiled", "graph"]
MODES: tuple[str, ...] = ("eager", "compiled", "graph")
# ModelRunner's: the runner's modes, or `reference` (the per-request SeqCache forward, for tests).
DecodeMode = Literal["eager", "compiled", "graph", "reference"]
DECODE_MODES: tuple[str, ...] = (*MODES, "reference")


def default_decode_mode(device: torch.device, enforce_eager: bool) -> Mode:
    """`eager` when eager is enforced; else a device graph on GPU/NPU, `torch.compile` on CPU."""
    if enforce_eager:
        return "eager"
    return "graph" if device.type in ("cuda", "npu") else "compiled"


def default_inductor_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dsv4" / "inductor"


def set_inductor_cache() -> str:
    """Point inductor's cache outside the repository unless the user already chose a folder."""
    return os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default_inductor_cache()))


class DecodeGraphRunner:
    def __init__(
        self,
        model: Dsv4ForCausalLM,
        kv_pool: Dsv4TokenToKVPool,
        req_pool: Dsv4ReqPool,
        max_context_len: int,
        *,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        mode: Mode = "eager",
        skip_guards: bool = True,
        kernels: KernelSet | None = None,
        trim: bool | None = None,
    ) -> None:
        """skip_guards (compiled mode): after a bucket's first call (compiled, or loaded from the
        cache, under dynamo's full guards), replay its compiled graph directly on the tensors dynamo
        passed it, as a device graph is replayed: every input is a static buffer by construction
        (weights, pools, the bucket's buffers), and dynamo's guards and input gathering cost about a
        fifth of the step.
        kernels: the engine's kernel set (`kernels.choose_kernels`; default: what an engine on the
        model's device runs); every step runs its decode variant (`KernelSet.for_decode`).
        trim (eager only; default: eager): gather compressed keys from the step's longest context
        and pool only completed blocks (host reads; `DecodeBatch`)."""
        if mode not in MODES:
            raise ValueError(f"decode mode must be one of {MODES}, got {mode!r}")
        self.model = model
        self.layout = kv_pool.layout
        self.req_pool = req_pool
        self.mode = mode
        self.device = model.device
        self.max_positions = model.model.rope.max_positions
        self.buffers = DecodeBuffers(self.layout, max_context_len, buckets, device=self.device)
        self.pools = PoolViews(kv_pool)
        # Per-bucket step inputs, the only tensors the host writes per step: token ids, request rows,
        # positions, validity, out-cache locations. The step refreshes the bucket's DecodeBuffers
        # from them.
        zeros = lambda bs: torch.zeros(bs, dtype=torch.long, device=self.device)  # noqa: E731
        self.input_ids = {bs: zeros(bs) for bs in self.buckets}
        self.req = {bs: zeros(bs) for bs in self.buckets}
        self.pos = {bs: zeros(bs) for bs in self.buckets}
        self.valid = {bs: torch.zeros(bs, dtype=torch.bool, device=self.device) for bs in self.buckets}
        self.locs = {bs: DecodeLocs.zeros(bs, device=self.device) for bs in self.buckets}
        # Row n: the validity of a step of n requests in bucket bs (its first n rows).
        self._valid_rows = {
            bs: torch.arange(bs)[None, :] < torch.arange(bs + 1)[:, None] for bs in self.buckets
        }
        self.skip_guards = skip_guards
        # Eager steps trim compressed-key gathers to the step's longest context (set by `prepare`);
        # compiled and captured steps keep the buffers' full width.
        self.num_pages: dict[int, int] = {}
        engine_kernels = kernels or choose_kernels(self.device)
        self.kernels = engine_kernels.for_decode(compiled=mode == "compiled")
        self.trim = mode == "eager" and trim is not False
        self.packs = decode_packs(model)
        self.num_compiles = 0  # compile events (compiled mode) / captures (graph mode)
        self._steps: dict[int, Callable[[], torch.Tensor]] = {}
        self._graphs: dict[int, object] = {}
        self._graph_out: dict[int, torch.Tensor] = {}
        self._graph_streams: dict[int, torch.Tensor] = {}
        if mode == "compiled":
            set_inductor_cache()
            import torch._dynamo as dynamo

            # Every bucket compiles the same function once: allow one entry per bucket.
            dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, len(self.buckets) + 1)
            for t in self.static_tensors().values():
                dynamo.mark_static_address(t)

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.buffers.buckets

    def static_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor a step reads or writes besides the weights: pools, metadata, inputs."""
        out: dict[str, torch.Tensor] = {}
        for group in ("swa", "c4", "c128", "indexer", "c4_state", "c4_index_state", "c128_state"):
            for layer, t in getattr(self.pools, group).items():
                out[f"pool.{group}.{layer}"] = t
        for name in ("input_ids", "req", "pos", "valid"):
            for bs, t in getattr(self, name).items():
                out[f"{name}.{bs}"] = t
        for bs, locs in self.locs.items():
            out[f"locs.{bs}"] = locs.slots
        for name in ("req_to_token", *self.req_pool.DSV4_TABLES):
            out[f"table.{name}"] = getattr(self.req_pool, name)
        for bs in self.buckets:
            for name, t in self.buffers.buffers(bs).tensors().items():
                out[f"meta.{bs}.{name}"] = t
        for bs, t in self._graph_out.items():
            out[f"logits.{bs}"] = t
        for bs, t in self._graph_streams.items():
            out[f"streams.{bs}"] = t
        return out

    # ---- one step -------------------------------------------------------------------------------
    def prepare(
        self, specs: Sequence[ExtendSpec], token_ids: Sequence[int] | torch.Tensor, bundle: DSV4OutCacheLoc
    ) -> int:
        """Copy the step's inputs into its bucket's static tensors; `bundle`: what `alloc_decode`
        returned for `specs`. Returns the bucket."""
        n = len(specs)
        if n == 0 or len(token_ids) != n:
            raise ValueError(f"need one token id per request, got {len(token_ids)} for {n}")
        if any(s.seq_len != s.prefix_len + 1 for s in specs):
            raise ValueError("decode steps add exactly one token per request")
        top = max(s.prefix_len for s in specs)
        if top >= self.max_positions:
            raise ValueError(f"position {top} exceeds max_positions {self.max_positions}")
        bs = self.buffers.bucket_for(n)
        self.num_pages[bs] = top // self.layout.page_size + 1  # the longest context, in pages
        # One host tensor for every integer input (ids, request rows, positions, the five slot kinds):
        # a decode step's host side is a few Python lists, and each tensor made from one costs ~5 us.
        ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        pad = [0] * (bs - n)
        flat = [*ids, *pad, *(s.req_idx for s in specs), *pad, *(s.prefix_len for s in specs), *pad]
        host = torch.tensor(flat + DecodeLocs.rows(bundle, bs), dtype=torch.long).view(8, bs)
        with torch.inference_mode():  # the buffers may be inference tensors (runner built in one)
            self.input_ids[bs].copy_(host[0])
            self.req[bs].copy_(host[1])
            self.pos[bs].copy_(host[2])
            self.locs[bs].slots.copy_(host[3:])
            self.valid[bs].copy_(self._valid_rows[bs][n])
        return bs

    def run(
        self, specs: Sequence[ExtendSpec], token_ids: Sequence[int] | torch.Tensor, bundle: DSV4OutCacheLoc
    ) -> torch.Tensor:
        """Logits `[len(specs), vocab]` of one decode token per request, after `alloc_decode` gave
        `specs` their slots (`bundle`); writes their KV, compressed rows and state there."""
        return self.run_with_streams(specs, token_ids, bundle)[0]

    def run_with_streams(
        self, specs: Sequence[ExtendSpec], token_ids: Sequence[int] | torch.Tensor, bundle: DSV4OutCacheLoc
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`run`, and the last layer's streams `[len(specs), hc, hidden]` (what the MTP layer reads)."""
        logits, streams = self.step(self.prepare(specs, token_ids, bundle))
        return logits[: len(specs)], streams[: len(specs)]

    def step(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run bucket `bs` on whatever its buffers hold now (padded rows are inert): (logits, the last
        layer's streams). Always under inference mode, whatever the caller's grad mode: a compiled
        step guards on it."""
        with torch.inference_mode():  # a capture records no autograd state either
            fn = self._steps.get(bs)
            if fn is None:
                fn = self._steps[bs] = self._build(bs)
            return fn()

    def warmup(self, buckets: Sequence[int] | None = None) -> None:
        """Compile / capture buckets ahead of traffic. Safe at any time: the buffers of a bucket not
        in use hold padding, whose writes only rewrite the sentinel slot with sentinel values."""
        for bs in buckets or self.buckets:
            t0, compiles = time.perf_counter(), self.num_compiles
            self._reset(bs)
            self.step(bs)
            if self.num_compiles > compiles:  # eager mode has nothing to report
                # A compile that finds its artefacts in TORCHINDUCTOR_CACHE_DIR takes a fraction of
                # a cold one: the times say whether this start reused the cache.
                what = "captured" if self.mode == "graph" else "compiled"
                log.info("decode bucket %d: %s in %.2f s", bs, what, time.perf_counter() - t0)

    def _reset(self, bs: int) -> None:
        self.num_pages.pop(bs, None)
        for name in ("input_ids", "req", "pos", "valid"):
            getattr(self, name)[bs].zero_()  # all rows padding
        self.locs[bs].slots.zero_()

    # ---- modes ----------------------------------------------------------------------------------
    def _eager_fn(self, bs: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        model, ids, meta, pools = self.model, self.input_ids[bs], self.buffers.buffers(bs), self.pools
        req_pool, page_size = self.req_pool, self.layout.page_size
        req, pos, valid, locs = self.req[bs], self.pos[bs], self.valid[bs], self.locs[bs]
        trim, packs, kernels = self.trim, self.packs, self.kernels
        full = meta.page_table.shape[1]

        def step() -> torch.Tensor:
            kernels.fill_decode(meta, req_pool, page_size, req, pos, valid, locs)
            pages = min(self.num_pages.get(bs, full), full) if trim else None
            batch = DecodeBatch(ids, meta, pools, kernels, num_pages=pages, packs=packs)
            streams = model.model.streams(batch)
            return model.compute_logits(model.model.head(streams, batch), kernels), streams

        return step

    def _build(self, bs: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        eager = self._eager_fn(bs)
        if self.mode == "eager":
            return eager
        if self.mode == "compiled":
            graph: list = []  # [compiled graph, the tensors dynamo passed it], once compiled
            backend = self._counting_backend(graph)
            compiled = torch.compile(eager, backend=backend, fullgraph=True, dynamic=False)
            if not self.skip_guards:
                return compiled

            def replay() -> tuple[torch.Tensor, torch.Tensor]:
                if not graph:  # compile (or load from the cache) under full guards
                    return compiled()
                fn, inputs = graph
                logits, streams = fn(*inputs)[:2]
                return logits, streams

            return replay
        return self._capture(bs, eager)

    def _counting_backend(self, graph: list) -> Callable:
        """Inductor, counting compiles; leaves `[compiled graph, its inputs]` in `graph`."""

        def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
            from torch._inductor.compile_fx import compile_fx

            self.num_compiles += 1
            # A C++ wrapper launches the step's ~150 kernels and BLAS calls without Python between
            # them: ~45% off a batch-1 step here. Patched for this graph only, not process-wide.
            fn = compile_fx(gm, example_inputs, config_patches={"cpp_wrapper": True})
            graph[:] = [fn, list(example_inputs)]
            return fn

        return backend

    def _capture(
        self, bs: int, eager: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        from dsv4_engine.device import graph_api

        api = graph_api(self.device)
        # Warm up on a side stream (allocator pools, lazy inits), then capture one replayable step.
        stream = api.stream()
        stream.wait_stream(api.current_stream())
        with api.use_stream(stream):
            for _ in range(2):
                eager()
        api.current_stream().wait_stream(stream)
        graph = api.graph()
        with api.capture(graph):
            out = eager()
        self.num_compiles += 1
        self._graphs[bs] = graph
        self._graph_out[bs] = out[0]
        self._graph_streams[bs] = out[1]

        def replay() -> tuple[torch.Tensor, torch.Tensor]:
            graph.replay()  # type: ignore[attr-defined]
            return out

        return replay
