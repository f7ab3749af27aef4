"""Shared pytest configuration and fixtures (engine imports stay inside fixtures: the operator's
tests must not pull in torch)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# torch_npu, if ever present in a CPU environment, breaks `import torch` without this.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    from dsv4_engine.testing import one_thread

    with one_thread():
        yield


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The parity checkpoints (dsv4_engine.testing.PARITY_CONFIGS), written once per session."""
    from dsv4_engine.make_tiny import make_tiny
    from dsv4_engine.testing import PARITY_CONFIGS, one_thread

    root = tmp_path_factory.mktemp("dsv4_parity_ckpts")
    with one_thread():
        return {
            name: make_tiny(root / name, seed=i, overrides=o)
            for i, (name, o) in enumerate(PARITY_CONFIGS.items())
        }


@pytest.fixture(scope="session")
def hf_models(checkpoints: dict[str, Path]) -> Callable[[str], Any]:
    """HF transformers' DeepseekV4ForCausalLM of a parity checkpoint, loaded once per session."""
    from dsv4_engine.testing import load_hf

    cache: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in cache:
            cache[name] = load_hf(checkpoints[name])
        return cache[name]

    return get
