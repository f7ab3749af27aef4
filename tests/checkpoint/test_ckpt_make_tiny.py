"""make-tiny: presets, determinism, and that every feature is exercised by the random weights."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from dsv4_engine.make_tiny import PRESETS, build_config, draw, hf_shapes, main


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize(("preset", "low", "high"), [("tiny", 4.0e6, 6.5e6), ("small", 80e6, 125e6)])
def test_preset_parameter_counts(preset: str, low: float, high: float) -> None:
    n = sum(math.prod(s) for s in hf_shapes(build_config(preset)).values())
    assert low <= n <= high, f"{preset}: {n / 1e6:.2f}M parameters"


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_cover_every_layer_kind(preset: str) -> None:
    from transformers import DeepseekV4Config

    cfg = DeepseekV4Config(**build_config(preset))
    assert set(cfg.layer_types) == {
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    }
    assert set(cfg.mlp_layer_types) == {"hash_moe", "moe"}
    assert cfg.num_hidden_layers == len(cfg.layer_types)


def test_hf_auto_classes_load_offline(tiny_ckpt: Path, hf_tiny) -> None:
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(tiny_ckpt)
    assert cfg.model_type == "deepseek_v4"
    assert type(hf_tiny).__name__ == "DeepseekV4ForCausalLM"
    assert len(AutoTokenizer.from_pretrained(tiny_ckpt)) == cfg.vocab_size
    gen = json.loads((tiny_ckpt / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg.eos_token_id


def test_same_seed_same_bytes_via_cli(tiny_ckpt: Path, tmp_path: Path, capsys) -> None:
    assert main([str(tmp_path / "again"), "--seed", "0", "--preset", "tiny"]) == 0
    assert "wrote tiny checkpoint" in capsys.readouterr().out
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert _sha(tiny_ckpt / name) == _sha(tmp_path / "again" / name), name


def test_other_seed_other_weights() -> None:
    cfg = build_config("tiny")
    for name, shape in [
        ("model.layers.1.self_attn.sinks", (4,)),
        ("model.layers.0.mlp.gate.tid2eid", (512, 2)),
    ]:
        assert not torch.equal(draw(name, shape, cfg, 0), draw(name, shape, cfg, 1)), name
        assert torch.equal(draw(name, shape, cfg, 3), draw(name, shape, cfg, 3)), name


def test_overrides_change_the_schedule(tmp_path: Path) -> None:
    cfg = build_config("tiny", overrides={"layer_types": ["sliding_attention"] * 4, "o_groups": 4})
    assert "compress_ratios" not in cfg and cfg["o_groups"] == 4
    with pytest.raises(ValueError, match="compress_ratios has 3 entries for 4 layers"):
        build_config("tiny", overrides={"compress_ratios": [0, 4, 128]})


def test_every_tensor_is_drawn_non_trivially(hf_tiny) -> None:
    # HF's own init leaves sinks, position biases, correction bias, mHC base and tid2eid at zero
    # and norms / mHC scales at one: none of that may survive here
    for name, t in hf_tiny.state_dict().items():
        assert not torch.all(t == 0), f"{name} is all zeros"
        assert not torch.all(t == 1), f"{name} is all ones"
        if t.numel() > 1:
            assert t.unique().numel() > 1, f"{name} is constant"


def test_tid2eid_maps_tokens_to_distinct_random_experts(hf_tiny) -> None:
    cfg = hf_tiny.config
    hash_layers = [i for i, kind in enumerate(cfg.mlp_layer_types) if kind == "hash_moe"]
    assert hash_layers
    for i in hash_layers:
        table = hf_tiny.model.layers[i].mlp.gate.tid2eid
        assert table.shape == (cfg.vocab_size, cfg.num_experts_per_tok)
        assert int(table.min()) >= 0 and int(table.max()) < cfg.n_routed_experts
        ordered = table.sort(dim=1).values
        assert bool((ordered[:, 1:] != ordered[:, :-1]).all()), "a token repeats an expert"
        assert table.unique().numel() == cfg.n_routed_experts  # every expert is reachable
        orderings = math.perm(cfg.n_routed_experts, cfg.num_experts_per_tok)
        assert table.unique(dim=0).shape[0] > min(orderings, cfg.vocab_size) // 2  # tokens really differ


def _routing_and_clamps(model, ids: torch.Tensor) -> tuple[dict[int, float], dict[str, list[float]]]:
    """Per routed layer, the fraction of selections the correction bias changes; per expert kind, the
    fraction of SwiGLU pre-activations the limit clamps. Computed from the layer inputs, not HF's code."""
    limit = model.config.swiglu_limit
    changed: dict[int, float] = {}
    clamped: dict[str, list[float]] = {"routed": [], "shared": []}

    def clamp_fraction(gate: torch.Tensor, up: torch.Tensor) -> float:
        return ((gate > limit).sum() + (up.abs() > limit).sum()).item() / (gate.numel() + up.numel())

    def on_moe(index: int):
        def hook(mlp, args):
            x = args[0].reshape(-1, args[0].shape[-1])
            if not mlp.is_hash:
                scores = torch.sqrt(torch.nn.functional.softplus(x @ mlp.gate.weight.T))
                k = mlp.gate.top_k
                plain = scores.topk(k, dim=-1).indices
                biased = (scores + mlp.gate.e_score_correction_bias).topk(k, dim=-1).indices
                kept = (plain.unsqueeze(-1) == biased.unsqueeze(-2)).any(-1).sum().item()
                changed[index] = 1 - kept / plain.numel()
            sh = mlp.shared_experts
            clamped["shared"].append(clamp_fraction(x @ sh.gate_proj.weight.T, x @ sh.up_proj.weight.T))

        return hook

    def on_experts(experts, args):
        x, top_k_index = args[0], args[1]
        half = experts.gate_up_proj.shape[1] // 2
        gates, ups = [], []
        for e in top_k_index.unique().tolist():
            rows = (top_k_index == e).any(-1)
            gate_up = x[rows] @ experts.gate_up_proj[e].T
            gates.append(gate_up[:, :half])
            ups.append(gate_up[:, half:])
        clamped["routed"].append(clamp_fraction(torch.cat(gates), torch.cat(ups)))

    handles = []
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.mlp.register_forward_pre_hook(on_moe(i)))
        handles.append(layer.mlp.experts.register_forward_pre_hook(on_experts))
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return changed, clamped


def test_correction_bias_and_swiglu_limit_bind(hf_tiny) -> None:
    ids = torch.randint(0, hf_tiny.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(7))
    changed, clamped = _routing_and_clamps(hf_tiny, ids)
    routed_layers = [i for i, kind in enumerate(hf_tiny.config.mlp_layer_types) if kind == "moe"]
    assert sorted(changed) == routed_layers
    for i, fraction in changed.items():
        assert fraction >= 0.20, f"layer {i}: the correction bias changes only {fraction:.1%} of selections"
    assert len(clamped["routed"]) == len(clamped["shared"]) == hf_tiny.config.num_hidden_layers
    for kind, fractions in clamped.items():
        for i, fraction in enumerate(fractions):
            assert fraction >= 0.05, f"layer {i} {kind} experts: swiglu_limit clamps only {fraction:.1%}"
