"""Dsv4Config from the legacy keys DeepSeek ships and from the modern HF form."""

from __future__ import annotations

import json

import pytest

from dsv4_engine.config import CSA, HASH_MOE, HCA, MOE, SLIDING, Dsv4Config, RopeParams

# DeepSeek-V4-Flash's released config.json (legacy keys), as quoted in the reference doc.
V4_FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "vocab_size": 129280,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "sliding_window": 128,
    "max_position_embeddings": 1048576,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],  # 44: the last entry is the MTP layer's
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "num_hash_layers": 3,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
}


def test_legacy_v4_flash_values() -> None:
    c = Dsv4Config.from_dict(V4_FLASH)
    assert len(c.layer_types) == 43  # the MTP entry is dropped
    assert c.compress_ratios == [0, 0] + [4, 128] * 20 + [4]
    assert c.layer_types[:4] == [SLIDING, SLIDING, CSA, HCA]
    assert c.mlp_layer_types == [HASH_MOE] * 3 + [MOE] * 40
    assert c.num_hash_layers == 3
    assert c.qk_rope_head_dim == 64
    assert c.rope_main == RopeParams(theta=10000.0)
    assert c.rope_compress == RopeParams(
        theta=160000.0,
        rope_type="yarn",
        factor=16.0,
        original_max_position_embeddings=65536,
        beta_fast=32.0,
        beta_slow=1.0,
    )


def test_modern_form_gives_same_config(tmp_path) -> None:
    from transformers import DeepseekV4Config

    modern = DeepseekV4Config(**V4_FLASH).to_dict()  # HF writes layer_types, rope_parameters, ...
    for key in ("compress_ratios", "num_hash_layers", "rope_scaling"):
        assert key not in modern
    assert "layer_types" in modern and "rope_parameters" in modern
    (tmp_path / "config.json").write_text(json.dumps(modern))
    assert Dsv4Config.from_pretrained(tmp_path) == Dsv4Config.from_dict(V4_FLASH)
    hf = DeepseekV4Config(**V4_FLASH)
    ours = Dsv4Config.from_dict(V4_FLASH)
    assert ours.layer_types == hf.layer_types and ours.mlp_layer_types == hf.mlp_layer_types
    assert ours.qk_rope_head_dim == hf.qk_rope_head_dim


def test_bad_configs_name_the_field() -> None:
    with pytest.raises(ValueError, match="layer_types"):
        Dsv4Config.from_dict({**V4_FLASH, "compress_ratios": [0, 0, 4]})
    with pytest.raises(ValueError, match="scoring_func"):
        Dsv4Config.from_dict({**V4_FLASH, "scoring_func": "softmax"})
    with pytest.raises(ValueError, match="rope type"):
        Dsv4Config.from_dict({**V4_FLASH, "rope_scaling": {"type": "longrope", "factor": 2}})


def test_state_dict_names_and_shapes_equal_hf_for_v4_flash() -> None:
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from dsv4_engine.model import Dsv4ForCausalLM

    with torch.device("meta"):  # shapes only: no memory for 284B parameters
        hf = DeepseekV4ForCausalLM(DeepseekV4Config(**V4_FLASH))
        ours = Dsv4ForCausalLM(Dsv4Config.from_dict(V4_FLASH), max_positions=256)
    want = {k: (tuple(v.shape), v.dtype) for k, v in hf.state_dict().items()}
    got = {k: (tuple(v.shape), v.dtype) for k, v in ours.state_dict().items()}
    assert got == want
