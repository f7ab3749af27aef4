"""`EngineConfig`: every setting of one engine in one place, with its defaults resolved.

`EngineOptions` (options.py: `LLMEngine`'s keyword arguments, `dsv4 serve`'s flags) says what the user
asked for; `EngineConfig.build` fills in the rest against the checkpoint and the device (the context
cap, the chunk and token budget rules) and rejects what cannot work, naming the setting. The
scheduler, the pools and the model runner then read their part from the result (`scheduler_config`,
`pool_sizes`, `runner_options`) instead of each taking its own copy of the numbers.

`kernels` says whether this engine uses the fused kernels (`dsv4_engine.kernels`: the CPU kernels on
CPU, torch_npu's ops on NPU; default: on unless `DSV4_KERNELS=0`): the runner chooses its kernel set
once with it (`choose_kernels`) and every kind of step runs that set, so two engines in one process may
differ. Without a C++ compiler (or with `DSV4_KERNELS=0`, which also keeps them from being built) the
CPU kernels are off whatever it says.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsv4_engine.device import resolve_dtype, select_device
from dsv4_engine.kernels import KERNELS_ENV
from dsv4_engine.memory import Dsv4MemoryLayout, PoolSizes
from dsv4_engine.memory.sizing import fixed_pool_sizes, plan_pool_sizes, pool_bytes, table_bytes
from dsv4_engine.memory.state_tail import cdiv
from dsv4_engine.options import (
    DEFAULT_CHUNK_PAGES,
    DEFAULT_DEVICE_MEMORY_FRACTION,
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MEMORY_FRACTION,
    DEFAULT_PAGE_SIZE,
    UNLIMITED_CHUNK,
    EngineOptions,
)
from dsv4_engine.scheduler import SchedulerConfig


@dataclass(frozen=True)
class EngineConfig:
    """The options resolved: every size a number, `chunked_prefill_size` None for "the budget only"."""

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
    prewarm: bool = True
    prefix_cache: bool = True
    speculative_num_steps: int = 0  # draft tokens per decode step (0: no speculative decoding)

    @classmethod
    def build(
        cls,
        model: str | Path,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "cpu",
        *,
        max_position_embeddings: int,
        **options: Any,
    ) -> EngineConfig:
        """What was asked (`EngineOptions`' fields), resolved; max_position_embeddings is the
        checkpoint's (it caps the context)."""
        asked = EngineOptions(**options)
        asked.check()
        page_size = DEFAULT_PAGE_SIZE if asked.page_size is None else asked.page_size
        if asked.chunked_prefill_size is None:
            chunk: int | None = DEFAULT_CHUNK_PAGES * page_size
        elif asked.chunked_prefill_size == UNLIMITED_CHUNK:
            chunk = None
        elif asked.chunked_prefill_size <= 0 or asked.chunked_prefill_size % page_size:
            raise ValueError(
                f"chunked_prefill_size {asked.chunked_prefill_size} must be -1 or a positive multiple of "
                f"page_size {page_size}"
            )
        else:
            chunk = asked.chunked_prefill_size
        budget = asked.max_num_batched_tokens
        if budget is None:
            budget = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, chunk or 0)
        kernels = asked.kernels
        if kernels is None:
            kernels = os.environ.get(KERNELS_ENV, "1") != "0"
        resolved_device = select_device(device)
        drafts = asked.num_draft_tokens()
        return cls(
            model=Path(model),
            device=resolved_device,
            dtype=resolve_dtype(dtype, resolved_device),
            max_model_len=min(asked.max_model_len or DEFAULT_MAX_MODEL_LEN, max_position_embeddings),
            max_num_seqs=DEFAULT_MAX_NUM_SEQS if asked.max_num_seqs is None else asked.max_num_seqs,
            max_num_batched_tokens=budget,
            chunked_prefill_size=chunk,
            page_size=page_size,
            num_pages=asked.num_pages,
            kv_cache_memory_bytes=asked.kv_cache_memory_bytes,
            enforce_eager=asked.enforce_eager,
            tp_size=asked.tp_size,
            ep_size=asked.ep_size,
            kernels=kernels,
            prewarm=asked.prewarm,
            prefix_cache=not asked.disable_radix_cache,
            speculative_num_steps=drafts,
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
            num_draft_tokens=self.speculative_num_steps,
        )

    def runner_options(self) -> dict[str, Any]:
        """ModelRunner's keyword arguments."""
        return {
            "enforce_eager": self.enforce_eager,
            "max_num_seqs": self.max_num_seqs,
            "kernels": self.kernels,
            "num_draft_tokens": self.speculative_num_steps,
        }

    def pool_sizes(self, layout: Dsv4MemoryLayout) -> PoolSizes:
        """Pool sizes from `num_pages` (full pages; the other families by formula), an explicit byte
        budget, or by default a share of available memory capped at max_num_seqs full contexts."""
        kw = {
            "max_reqs": self.max_num_seqs,
            "max_batched_tokens": self.max_num_batched_tokens,
            "snapshots": self.max_num_seqs if self.prefix_cache else 0,
        }
        if self.num_pages is not None:
            return fixed_pool_sizes(layout, self.num_pages, **kw)
        budget = self.kv_cache_memory_bytes
        if budget is None:
            pages = self.max_num_seqs * cdiv(self.max_model_len, layout.page_size)
            most = fixed_pool_sizes(layout, pages, **kw)
            wanted = pool_bytes(layout, most) + table_bytes(self.max_num_seqs, self.max_model_len)
            share = self.memory_fraction * available_memory(self.device)
            if self.device.type == "cpu":  # every rank holds pools this size, all in the one host's memory
                share /= self.tp_size
            budget = min(wanted, int(share))
        return plan_pool_sizes(layout, budget, max_ctx=self.max_model_len, **kw)


def available_memory(device: torch.device) -> int:
    """Bytes free for the pools now: MemAvailable on CPU, the device's free memory otherwise."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "npu":
        return int(torch.npu.mem_get_info(device)[0])  # type: ignore[attr-defined]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
