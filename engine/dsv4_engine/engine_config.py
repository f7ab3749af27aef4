"""`EngineConfig`: every setting of one engine in one place, with its defaults resolved.

`LLMEngine`'s keyword arguments and `dsv4 serve`'s flags say what the user asked for; `EngineConfig.build`
fills in the rest against the checkpoint and the device (the context cap, the chunk and token budget
rules) and rejects what cannot work, naming the setting. The scheduler, the pools and the model runner
then read their part from the result (`scheduler_config`, `runner_options`, the pool sizing in
`engine.plan_sizes`) instead of each taking its own copy of the numbers.

`kernels` says whether this engine uses the fused CPU kernels (`dsv4_engine.kernels`; default: on
unless `DSV4_KERNELS=0`): the runner fixes its model's modules' choice with it
(`Dsv4ForCausalLM.use_kernels`, `model.ops.KernelChoice`) and picks the decode attention backend by
it, so every kind of step follows it and two engines in one process may differ. Without a C++ compiler (or with
`DSV4_KERNELS=0`, which also keeps them from being built) they are off whatever it says.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsv4_engine.device import resolve_dtype, select_device
from dsv4_engine.kernels import KERNELS_ENV
from dsv4_engine.scheduler import SchedulerConfig

DEFAULT_MAX_MODEL_LEN = 16384  # caps the RoPE tables; the real model allows 1M positions
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_PAGE_SIZE = 128
# Per-request prefill chunk when none is given: one page. Attention runs in query blocks over the
# window keys each block can see, so its cost per token hardly depends on the chunk (on the small
# preset, CPU, 1 and 2 pages prefill equally fast, 4 pages ~5% slower); many requests' chunks still
# share one forward, so the linear layers see the whole token budget.
DEFAULT_CHUNK_PAGES = 1
# Without an explicit budget the pools take at most this share of the memory available at start
# (host memory on CPU, free device memory otherwise), and never more than max_num_seqs full contexts.
DEFAULT_MEMORY_FRACTION = {"cpu": 0.25}
DEFAULT_DEVICE_MEMORY_FRACTION = 0.8
UNLIMITED_CHUNK = -1  # chunked_prefill_size: chunks limited by the token budget only


@dataclass(frozen=True)
class EngineConfig:
    model: Path
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    chunked_prefill_size: int | None  # None: the token budget only
    page_size: int
    num_pages: int | None  # full pages; None: sized from memory
    kv_cache_memory_bytes: int | None
    enforce_eager: bool
    tp_size: int = 1
    ep_size: int = 1
    kernels: bool = True
    # One collective per process group before serving (parallel.groups.prewarm); off only to measure
    # what it saves (bench/parallel.py).
    prewarm: bool = True

    @classmethod
    def build(
        cls,
        model: str | Path,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "cpu",
        *,
        max_position_embeddings: int,
        max_model_len: int | None = None,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens: int | None = None,
        chunked_prefill_size: int | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
        num_pages: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        enforce_eager: bool = True,
        tp_size: int = 1,
        ep_size: int = 1,
        kernels: bool | None = None,
        prewarm: bool = True,
    ) -> EngineConfig:
        """What was asked, resolved; max_position_embeddings is the checkpoint's (it caps the context)."""
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("page_size", page_size),
            ("tp_size", tp_size),
            ("ep_size", ep_size),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if tp_size % ep_size:
            raise ValueError(f"ep_size {ep_size} must divide tp_size {tp_size}")
        if num_pages is not None and num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        chunk: int | None
        if chunked_prefill_size is None:
            chunk = DEFAULT_CHUNK_PAGES * page_size
        elif chunked_prefill_size == UNLIMITED_CHUNK:
            chunk = None
        elif chunked_prefill_size <= 0 or chunked_prefill_size % page_size:
            raise ValueError(
                f"chunked_prefill_size {chunked_prefill_size} must be -1 or a positive multiple of "
                f"page_size {page_size}"
            )
        else:
            chunk = chunked_prefill_size
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, chunk or 0)
        resolved_device = select_device(device)
        return cls(
            model=Path(model),
            device=resolved_device,
            dtype=resolve_dtype(dtype, resolved_device),
            max_model_len=min(max_model_len or DEFAULT_MAX_MODEL_LEN, max_position_embeddings),
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            chunked_prefill_size=chunk,
            page_size=page_size,
            num_pages=num_pages,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            enforce_eager=enforce_eager,
            tp_size=tp_size,
            ep_size=ep_size,
            kernels=kernels if kernels is not None else os.environ.get(KERNELS_ENV, "1") != "0",
            prewarm=prewarm,
        )

    @property
    def memory_fraction(self) -> float:
        """The share of free memory the pools may take when neither num_pages nor a byte budget is set."""
        return DEFAULT_MEMORY_FRACTION.get(self.device.type, DEFAULT_DEVICE_MEMORY_FRACTION)

    def scheduler_config(self, eos_token_ids: tuple[int, ...]) -> SchedulerConfig:
        return SchedulerConfig(
            page_size=self.page_size,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            chunk_size=self.chunked_prefill_size,
            eos_token_ids=eos_token_ids,
        )

    def runner_options(self) -> dict[str, Any]:
        """ModelRunner's keyword arguments."""
        return {
            "enforce_eager": self.enforce_eager,
            "max_num_seqs": self.max_num_seqs,
            "kernels": self.kernels,
        }
