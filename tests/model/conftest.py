"""Fixtures for the model tests: tiny random checkpoints, our model and HF's on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv4_engine.config import Dsv4Config
from dsv4_engine.loader import load_checkpoint
from dsv4_engine.model import Dsv4ForCausalLM, ForwardBatch
from dsv4_engine.testing import dense_cache, hf_stable_topk, load_hf, random_ids


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here runs torch on one thread (see dsv4_engine.testing.one_thread)."""


def _load_ours(path: Path, dtype: torch.dtype = torch.float32, max_positions: int = 2048) -> Dsv4ForCausalLM:
    model = Dsv4ForCausalLM(Dsv4Config.from_pretrained(path), max_positions=max_positions).cast(dtype)
    load_checkpoint(model, path, dtype=None, progress=False)
    return model.eval()


def _our_logits(model: Dsv4ForCausalLM, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one prompt, from a fresh cache."""
    with torch.inference_mode():
        return model.compute_logits(model(ForwardBatch.build([(dense_cache(model), ids)])))


class Models:
    """Loaded models, each loaded once per session, plus the helpers tests share."""

    def __init__(self, checkpoints: dict[str, Path]) -> None:
        self.checkpoints = checkpoints
        self._cache: dict[tuple[str, str, torch.dtype], torch.nn.Module] = {}

    def ours(self, name: str, dtype: torch.dtype = torch.float32) -> Dsv4ForCausalLM:
        key = ("ours", name, dtype)
        if key not in self._cache:
            self._cache[key] = _load_ours(self.checkpoints[name], dtype)
        return self._cache[key]  # type: ignore[return-value]

    def hf(self, name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        key = ("hf", name, dtype)
        if key not in self._cache:
            self._cache[key] = load_hf(self.checkpoints[name], dtype)
        return self._cache[key]

    stable_topk = staticmethod(hf_stable_topk)
    logits = staticmethod(_our_logits)
    random_ids = staticmethod(random_ids)


@pytest.fixture(scope="session")
def models(checkpoints: dict[str, Path]) -> Models:
    return Models(checkpoints)
