"""Load a DeepSeek-V4 safetensors checkpoint into a model named like HF's `DeepseekV4ForCausalLM`.

Accepted checkpoints (single `model.safetensors`, sharded `model.safetensors.index.json`, or any
`*.safetensors` in the folder):
- HF names (`model.layers.0.self_attn.q_a_proj.weight`, fused `mlp.experts.gate_up_proj`);
- the released DeepSeek names (`layers.0.attn.wq_a.weight`, per-expert `ffn.experts.3.w1.weight`,
  `embed.weight`, `head.weight`), with or without a `model.` prefix (HF's `save_pretrained` writes the
  latter), FP8 weights with 128x128 block scales (`.scale` ue8m0 or `.weight_scale_inv` float32) and
  FP4-packed experts (see quant.py), dequantised here on CPU, tensor by tensor;
- `mtp.*` (the multi-token-prediction layer) is skipped and counted.

Every check that needs only the headers (unknown, missing, mis-shaped tensors) runs before any data is read.
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
from dsv4_engine.ckpt_names import hf_name

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
FP4_DTYPES = ("I8", "U8", "F4")
# Parameters HF keeps in float32 whatever the model dtype (its `_keep_in_fp32_modules_strict`).
KEEP_FP32 = re.compile(r"(attn_hc|ffn_hc|hc_head|sinks|position_bias|e_score_correction_bias|norm)\b")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names every offending tensor."""


@dataclass
class LoadReport:
    path: str
    files: int = 0
    tensors_read: int = 0  # checkpoint tensors consumed (weights and their scales)
    targets_filled: int = 0  # model parameters/buffers written
    skipped_mtp: int = 0
    dequantized_fp8: int = 0
    dequantized_fp4: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    skipped_names: list[str] = field(default_factory=list)


@dataclass
class _Piece:
    """One checkpoint weight and where it goes: the whole target, or `target[index]` (an expert slice)."""

    key: str
    file: Path
    target: str
    index: tuple[int | slice, ...] | None
    logical_shape: tuple[int, ...]
    kind: str  # "plain" | "fp8" | "fp4"
    scale_key: str | None = None
    scale_file: Path | None = None
    nbytes: int = 0


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


def checkpoint_files(path: str | Path) -> dict[str, Path]:
    """Map every tensor name of the checkpoint at `path` (a folder or one .safetensors file) to its file."""
    path = Path(path)
    if path.is_file():
        return _keys_of([path])
    index = path / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        missing = sorted({f for f in weight_map.values() if not (path / f).exists()})
        if missing:
            raise CheckpointError(f"{index} names shard(s) that do not exist: {', '.join(missing)}")
        return {k: path / f for k, f in weight_map.items()}
    if (path / SINGLE_FILE).exists():
        return _keys_of([path / SINGLE_FILE])
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors checkpoint in {path} (looked for {INDEX_FILE}, {SINGLE_FILE})")
    return _keys_of(files)


def _keys_of(files: list[Path]) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118 - safe_open is not a mapping
                out[k] = f
    return out


def _block_size(path: Path) -> tuple[int, int]:
    cfg_file = (path if path.is_dir() else path.parent) / "config.json"
    if cfg_file.exists():
        q = json.loads(cfg_file.read_text()).get("quantization_config") or {}
        if q.get("weight_block_size"):
            b = q["weight_block_size"]
            return (int(b[0]), int(b[1]))
    return quant.FP8_BLOCK


def _plan(
    files: dict[str, Path],
    targets: dict[str, torch.Tensor],
    block: tuple[int, int],
    report: LoadReport,
    full_shapes: dict[str, tuple[int, ...]],
) -> list[_Piece]:
    """The checkpoint's tensors matched to the model's, against each tensor's full shape (a rank's
    sharded tensors are only its part: `full_shapes` holds theirs)."""
    model_keys = set(targets)
    handles: dict[Path, object] = {}

    def meta(key: str) -> tuple[str, tuple[int, ...]]:
        f = files[key]
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt")
        sl = handles[f].get_slice(key)
        return sl.get_dtype(), tuple(sl.get_shape())

    scale_keys = {k for k in files if k.endswith(SCALE_SUFFIXES)}
    used_scales: set[str] = set()
    pieces: list[_Piece] = []
    errors: list[str] = []
    covered: dict[str, list[tuple]] = {}
    for key in sorted(files):
        if key.removeprefix("model.").startswith("mtp."):
            report.skipped_mtp += 1
            report.skipped_names.append(key)
            continue
        if key in scale_keys:
            continue
        dtype, shape = meta(key)
        stem = key.removesuffix(".weight")
        scale_key = next((stem + s for s in SCALE_SUFFIXES if stem + s in scale_keys), None)
        kind = "plain"
        logical = shape
        if dtype in FP8_DTYPES:
            kind = "fp8"
            if scale_key is None:
                errors.append(
                    f"{key}: fp8 weight without a block scale ({stem}.scale or {stem}.weight_scale_inv)"
                )
                continue
            _, sshape = meta(scale_key)
            if sshape != quant.fp8_grid_shape(shape, block):
                errors.append(
                    f"{scale_key}: scale grid has shape {sshape}, expected "
                    f"{quant.fp8_grid_shape(shape, block)} for weight {shape} with {block} blocks"
                )
        elif scale_key is not None and dtype in FP4_DTYPES:
            kind = "fp4"
            logical = (*shape[:-1], shape[-1] * 2)
            _, sshape = meta(scale_key)
            want = (*logical[:-1], logical[-1] // quant.FP4_GROUP)
            if sshape != want:
                errors.append(
                    f"{scale_key}: fp4 scale has shape {sshape}, expected {want} for weight {logical}"
                )
        elif scale_key is not None:
            errors.append(
                f"{key}: has a scale tensor {scale_key} but dtype {dtype} is neither fp8 nor packed fp4"
            )
        if scale_key is not None:
            used_scales.add(scale_key)

        hit = hf_name(key, model_keys)
        if hit is None or hit[0] not in targets:
            name = hit[0] if hit else key
            errors.append(f"unexpected tensor {key} (shape {logical}): the model has no tensor named {name}")
            continue
        target, index = hit
        tshape = full_shapes.get(target) or tuple(targets[target].shape)
        if index is not None and len(index) == 2:  # an expert's w1/w3: a half of gate_up_proj
            half = tshape[1] // 2
            index = (index[0], slice(0, half) if index[1] == "w1" else slice(half, 2 * half))
        if index is not None and index[0] >= tshape[0]:
            errors.append(
                f"unexpected tensor {key}: expert {index[0]} but {target} holds {tshape[0]} experts"
            )
            continue
        want_shape = _slice_shape(tshape, index)
        if logical != want_shape:
            errors.append(
                f"shape mismatch for {key} -> {_where(target, index)}: expected {want_shape}, got {logical}"
            )
            continue
        covered.setdefault(target, []).append(index)
        pieces.append(
            _Piece(
                key=key,
                file=files[key],
                target=target,
                index=index,
                logical_shape=logical,
                kind=kind,
                scale_key=scale_key,
                scale_file=files.get(scale_key) if scale_key else None,
                nbytes=_numel(shape) * _itemsize(dtype),
            )
        )
    for s in sorted(scale_keys - used_scales - set(report.skipped_names)):
        errors.append(f"unexpected tensor {s}: a scale whose weight is not in the checkpoint")
    for name, t in targets.items():
        errors.extend(_missing(name, full_shapes.get(name) or tuple(t.shape), covered.get(name)))
    if errors:
        shown = "\n  ".join(errors[:20])
        more = f"\n  ... and {len(errors) - 20} more" if len(errors) > 20 else ""
        raise CheckpointError(f"checkpoint {report.path} does not fit the model:\n  {shown}{more}")
    return pieces


def _missing(name: str, shape: tuple[int, ...], got: list[tuple] | None) -> list[str]:
    if got is None:
        return [f"missing tensor {name}: expected shape {shape}"]
    if got == [None]:
        return []
    if all(i is None for i in got):
        return [f"tensor {name} is given {len(got)} times (under different names)"]
    if None in got:
        return [f"tensor {name} is given both whole and per expert"]
    out = []
    parts = [(e,) for e in range(shape[0])] if name.endswith("down_proj") else None
    if parts is None:  # gate_up_proj: every expert's two halves
        half = shape[1] // 2
        parts = [(e, s) for e in range(shape[0]) for s in (slice(0, half), slice(half, 2 * half))]
    have = {_key_of(i) for i in got}
    for p in parts:
        if _key_of(p) not in have:
            out.append(f"missing tensor {_where(name, p)}: expected shape {_slice_shape(shape, p)}")
    if len(got) != len(have):
        out.append(f"tensor {name}: some expert slices are given twice")
    return out


def _key_of(index: tuple) -> tuple:
    return tuple((i.start, i.stop) if isinstance(i, slice) else i for i in index)


def _where(target: str, index: tuple | None) -> str:
    if index is None:
        return target
    parts = [f"{i.start}:{i.stop}" if isinstance(i, slice) else str(i) for i in index]
    return f"{target}[{', '.join(parts)}]"


def _slice_shape(shape: tuple[int, ...], index: tuple | None) -> tuple[int, ...]:
    if index is None:
        return shape
    return tuple(torch.empty(shape, device="meta")[index].shape)


def _numel(shape: list[int] | tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: str) -> int:
    return {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2}.get(dtype, 1)


def _targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # parameters and persistent buffers, i.e. exactly what state_dict() holds, as live tensors
    return dict(model.state_dict(keep_vars=True).items())


def _cast_model(model: torch.nn.Module, dtype: torch.dtype) -> None:
    for name, t in _targets(model).items():
        if t.is_floating_point() and t.dtype != dtype and not KEEP_FP32.search(name):
            t.data = t.data.to(dtype)


def load_checkpoint(
    model: torch.nn.Module,
    path: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    progress: bool = True,
    device: str | torch.device = "cpu",
) -> LoadReport:
    """Fill `model`'s parameters and persistent buffers from the checkpoint at `path`.

    dtype: None keeps the model's dtypes; "auto" is float32 on CPU; a dtype converts floating tensors to it
    first (except those HF keeps in float32: norms, sinks, hyper-connections, compressor biases).
    Each checkpoint tensor is read, dequantised and cast on its own, then copied into place. A rank of
    a parallel server (`model.parallel`) reads only its shard of each split tensor (parallel/shard.py);
    quantised ones are read whole, since their scales cover blocks across the split.
    """
    from dsv4_engine.parallel.shard import model_shards

    start = time.perf_counter()
    report = LoadReport(path=str(path))
    want = resolve_dtype(dtype, device)
    if want is not None:
        _cast_model(model, want)
    files = checkpoint_files(path)
    report.files = len(set(files.values()))
    block = _block_size(Path(path))
    targets = _targets(model)
    shards = model_shards(model) if hasattr(model, "parallel") else {}
    pieces = _plan(files, targets, block, report, {k: full for k, (full, _) in shards.items()})
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
            if p.kind != "plain":
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
        "loaded %s: %d model tensors from %d checkpoint tensors in %d file(s), %d fp8 and %d fp4 dequantised, "
        "%d mtp.* tensors skipped, %.1fs",
        path,
        report.targets_filled,
        report.tensors_read,
        report.files,
        report.dequantized_fp8,
        report.dequantized_fp4,
        report.skipped_mtp,
        report.seconds,
    )
    return report
