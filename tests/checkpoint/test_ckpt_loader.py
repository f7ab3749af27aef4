"""loader.load_checkpoint: names, errors before any data is read, shards, mtp skipping, dtypes."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dsv4_engine.loader import CheckpointError, checkpoint_files, load_checkpoint
from dsv4_engine.make_tiny import write_safetensors


class Toy(nn.Module):
    """A target with a plain parameter, a persistent buffer and a non-persistent one (never expected)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3, bias=False)
        self.register_buffer("table", torch.zeros(5, 2, dtype=torch.long))
        self.register_buffer("cache", torch.zeros(7), persistent=False)


def _toy_ckpt(path: Path, **change: torch.Tensor | None) -> Path:
    tensors = {"proj.weight": torch.arange(12.0).view(3, 4), "table": torch.arange(10).view(5, 2)}
    for k, v in change.items():
        k = k.replace("__", ".")
        if v is None:
            tensors.pop(k)
        else:
            tensors[k] = v
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_toy_loads_by_name(tmp_path: Path) -> None:
    model = Toy()
    report = load_checkpoint(model, _toy_ckpt(tmp_path / "ok"))
    assert torch.equal(model.proj.weight, torch.arange(12.0).view(3, 4))
    assert torch.equal(model.table, torch.arange(10).view(5, 2))
    assert report.targets_filled == 2 and report.tensors_read == 2


def test_missing_tensor_named_with_shape(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=re.escape("missing tensor table: expected shape (5, 2)")):
        load_checkpoint(Toy(), _toy_ckpt(tmp_path / "m", table=None))


def test_unexpected_tensor_named(tmp_path: Path) -> None:
    ckpt = _toy_ckpt(tmp_path / "u", extra__weight=torch.ones(2, 2))
    with pytest.raises(CheckpointError, match=re.escape("unexpected tensor extra.weight (shape (2, 2))")):
        load_checkpoint(Toy(), ckpt)


def test_shape_mismatch_named_with_both_shapes(tmp_path: Path) -> None:
    ckpt = _toy_ckpt(tmp_path / "s", proj__weight=torch.ones(3, 5))
    with pytest.raises(CheckpointError, match=re.escape("proj.weight: expected (3, 4), got (3, 5)")):
        load_checkpoint(Toy(), ckpt)


def test_errors_leave_model_untouched(tmp_path: Path) -> None:
    # every header check runs before the first tensor is copied
    model = Toy()
    before = model.proj.weight.detach().clone()
    with pytest.raises(CheckpointError):
        load_checkpoint(model, _toy_ckpt(tmp_path / "e", table=torch.ones(6, 2, dtype=torch.long)))
    assert torch.equal(model.proj.weight, before)


def _hf_model(ckpt: Path):
    from transformers import AutoConfig, DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM(AutoConfig.from_pretrained(ckpt))


def test_released_names_load_into_hf_model_exactly(tiny_ckpt: Path, hf_tiny) -> None:
    ours = _hf_model(tiny_ckpt)
    report = load_checkpoint(ours, tiny_ckpt)
    theirs = hf_tiny.state_dict()
    assert report.targets_filled == len(theirs)
    for name, t in ours.state_dict().items():
        assert torch.equal(t, theirs[name]), name


def _rewrite(src: Path, dst: Path, edit) -> Path:
    dst.mkdir(parents=True)
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_missing_expert_names_fused_slice_and_shape(tiny_ckpt: Path, tmp_path: Path) -> None:
    ckpt = _rewrite(tiny_ckpt, tmp_path / "c", lambda t: t.pop("layers.1.ffn.experts.3.w3.weight"))
    msg = "missing tensor model.layers.1.mlp.experts.gate_up_proj[3, 128:256]: expected shape (128, 256)"
    with pytest.raises(CheckpointError, match=re.escape(msg)):
        load_checkpoint(_hf_model(tiny_ckpt), ckpt)


def test_unexpected_layer_and_expert_are_named(tiny_ckpt: Path, tmp_path: Path) -> None:
    def edit(t: dict) -> None:
        t["layers.9.attn.wq_a.weight"] = torch.zeros(64, 256)
        t["layers.0.ffn.experts.8.w2.weight"] = torch.zeros(256, 128)

    ckpt = _rewrite(tiny_ckpt, tmp_path / "c", edit)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(_hf_model(tiny_ckpt), ckpt)
    text = str(err.value)
    assert "unexpected tensor layers.9.attn.wq_a.weight (shape (64, 256))" in text
    assert "model.layers.9.self_attn.q_a_proj.weight" in text
    assert "unexpected tensor layers.0.ffn.experts.8.w2.weight" in text


def test_shape_mismatch_in_hf_model_names_both(tiny_ckpt: Path, tmp_path: Path) -> None:
    ckpt = _rewrite(
        tiny_ckpt, tmp_path / "c", lambda t: t.update({"layers.2.attn.attn_sink": torch.zeros(5)})
    )
    msg = "shape mismatch for layers.2.attn.attn_sink -> model.layers.2.self_attn.sinks: expected (4,), got (5,)"
    with pytest.raises(CheckpointError, match=re.escape(msg)):
        load_checkpoint(_hf_model(tiny_ckpt), ckpt)


def test_sharded_equals_single_file(tiny_ckpt: Path, tmp_path: Path) -> None:
    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    write_safetensors(load_file(str(tiny_ckpt / "model.safetensors")), shard_dir, shards=3)
    (shard_dir / "config.json").write_text((tiny_ckpt / "config.json").read_text())
    index = json.loads((shard_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    assert len(set(checkpoint_files(shard_dir).values())) == 3

    single, sharded = _hf_model(tiny_ckpt), _hf_model(tiny_ckpt)
    load_checkpoint(single, tiny_ckpt)
    report = load_checkpoint(sharded, shard_dir)
    assert report.files == 3
    for (name, a), b in zip(single.state_dict().items(), sharded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_index_naming_a_missing_shard_fails(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "gone.safetensors"}})
    )
    with pytest.raises(CheckpointError, match=re.escape("gone.safetensors")):
        checkpoint_files(tmp_path)


def test_mtp_tensors_skipped_and_counted(tiny_ckpt: Path, tmp_path: Path, caplog) -> None:
    def edit(t: dict) -> None:
        t["mtp.0.attn.wq_a.weight"] = torch.zeros(64, 256).to(torch.float8_e4m3fn)
        t["mtp.0.attn.wq_a.scale"] = torch.ones(1, 2).to(torch.float8_e8m0fnu)
        t["mtp.0.ffn.gate.weight"] = torch.zeros(8, 256)

    ckpt = _rewrite(tiny_ckpt, tmp_path / "c", edit)
    with caplog.at_level(logging.INFO, logger="dsv4_engine.loader"):
        report = load_checkpoint(_hf_model(tiny_ckpt), ckpt)
    assert report.skipped_mtp == 3
    assert sorted(report.skipped_names) == [
        "mtp.0.attn.wq_a.scale",
        "mtp.0.attn.wq_a.weight",
        "mtp.0.ffn.gate.weight",
    ]
    assert "3 mtp.* tensors skipped" in caplog.text


def test_dtype_bf16_keeps_fp32_islands(tiny_ckpt: Path) -> None:
    model = _hf_model(tiny_ckpt)
    load_checkpoint(model, tiny_ckpt, dtype="bfloat16")
    layer = model.model.layers[1]
    assert layer.self_attn.q_a_proj.weight.dtype == torch.bfloat16
    assert layer.mlp.experts.gate_up_proj.dtype == torch.bfloat16
    for kept in (
        layer.self_attn.sinks,
        layer.attn_hc.fn,
        layer.input_layernorm.weight,
        layer.mlp.gate.e_score_correction_bias,
    ):
        assert kept.dtype == torch.float32
    assert layer.mlp.gate.weight.dtype == torch.bfloat16
    assert model.model.layers[0].mlp.gate.tid2eid.dtype == torch.long


def test_dtype_auto_is_fp32_on_cpu(tiny_ckpt: Path) -> None:
    model = _hf_model(tiny_ckpt).to(torch.bfloat16)
    load_checkpoint(model, tiny_ckpt, dtype="auto")
    assert model.lm_head.weight.dtype == torch.float32


def test_same_tensor_under_two_names_is_refused(tmp_path: Path) -> None:
    model = nn.Module()
    model.model = nn.Module()
    model.model.norm = nn.LayerNorm(3, bias=False)
    path = tmp_path / "dup"
    path.mkdir()
    save_file(
        {"norm.weight": torch.ones(3), "model.norm.weight": torch.ones(3)}, str(path / "model.safetensors")
    )
    with pytest.raises(CheckpointError, match=re.escape("tensor model.norm.weight is given 2 times")):
        load_checkpoint(model, path)
