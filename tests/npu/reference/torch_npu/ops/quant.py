"""W8A8: npu_dynamic_quant (per-token int8) and npu_quant_matmul.

Sources (torch_npu 2.14.0 wheel, `_op_plugin_docs.py`; output shapes from
`op_plugin/meta/_meta_registrations.py`):
- npu_dynamic_quant: x float16 or bfloat16 (float32 is rejected), more than 1 dim; smooth_scales
  1-D with x's last dim and x's dtype (2-D [G, H] with group_index, int32, increasing, last value =
  number of rows); dst_type None means int8 (the reference models int8 only: quint4x2 and fp8
  outputs are rejected); scale = rowmax(|x * smooth|) / 127, y = round(x * smooth / scale); scale is
  float32 with x's shape minus the last dim. Rounding: torch.round (half to even), as CANN's Round.
- npu_quant_matmul: x1, x2 int8 (int32 packs int4: A4W4 both int32, A8W4 an int32 x2; not
  modelled), 2-6 dims, same dtype, not empty; each either contiguous or the transpose of a contiguous
  tensor's last two dims (the weight [n, k] passed as `.t()`: the op's transposed layout), other
  strides unsupported; k of x1 = k of x2; scale float32, int64 (from npu_trans_quant_param: not
  modelled) or bfloat16, 1-D of 1 or n; offset float32 1-D (int8 output only); pertoken_scale float32
  1-D of m; bias int32, bfloat16, float16, float32; output_dtype None (int8), int8, float16,
  bfloat16, int32; x1/x2 last dims at most 65535.
  Combinations (A2/A3): a bfloat16 scale needs a bfloat16 or int32 output; with pertoken_scale the
  output is float16 or bfloat16, and float16 needs a float32 scale; an int32 output takes an int32
  bias only. A float32 scale without pertoken_scale and an int8/float16 output is converted by
  torch_npu (npu_trans_quant_param) before aclnn, so it is accepted here too.
  y = x1 @ x2 (int32 accumulate) * scale * pertoken_scale[:, None] + bias (+ offset when int8).
  A3 has no fp8 matmul: W8A8 is int8 on Ascend. No k alignment applies to int8 in ND layout (k
  multiples exist only for int4 packing, fp8/fp4, and x2 cast to the NZ format).
- Sources beyond the wheel: hicann/ops-nn `matmul/quant_batch_matmul_v3/docs/aclnnQuantMatmulV4.md`
  (layouts, dtype table) and `op_host/op_api/aclnn_quant_matmul_v4.cpp` (CheckDtypeValidOnOnlyL0c2out,
  CheckEmptyTensor, TensorContiguousProcess); op-plugin's `QuantMatmulKernelNpuOpApi.cpp`
  (use_trans_quant_param).
"""

from __future__ import annotations

import torch

from ._registry import DTYPE_ENUM, check, dtype_in, op

DOC = "torch_npu 2.14.0 _op_plugin_docs.py"
ACLNN = "ops-nn aclnnQuantMatmulV4.md / aclnn_quant_matmul_v4.cpp"
HALFS = (torch.float16, torch.bfloat16)


@op(
    "npu_dynamic_quant(Tensor input, *, Tensor? smooth_scales=None, Tensor? group_index=None, "
    'int? dst_type=None, str quant_mode="pertoken", float dst_type_max=0.0) -> (Tensor, Tensor)'
)
def npu_dynamic_quant(
    input: torch.Tensor,
    *,
    smooth_scales: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
    dst_type: int | None = None,
    quant_mode: str = "pertoken",
    dst_type_max: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-token int8: y = round(x * smooth / scale), scale = rowmax(|x * smooth|) / 127."""
    name = "npu_dynamic_quant"
    dtype_in(name, "input", input, HALFS, DOC)
    check(input.dim() > 1, name, f"input must have more than 1 dim, got {input.dim()}", DOC)
    check(
        dst_type in (None, 1), name, f"dst_type {dst_type} is not int8 (1): only int8 output is modelled", DOC
    )
    check(quant_mode == "pertoken", name, f"quant_mode {quant_mode!r}: only 'pertoken' is modelled", DOC)
    x = input.float()
    if smooth_scales is not None:
        check(smooth_scales.dtype == input.dtype, name, "smooth_scales must have input's dtype", DOC)
        if group_index is None:
            check(
                smooth_scales.dim() == 1 and smooth_scales.shape[0] == input.shape[-1],
                name,
                f"smooth_scales must be 1-D of {input.shape[-1]}, got {tuple(smooth_scales.shape)}",
                DOC,
            )
            x = x * smooth_scales.float()
        else:
            dtype_in(name, "group_index", group_index, (torch.int32,), DOC)
            rows = x.reshape(-1, x.shape[-1])
            ends = group_index.long()
            check(
                smooth_scales.dim() == 2 and smooth_scales.shape == (ends.numel(), input.shape[-1]),
                name,
                "with group_index, smooth_scales must be [len(group_index), H]",
                DOC,
            )
            check(
                bool((ends[1:] >= ends[:-1]).all()) and int(ends[-1]) == rows.shape[0],
                name,
                "group_index must increase and end at the number of rows",
                DOC,
            )
            group = torch.bucketize(torch.arange(rows.shape[0]), ends, right=True)  # row -> its group
            x = (rows * smooth_scales.float()[group]).reshape(x.shape)
    scale = x.abs().amax(dim=-1) / 127.0
    y = torch.round(x / scale.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)).clamp(-128, 127)
    return y.to(torch.int8), scale


def _dtype(output_dtype: int | None) -> torch.dtype:
    return torch.int8 if output_dtype is None else DTYPE_ENUM.get(output_dtype, torch.uint8)


@op(
    "npu_quant_matmul(Tensor x1, Tensor x2, Tensor scale, *, Tensor? offset=None, Tensor? pertoken_scale=None, "
    "Tensor? bias=None, int? output_dtype=None, int? x1_dtype=None, int? x2_dtype=None, "
    "int? pertoken_scale_dtype=None, int? scale_dtype=None, int[]? group_sizes=None, Tensor? y_scale=None) -> Tensor"
)
def npu_quant_matmul(
    x1: torch.Tensor,
    x2: torch.Tensor,
    scale: torch.Tensor,
    *,
    offset: torch.Tensor | None = None,
    pertoken_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    output_dtype: int | None = None,
    **unmodelled: object,
) -> torch.Tensor:
    """y = (x1 @ x2) * scale [* pertoken_scale] [+ bias], int32 accumulation, cast to output_dtype."""
    name = "npu_quant_matmul"
    check(
        all(v is None for v in unmodelled.values()),
        name,
        f"{sorted(k for k, v in unmodelled.items() if v is not None)} are not modelled",
        DOC,
    )
    dtype_in(name, "x1", x1, (torch.int8,), DOC + " (int32 packs int4, A4W4: not modelled)")
    check(
        x2.dtype == x1.dtype,
        name,
        f"x2 dtype {x2.dtype} must equal x1's {x1.dtype} (an int32 x2 packs int4, A8W4: not modelled)",
        DOC,
    )
    for arg, t in (("x1", x1), ("x2", x2)):
        check(2 <= t.dim() <= 6, name, f"{arg} must have 2-6 dims, got {t.dim()}", DOC)
        check(t.numel() > 0, name, f"{arg} is empty: empty tensors are not supported", ACLNN)
        check(
            t.is_contiguous() or _transposed_last_two(t),
            name,
            f"{arg} must be contiguous or the transpose of a contiguous tensor's last two dims "
            f"(strides {t.stride()} for shape {tuple(t.shape)})",
            ACLNN,
        )
        check(t.shape[-1] <= 65535, name, f"{arg}'s last dim {t.shape[-1]} exceeds 65535", DOC)
    m, k, n = x1.shape[-2], x1.shape[-1], x2.shape[-1]
    check(
        x2.shape[-2] == k,
        name,
        f"k of x1 [.., {m}, {k}] and x2 [.., {x2.shape[-2]}, {n}] differ (x2 is the weight [k, n]: "
        "a stored [n, k] goes as its .t())",
        DOC,
    )
    dtype_in(
        name,
        "scale",
        scale,
        (torch.float32, torch.bfloat16),
        DOC + " (int64 scales from npu_trans_quant_param: not modelled)",
    )
    check(scale.dim() == 1 and scale.shape[0] in (1, n), name, f"scale must be 1-D of 1 or n={n}", DOC)
    out = _dtype(output_dtype)
    check(
        out in (torch.int8, torch.float16, torch.bfloat16, torch.int32),
        name,
        f"output_dtype {out} unsupported",
        DOC,
    )
    _check_combination(scale, offset, pertoken_scale, bias, out)
    y = (x1.int() @ x2.int()).double() * scale.double()
    if pertoken_scale is not None:
        dtype_in(name, "pertoken_scale", pertoken_scale, (torch.float32,), DOC)
        check(pertoken_scale.shape == (m,), name, f"pertoken_scale must be 1-D of m={m}", DOC)
        y = y * pertoken_scale.double().unsqueeze(-1)
    if offset is not None:
        dtype_in(name, "offset", offset, (torch.float32,), DOC)
        y = y + offset.double()
    if bias is not None:
        dtype_in(name, "bias", bias, (torch.int32, torch.bfloat16, torch.float16, torch.float32), DOC)
        check(bias.shape[-1] == n, name, f"bias's last dim must be n={n}", DOC)
        y = y + bias.double()
    if out in (torch.int8, torch.int32):
        info = torch.iinfo(out)
        y = torch.round(y).clamp(info.min, info.max)
    return y.to(out)


def _transposed_last_two(t: torch.Tensor) -> bool:
    """torch_npu's is_transpose_last_two_dims: t is `.transpose(-1, -2)` of a contiguous tensor (what
    the op reads as transposeX2 without a copy)."""
    if t.dim() < 2 or t.stride(-2) != 1 or t.stride(-1) != t.shape[-2]:
        return False
    span = t.shape[-1] * t.shape[-2]
    for d in range(t.dim() - 3, -1, -1):
        if t.stride(d) != span:
            return False
        span *= t.shape[d]
    return not (t.shape[-1] == 1 and t.shape[-2] == 1)


def _check_combination(
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    pertoken: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.dtype,
) -> None:
    """The A2/A3 dtype combinations aclnn accepts (CheckDtypeValidOnOnlyL0c2out), as torch_npu calls it."""
    name = "npu_quant_matmul"
    if scale.dtype == torch.bfloat16:
        check(
            out in (torch.bfloat16, torch.int32),
            name,
            f"a bfloat16 scale needs a bfloat16 or int32 output, not {out}",
            ACLNN,
        )
    if pertoken is not None:
        check(
            out in (torch.float16, torch.bfloat16),
            name,
            f"with pertoken_scale the output is float16 or bfloat16, not {out}",
            ACLNN,
        )
        if out == torch.float16:
            check(
                scale.dtype == torch.float32,
                name,
                f"a float16 output with pertoken_scale needs a float32 scale, not {scale.dtype}",
                ACLNN,
            )
    if offset is not None:
        check(out == torch.int8, name, f"offset exists only with an int8 output, not {out}", ACLNN)
    if out == torch.int32 and bias is not None:
        check(
            bias.dtype == torch.int32, name, f"an int32 output takes an int32 bias, not {bias.dtype}", ACLNN
        )


def quant_matmul(
    x1: torch.Tensor,
    x2: torch.Tensor,
    scale: torch.Tensor,
    *,
    output_dtype: torch.dtype | int | None = None,
    **kw: object,
) -> torch.Tensor:
    """torch_npu's Python entry accepts a torch.dtype for `output_dtype` (the schema carries its enum)."""
    if isinstance(output_dtype, torch.dtype):
        from ._registry import ENUM_OF

        output_dtype = ENUM_OF[output_dtype]
    return torch.ops.npu.npu_quant_matmul(x1, x2, scale, output_dtype=output_dtype, **kw)
