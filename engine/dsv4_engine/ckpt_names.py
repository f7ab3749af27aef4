"""Checkpoint tensor names: DeepSeek's released spelling <-> HF `DeepseekV4ForCausalLM` state-dict names.

Released checkpoints name tensors `layers.N.attn.wq_a.weight`, `layers.N.ffn.experts.E.w1.weight`,
`embed.weight`, `head.weight`; HF's model fuses the experts into `mlp.experts.gate_up_proj [E, 2I, H]`
(w1 rows first, then w3) and `mlp.experts.down_proj [E, H, I]` (w2).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Released DeepSeek-V4 names (inside `layers.N.`) -> HF names.
LAYER_NAMES = {
    "attn.attn_sink": "self_attn.sinks",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.norm.weight": "self_attn.kv_norm.weight",  # HF's save_pretrained writes this spelling
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
# The MTP layer's own tensors (inside `mtp.N.`), besides a decoder layer's: DeepSeek's `MTPBlock`.
MTP_NAMES = {
    "e_proj.weight": "e_proj.weight",
    "h_proj.weight": "h_proj.weight",
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "norm.weight": "norm.weight",
    "hc_head_fn": "hc_head.hc_fn",
    "hc_head_base": "hc_head.hc_base",
    "hc_head_scale": "hc_head.hc_scale",
}
TOP_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_LAYER_RE = re.compile(r"^(layers|mtp)\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")


def hf_name(key: str, model_keys: set[str]) -> tuple[str, tuple | None] | None:
    """The model tensor (and expert slice) a checkpoint weight fills, or None if nothing matches."""
    base = key.removeprefix("model.")
    for cand in (key, f"model.{base}", base):  # already an HF name (with or without the prefix)
        if cand in model_keys:
            return cand, None
    mapped = TOP_NAMES.get(base)
    if mapped is None and (m := _LAYER_RE.match(base)):
        kind, layer, rest = m.groups()
        # A main layer is `model.layers.N.`; the MTP layer N (a decoder layer plus its own) `mtp.N.`.
        prefix = f"model.layers.{layer}" if kind == "layers" else f"mtp.{layer}"
        if rest in LAYER_NAMES:
            mapped = f"{prefix}.{LAYER_NAMES[rest]}"
        elif kind == "mtp" and rest in MTP_NAMES:
            mapped = f"{prefix}.{MTP_NAMES[rest]}"
        elif e := _EXPERT_RE.match(rest):
            expert, which = int(e.group(1)), e.group(2)
            if which == "w2":
                return f"{prefix}.mlp.experts.down_proj", (expert,)
            # gate_up_proj rows: w1 (gate) first, then w3 (up); the half is resolved against the shape
            return f"{prefix}.mlp.experts.gate_up_proj", (expert, which)
    if mapped is None:
        return None
    for cand in (mapped, mapped.removeprefix("model.")):
        if cand in model_keys:
            return cand, None
    return mapped, None


def released_names(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """An HF-named tensor under its released name(s); fused experts split into one tensor per expert."""
    inverse_layer = {hf: rel for rel, hf in LAYER_NAMES.items() if rel != "attn.norm.weight"}
    inverse_top = {hf: rel for rel, hf in TOP_NAMES.items()}
    if name in inverse_top:
        return {inverse_top[name]: tensor}
    _, _, layer, rest = name.split(".", 3)  # model.layers.N.rest
    if rest == "mlp.experts.gate_up_proj":
        half = tensor.shape[1] // 2
        out = {}
        for e in range(tensor.shape[0]):
            out[f"layers.{layer}.ffn.experts.{e}.w1.weight"] = tensor[e, :half].clone()
            out[f"layers.{layer}.ffn.experts.{e}.w3.weight"] = tensor[e, half:].clone()
        return out
    if rest == "mlp.experts.down_proj":
        return {
            f"layers.{layer}.ffn.experts.{e}.w2.weight": tensor[e].clone() for e in range(tensor.shape[0])
        }
    return {f"layers.{layer}.{inverse_layer[rest]}": tensor}
