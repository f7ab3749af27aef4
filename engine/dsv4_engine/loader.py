"""Load a DeepSeek-V4 safetensors checkpoint into a model named like HF's `DeepseekV4ForCausalLM`.

Accepted checkpoints (single `model.safetensors`, sharded `model.safetensors.index.json`, or any
`*.safetensors` in the folder):
- HF names (`model.layers.0.self_attn.q_a_proj.weight`, fused `mlp.experts.gate_up_proj`);
- the released DeepSeek names (`layers.0.attn.wq_a.weight`, per-expert `ffn.experts.3.w1.weight`,
  `embed.weight`, `head.weight`), with or without a `model.` prefix (HF's `save_pretrained` writes the
  latter), FP8 weights with 128x128 block scales (`.scale` ue8m0 or `.weight_scale_inv` float32) and
  FP4-packed experts (see quant.py), dequantised here on CPU, tensor by tensor;
- the Ascend W8A8 release: int8 `X.weight` with per-channel `X.weight_scale` (and a zero
  `X.weight_offset`), dequantised like FP8 by default; with `keep_int8` (an engine whose kernel set runs
  W8A8 natively, `KernelSet.native_w8a8`: NPU) a module that takes int8 weights (`int8_weights`: the
  projections, the routed experts) keeps them, its per-row scales beside each as `<name>_scale`
  (`weight_scale`; `gate_up_proj_scale` and `down_proj_scale` for the stacked experts);
- `mtp.*` (the multi-token-prediction layer) fills the model's MTP layer when it has one
  (speculative decoding on), and is otherwise skipped and counted.

Every check that needs only the headers (unknown, missing, mis-shaped tensors) runs before any data is
read: ckpt_plan.py matches the checkpoint's tensors to the model's; this module reads and places them.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from dsv4_engine import quant
from dsv4_engine.ckpt_plan import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    Piece,
    block_size,
    checkpoint_files,
    plan,
)
from dsv4_engine.parallel.shard import Shard, model_shards

# What callers name from here: the loading, and what they need to find or refuse a checkpoint.
__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "CheckpointError",
    "LoadReport",
    "checkpoint_files",
    "load_checkpoint",
    "load_config",
    "resolve_dtype",
]

log = logging.getLogger(__name__)

# Parameters HF keeps in float32 whatever the model dtype (its `_keep_in_fp32_modules_strict`).
KEEP_FP32 = re.compile(r"(attn_hc|ffn_hc|hc_head|sinks|position_bias|e_score_correction_bias|norm)\b")


@dataclass
class LoadReport:
    path: str
    files: int = 0
    tensors_read: int = 0  # checkpoint tensors consumed (weights and their scales)
    targets_filled: int = 0  # model parameters/buffers written
    skipped_mtp: int = 0
    dequantized_fp8: int = 0
    dequantized_fp4: int = 0
    dequantized_w8a8: int = 0
    kept_int8: int = 0  # W8A8 weights left int8 (keep_int8), their scales beside them
    bytes_read: int = 0
    seconds: float = 0.0
    skipped_names: list[str] = field(default_factory=list)


def load_config(path: str | Path) -> dict:
    """The raw `config.json` of a checkpoint folder (parsing it is `Dsv4Config`'s job)."""
    return json.loads((Path(path) / "config.json").read_text())


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device = "cpu") -> torch.dtype | None:
    """`auto`: float32 on CPU (no fast bf16 there), bfloat16 on accelerators; None keeps the model's."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
    }
    names |= {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    return names[dtype]


def _targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # parameters and persistent buffers, i.e. exactly what state_dict() holds, as live tensors
    return dict(model.state_dict(keep_vars=True).items())


def _cast_model(model: torch.nn.Module, dtype: torch.dtype) -> None:
    for name, t in _targets(model).items():
        if t.is_floating_point() and t.dtype != dtype and not KEEP_FP32.search(name):
            t.data = t.data.to(dtype)


def _int8_owner(model: torch.nn.Module, target: str) -> torch.nn.Module | None:
    """The module whose parameter `target` is, if it runs int8 weights (`int8_weights`, a class flag:
    its forward sends them to the set's `quant_linear` or `quant_routed_experts`); else None."""
    owner, _, leaf = target.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    param = isinstance(getattr(module, leaf, None), torch.nn.Parameter)
    return module if param and getattr(module, "int8_weights", False) else None


def _int8_targets(
    model: torch.nn.Module, pieces: list[Piece], targets: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The targets kept int8 (keep_int8): every piece W8A8 (one for a projection, one per expert and
    half for the routed experts) and the owner taking int8. Each becomes an int8 parameter of its
    shape (in `targets` too) beside a float32 buffer `<name>_scale`, its shape less the input dim (one
    scale per output row: `[O]`, `[E, 2I]`, `[E, D]`), outside the state dict, whose names stay the
    checkpoint's. Returns target -> its scales."""
    kinds: dict[str, set[str]] = {}
    for p in pieces:
        kinds.setdefault(p.target, set()).add(p.kind)
    scales = {}
    for name, kind in kinds.items():
        owner = _int8_owner(model, name)
        if kind != {"w8a8"} or owner is None:
            continue
        leaf, old = name.rpartition(".")[2], targets[name]
        weight = torch.nn.Parameter(
            torch.zeros(old.shape, dtype=torch.int8, device=old.device), requires_grad=False
        )
        setattr(owner, leaf, weight)
        scales[name] = torch.zeros(old.shape[:-1], dtype=torch.float32, device=old.device)
        owner.register_buffer(f"{leaf}_scale", scales[name], persistent=False)
        targets[name] = weight
    return scales


def _row_shard(scale: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    """A rank's part of a weight's per-row scales: the rows it keeps when it splits the rows (dim 0);
    every scale when it splits the inputs."""
    rows = shard.ranges.get(0) if shard is not None else None
    return Shard({0: rows}).take(scale) if rows else scale


def load_checkpoint(
    model: torch.nn.Module,
    path: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    progress: bool = True,
    device: str | torch.device = "cpu",
    keep_int8: bool = False,
) -> LoadReport:
    """Fill `model`'s parameters and persistent buffers from the checkpoint at `path`.

    dtype: None keeps the model's dtypes; "auto" is float32 on CPU; a dtype converts floating tensors to it
    first (except those HF keeps in float32: norms, sinks, hyper-connections, compressor biases).
    keep_int8: W8A8 weights of modules that take int8 (`int8_weights`: projections, routed experts)
    stay int8 with their per-row scales, sharded as their rows are (the caller's kernel set runs
    `quant_linear` and `quant_routed_experts` natively: `KernelSet.native_w8a8`); other W8A8 weights
    (the grouped o_a projection) and every W8A8 weight by default are dequantised to the model's dtype
    like FP8.
    Each checkpoint tensor is read, dequantised and cast on its own, then copied into place. A rank of
    a parallel server (`model.parallel`) reads only its shard of each split tensor (parallel/shard.py);
    quantised ones are read whole, since their scales cover blocks across the split.
    """
    start = time.perf_counter()
    report = LoadReport(path=str(path))
    want = resolve_dtype(dtype, device)
    if want is not None:
        _cast_model(model, want)
    files = checkpoint_files(path)
    report.files = len(set(files.values()))
    block = block_size(Path(path))
    targets = _targets(model)
    shards = model_shards(model) if hasattr(model, "parallel") else {}
    full_shapes = {k: full for k, (full, _) in shards.items()}
    pieces, report.skipped_names = plan(files, targets, block, str(path), full_shapes)
    int8 = _int8_targets(model, pieces, targets) if keep_int8 else {}
    report.skipped_mtp = len(report.skipped_names)
    total = sum(p.nbytes for p in pieces)
    step = max(total // 10, 1)
    next_log = step
    verbose = progress and total >= 64 << 20
    if verbose:
        log.info(
            "loading %d tensors (%.1f GiB) from %d file(s) in %s",
            len(pieces),
            total / 2**30,
            report.files,
            path,
        )
    handles: dict[Path, object] = {}

    def handle(f: Path):  # safetensors' handle type is not public
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt")
        return handles[f]

    def read(key: str, f: Path) -> torch.Tensor:
        return handle(f).get_tensor(key)

    filled: set[str] = set()
    with torch.no_grad():
        for p in sorted(pieces, key=lambda p: (str(p.file), p.key)):  # file order: sequential reads
            dest = targets[p.target]
            index, shard = p.index, None
            if p.target in shards:
                shard = shards[p.target][1]
                if index is not None:
                    placed = shard.piece(index)
                    if placed is None:
                        continue  # another rank's expert
                    index, shard = placed
            if shard is not None and p.kind == "plain":
                sl = handle(p.file).get_slice(p.key)
                t = shard.read(lambda box, sl=sl: sl[box], len(p.logical_shape))
                report.tensors_read += 1
                view = dest.data if index is None else dest.data[index]
                view.copy_(t.to(dtype=dest.dtype))
                filled.add(p.target)
                report.bytes_read += t.numel() * t.element_size()
                continue
            t = read(p.key, p.file)
            report.tensors_read += 1
            if p.kind == "w8a8":
                scale = read(p.scale_key, p.scale_file)
                offset = read(p.offset_key, p.offset_file) if p.offset_key else None
                report.tensors_read += 1 + (offset is not None)
                try:
                    scale = quant.w8a8_scale_rows(scale, t.shape[0])
                    quant.check_w8a8_offset(offset, t.shape[0])
                except ValueError as e:
                    raise CheckpointError(f"{p.key}: {e}") from e
                if p.target in int8:  # the weight goes in as is; its scales beside it, rows alike
                    into = int8[p.target]
                    (into if index is None else into[index]).copy_(_row_shard(scale, shard))
                    report.kept_int8 += 1
                else:
                    t = quant.dequant_w8a8(t, scale)
                    report.dequantized_w8a8 += 1
            elif p.kind != "plain":
                scale = read(p.scale_key, p.scale_file)
                report.tensors_read += 1
                if p.kind == "fp8":
                    t = quant.dequant_fp8_block(t, scale, block)
                    report.dequantized_fp8 += 1
                else:
                    t = quant.dequant_fp4(t, scale)
                    report.dequantized_fp4 += 1
            if shard is not None:
                t = shard.take(t)
            view = dest.data if index is None else dest.data[index]
            view.copy_(t.to(dtype=dest.dtype))
            filled.add(p.target)
            report.bytes_read += p.nbytes
            if verbose and report.bytes_read >= next_log:
                log.info(
                    "  %3.0f%% (%d/%d tensors)",
                    100 * report.bytes_read / max(total, 1),
                    report.tensors_read,
                    len(pieces),
                )
                next_log += step
    report.targets_filled = len(filled)
    report.seconds = time.perf_counter() - start
    log.info(
        "loaded %s: %d model tensors from %d checkpoint tensors in %d file(s), %d fp8, %d fp4 and %d w8a8 "
        "dequantised, %d w8a8 kept int8, %d mtp.* tensors skipped, %.1fs",
        path,
        report.targets_filled,
        report.tensors_read,
        report.files,
        report.dequantized_fp8,
        report.dequantized_fp4,
        report.dequantized_w8a8,
        report.kept_int8,
        report.skipped_mtp,
        report.seconds,
    )
    return report
