"""A checkpoint with an MTP layer for speculative-decoding tests: the bundled demo model when it carries
one (`num_nextn_predict_layers` >= 1), else a copy of it with a random MTP layer added.

A random MTP layer drafts tokens the target almost never accepts, so it exercises the whole verify path
(drafts proposed, rejected, rows cut back) but says nothing about speed. Its tensors are written under
DeepSeek's released names (`mtp.0.*`), as a real checkpoint ships them, and drawn like make_tiny's
random presets so activations stay ~N(0, 1).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "engine" / "dsv4_engine" / "data" / "demo"
# The released name prefix the MTP layer's decoder-layer tensors are renamed from (`released_names`
# only spells main layers; any index past the model's layers serves).
_SCRATCH_LAYER = 999


def has_mtp(path: Path) -> bool:
    cfg = json.loads((path / "config.json").read_text())
    return int(cfg.get("num_nextn_predict_layers") or 0) >= 1


def add_random_mtp(src: Path, dst: Path, seed: int = 0) -> Path:
    """Copy checkpoint `src` (one `model.safetensors`) to `dst` with a random MTP layer; returns `dst`."""
    import torch
    from safetensors.torch import load_file, save_file

    from dsv4_engine.ckpt_names import MTP_NAMES, released_names
    from dsv4_engine.config import Dsv4Config
    from dsv4_engine.make_tiny import draw
    from dsv4_engine.model import Dsv4ForCausalLM

    shutil.rmtree(dst, ignore_errors=True)
    # SHA256SUMS would no longer match the weights: a damaged demo to `demo.bundled()`.
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("SHA256SUMS"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    ratios = cfg.get("compress_ratios")
    if ratios is not None and len(ratios) == cfg["num_hidden_layers"]:
        cfg["compress_ratios"] = [*ratios, 0]  # the released layout: the MTP layer's entry, SWA only
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    with torch.device("meta"):  # names and shapes only
        model = Dsv4ForCausalLM(Dsv4Config.from_dict(cfg), mtp=True)
    base = load_file(str(src / "model.safetensors"))
    dtype = base["embed.weight"].dtype
    inverse_mtp = {hf: rel for rel, hf in MTP_NAMES.items()}
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if not name.startswith("mtp.0."):
            continue
        value = draw(name, tuple(t.shape), cfg, seed)
        value = value.to(dtype) if value.is_floating_point() else value
        rest = name.removeprefix("mtp.0.")
        if rest in inverse_mtp:
            tensors[f"mtp.0.{inverse_mtp[rest]}"] = value.contiguous()
            continue
        for rel, part in released_names(f"model.layers.{_SCRATCH_LAYER}.{rest}", value).items():
            tensors[rel.replace(f"layers.{_SCRATCH_LAYER}.", "mtp.0.", 1)] = part.contiguous()
    save_file({**base, **tensors}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def mtp_checkpoint(dst: Path, src: Path = DEMO) -> Path:
    """`src` itself when it has an MTP layer, else `add_random_mtp(src, dst)`."""
    return src if has_mtp(src) else add_random_mtp(src, dst)


def record_drafts(llm: Any) -> tuple[list[list[int]], list[Any]]:
    """Every draft rank 0's drafter proposes from now on, in order (each request's, step by step),
    and every row (`DraftRow`) it drafts from."""
    drafter = llm.engine.runner.drafter
    assert drafter is not None
    drafts: list[list[int]] = []
    rows: list[Any] = []
    propose = drafter.propose

    def recording(batch: list[Any], streams: Any) -> dict[str, list[int]]:
        rows.extend(batch)
        out = propose(batch, streams)
        drafts.extend(out.values())
        return out

    drafter.propose = recording
    return drafts, rows
