"""The `--quant w8a8` checkpoint, the Ascend W8A8 release's layout: what make-tiny writes, what the
loader makes of it on CPU (dequantised: every weight within half an int8 step of the original, logits
close to the fp32 model's), what it keeps int8 for a set that runs W8A8 itself (NPU: the projections
and the stacked routed experts, each with its scales, sharded alike on parallel ranks), and the headers
it refuses before reading any data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dsv4_engine.ckpt_names import hf_name
from dsv4_engine.config import Dsv4Config
from dsv4_engine.loader import CheckpointError, LoadReport, load_checkpoint
from dsv4_engine.model import Dsv4ForCausalLM, ForwardBatch
from dsv4_engine.model.moe import Experts
from dsv4_engine.model.ops import Linear
from dsv4_engine.parallel.groups import Parallel
from dsv4_engine.parallel.shard import Shard, shard_for
from dsv4_engine.testing import dense_cache

# What the release quantises (a third-party reading of its quant_model_description.json, and the FP8
# release's set): every projection DeepSeek ships in FP8 or FP4.
QUANTISED = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b")


def _load(
    path: Path, keep_int8: bool = False, parallel: Parallel | None = None
) -> tuple[Dsv4ForCausalLM, LoadReport]:
    config = Dsv4Config.from_pretrained(path)
    kw = {"parallel": parallel} if parallel is not None else {}
    model = Dsv4ForCausalLM(config, max_positions=1024, **kw).cast(torch.float32)
    return model.eval(), load_checkpoint(model, path, dtype=None, progress=False, keep_int8=keep_int8)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _rewritten(src: Path, out: Path, tensors: dict[str, torch.Tensor]) -> Path:
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text((src / "config.json").read_text())
    return out


def test_layout_dtypes_and_description(tiny_w8a8_ckpt: Path) -> None:
    with safe_open(str(tiny_w8a8_ckpt / "model.safetensors"), framework="pt") as f:
        meta = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}  # noqa: SIM118
    for stem in [f"layers.1.{q}" for q in QUANTISED] + [
        "layers.0.ffn.shared_experts.w2",
        "layers.2.ffn.experts.5.w1",
    ]:
        dtype, shape = meta[f"{stem}.weight"]
        assert dtype == "I8" and len(shape) == 2, stem  # [O, I], not packed
        assert meta[f"{stem}.weight_scale"] == meta[f"{stem}.weight_offset"] == ("F32", (shape[0], 1)), stem
    assert not any(k.endswith((".scale", "_scale_inv")) for k in meta)
    assert meta["layers.0.ffn.gate.tid2eid"][0] == "I64"
    assert meta["layers.1.ffn.gate.bias"][0] == meta["layers.1.attn.attn_sink"][0] == "F32"
    assert meta["embed.weight"][0] == meta["layers.1.attn.compressor.wkv.weight"][0] == "BF16"
    cfg = json.loads((tiny_w8a8_ckpt / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and "quantization_config" not in cfg
    description = json.loads((tiny_w8a8_ckpt / "quant_model_description.json").read_text())
    assert description.pop("model_quant_type") == "W8A8_DYNAMIC"
    assert set(description) == set(meta)
    for key, kind in description.items():
        assert kind == ("W8A8_DYNAMIC" if meta[key][0] == "I8" or "weight_" in key else "FLOAT"), key
    offsets = [t for k, t in _tensors(tiny_w8a8_ckpt).items() if k.endswith(".weight_offset")]
    assert offsets and all(not t.any() for t in offsets)  # symmetric


def test_dequantised_weights_are_exact_and_within_half_a_step(tiny_ckpt: Path, tiny_w8a8_ckpt: Path) -> None:
    """Each int8 weight becomes `q * scale` (fp32) exactly, at most half a step (scale / 2) from the
    fp32 original it was rounded from; every other tensor is the original in its shipped dtype."""
    ours, report = _load(tiny_w8a8_ckpt)
    full, _ = _load(tiny_ckpt)
    got, orig = ours.state_dict(), full.state_dict()
    raw = _tensors(tiny_w8a8_ckpt)
    quantised = plain = 0
    for key, t in raw.items():
        if key.endswith((".weight_scale", ".weight_offset")):
            continue
        target, index = hf_name(key, set(got))
        mine, theirs = got[target], orig[target]
        if index is not None:  # one expert: w2 is down_proj[e]; w1 / w3 a half of gate_up_proj[e]
            half = mine.shape[1] // 2
            rows = (
                slice(None) if len(index) == 1 else slice(0, half) if index[1] == "w1" else slice(half, None)
            )
            mine, theirs = mine[index[0]][rows], theirs[index[0]][rows]
        if t.dtype == torch.int8:
            scale = raw[key.removesuffix(".weight") + ".weight_scale"]
            assert torch.equal(mine, t.float() * scale), key
            assert ((mine - theirs).abs() <= 0.5001 * scale + 1e-7).all(), key
            quantised += 1
        else:
            assert torch.equal(mine, t.to(mine.dtype)), key
            assert torch.equal(mine, theirs.to(t.dtype).to(mine.dtype)), key  # the original, as shipped
            plain += 1
    assert quantised == report.dequantized_w8a8 > 0 and plain > 0 and report.kept_int8 == 0


def test_logits_stay_close_to_the_fp32_original(tiny_ckpt: Path, tiny_w8a8_ckpt: Path) -> None:
    """Teacher-forced logits (so the greedy next token at every prefix) over a 300-token prompt. The
    rule: the difference's RMS is at most 0.2 of the logits' spread (measured 0.09-0.11 on four seeds:
    int8 per channel, plus bf16 for what ships in bf16), the argmax agrees at >= 85% of positions
    (measured 88-91%), and it flips only where the fp32 model's top-2 margin is below 0.75 (measured
    <= 0.44; the median margin is ~0.2). A routing or indexer pick near a tie can flip, so the largest
    difference is not bounded."""
    ours, _ = _load(tiny_w8a8_ckpt)
    full, _ = _load(tiny_ckpt)
    ids = torch.randint(
        3, ours.config.vocab_size, (300,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    with torch.inference_mode():
        got, want = (m.compute_logits(m(ForwardBatch.build([(dense_cache(m), ids)]))) for m in (ours, full))
    assert (got - want).pow(2).mean().sqrt() <= 0.2 * want.std()
    flips = got.argmax(-1) != want.argmax(-1)
    assert flips.float().mean() <= 0.15
    top2 = want.topk(2, dim=-1).values
    assert ((top2[:, 0] - top2[:, 1])[flips] < 0.75).all()


def _scale_of(model: torch.nn.Module, name: str) -> torch.Tensor:
    """The per-row scales the loader keeps beside the int8 tensor `name` (`<leaf>_scale`)."""
    owner, _, leaf = name.rpartition(".")
    return getattr(model.get_submodule(owner), f"{leaf}_scale")


def test_keep_int8_leaves_the_linears_and_experts_int8_with_their_scales(tiny_w8a8_ckpt: Path) -> None:
    """Where a module takes int8 weights, keep_int8 leaves them int8 with their per-row scales beside
    them (float32, outside the state dict, whose names do not change): a projection's `[O]`, the
    stacked routed experts' `[E, 2I]` (w1's rows, then w3's) and `[E, D]`, the grouped o_a projection's
    `[G*R]` (its rows, group by group, as stored)."""
    model, report = _load(tiny_w8a8_ckpt, keep_int8=True)
    deq, _ = _load(tiny_w8a8_ckpt)
    raw = _tensors(tiny_w8a8_ckpt)
    attn = model.model.layers[1].self_attn
    assert attn.q_a_proj.weight.dtype == torch.int8 and not attn.q_a_proj.weight.requires_grad
    assert torch.equal(attn.q_a_proj.weight, raw["layers.1.attn.wq_a.weight"])
    assert attn.q_a_proj.weight_scale.dtype == torch.float32
    assert torch.equal(attn.q_a_proj.weight_scale, raw["layers.1.attn.wq_a.weight_scale"].flatten())
    assert attn.o_a_proj.weight.dtype == torch.int8
    assert torch.equal(attn.o_a_proj.weight, raw["layers.1.attn.wo_a.weight"])
    assert torch.equal(attn.o_a_proj.weight_scale, raw["layers.1.attn.wo_a.weight_scale"].flatten())
    experts = model.model.layers[2].mlp.experts
    inter = model.config.moe_intermediate_size
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.int8
    assert experts.gate_up_proj_scale.shape == (experts.num_experts, 2 * inter)
    assert experts.down_proj_scale.shape == (experts.num_experts, model.config.hidden_size)
    for e in range(experts.num_experts):
        stem = f"layers.2.ffn.experts.{e}"
        for weight, scale, part in [
            (experts.gate_up_proj[e, :inter], experts.gate_up_proj_scale[e, :inter], "w1"),
            (experts.gate_up_proj[e, inter:], experts.gate_up_proj_scale[e, inter:], "w3"),
            (experts.down_proj[e], experts.down_proj_scale[e], "w2"),
        ]:
            assert torch.equal(weight, raw[f"{stem}.{part}.weight"]), (e, part)
            assert torch.equal(scale, raw[f"{stem}.{part}.weight_scale"].flatten()), (e, part)
    int8 = {n for n, t in model.state_dict().items() if t.dtype == torch.int8}
    per_layer = {
        "q_a_proj",
        "q_b_proj",
        "kv_proj",
        "o_a_proj",
        "o_b_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert {n.split(".")[-2] for n in int8} == per_layer | {"experts"}
    csa = sum(r == 4 for r in model.config.compress_ratios)  # each CSA layer's indexer has a q_b too
    layers = len(model.model.layers)
    assert len(int8) == layers * (len(per_layer) + 2) + csa
    kept = layers * (len(per_layer) + 3 * experts.num_experts) + csa  # w1, w3, w2 per expert
    assert report.kept_int8 == kept and report.dequantized_w8a8 == 0
    assert set(model.state_dict()) == set(deq.state_dict())
    assert not any(n.endswith(("weight_scale", "proj_scale")) for n in model.state_dict())
    # The dequantised model is the int8 one with its scales applied, row by row.
    for name in int8:
        t = model.state_dict()[name]
        assert torch.equal(deq.state_dict()[name], t.float() * _scale_of(model, name)[..., None]), name


def test_keep_int8_does_nothing_until_a_module_takes_int8(
    tiny_w8a8_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a module's `int8_weights` flag every W8A8 weight is dequantised, keep_int8 or not; the
    routed experts' flag alone keeps only theirs."""
    monkeypatch.setattr(Linear, "int8_weights", False)
    model, report = _load(tiny_w8a8_ckpt, keep_int8=True)
    int8 = {n.rpartition(".")[2] for n, t in model.state_dict().items() if t.dtype == torch.int8}
    assert int8 == {"gate_up_proj", "down_proj"} and report.dequantized_w8a8 > 0
    monkeypatch.setattr(Experts, "int8_weights", False)
    model, report = _load(tiny_w8a8_ckpt, keep_int8=True)
    assert report.kept_int8 == 0 and report.dequantized_w8a8 > 0
    assert all(t.dtype != torch.int8 for t in model.state_dict().values())


@pytest.mark.parametrize("ep_size", [1, 2], ids=["tp2", "tp2-ep2"])
def test_keep_int8_on_parallel_ranks(tiny_w8a8_ckpt: Path, ep_size: int) -> None:
    """Two ranks: a split along the output rows (q_b, the shared expert's gate, the routed experts'
    gate and up halves) takes the scales' rows with the weight's; a split along the inputs (o_b, the
    shared and routed down) keeps every row's scale; an expert split (ep2) takes its experts' scales.
    Every int8 tensor and its scales on a rank are the rank's shard of the whole ones."""
    full, _ = _load(tiny_w8a8_ckpt, keep_int8=True)
    whole = full.state_dict()
    for rank in (0, 1):
        parallel = Parallel(rank=rank, tp_size=2, ep_size=ep_size)
        model, _ = _load(tiny_w8a8_ckpt, keep_int8=True, parallel=parallel)
        int8 = {n: t for n, t in model.state_dict().items() if t.dtype == torch.int8}
        assert len(int8) == sum(t.dtype == torch.int8 for t in whole.values())
        split = {"layers.1.self_attn.q_b_proj.weight", "layers.1.mlp.experts.gate_up_proj"}
        for name, t in int8.items():
            shard = shard_for(name, tuple(whole[name].shape), model.config, parallel)
            if shard is None:  # replicated
                assert torch.equal(t, whole[name]), name
                assert torch.equal(_scale_of(model, name), _scale_of(full, name)), name
                continue
            split.discard(name.removeprefix("model."))
            assert torch.equal(t, shard.take(whole[name])), name
            rows = Shard({d: r for d, r in shard.ranges.items() if d < t.dim() - 1})  # the input dim's go
            assert torch.equal(_scale_of(model, name), rows.take(_scale_of(full, name))), name
        assert not split  # both kinds of split were seen


def test_bad_w8a8_headers_are_all_named(tiny_w8a8_ckpt: Path, tmp_path: Path) -> None:
    tensors = _tensors(tiny_w8a8_ckpt)
    tensors["layers.1.attn.wq_a.weight_scale"] = tensors["layers.1.attn.wq_a.weight_scale"][:10]
    tensors["layers.1.attn.wkv.weight"] = tensors["layers.1.attn.wkv.weight"].to(torch.int32)
    del tensors["layers.1.attn.wo_b.weight_scale"]
    tensors["layers.9.attn.wq_b.weight_scale"] = torch.ones(4, 1)
    out = _rewritten(tiny_w8a8_ckpt, tmp_path / "bad", tensors)
    with pytest.raises(CheckpointError) as err:
        _load(out)
    message = str(err.value)
    assert "layers.1.attn.wq_a.weight_scale: W8A8 scale has shape (10, 1), expected" in message
    assert "layers.1.attn.wkv.weight: has a W8A8 scale layers.1.attn.wkv.weight_scale but is I32" in message
    assert (
        "layers.1.attn.wo_b.weight: has a W8A8 offset layers.1.attn.wo_b.weight_offset but no scale"
        in message
    )
    assert "unexpected tensor layers.9.attn.wq_b.weight_scale: a scale whose weight is not" in message


def test_a_nonzero_offset_is_refused(tiny_w8a8_ckpt: Path, tmp_path: Path) -> None:
    """Asymmetric int8 weights: npu_quant_matmul has no weight zero point with per-token scales."""
    tensors = _tensors(tiny_w8a8_ckpt)
    tensors["layers.2.attn.wq_a.weight_offset"][3] = 1.0
    out = _rewritten(tiny_w8a8_ckpt, tmp_path / "asym", tensors)
    with pytest.raises(CheckpointError, match=r"layers\.2\.attn\.wq_a\.weight: .*offset is not zero"):
        _load(out)
