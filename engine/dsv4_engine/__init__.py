"""dsv4 engine: DeepSeek-V4 inference with paged DSV4 memory and PD disaggregation."""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Lazy, so `import dsv4_engine.cli` does not pull in torch.
    if name == "LLM":
        from dsv4_engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from dsv4_engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'dsv4_engine' has no attribute {name!r}")
