"""Helpers for parity tests and benchmarks against HF transformers' `DeepseekV4ForCausalLM`.

HF's indexer uses `torch.topk`, whose order among exact ties (common: ReLU zeros) depends on memory
layout; `hf_stable_topk()` runs it with our stable top-k (ties to the lower row) so both sides pick
the same rows. `greedy_divergences` checks greedy tokens against HF's teacher-forced logits with the
model tests' rule: a token may differ only where HF's top-2 margin is below `margin`, and the
comparison stops there (the contexts differ from then on).

`DenseSeqCache` (and `dense_cache(model)`) is the reference `SeqCache`: dense per-request tensors,
for tests and benchmarks that run the model without the engine's paged pools.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from dsv4_engine.config import CSA, HCA, MOE, SLIDING, Dsv4Config
from dsv4_engine.kernels.torch_ops import stable_topk

PARITY_MARGIN = 1e-4


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread, restored afterwards. Tiny models on an oversubscribed machine
    (CI's 2 shared cores) run many times slower with spinning intra-op threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# Three schedules that differ in every dimension the issue names. Prompt lengths 129..700
# give 32..175 CSA rows, so index_topk 16 and 40 bind while 256 never does.
PARITY_CONFIGS: dict[str, dict] = {
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


@contextlib.contextmanager
def hf_stable_topk() -> Iterator[None]:
    """Run HF's indexer with our stable top-k, only inside its forward."""
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


def load_hf(path: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def random_ids(n: int, seed: int, vocab: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()  # skip bos/eos/pad


@dataclass
class Divergence:
    step: int
    ours: int
    hf: int
    margin: float


def greedy_divergences(
    hf_model: torch.nn.Module, prompt: list[int], tokens: list[int], margin: float = PARITY_MARGIN
) -> list[Divergence]:
    """Compare greedy `tokens` generated after `prompt` with HF's argmax on prompt + tokens[:-1]
    (one teacher-forced forward). Returns the excused divergence (at most one); raises
    AssertionError on a divergence HF's top-2 margin does not excuse."""
    ids = torch.tensor([prompt + tokens[:-1]])
    with hf_stable_topk(), torch.inference_mode():
        logits = hf_model(ids, use_cache=False).logits[0, len(prompt) - 1 :].float()
    for step, (ours, row) in enumerate(zip(tokens, logits, strict=True)):
        ref = int(row.argmax())
        if ours != ref:
            top2 = row.topk(2).values
            gap = float(top2[0] - top2[1])
            if gap >= margin:
                raise AssertionError(f"step {step}: ours {ours}, HF {ref}, HF top-2 margin {gap:.3g}")
            return [Divergence(step, ours, ref, gap)]
    return []


# ---- the dense reference cache --------------------------------------------------------------


def dense_cache(model: torch.nn.Module) -> DenseSeqCache:
    """A fresh dense cache for one request of `model` (a Dsv4ForCausalLM), in its dtype and device."""
    return DenseSeqCache(model.config, model.dtype, model.device)


class DenseSeqCache:
    """Dense tensors per request; rings for SWA and compressor state, growing row buffers."""

    def __init__(self, config: Dsv4Config, dtype: torch.dtype, device: torch.device | str) -> None:
        self.window = config.sliding_window
        self.ratios = config.compress_ratios
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_tokens = 0
        self._swa: dict[int, torch.Tensor] = {}
        self._state: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._rows: dict[tuple[int, str], torch.Tensor] = {}

    def _ring(self, start: int, end: int, size: int) -> torch.Tensor:
        return torch.arange(start, end, device=self.device) % size

    def read_swa(self, layer: int, start: int, end: int) -> torch.Tensor:
        if end <= start:
            return torch.empty(0, 0, dtype=self.dtype, device=self.device)
        if end - start > self.window or start < self.num_tokens - self.window:
            raise IndexError(f"SWA rows [{start}, {end}) are outside the window")
        return self._swa[layer].index_select(0, self._ring(start, end, self.window))

    def write_swa(self, layer: int, start: int, rows: torch.Tensor) -> None:
        drop = max(0, len(rows) - self.window)
        rows, start = rows[drop:], start + drop
        if layer not in self._swa:
            self._swa[layer] = rows.new_zeros(self.window, rows.shape[-1])
        self._swa[layer].index_copy_(0, self._ring(start, start + len(rows), self.window), rows)

    def _state_size(self, layer: int) -> int:
        ratio = self.ratios[layer]
        return ratio * (2 if ratio == 4 else 1)

    def read_state(self, layer: int, name: str, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv, score = self._state[(layer, name)]
        idx = self._ring(start, end, self._state_size(layer))
        return kv.index_select(0, idx), score.index_select(0, idx)

    def write_state(self, layer: int, name: str, start: int, kv: torch.Tensor, score: torch.Tensor) -> None:
        size = self._state_size(layer)
        drop = max(0, len(kv) - size)
        kv, score, start = kv[drop:], score[drop:], start + drop
        if (layer, name) not in self._state:
            self._state[(layer, name)] = (
                kv.new_zeros(size, kv.shape[-1]),
                score.new_zeros(size, score.shape[-1]),
            )
        buf_kv, buf_score = self._state[(layer, name)]
        idx = self._ring(start, start + len(kv), size)
        buf_kv.index_copy_(0, idx, kv)
        buf_score.index_copy_(0, idx, score)

    def read_rows(self, layer: int, name: str, end: int) -> torch.Tensor:
        return self._rows[(layer, name)][:end]

    def write_rows(self, layer: int, name: str, start: int, rows: torch.Tensor) -> None:
        buf = self._rows.get((layer, name))
        need = start + len(rows)
        if buf is None or len(buf) < need:
            grown = rows.new_empty(max(need, 2 * (0 if buf is None else len(buf)), 16), rows.shape[-1])
            if buf is not None:
                grown[: len(buf)] = buf
            buf = self._rows[(layer, name)] = grown
        buf[start:need] = rows

    def free(self) -> None:
        self._swa.clear()
        self._state.clear()
        self._rows.clear()
        self.num_tokens = 0
