"""What a checkpoint holds and where each tensor goes, read from the safetensors headers alone.

`checkpoint_files` maps every tensor name to its file (an index, one `model.safetensors`, or every
`*.safetensors` in the folder); `plan` matches each checkpoint tensor to the model tensor it fills
(or the expert slice of a fused one), with its kind (plain, fp8 with a block scale, packed fp4 with
a group scale, W8A8 int8 with per-channel scales), and names every unknown, missing, mis-shaped or
doubly given tensor in one CheckpointError, before any data is read.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from dsv4_engine import quant
from dsv4_engine.ckpt_names import hf_name

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
FP4_DTYPES = ("I8", "U8", "F4")
# The Ascend W8A8 release (msmodelslim): `X.weight` int8 [O, I] beside `X.weight_scale` and
# `X.weight_offset` [O, 1]; `.weight_scale` is not `.scale`/`.weight_scale_inv` (those end otherwise).
W8A8_SCALE = ".weight_scale"
W8A8_OFFSET = ".weight_offset"
W8A8_SCALE_DTYPES = ("F32", "BF16", "F16")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names every offending tensor."""


@dataclass
class Piece:
    """One checkpoint weight and where it goes: the whole target, or `target[index]` (an expert slice)."""

    key: str
    file: Path
    target: str
    index: tuple[int | slice, ...] | None
    logical_shape: tuple[int, ...]
    kind: str  # "plain" | "fp8" | "fp4" | "w8a8"
    scale_key: str | None = None
    scale_file: Path | None = None
    nbytes: int = 0
    offset_key: str | None = None  # w8a8's zero point, when the checkpoint has one
    offset_file: Path | None = None


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


def block_size(path: Path) -> tuple[int, int]:
    cfg_file = (path if path.is_dir() else path.parent) / "config.json"
    if cfg_file.exists():
        q = json.loads(cfg_file.read_text()).get("quantization_config") or {}
        if q.get("weight_block_size"):
            b = q["weight_block_size"]
            return (int(b[0]), int(b[1]))
    return quant.FP8_BLOCK


def plan(
    files: dict[str, Path],
    targets: dict[str, torch.Tensor],
    block: tuple[int, int],
    path: str,
    full_shapes: dict[str, tuple[int, ...]],
) -> tuple[list[Piece], list[str]]:
    """The checkpoint's tensors matched to the model's, against each tensor's full shape (a rank's
    sharded tensors are only its part: `full_shapes` holds theirs); and the `mtp.*` tensors skipped (all of
    them when the model has no MTP layer)."""
    model_keys = set(targets)
    handles: dict[Path, object] = {}

    def meta(key: str) -> tuple[str, tuple[int, ...]]:
        f = files[key]
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt")
        sl = handles[f].get_slice(key)
        return sl.get_dtype(), tuple(sl.get_shape())

    scale_keys = {k for k in files if k.endswith(SCALE_SUFFIXES)}
    w8a8_keys = {k for k in files if k.endswith((W8A8_SCALE, W8A8_OFFSET))}
    used_scales: set[str] = set()
    pieces: list[Piece] = []
    skipped: list[str] = []
    errors: list[str] = []
    covered: dict[str, list[tuple]] = {}
    # The MTP layer is read only into a model that has one (speculative decoding on); else skipped.
    has_mtp = any(k.startswith("mtp.") for k in model_keys)
    for key in sorted(files):
        if key.removeprefix("model.").startswith("mtp.") and not has_mtp:
            skipped.append(key)
            continue
        if key in scale_keys or key in w8a8_keys:
            continue
        dtype, shape = meta(key)
        stem = key.removesuffix(".weight")
        scale_key = next((stem + s for s in SCALE_SUFFIXES if stem + s in scale_keys), None)
        offset_key = None
        kind = "plain"
        logical = shape
        if stem + W8A8_SCALE in w8a8_keys:
            kind, scale_key = "w8a8", stem + W8A8_SCALE
            offset_key = stem + W8A8_OFFSET if stem + W8A8_OFFSET in w8a8_keys else None
            errors.extend(_w8a8_errors(key, dtype, shape, scale_key, offset_key, meta))
        elif key.endswith(".weight") and stem + W8A8_OFFSET in w8a8_keys:
            errors.append(f"{key}: has a W8A8 offset {stem}{W8A8_OFFSET} but no scale {stem}{W8A8_SCALE}")
        elif dtype in FP8_DTYPES:
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
        if offset_key is not None:
            used_scales.add(offset_key)

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
            Piece(
                key=key,
                file=files[key],
                target=target,
                index=index,
                logical_shape=logical,
                kind=kind,
                scale_key=scale_key,
                scale_file=files.get(scale_key) if scale_key else None,
                nbytes=_numel(shape) * _itemsize(dtype),
                offset_key=offset_key,
                offset_file=files.get(offset_key) if offset_key else None,
            )
        )
    for s in sorted((scale_keys | w8a8_keys) - used_scales - set(skipped)):
        errors.append(f"unexpected tensor {s}: a scale whose weight is not in the checkpoint")
    for name, t in targets.items():
        errors.extend(_missing(name, full_shapes.get(name) or tuple(t.shape), covered.get(name)))
    if errors:
        shown = "\n  ".join(errors[:20])
        more = f"\n  ... and {len(errors) - 20} more" if len(errors) > 20 else ""
        raise CheckpointError(f"checkpoint {path} does not fit the model:\n  {shown}{more}")
    return pieces, skipped


def _w8a8_errors(
    key: str,
    dtype: str,
    shape: tuple[int, ...],
    scale_key: str,
    offset_key: str | None,
    meta: Callable[[str], tuple[str, tuple[int, ...]]],
) -> list[str]:
    """What is wrong with a W8A8 weight and its per-channel scale (and zero point), from the headers."""
    if dtype != "I8" or len(shape) != 2:
        return [f"{key}: has a W8A8 scale {scale_key} but is {dtype} {shape}, not a 2-D int8 weight"]
    out = []
    rows = ((shape[0], 1), (shape[0],))
    for k in (scale_key, offset_key):
        if k is None:
            continue
        kdtype, kshape = meta(k)
        what = f"{k}: W8A8 {k.rsplit('_', 1)[-1]}"  # scale or offset
        if kshape not in rows:
            out.append(f"{what} has shape {kshape}, expected {rows[0]} for weight {shape}")
        if kdtype not in W8A8_SCALE_DTYPES:
            out.append(f"{what} has dtype {kdtype}; expected one of {', '.join(W8A8_SCALE_DTYPES)}")
    return out


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
