"""The MTP layer (mtp_layer.py): its checkpoint names, HF loading an MTP-carrying checkpoint with unchanged
logits, the reference logits engine tests compare with, and the demo checkpoint's trained MTP layer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dsv4_engine import demo
from dsv4_engine.ckpt_names import LAYER_NAMES
from dsv4_engine.make_tiny import PRESETS, make_tiny
from dsv4_engine.mtp_layer import load_mtp, mtp_reference_logits, mtp_state, read_mtp_tensors
from dsv4_engine.testing import one_thread, random_ids

OWN = {"e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight"}
OWN |= {"hc_head_fn", "hc_head_base", "hc_head_scale"}
EXPERT = re.compile(r"ffn\.experts\.\d+\.w[123]\.weight")


@pytest.fixture(scope="module")
def tiny_mtp_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    with one_thread():
        return make_tiny(tmp_path_factory.mktemp("tiny_mtp") / "ckpt", seed=0, mtp=True)


def _mtp_names(names: set[str]) -> set[str]:
    return {k for k in names if k.startswith("mtp.")}


def test_names_are_a_routed_sliding_layers_plus_the_mtp_own(tiny_mtp_ckpt: Path) -> None:
    names = set(load_file(str(tiny_mtp_ckpt / "model.safetensors")))
    # layer 1 of the tiny preset is CSA with a routed MoE: the MTP's Block is that without the compressor
    routed = {k.split(".", 2)[2] for k in names if k.startswith("layers.1.")}
    block = {r for r in routed if not r.startswith(("attn.compressor.", "attn.indexer."))}
    assert _mtp_names(names) == {f"mtp.0.{r}" for r in block | OWN}
    assert all(r in LAYER_NAMES or EXPERT.fullmatch(r) for r in block)
    assert {"ffn.gate.bias", "attn.attn_sink", "hc_attn_fn"} <= block and "ffn.gate.tid2eid" not in block
    cfg = json.loads((tiny_mtp_ckpt / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    assert cfg["compress_ratios"] == [*PRESETS["tiny"]["compress_ratios"], 0]


def test_fp8_checkpoints_quantise_the_mtp_like_a_layer(tmp_path: Path) -> None:
    with one_thread():
        ckpt = make_tiny(tmp_path / "fp8", seed=0, mtp=True, quant="fp8")
    tensors = load_file(str(ckpt / "model.safetensors"))
    for stem in ("attn.wq_a", "e_proj", "h_proj", "ffn.shared_experts.w1"):
        assert tensors[f"mtp.0.{stem}.weight"].dtype == torch.float8_e4m3fn, stem
        assert f"mtp.0.{stem}.scale" in tensors
    assert tensors["mtp.0.ffn.experts.0.w2.weight"].dtype == torch.int8
    assert tensors["mtp.0.hc_head_fn"].dtype == tensors["mtp.0.attn.attn_sink"].dtype == torch.float32
    assert tensors["mtp.0.enorm.weight"].dtype == torch.bfloat16
    assert load_mtp(ckpt).e_proj.weight.dtype == torch.float32  # dequantised


def test_w8a8_checkpoints_carry_and_load_the_mtp(tmp_path: Path, tiny_mtp_ckpt: Path) -> None:
    with one_thread():
        ckpt = make_tiny(tmp_path / "w8a8", seed=0, mtp=True, quant="w8a8")
    tensors = load_file(str(ckpt / "model.safetensors"))
    assert (
        tensors["mtp.0.e_proj.weight"].dtype == tensors["mtp.0.ffn.experts.0.w1.weight"].dtype == torch.int8
    )
    ours, plain = load_mtp(ckpt).e_proj.weight, load_mtp(tiny_mtp_ckpt).e_proj.weight
    assert (ours - plain).abs().max() < 0.01 * plain.abs().max()  # per-channel int8 of the same draw


def test_hf_loads_an_mtp_checkpoint_with_the_same_logits(
    tiny_ckpt: Path, tiny_mtp_ckpt: Path, hf_tiny
) -> None:
    from transformers import AutoModelForCausalLM

    plain = load_file(str(tiny_ckpt / "model.safetensors"))
    with_mtp = load_file(str(tiny_mtp_ckpt / "model.safetensors"))
    assert set(with_mtp) - set(plain) == _mtp_names(set(with_mtp))
    assert all(torch.equal(plain[k], with_mtp[k]) for k in plain)
    hf = AutoModelForCausalLM.from_pretrained(tiny_mtp_ckpt, dtype=torch.float32).eval()
    ids = torch.tensor([random_ids(64, seed=3)])
    with torch.inference_mode():
        assert torch.equal(hf(ids).logits, hf_tiny(ids).logits)


def test_reference_logits_read_the_streams_up_to_i_and_the_token_after(tiny_mtp_ckpt: Path) -> None:
    ids = random_ids(40, seed=4)
    logits = mtp_reference_logits(tiny_mtp_ckpt, ids)
    assert logits.shape == (39, 512) and logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert logits.std() > 0.3  # a random MTP layer, not a constant
    # row i reads tokens up to i + 1 only: a prefix gives the same rows, another last token only a new last row
    torch.testing.assert_close(
        mtp_reference_logits(tiny_mtp_ckpt, ids[:20]), logits[:19], rtol=1e-4, atol=1e-4
    )
    other = mtp_reference_logits(tiny_mtp_ckpt, [*ids[:-1], 3 + ids[-1] % 500])
    torch.testing.assert_close(other[:-1], logits[:-1], rtol=1e-4, atol=1e-4)
    assert (other[-1] - logits[-1]).abs().max() > 0.1
    # the loaded layer holds exactly the checkpoint's tensors
    stored = read_mtp_tensors(tiny_mtp_ckpt)
    loaded = mtp_state(load_mtp(tiny_mtp_ckpt))
    assert loaded.keys() == stored.keys() and all(torch.equal(loaded[k], stored[k]) for k in stored)


def test_the_demo_mtp_layer_predicts_two_tokens_ahead() -> None:
    from transformers import AutoTokenizer

    recipe = json.loads((demo.BUNDLED / "demo.json").read_text())["mtp"]
    assert recipe["steps"] == demo.MTP_STEPS and recipe["heldout_accuracy"] > 0.15
    assert recipe["heldout_acceptance"] > 0.25
    tensors = load_file(str(demo.BUNDLED / "model.safetensors"))
    for name in _mtp_names(set(tensors)):  # shipped as the main layers' twins are
        twin = tensors.get(name.replace("mtp.0.", "layers.3."))
        want = twin.dtype if twin is not None else (torch.float32 if "hc_" in name else torch.bfloat16)
        assert tensors[name].dtype == want, name
    tok = AutoTokenizer.from_pretrained(demo.BUNDLED)
    train = demo.load_corpus().train
    hits = total = 0
    for chunk in (train[0], train[100]):
        ids = tok(chunk)["input_ids"][:160]
        logits = mtp_reference_logits(demo.BUNDLED, ids)
        hits += int((logits[:-1].argmax(-1) == torch.tensor(ids[2:])).sum())
        total += len(ids) - 2
    # the trained layer recites its training text two tokens ahead (96% here); the stage's start (the
    # main model's last layer) gets 2-3%, a random layer nothing
    assert hits / total > 0.7, f"{hits}/{total}"
