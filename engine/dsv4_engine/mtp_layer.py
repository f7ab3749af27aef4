"""DeepSeek-V4's multi-token-prediction (MTP) layer in plain torch, on HF transformers' own decoder layer:
the module the demo recipe trains, its checkpoint names, and the reference logits engine tests compare with.

The MTP layer (DeepSeek's `MTPBlock`, layer id = num_hidden_layers) reads the main model's residual
streams x_i [hc_mult, hidden] after its last decoder layer (before hc_head) and the next token t_{i+1}:

    y = e_proj(enorm(embed(t_{i+1})))[None] + h_proj(hnorm(x_i))      # [hc_mult, hidden]
    y = Block(y)                                                       # sliding-window attention, routed MoE
    logits = head(norm(hc_head(y)))                                    # predicts t_{i+2}

with its own hc_head and norm, the main model's embed and head. A k-th draft step feeds y back as x.
Checkpoints carry it as `mtp.0.*`: the Block under a main layer's released names (`mtp.0.attn.wq_a.weight`),
plus `mtp.0.{e_proj,h_proj,enorm,hnorm,norm}.weight` and `mtp.0.hc_head_{fn,base,scale}`; legacy configs
give it a trailing `compress_ratios` entry 0 and `num_nextn_predict_layers: 1`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dsv4_engine import quant
from dsv4_engine.ckpt_names import LAYER_NAMES, released_names
from dsv4_engine.ckpt_plan import checkpoint_files

if TYPE_CHECKING:
    from transformers import DeepseekV4Config

PREFIX = "mtp.0."
# The MTP layer's tensors beside its Block: module names -> released names (after PREFIX).
OWN_NAMES = {
    "e_proj.weight": "e_proj.weight",
    "h_proj.weight": "h_proj.weight",
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "norm.weight": "norm.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
_EXPERT_RE = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")
BLOCK_KWARGS = ("position_embeddings", "position_ids", "attention_mask")


def with_mtp(cfg: dict) -> dict:
    """`cfg` (a config.json dict) declaring one MTP layer: `num_nextn_predict_layers` 1 and, in the legacy
    spelling, the MTP's trailing `compress_ratios` entry 0 (modern `layer_types` list main layers only)."""
    out = json.loads(json.dumps(cfg))
    out["num_nextn_predict_layers"] = 1
    ratios = out.get("compress_ratios")
    if ratios is not None and len(ratios) == out["num_hidden_layers"]:
        out["compress_ratios"] = [*ratios, 0]
    return out


def mtp_config(cfg: dict) -> DeepseekV4Config:
    """HF's config with the MTP layer as layer num_hidden_layers: sliding attention, routed (not hash) MoE."""
    from transformers import DeepseekV4Config

    main = DeepseekV4Config(**cfg)
    n = main.num_hidden_layers
    d = {k: v for k, v in cfg.items() if k not in ("compress_ratios", "num_hash_layers")}
    d |= {
        "num_hidden_layers": n + 1,
        "layer_types": [*main.layer_types, "sliding_attention"],
        "mlp_layer_types": [*main.mlp_layer_types, "moe"],
    }
    config = DeepseekV4Config(**d)
    config._attn_implementation = "eager"  # the only attention HF's DeepseekV4 has
    return config


class MtpLayer(nn.Module):
    def __init__(self, config: DeepseekV4Config) -> None:
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
            DeepseekV4DecoderLayer,
            DeepseekV4HyperHead,
            DeepseekV4RMSNorm,
        )

        super().__init__()
        self.layer_idx = config.num_hidden_layers - 1
        h, eps = config.hidden_size, config.rms_norm_eps
        self.block = DeepseekV4DecoderLayer(config, self.layer_idx)
        self.e_proj = nn.Linear(h, h, bias=False)
        self.h_proj = nn.Linear(h, h, bias=False)
        self.enorm = DeepseekV4RMSNorm(h, eps)
        self.hnorm = DeepseekV4RMSNorm(h, eps)
        self.norm = DeepseekV4RMSNorm(h, eps)
        self.hc_head = DeepseekV4HyperHead(config)

    def forward(
        self, streams: torch.Tensor, next_ids: torch.Tensor, embed: nn.Module, block_kwargs: dict[str, Any]
    ) -> torch.Tensor:
        """The MTP's output streams y [B, S, hc_mult, hidden] from streams x [B, S, hc_mult, hidden] and the
        next tokens [B, S]; block_kwargs: rope, positions and mask as the main model's layers get them."""
        e = self.enorm(embed(next_ids))
        y = self.e_proj(e).unsqueeze(2) + self.h_proj(self.hnorm(streams))
        return self.block(y, input_ids=next_ids, **block_kwargs)

    def logits(self, y: torch.Tensor, head: nn.Module) -> torch.Tensor:
        return head(self.norm(self.hc_head(y)))


def init_from_main(layer: MtpLayer, model: nn.Module) -> None:
    """A trained start (DeepSeek trains the MTP beside the main model; here it comes after): the Block from
    the main model's last layer (its compressor, which a sliding layer lacks, left out), hc_head and norm
    from the main model's, e_proj and h_proj the identity (the Block first reads the normed stream plus the
    normed embedding; the demo's held-out t+2 accuracy got 1-2 points more than from a small random e_proj)."""
    main = model.model
    with torch.no_grad():
        missing, _ = layer.block.load_state_dict(main.layers[-1].state_dict(), strict=False)
        if missing:
            raise ValueError(f"the main model's last layer lacks {missing}")
        layer.hc_head.load_state_dict(main.hc_head.state_dict())
        layer.norm.load_state_dict(main.norm.state_dict())
        layer.enorm.weight.fill_(1.0)
        layer.hnorm.weight.fill_(1.0)
        layer.h_proj.weight.copy_(torch.eye(layer.h_proj.weight.shape[0]))
        layer.e_proj.weight.copy_(torch.eye(layer.e_proj.weight.shape[0]))


# ---- names ------------------------------------------------------------------------------------------


def released_mtp_names(name: str, tensor: torch.Tensor, layer_idx: int) -> dict[str, torch.Tensor]:
    """One MtpLayer state-dict tensor under its released `mtp.0.*` name(s) (experts split per expert)."""
    if name in OWN_NAMES:
        return {PREFIX + OWN_NAMES[name]: tensor}
    block = f"layers.{layer_idx}."
    rest = name.removeprefix("block.")
    out = released_names(f"model.{block}{rest}", tensor)
    return {PREFIX + k.removeprefix(block): v for k, v in out.items()}


def mtp_state(layer: MtpLayer) -> dict[str, torch.Tensor]:
    """The layer's checkpoint tensors under their released names, as they are (callers pick the dtypes)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in layer.state_dict().items():
        out |= released_mtp_names(name, t.detach(), layer.layer_idx)
    return out


def mtp_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """MtpLayer state-dict names and shapes for `cfg` (built on the meta device)."""
    with torch.device("meta"):
        layer = MtpLayer(mtp_config(cfg))
    return {k: tuple(v.shape) for k, v in layer.state_dict().items()}


def load_released(layer: MtpLayer, tensors: dict[str, torch.Tensor]) -> MtpLayer:
    """Fill `layer` (strictly: every tensor, none unknown) from its released `mtp.0.*` tensors, which are
    cast to the layer's dtypes; experts are stacked back into HF's fused form."""
    layer.load_state_dict(_module_state(tensors, layer.block.mlp.experts.num_experts), strict=True)
    return layer


def _module_state(tensors: dict[str, torch.Tensor], n_experts: int) -> dict[str, torch.Tensor]:
    own = {rel: hf for hf, rel in OWN_NAMES.items()}
    layer_names = {rel: hf for rel, hf in LAYER_NAMES.items()}
    state: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], torch.Tensor] = {}
    for key, t in tensors.items():
        rest = key.removeprefix(PREFIX)
        if rest in own:
            state[own[rest]] = t
        elif m := _EXPERT_RE.match(rest):
            experts[(int(m.group(1)), m.group(2))] = t
        elif rest in layer_names:
            state[f"block.{layer_names[rest]}"] = t
        else:
            raise ValueError(f"unknown MTP tensor {key}")
    if experts:
        state["block.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([experts[(e, "w1")], experts[(e, "w3")]]) for e in range(n_experts)]
        )
        state["block.mlp.experts.down_proj"] = torch.stack([experts[(e, "w2")] for e in range(n_experts)])
    return state


def read_mtp_tensors(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    """The checkpoint's `mtp.0.*` weights in float32: FP8 blocks, FP4 experts and W8A8 rows dequantised."""
    from safetensors import safe_open

    files = checkpoint_files(checkpoint_dir)
    raw: dict[str, torch.Tensor] = {}
    for key, f in files.items():
        if key.startswith(PREFIX):
            with safe_open(str(f), framework="pt") as h:
                raw[key] = h.get_tensor(key)
    out: dict[str, torch.Tensor] = {}
    for key, t in raw.items():
        if key.endswith((".scale", ".weight_scale", ".weight_offset")):
            continue
        stem = key.removesuffix(".weight")
        scale, w8a8_scale = raw.get(f"{stem}.scale"), raw.get(f"{stem}.weight_scale")
        if t.dtype == torch.float8_e4m3fn and scale is not None:
            out[key] = quant.dequant_fp8_block(t, scale)
        elif t.dtype in (torch.int8, torch.uint8) and scale is not None:
            out[key] = quant.dequant_fp4(t, scale)
        elif t.dtype == torch.int8 and w8a8_scale is not None:
            out[key] = quant.dequant_w8a8(t, w8a8_scale, raw.get(f"{stem}.weight_offset"))
        elif not t.is_floating_point() and t.dtype != torch.int64:
            raise ValueError(f"{key}: {t.dtype} without a scale")
        else:
            out[key] = t if t.dtype == torch.int64 else t.float()
    if not out:
        raise ValueError(f"{checkpoint_dir} has no {PREFIX}* tensors")
    return out


def load_mtp(checkpoint_dir: str | Path) -> MtpLayer:
    """The checkpoint's MTP layer in float32 (strict: every tensor present, none unknown)."""
    cfg = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    return load_released(MtpLayer(mtp_config(cfg)), read_mtp_tensors(checkpoint_dir)).float().eval()


# ---- running it on HF's main model --------------------------------------------------------------


def main_forward(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """HF `DeepseekV4ForCausalLM` on ids [B, S]: its logits, its streams before hc_head [B, S, hc_mult,
    hidden] and the rope/positions/mask its last layer got (the MTP's Block takes the same)."""
    seen: dict[str, Any] = {}

    def take_kwargs(_m: nn.Module, _args: tuple, kwargs: dict) -> None:
        seen["kwargs"] = {k: kwargs[k] for k in BLOCK_KWARGS}

    def take_streams(_m: nn.Module, args: tuple) -> None:
        seen["streams"] = args[0]

    hooks = [
        model.model.layers[-1].register_forward_pre_hook(take_kwargs, with_kwargs=True),
        model.model.hc_head.register_forward_pre_hook(take_streams),
    ]
    try:
        logits = model(input_ids=ids, use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    return logits, seen["streams"], seen["kwargs"]


def mtp_logits(model: nn.Module, mtp: MtpLayer, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(main logits, MTP logits), both [B, S - 1, V], on window [B, S]: the main model runs on the first
    S - 1 tokens (row i predicts t_{i+1}); MTP row i reads x_i and t_{i+1} and predicts t_{i+2}."""
    config = mtp.block.self_attn.config  # HF's layers read their kernels' choice from it at each call
    config._attn_implementation = model.config._attn_implementation
    config._experts_implementation = model.config._experts_implementation
    logits, streams, kwargs = main_forward(model, window[:, :-1])
    y = mtp(streams, window[:, 1:], model.model.embed_tokens, kwargs)
    return logits, mtp.logits(y, model.lm_head)


def mtp_reference_logits(checkpoint_dir: str | Path, token_ids: list[int]) -> torch.Tensor:
    """fp32 MTP logits [len - 1, vocab]: row i predicts t_{i+2} from the main model's streams at i and
    t_{i+1}. HF transformers runs the main model (fp32, its indexer with the parity tests' stable top-k)."""
    from dsv4_engine.testing import hf_stable_topk, load_hf

    if len(token_ids) < 2:
        raise ValueError("the MTP needs at least two tokens")
    model = load_hf(checkpoint_dir, torch.float32)
    mtp = load_mtp(checkpoint_dir)
    with hf_stable_topk(), torch.inference_mode():
        _, logits = mtp_logits(model, mtp, torch.tensor([token_ids]))
    return logits[0].float()
