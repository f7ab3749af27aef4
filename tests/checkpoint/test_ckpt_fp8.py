"""The `--quant fp8` checkpoint: released layout, our dequantisation against an independent one, HF parity.

The independent dequantisation reads the safetensors file byte by byte (header parsed by hand), decodes
e4m3, e2m1 and e8m0 from their bit fields with numpy, and applies scales in explicit per-block loops.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from dsv4_engine.ckpt_names import hf_name
from dsv4_engine.loader import load_checkpoint


def _raw_tensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    body = data[8 + n :]
    return {
        k: (v["dtype"], v["shape"], body[v["data_offsets"][0] : v["data_offsets"][1]])
        for k, v in header.items()
    }


def _e4m3(b: np.ndarray) -> np.ndarray:
    sign = np.where(b >> 7, -1.0, 1.0)
    exp = ((b >> 3) & 0xF).astype(np.int64)
    man = (b & 0x7).astype(np.float64)
    value = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * np.exp2(exp - 7.0))
    assert not np.any((exp == 15) & (man == 7)), "NaN in an fp8 weight"
    return sign * value


def _e2m1(nibble: np.ndarray) -> np.ndarray:
    sign = np.where(nibble >> 3, -1.0, 1.0)
    exp = ((nibble >> 1) & 0x3).astype(np.int64)
    man = (nibble & 0x1).astype(np.float64)
    value = np.where(exp == 0, man * 0.5, (1 + man / 2) * np.exp2(exp - 1.0))
    return sign * value


def _e8m0(b: np.ndarray) -> np.ndarray:
    return np.exp2(b.astype(np.float64) - 127)


def _decode(raw: dict, key: str) -> np.ndarray:
    dtype, shape, buf = raw[key]
    if dtype in ("F8_E4M3", "F8_E8M0", "I8", "U8"):
        return np.frombuffer(buf, dtype=np.uint8).reshape(shape)
    if dtype == "BF16":  # bf16 is the top half of an f32
        return (np.frombuffer(buf, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return np.frombuffer(buf, dtype={"F32": np.float32, "I64": np.int64}[dtype]).reshape(shape)


def _reference_fp8(weight: np.ndarray, scale: np.ndarray, block: int = 128) -> np.ndarray:
    out = _e4m3(weight)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * block : (i + 1) * block, j * block : (j + 1) * block] *= _e8m0(scale[i, j])
    return out


def _reference_fp4(packed: np.ndarray, scale: np.ndarray, group: int = 32) -> np.ndarray:
    rows, half = packed.shape
    out = np.empty((rows, 2 * half))
    out[:, 0::2] = _e2m1(packed & 0xF)  # element 2j: low nibble of byte j
    out[:, 1::2] = _e2m1(packed >> 4)
    for g in range(scale.shape[1]):
        out[:, g * group : (g + 1) * group] *= _e8m0(scale[:, g : g + 1])
    return out


def _ours(ckpt: Path):
    from transformers import AutoConfig, DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM(AutoConfig.from_pretrained(ckpt))
    report = load_checkpoint(model, ckpt)
    return model, report


def test_released_layout_and_dtypes(tiny_fp8_ckpt: Path) -> None:
    raw = _raw_tensors(tiny_fp8_ckpt / "model.safetensors")
    dtypes = {k: v[0] for k, v in raw.items()}
    assert dtypes["layers.1.attn.wq_a.weight"] == "F8_E4M3"
    assert dtypes["layers.1.attn.wq_a.scale"] == "F8_E8M0"
    assert dtypes["layers.1.attn.indexer.wq_b.weight"] == "F8_E4M3"
    assert dtypes["layers.0.ffn.shared_experts.w2.weight"] == "F8_E4M3"
    assert (dtypes["layers.2.ffn.experts.5.w1.weight"], raw["layers.2.ffn.experts.5.w1.weight"][1]) == (
        "I8",
        [128, 128],
    )
    assert (dtypes["layers.2.ffn.experts.5.w1.scale"], raw["layers.2.ffn.experts.5.w1.scale"][1]) == (
        "F8_E8M0",
        [128, 8],
    )
    assert dtypes["layers.0.ffn.gate.tid2eid"] == "I64"
    assert dtypes["layers.1.ffn.gate.bias"] == dtypes["layers.1.attn.attn_sink"] == "F32"
    assert dtypes["embed.weight"] == dtypes["layers.1.attn.compressor.wkv.weight"] == "BF16"
    cfg = json.loads((tiny_fp8_ckpt / "config.json").read_text())
    assert cfg["quantization_config"]["scale_fmt"] == "ue8m0"
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    assert cfg["expert_dtype"] == "fp4"


def test_loader_dequantisation_equals_independent_one(tiny_fp8_ckpt: Path) -> None:
    raw = _raw_tensors(tiny_fp8_ckpt / "model.safetensors")
    model, report = _ours(tiny_fp8_ckpt)
    ours = model.state_dict()
    keys = set(ours)
    checked = {"fp8": 0, "fp4": 0, "plain": 0}
    for key, (dtype, _, _) in raw.items():
        if key.endswith(".scale"):
            continue
        target, index = hf_name(key, keys)
        got = ours[target]
        if (
            index is not None
        ):  # one expert: w2 is down_proj[e]; w1 / w3 the first / second half of gate_up_proj[e]
            half = got.shape[1] // 2
            got = got[index[0]]
            if len(index) == 2:
                got = got[:half] if index[1] == "w1" else got[half:]
        stem = key.removesuffix(".weight")
        if dtype == "F8_E4M3":
            want, kind = _reference_fp8(_decode(raw, key), _decode(raw, stem + ".scale")), "fp8"
        elif dtype == "I8":
            want, kind = _reference_fp4(_decode(raw, key), _decode(raw, stem + ".scale")), "fp4"
        else:
            want, kind = _decode(raw, key), "plain"
        np.testing.assert_array_equal(got.double().numpy(), want.astype(np.float64), err_msg=key)
        checked[kind] += 1
    assert checked["fp8"] == report.dequantized_fp8 > 0
    assert checked["fp4"] == report.dequantized_fp4 > 0
    assert checked["plain"] > 0


def test_fp8_checkpoint_stays_close_to_the_fp32_one(tiny_ckpt: Path, tiny_fp8_ckpt: Path, hf_tiny) -> None:
    # same seed, same draws: quantisation error only (e4m3: 3 mantissa bits; e2m1 with a per-32 scale)
    model, _ = _ours(tiny_fp8_ckpt)
    full = hf_tiny.state_dict()
    for name, t in model.state_dict().items():
        ref = full[name]
        if t.is_floating_point():
            tol = 0.51 * ref.abs().max().item() if ".experts." in name else 2**-4 * ref.abs().max().item()
            assert (t - ref).abs().max().item() <= tol + 1e-6, name
        else:
            assert torch.equal(t, ref), name


def test_hf_loads_it_to_the_same_weights_and_logits(tiny_fp8_ckpt: Path) -> None:
    from transformers import AutoModelForCausalLM

    # On CPU HF turns on `dequantize` itself: FP8 and FP4 weights become plain Linear / expert weights
    # in float32, but tensors stored as bf16 (embeddings, norms, router) stay bf16 and HF's own forward
    # then fails on mixed dtypes; `.float()` makes it runnable without changing any value.
    theirs = AutoModelForCausalLM.from_pretrained(tiny_fp8_ckpt, dtype=torch.float32).float().eval()
    ours, _ = _ours(tiny_fp8_ckpt)
    ours.eval()
    theirs_sd = theirs.state_dict()
    assert set(theirs_sd) == set(ours.state_dict())
    for name, t in ours.state_dict().items():
        assert t.dtype == theirs_sd[name].dtype and torch.equal(t, theirs_sd[name]), name
    ids = torch.randint(0, theirs.config.vocab_size, (1, 140), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(ours(ids, use_cache=False).logits, theirs(ids, use_cache=False).logits)


def test_v3_style_weight_scale_inv_in_float32_loads_the_same(tiny_fp8_ckpt: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    renamed = {}
    for key, t in load_file(str(tiny_fp8_ckpt / "model.safetensors")).items():
        if key.endswith(".scale"):
            key, t = key.removesuffix(".scale") + ".weight_scale_inv", t.float()
        renamed[key] = t
    out = tmp_path / "v3"
    out.mkdir()
    save_file(renamed, str(out / "model.safetensors"))
    (out / "config.json").write_text((tiny_fp8_ckpt / "config.json").read_text())
    released, _ = _ours(tiny_fp8_ckpt)
    v3, report = _ours(out)
    assert report.dequantized_fp8 > 0 and report.dequantized_fp4 > 0
    for (name, a), b in zip(released.state_dict().items(), v3.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_fp8_weight_without_scale_is_named(tiny_fp8_ckpt: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from dsv4_engine.loader import CheckpointError

    tensors = load_file(str(tiny_fp8_ckpt / "model.safetensors"))
    del tensors["layers.2.attn.wo_b.scale"]
    out = tmp_path / "noscale"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text((tiny_fp8_ckpt / "config.json").read_text())
    with pytest.raises(
        CheckpointError, match=r"layers\.2\.attn\.wo_b\.weight: fp8 weight without a block scale"
    ):
        _ours(out)
