"""`dsv4 make-tiny OUT`: a random DeepSeek-V4 checkpoint in the released layout, with a real tokenizer.

Every tensor is drawn so that no feature can hide behind a zero: attention sinks, compressor position
biases, the score-correction bias, the mHC bases and scales, norm weights, and a `tid2eid` table that maps
each token to distinct random experts. Each tensor has its own generator, seeded from (seed, name), so a
tensor does not change when an override adds or removes another one.
"""

from __future__ import annotations

import argparse
import json
import math
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from dsv4_engine import quant
from dsv4_engine.ckpt_names import released_names
from dsv4_engine.loader import INDEX_FILE, SINGLE_FILE
from dsv4_engine.mtp_layer import mtp_shapes, released_mtp_names, with_mtp
from dsv4_engine.tokenizer import write_tokenizer

# Pinned presets (docs/checkpoints.md). Legacy (released) config keys, as DeepSeek ships them.
PRESETS: dict[str, dict] = {
    "tiny": {
        "vocab_size": 512,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "compress_ratios": [0, 4, 128, 4],
        "num_hash_layers": 1,
        "num_attention_heads": 4,
        "head_dim": 128,
        "qk_rope_head_dim": 32,
        "q_lora_rank": 64,
        "o_lora_rank": 64,
        "o_groups": 2,
        "sliding_window": 16,
        "index_n_heads": 4,
        "index_head_dim": 64,
        "index_topk": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "max_position_embeddings": 4096,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 256,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    },
    "small": {
        "vocab_size": 1024,
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "compress_ratios": [0, 4, 128, 4, 128, 4, 128, 0],
        "num_hash_layers": 2,
        "num_attention_heads": 8,
        "head_dim": 128,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 256,
        "o_lora_rank": 128,
        "o_groups": 4,
        "sliding_window": 64,
        "index_n_heads": 8,
        "index_head_dim": 64,
        "index_topk": 64,
        "n_routed_experts": 28,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 256,
        "max_position_embeddings": 16384,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    },
}

# Shared by every preset.
COMMON = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "num_key_value_heads": 1,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    # Pre-activations are ~N(0, 1) by construction (normed inputs, 1/sqrt(fan_in) weights), so a
    # limit of 1.5 binds on roughly a tenth of them; the real model's 10 would never bind here.
    "swiglu_limit": 1.5,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_cache": True,
}

# Released FP8 checkpoint: these linears are FP8 with 128x128 ue8m0 block scales, routed experts FP4.
FP8_LINEARS = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b")
MTP_FP8_LINEARS = ("e_proj", "h_proj")  # the MTP layer's own projections ship FP8 too
FP8_QUANT_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}
# The Ascend W8A8 release (msmodelslim W8A8_DYNAMIC) quantises what DeepSeek ships in FP8 or FP4 to
# per-channel int8 and lists every tensor's kind in this file (docs/checkpoints.md).
W8A8_DESCRIPTION = "quant_model_description.json"
QUANT_MODES = ("none", "fp8", "w8a8")
SCORE_BIAS_STD = 0.25  # large enough that the correction bias changes >= 20% of expert picks


def build_config(preset: str = "tiny", quant_mode: str = "none", overrides: dict | None = None) -> dict:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    cfg = {**COMMON, **json.loads(json.dumps(PRESETS[preset]))}
    for key, value in (overrides or {}).items():
        # a modern key replaces its legacy spelling, so the two can never disagree
        if key == "layer_types":
            cfg.pop("compress_ratios", None)
        if key == "mlp_layer_types":
            cfg.pop("num_hash_layers", None)
        cfg[key] = value
    n = cfg["num_hidden_layers"]
    if "compress_ratios" in cfg and len(cfg["compress_ratios"]) != n:
        raise ValueError(f"compress_ratios has {len(cfg['compress_ratios'])} entries for {n} layers")
    if quant_mode == "fp8":
        cfg["quantization_config"] = dict(FP8_QUANT_CONFIG)
        cfg["expert_dtype"] = "fp4"
        cfg["torch_dtype"] = "bfloat16"
    elif quant_mode == "w8a8":  # the weights say it (int8 + weight_scale) and the description lists them
        cfg["torch_dtype"] = "bfloat16"
    elif quant_mode == "none":
        cfg["torch_dtype"] = "float32"
    else:
        raise ValueError(f"quant must be one of {', '.join(QUANT_MODES)}, got {quant_mode!r}")
    return cfg


def hf_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Names and shapes of HF `DeepseekV4ForCausalLM`'s state dict for `cfg`, built on the meta device."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(DeepseekV4Config(**cfg))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def draw(name: str, shape: tuple[int, ...], cfg: dict, seed: int) -> torch.Tensor:
    """One tensor of the random model, by HF name; weights are scaled so activations stay ~N(0, 1)."""
    g = _generator(seed, name)

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std + mean

    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":  # each token -> top_k distinct experts, in random order
        vocab, k = shape
        return torch.rand(vocab, cfg["n_routed_experts"], generator=g).argsort(dim=1)[:, :k].contiguous()
    if leaf == "e_score_correction_bias":
        return normal(SCORE_BIAS_STD)
    if leaf == "sinks":
        return normal(1.0)
    if leaf == "position_bias":
        return normal(1.0)
    if leaf in ("base", "hc_base"):
        return normal(1.0)
    if leaf in ("scale", "hc_scale"):
        return 1.0 + normal(0.25)
    if leaf in ("fn", "hc_fn"):
        return normal(1.0 / math.sqrt(shape[-1]))
    if "norm" in name:
        return 1.0 + normal(0.1)
    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    if leaf == "weight" or leaf in ("gate_up_proj", "down_proj"):
        return normal(1.0 / math.sqrt(shape[-1]))
    raise ValueError(f"make-tiny does not know how to draw {name} {shape}")


def released_kind(name: str) -> str:
    """How DeepSeek's FP8 release stores a tensor (released name): "fp8" (the block-scaled linears),
    "fp4" (routed experts) or "plain"."""
    stem = name.removesuffix(".weight")
    layer_rest = stem.split(".", 2)[-1] if stem.startswith(("layers.", "mtp.")) else stem
    fp8 = FP8_LINEARS + (MTP_FP8_LINEARS if stem.startswith("mtp.") else ())
    if layer_rest in fp8 or ".shared_experts." in stem:
        return "fp8"
    return "fp4" if ".experts." in stem else "plain"


def quantise_released(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """The released storage of one tensor: FP8 + block scale, FP4 + group scale, or bf16/f32/i64 as shipped."""
    stem = name.removesuffix(".weight")
    kind = released_kind(name)
    if kind == "fp8":
        q, s = quant.quant_fp8_block(tensor)
        return {name: q, f"{stem}.scale": s}
    if kind == "fp4":
        q, s = quant.quant_fp4(tensor)
        return {name: q, f"{stem}.scale": s}
    return {name: shipped(name, tensor)}


def quantise_w8a8(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """The Ascend W8A8 storage of one tensor: what DeepSeek ships quantised becomes int8 with a float32
    per-channel scale and a zero offset `[O, 1]`; everything else as shipped."""
    if released_kind(name) == "plain":
        return {name: shipped(name, tensor)}
    stem = name.removesuffix(".weight")
    q, scale, offset = quant.quant_w8a8(tensor)
    return {name: q, f"{stem}.weight_scale": scale, f"{stem}.weight_offset": offset}


def stored(quant_mode: str, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """One tensor (released name) as `quant_mode` stores it."""
    if quant_mode == "fp8":
        return quantise_released(name, tensor)
    return quantise_w8a8(name, tensor) if quant_mode == "w8a8" else {name: tensor}


def shipped(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A tensor DeepSeek does not quantise, in the dtype it ships: bf16, but the sinks, the compressor
    position biases, the router biases and the hyper-connection tensors in fp32, integer tables as is."""
    if tensor.dtype == torch.int64 or name.endswith(("attn_sink", ".ape", ".bias")) or "hc_" in name:
        return tensor
    return tensor.to(torch.bfloat16)


def write_safetensors(tensors: dict[str, torch.Tensor], out: Path, shards: int = 1) -> None:
    """model.safetensors, or `shards` files plus model.safetensors.index.json (names split in order)."""
    names = sorted(tensors)
    if shards <= 1:
        save_file(
            {k: tensors[k].contiguous() for k in names}, str(out / SINGLE_FILE), metadata={"format": "pt"}
        )
        return
    per = -(-len(names) // shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(shards):
        part = names[i * per : (i + 1) * per]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, str(out / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, fname)
        total += sum(tensors[k].numel() * tensors[k].element_size() for k in part)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def make_tiny(
    out_dir: str | Path,
    *,
    seed: int = 0,
    preset: str = "tiny",
    quant: str = "none",
    overrides: dict | None = None,
    shards: int = 1,
    mtp: bool = False,
) -> Path:
    """Write a random checkpoint (config.json, safetensors, generation_config.json, tokenizer) to `out_dir`.
    mtp: also a random MTP layer (`mtp.0.*`, `num_nextn_predict_layers` 1; see mtp_layer.py)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = build_config(preset, quant, overrides)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in hf_shapes(cfg).items():
        for rel, t in released_names(name, draw(name, shape, cfg, seed)).items():
            tensors |= stored(quant, rel, t)
    if mtp:
        cfg = with_mtp(cfg)
        for name, shape in mtp_shapes(cfg).items():
            # `mtp.` in the generator's name: the MTP's tensors are not copies of a main layer's
            t = draw(f"mtp.{name}", shape, cfg, seed)
            for rel, r in released_mtp_names(name, t, cfg["num_hidden_layers"]).items():
                tensors |= stored(quant, rel, r)
    write_safetensors(tensors, out, shards)
    write_configs(out, cfg)
    if quant == "w8a8":
        write_w8a8_description(out, tensors)
    write_tokenizer(out, cfg["vocab_size"], cfg["max_position_embeddings"])
    return out


def write_w8a8_description(out: Path, tensors: dict[str, torch.Tensor]) -> None:
    """msmodelslim's description beside the weights: the model's quant type, then each tensor's,
    W8A8_DYNAMIC for a quantised weight and its scale and offset, FLOAT for the rest."""
    quantised = {k.removesuffix(".weight_scale") for k in tensors if k.endswith(".weight_scale")}
    kinds = {k: "W8A8_DYNAMIC" if k.rsplit(".", 1)[0] in quantised else "FLOAT" for k in sorted(tensors)}
    description = {"model_quant_type": "W8A8_DYNAMIC", **kinds}
    (out / W8A8_DESCRIPTION).write_text(json.dumps(description, indent=2) + "\n")


def write_configs(out: Path, cfg: dict) -> None:
    """config.json and a greedy generation_config.json beside the weights."""
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    generation = {
        "bos_token_id": cfg["bos_token_id"],
        "eos_token_id": cfg["eos_token_id"],
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def parser(extra_presets: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """`dsv4 make-tiny`'s flags. extra_presets: name -> help, presets built elsewhere
    (`dsv4_engine.cli` adds demo's: demo builds on this module, so this one does not import it)."""
    extra = extra_presets or {}
    p = argparse.ArgumentParser(
        prog="dsv4 make-tiny",
        description="Write a random DeepSeek-V4 checkpoint (HF format, released tensor names) and its tokenizer.",
    )
    p.add_argument("out", help="output folder")
    p.add_argument("--seed", type=int, default=0, help="same seed, same bytes (default 0)")
    p.add_argument(
        "--preset",
        choices=[*sorted(PRESETS), *extra],
        default="tiny",
        help="; ".join(["tiny: ~5M params", "small: ~100M", *(f"{k}: {v}" for k, v in extra.items())]),
    )
    p.add_argument(
        "--quant",
        choices=list(QUANT_MODES),
        default="none",
        help="fp8: DeepSeek's released FP8/FP4 format; w8a8: the Ascend W8A8 release (int8, per-channel scales)",
    )
    p.add_argument("--shards", type=int, default=1, help="split the weights into this many files")
    p.add_argument(
        "--mtp", action="store_true", help="random presets: also write a random MTP layer (mtp.0.*)"
    )
    return p


def run(a: argparse.Namespace) -> int:
    out = make_tiny(a.out, seed=a.seed, preset=a.preset, quant=a.quant, shards=a.shards, mtp=a.mtp)
    with_layer = " with an MTP layer" if a.mtp else ""
    print(f"wrote {a.preset} checkpoint{with_layer} (seed {a.seed}, quant {a.quant}) to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The random presets; `dsv4 make-tiny` (`dsv4_engine.cli.make_tiny_main`) adds `--preset demo`."""
    return run(parser().parse_args(argv))
