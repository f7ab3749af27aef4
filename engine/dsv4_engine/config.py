"""`Dsv4Config`: the model hyper-parameters, read from an HF `config.json`.

Two spellings exist. The modern one (transformers >= 5.23) names per-layer schedules
(`layer_types`, `mlp_layer_types`, `compress_rates`) and nests RoPE under
`rope_parameters = {"main": ..., "compress": ...}`. DeepSeek's released checkpoints ship the
legacy keys (`compress_ratios` with one extra entry for the MTP layer, `num_hash_layers`,
`qk_rope_head_dim`, `rope_scaling`). Both become the same `Dsv4Config`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
MOE = "moe"
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}


@dataclass(frozen=True)
class RopeParams:
    """One frequency table: plain RoPE (`rope_type="default"`) or YaRN."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # Multiplies cos/sin. DSV4 applies no YaRN mscale, so HF forces 1.0 for the compress table.
    attention_factor: float = 1.0


@dataclass
class Dsv4Config:
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_lora_rank: int = 1024
    o_groups: int = 8
    sliding_window: int = 128
    max_position_embeddings: int = 1048576
    layer_types: list[str] = field(default_factory=list)
    compress_rates: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_COMPRESS_RATES))
    rope_main: RopeParams = field(default_factory=lambda: RopeParams(theta=10000.0))
    rope_compress: RopeParams = field(default_factory=lambda: RopeParams(theta=160000.0))
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    mlp_layer_types: list[str] = field(default_factory=list)
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    num_nextn_predict_layers: int = 0
    quantization_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if len(self.layer_types) != n or len(self.mlp_layer_types) != n:
            raise ValueError(
                f"layer_types ({len(self.layer_types)}) and mlp_layer_types ({len(self.mlp_layer_types)}) "
                f"must both have num_hidden_layers={n} entries"
            )
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"layer_types entries must be one of {LAYER_TYPES}; got {bad}")
        bad = [t for t in self.mlp_layer_types if t not in (HASH_MOE, MOE)]
        if bad:
            raise ValueError(f"mlp_layer_types entries must be 'hash_moe' or 'moe'; got {bad}")
        if self.scoring_func != "sqrtsoftplus":
            raise ValueError(
                f"scoring_func {self.scoring_func!r} is not supported (DSV4 uses 'sqrtsoftplus')"
            )
        if self.num_attention_heads * self.head_dim % self.o_groups:
            raise ValueError("num_attention_heads * head_dim must be divisible by o_groups")

    def compress_ratio(self, layer: int) -> int:
        """0 for a sliding-window layer, else its compression ratio (4 for CSA, 128 for HCA)."""
        layer_type = self.layer_types[layer]
        return 0 if layer_type == SLIDING else self.compress_rates[layer_type]

    @property
    def compress_ratios(self) -> list[int]:
        return [self.compress_ratio(i) for i in range(self.num_hidden_layers)]

    @property
    def num_hash_layers(self) -> int:
        return sum(t == HASH_MOE for t in self.mlp_layer_types)

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.eos_token_id
        return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Dsv4Config:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Dsv4Config:
        d = dict(d)
        n = int(d.get("num_hidden_layers", cls.num_hidden_layers))
        head_dim = int(d.get("head_dim", cls.head_dim))
        rates = dict(d.get("compress_rates") or DEFAULT_COMPRESS_RATES)
        for key, layer_type in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
            if d.get(key) is not None:
                rates[layer_type] = int(d[key])
        by_ratio = {0: SLIDING, **{r: t for t, r in rates.items()}}

        layer_types = d.get("layer_types")
        if layer_types is None and d.get("compress_ratios") is not None:
            # Legacy: one ratio per layer, plus trailing entries for MTP layers (dropped below).
            layer_types = [by_ratio[int(r)] for r in d["compress_ratios"]]
        if layer_types is None:
            raise ValueError("config has neither `layer_types` nor `compress_ratios`")
        mlp_layer_types = d.get("mlp_layer_types")
        if mlp_layer_types is None:
            n_hash = int(d.get("num_hash_layers", 3))
            mlp_layer_types = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)

        rope_dim = d.get("qk_rope_head_dim")
        partial = d.get("partial_rotary_factor")
        rope_main, rope_compress, rope_partial = _rope_params(d)
        partial = partial if partial is not None else rope_partial
        if rope_dim is None:
            rope_dim = int(head_dim * partial) if partial is not None else 64

        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        kwargs.update(
            num_hidden_layers=n,
            head_dim=head_dim,
            qk_rope_head_dim=int(rope_dim),
            layer_types=list(layer_types[:n]),
            mlp_layer_types=list(mlp_layer_types[:n]),
            compress_rates=rates,
            rope_main=rope_main,
            rope_compress=rope_compress,
            torch_dtype=d.get("torch_dtype", d.get("dtype")),
        )
        return cls(**kwargs)


def _rope_params(d: dict[str, Any]) -> tuple[RopeParams, RopeParams, float | None]:
    """(main, compress, partial_rotary_factor) from either `rope_parameters` or legacy keys."""
    rp = d.get("rope_parameters") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, compress = rp["main"], rp["compress"]
        return _one_rope(main), _one_rope(compress), compress.get("partial_rotary_factor")
    # Flat form: the scaling dict (legacy `rope_scaling` or a flat `rope_parameters`) applies
    # to the compressed layers only; sliding layers use plain RoPE at `rope_theta`.
    scaling = {k: v for k, v in (rp or d.get("rope_scaling") or {}).items() if k not in ("main", "compress")}
    main = RopeParams(theta=float(d.get("rope_theta", 10000.0)))
    compress = _one_rope({**scaling, "rope_theta": d.get("compress_rope_theta", 160000.0)})
    return main, compress, None


def _one_rope(p: dict[str, Any]) -> RopeParams:
    rope_type = p.get("rope_type", p.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"rope type {rope_type!r} is not supported (DSV4 uses 'default' and 'yarn')")
    if rope_type == "default":
        return RopeParams(theta=float(p["rope_theta"]))
    return RopeParams(
        theta=float(p["rope_theta"]),
        rope_type="yarn",
        factor=float(p["factor"]),
        original_max_position_embeddings=int(p["original_max_position_embeddings"]),
        beta_fast=float(p.get("beta_fast") or 32.0),
        beta_slow=float(p.get("beta_slow") or 1.0),
        attention_factor=float(p.get("attention_factor") or 1.0),
    )
