"""Fixtures for the model tests: tiny random checkpoints, our model and HF's on the same weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dsv4_engine.config import CSA, HCA, MOE, SLIDING, Dsv4Config
from dsv4_engine.loader import load_checkpoint
from dsv4_engine.make_tiny import make_tiny
from dsv4_engine.model import Dsv4ForCausalLM, ForwardBatch
from dsv4_engine.model.ops import stable_topk

# Three schedules that differ in every dimension the issue names. Prompt lengths 129..700
# give 32..175 CSA rows, so index_topk 16 and 40 bind while 256 never does.
CONFIGS: dict[str, dict] = {
    # preset tiny: [SWA, CSA, HCA, CSA], 1 hash layer, o_groups 2, window 16, 4 index heads, top-16
    "A": {},
    # legacy keys, 5 layers CSA-first, 2 hash layers, o_groups 4, window 8, 2 index heads, top-256
    "B": {
        "num_hidden_layers": 5,
        "compress_ratios": [4, 128, 4, 0, 128],
        "num_hash_layers": 2,
        "o_groups": 4,
        "sliding_window": 8,
        "index_n_heads": 2,
        "index_topk": 256,
    },
    # modern keys, HCA first, no hash layer, o_groups 1, window 32, 8 index heads, top-40
    "C": {
        "num_hidden_layers": 3,
        "layer_types": [HCA, SLIDING, CSA],
        "mlp_layer_types": [MOE, MOE, MOE],
        "o_groups": 1,
        "sliding_window": 32,
        "index_n_heads": 8,
        "index_topk": 40,
    },
}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # The shared 2-core machine is oversubscribed; torch's intra-op threads then spin and make
    # tiny ops 10x slower. One thread keeps these small models fast; restored afterwards.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dsv4_model_ckpts")
    return {name: make_tiny(root / name, seed=i, overrides=o) for i, (name, o) in enumerate(CONFIGS.items())}


def _load_ours(path: Path, dtype: torch.dtype = torch.float32, max_positions: int = 2048) -> Dsv4ForCausalLM:
    model = Dsv4ForCausalLM(Dsv4Config.from_pretrained(path), max_positions=max_positions).cast(dtype)
    load_checkpoint(model, path, dtype=None, progress=False)
    return model.eval()


def _load_hf(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


@contextlib.contextmanager
def _hf_stable_topk() -> Iterator[None]:
    """Run HF's indexer with our stable top-k (ties to the lower row), only inside its forward."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_mod

    original = hf_mod.DeepseekV4Indexer.forward

    def stable(x: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
        assert dim in (-1, x.dim() - 1) and largest
        idx = stable_topk(x, k)
        return torch.return_types.topk((x.gather(-1, idx), idx))

    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        saved = torch.Tensor.topk
        torch.Tensor.topk = stable  # HF calls `index_scores.topk(...)` here and nowhere else in this forward
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.Tensor.topk = saved

    hf_mod.DeepseekV4Indexer.forward = forward
    try:
        yield
    finally:
        hf_mod.DeepseekV4Indexer.forward = original


def _our_logits(model: Dsv4ForCausalLM, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one prompt, from a fresh cache."""
    with torch.inference_mode():
        return model.compute_logits(model(ForwardBatch.build([(model.new_cache(), ids)])))


def _random_ids(n: int, seed: int, vocab: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()  # skip bos/eos/pad


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
            self._cache[key] = _load_hf(self.checkpoints[name], dtype)
        return self._cache[key]

    stable_topk = staticmethod(_hf_stable_topk)
    logits = staticmethod(_our_logits)
    random_ids = staticmethod(_random_ids)


@pytest.fixture(scope="session")
def models(checkpoints: dict[str, Path]) -> Models:
    return Models(checkpoints)
