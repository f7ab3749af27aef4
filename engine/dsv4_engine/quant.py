"""Dequantisation (and the inverse, for `make-tiny --quant fp8|w8a8`) of DeepSeek-V4's released weight formats.

Formats, as the released DeepSeek-V4 checkpoints store them (see docs/checkpoints.md):

- FP8 block: `X.weight` is float8_e4m3fn `[O, I]`; `X.scale` is a ue8m0 (float8_e8m0fnu) grid
  `[ceil(O/128), ceil(I/128)]`; the real weight is `weight * scale[r // 128, c // 128]`. DeepSeek-V3-style
  checkpoints name the same grid `X.weight_scale_inv` and store it as float32.
- FP4 experts: `X.weight` is int8 `[O, I/2]`, two e2m1 codes per byte, element `2j` in the low nibble of
  byte `j` and element `2j+1` in the high nibble; `X.scale` is ue8m0 `[O, I/32]`, one power of two per
  32 consecutive inputs of a row; the real weight is `e2m1(code) * scale[r, c // 32]`.

And the Ascend W8A8 release (msmodelslim's W8A8_DYNAMIC; docs/checkpoints.md):

- W8A8: `X.weight` is int8 `[O, I]` (not packed), `X.weight_scale` one scale per output channel `[O, 1]`
  (float32 or bfloat16), `X.weight_offset` its zero point `[O, 1]`, zero (symmetric); the real weight is
  `weight * scale[r]`. Activations are quantised at run time, per token (`quant_per_token`): on an NPU by
  `npu_dynamic_quant`, then `npu_quant_matmul` (projections) or `npu_grouped_matmul` (routed experts,
  `grouped_matmul_scale`) multiplies in int8 with int32 accumulation.
"""

from __future__ import annotations

import torch

FP8_BLOCK = (128, 128)
FP4_GROUP = 32
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest e2m1 magnitude
INT8_MAX = 127.0  # symmetric int8: a row's largest magnitude maps to 127

# e2m1 code -> value; bit 3 is the sign, bits 2..1 the exponent, bit 0 the mantissa.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A scale tensor as float32: ue8m0 (float8_e8m0fnu, or raw uint8 exponents) or any float dtype."""
    if scale.dtype == torch.uint8:  # raw biased exponents
        return torch.exp2(scale.to(torch.float32) - 127.0)
    return scale.to(torch.float32)


def float_to_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Positive power-of-two float32 scales as float8_e8m0fnu (exact for powers of two)."""
    exponent = torch.log2(scale.to(torch.float32)).round().clamp(-127, 127)
    return (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    # smallest power of two >= x (x > 0); ue8m0 can only hold powers of two
    return torch.exp2(torch.ceil(torch.log2(x)))


def fp8_grid_shape(shape: tuple[int, int], block: tuple[int, int] = FP8_BLOCK) -> tuple[int, int]:
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def dequant_fp8_block(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = FP8_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """`weight [O, I]` (float8) times its per-block `scale [ceil(O/bo), ceil(I/bi)]` grid."""
    rows, cols = weight.shape
    if tuple(scale.shape) != fp8_grid_shape((rows, cols), block):
        raise ValueError(
            f"fp8 scale grid {tuple(scale.shape)} does not match weight {(rows, cols)} with block {block}; "
            f"expected {fp8_grid_shape((rows, cols), block)}"
        )
    s = scale_to_float(scale)
    s = s.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return (weight.to(torch.float32) * s).to(dtype)


def quant_fp8_block(
    weight: torch.Tensor, block: tuple[int, int] = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `dequant_fp8_block`: float8_e4m3fn weight and a ue8m0 scale grid (power of two per block)."""
    rows, cols = weight.shape
    grid = fp8_grid_shape((rows, cols), block)
    w = weight.detach().to(torch.float32)
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:rows, :cols] = w
    amax = padded.view(grid[0], block[0], grid[1], block[1]).abs().amax(dim=(1, 3))
    scale = _pow2_ceil(amax.clamp(min=1e-30) / FP8_MAX)
    full = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, float_to_ue8m0(scale)


def _byte_table() -> torch.Tensor:
    # byte -> its (low nibble, high nibble) values: one gather per byte instead of two plus a stack
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = torch.arange(256)
    return torch.stack((table[codes & 0xF], table[codes >> 4]), dim=-1)


_BYTE_TABLE = _byte_table()
# midpoints between consecutive e2m1 magnitudes; a tie goes to the smaller magnitude
_E2M1_EDGES = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """`[..., N]` bytes holding two e2m1 codes each -> float32 `[..., 2N]` (low nibble first)."""
    fp4_x2 = getattr(torch, "float4_e2m1fn_x2", None)
    if fp4_x2 is not None and packed.dtype == fp4_x2:
        packed = packed.view(torch.uint8)
    if packed.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"packed fp4 weights must be int8/uint8, got {packed.dtype}")
    codes = packed.contiguous().view(torch.uint8).flatten().to(torch.int64)
    return _BYTE_TABLE.index_select(0, codes).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes `[..., 2N]` (0..15) -> int8 `[..., N]`, element 2j in the low nibble."""
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def dequant_fp4(
    packed: torch.Tensor, scale: torch.Tensor, group: int = FP4_GROUP, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Packed e2m1 `[O, I/2]` times its per-group ue8m0 `scale [O, I/group]`."""
    values = unpack_fp4(packed)
    rows, cols = values.shape
    if cols % group or tuple(scale.shape) != (rows, cols // group):
        raise ValueError(
            f"fp4 scale {tuple(scale.shape)} does not match weight {(rows, cols)} with group {group}; "
            f"expected {(rows, cols // group)}"
        )
    grouped = values.view(rows, cols // group, group) * scale_to_float(scale).unsqueeze(-1)
    return grouped.view(rows, cols).to(dtype)


def quant_fp4(weight: torch.Tensor, group: int = FP4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `dequant_fp4`: nearest e2m1 code per element, power-of-two scale per group."""
    rows, cols = weight.shape
    if cols % group:
        raise ValueError(f"fp4 needs the input dim ({cols}) to be a multiple of {group}")
    w = weight.detach().to(torch.float32).view(rows, cols // group, group)
    scale = _pow2_ceil(w.abs().amax(dim=-1).clamp(min=1e-30) / FP4_MAX)
    scaled = (w / scale.unsqueeze(-1)).reshape(rows, cols)
    absolute = scaled.abs()
    magnitude = torch.zeros(absolute.shape, dtype=torch.int64)
    for edge in _E2M1_EDGES.tolist():  # code of the nearest magnitude = number of midpoints below
        magnitude += absolute > edge
    codes = magnitude | ((scaled < 0).to(torch.int64) << 3)
    return pack_fp4(codes), float_to_ue8m0(scale)


def w8a8_scale_rows(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A W8A8 per-channel scale (`[O, 1]` as released, or `[O]`) as float32 `[O]`."""
    if tuple(scale.shape) not in ((rows, 1), (rows,)):
        raise ValueError(f"w8a8 scale {tuple(scale.shape)} does not match {rows} output channels")
    return scale.reshape(rows).to(torch.float32)


def check_w8a8_offset(offset: torch.Tensor | None, rows: int) -> None:
    """A W8A8 zero point must be zero (or absent): the release is symmetric, and npu_quant_matmul
    takes no weight zero point with per-token activations."""
    if offset is not None and bool(w8a8_scale_rows(offset, rows).ne(0).any()):
        raise ValueError("w8a8 weight_offset is not zero: asymmetric int8 weights are not supported")


def dequant_w8a8(
    weight: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """int8 `weight [O, I]` times its per-output-channel `scale` (`[O, 1]` or `[O]`); offset: see
    `check_w8a8_offset`."""
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError(f"w8a8 weights are 2-D int8, got {weight.dtype} {tuple(weight.shape)}")
    check_w8a8_offset(offset, weight.shape[0])
    s = w8a8_scale_rows(scale, weight.shape[0])
    return (weight.to(torch.float32) * s.unsqueeze(1)).to(dtype)


def quant_w8a8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `dequant_w8a8`: symmetric per-row int8, scale = rowmax|w| / 127 (float32 `[O, 1]`),
    round half to even; and the zero offsets the release stores beside them."""
    w = weight.detach().to(torch.float32)
    scale = (w.abs().amax(dim=1, keepdim=True) / INT8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale, torch.zeros_like(scale)


def grouped_matmul_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A per-channel W8A8 scale as npu_grouped_matmul takes it beside per-token scales on A2/A3, for a
    `dtype` output: bfloat16 for bfloat16, float32 for float16 (its only two pairings, unlike
    npu_quant_matmul's); float32 for any other (host) dtype. The host forms round it alike."""
    return scale.to(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)


def store_grouped_scales(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Round, once at load, the W8A8 scales an npu_grouped_matmul reads (each module's
    `grouped_int8_scales` buffers, where its weights stayed int8) as `grouped_matmul_scale` gives them
    for a `dtype` model, so no step casts them again (the same values: the forms cast to what they
    already are)."""
    for module in model.modules():
        for name in getattr(module, "grouped_int8_scales", ()):
            scale = module._buffers.get(name)
            if scale is not None:
                module._buffers[name] = grouped_matmul_scale(scale, dtype)


def quant_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-token int8 of x `[..., K]`, npu_dynamic_quant's math: scale = rowmax|x| / 127
    (float32 `[...]`), q = round(x / scale) (half to even); an all-zero row gets scale 0 and zeros."""
    xf = x.to(torch.float32)
    scale = xf.abs().amax(dim=-1) / INT8_MAX
    q = torch.round(xf / scale.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1))
    return q.clamp(-INT8_MAX - 1, INT8_MAX).to(torch.int8), scale
