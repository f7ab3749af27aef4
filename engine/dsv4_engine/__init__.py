"""dsv4 engine: DeepSeek-V4 inference with paged DSV4 memory and PD disaggregation."""

from __future__ import annotations

import importlib.metadata
from typing import Any

__all__ = ["LLM", "SamplingParams", "package_version"]


def package_version() -> str:
    """The installed `dsv4` distribution's version (`dsv4 --version`, /server_info)."""
    try:
        return importlib.metadata.version("dsv4")
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


def __getattr__(name: str) -> Any:
    # Lazy, so `import dsv4_engine.cli` does not pull in torch.
    if name == "LLM":
        from dsv4_engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from dsv4_engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'dsv4_engine' has no attribute {name!r}")
