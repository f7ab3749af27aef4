"""RMSNorm, SwiGLU and the two RoPE ops.

Sources (torch_npu 2.14.0 wheel unless noted):
- npu_rms_norm: `_op_plugin_docs.py` ("self: float16, bfloat16, float32, 2-8 dims; gamma: dtype must
  equal self's"); outputs from `op_plugin/meta/_meta_registrations.py` (rstd float32, shape
  self.shape[:-gamma.dim()] + [1] * gamma.dim()).
- npu_swiglu: `_op_plugin_docs.py` (swish(A) * B, A and B the halves of x along `dim`; 1-8 dims;
  float32, float16, bfloat16); output shape from the meta (size along dim halved).
- npu_rotary_mul: `_op_plugin_docs.py` (formulas for 'half' and 'interleave'; input, r1, r2 4-D;
  float16, bfloat16, float32; D even and < 896; in 'interleave' mode r1/r2 broadcast over B and N:
  11SD for BNSD, 1S1D for BSND, S11D for SBND).
- npu_interleave_rope: not in the wheel's docstrings (schema in
  `csrc/aten/npu_native_functions_by_codegen.yaml`); rules from the op's page in Ascend/op-plugin
  (`docs/.../torch_npu-npu_interleave_rope.md`: x 4-D [B, N, S, D], bfloat16 or float16,
  contiguous; cos/sin [B, 1, S or 1, D] with x's dtype; D must be 64) and the formula from the
  kernel, ops-transformer `posembedding/interleave_rope/op_kernel/interleave_rope_b1sd.h`: the
  pairs (x[2i], x[2i+1]) are split into real = x[0::2] and imag = x[1::2], computed in float32,
  and written *de-interleaved*: y[:32] = real*cos[:32] - imag*sin[:32], y[32:] = imag*cos[32:] +
  real*sin[32:]. So cos/sin are in the half layout [c0..c31, c0..c31] and the output's rope dims
  come out in the half layout: a caller keeping the interleaved layout must permute back.
"""

from __future__ import annotations

import torch

from ._registry import check, contiguous, dtype_in, op

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
HALFS = (torch.float16, torch.bfloat16)
DOC = "torch_npu 2.14.0 _op_plugin_docs.py"


@op("npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)")
def npu_rms_norm(
    self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """y = x / sqrt(mean(x^2 over gamma's dims) + eps) * gamma, computed in float32; and rstd."""
    name = "npu_rms_norm"
    dtype_in(name, "self", self, FLOATS, DOC)
    check(
        gamma.dtype == self.dtype, name, f"gamma dtype {gamma.dtype} must equal self dtype {self.dtype}", DOC
    )
    check(2 <= self.dim() <= 8, name, f"self must have 2-8 dims, got {self.dim()}", DOC)
    check(
        0 < gamma.dim() <= self.dim() and tuple(self.shape[-gamma.dim() :]) == tuple(gamma.shape),
        name,
        f"gamma shape {tuple(gamma.shape)} must equal self's trailing dims {tuple(self.shape)}",
        DOC,
    )
    dims = tuple(range(self.dim() - gamma.dim(), self.dim()))
    x = self.float()
    rstd = torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return (x * rstd * gamma.float()).to(self.dtype), rstd


@op("npu_swiglu(Tensor self, int dim=-1) -> Tensor")
def npu_swiglu(self: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """swish(A) * B where A, B = x.chunk(2, dim) (A first), in float32."""
    name = "npu_swiglu"
    dtype_in(name, "self", self, FLOATS, DOC)
    check(1 <= self.dim() <= 8, name, f"self must have 1-8 dims, got {self.dim()}", DOC)
    check(
        self.shape[dim] % 2 == 0, name, f"self's size along dim {dim} ({self.shape[dim]}) must be even", DOC
    )
    a, b = self.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(a) * b).to(self.dtype)


@op(
    "npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half', Tensor? rotate=None) -> Tensor"
)
def npu_rotary_mul(
    self: torch.Tensor,
    r1: torch.Tensor,
    r2: torch.Tensor,
    rotary_mode: str = "half",
    rotate: torch.Tensor | None = None,
) -> torch.Tensor:
    """out = r1 * x + r2 * x_new; x_new rotates halves ('half') or pairs ('interleave'), or x @ rotate."""
    name = "npu_rotary_mul"
    check(
        rotary_mode in ("half", "interleave"),
        name,
        f"rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}",
        DOC,
    )
    for arg, t in (("input", self), ("r1", r1), ("r2", r2)):
        dtype_in(name, arg, t, FLOATS, DOC)
        check(t.dim() == 4, name, f"{arg} must be 4-D, got {t.dim()}-D", DOC)
    check(r1.dtype == self.dtype and r2.dtype == self.dtype, name, "r1 and r2 must have input's dtype", DOC)
    d = self.shape[-1]
    check(d % 2 == 0 and d < 896, name, f"the last dim D={d} must be even and < 896", DOC)
    check(
        r1.shape == r2.shape, name, f"r1 {tuple(r1.shape)} and r2 {tuple(r2.shape)} must have one shape", DOC
    )
    check(r1.shape[-1] == d, name, f"r1's last dim {r1.shape[-1]} must equal D={d}", DOC)
    if rotary_mode == "interleave":
        # 11SD / 1S1D / S11D: one table per position, broadcast over batch and heads.
        ones = sum(1 for n in r1.shape[:3] if n == 1)
        check(
            ones >= 2,
            name,
            f"in interleave mode r1/r2 must broadcast over B and N (11SD, 1S1D or S11D), got {tuple(r1.shape)}",
            DOC,
        )
    try:
        torch.broadcast_shapes(self.shape, r1.shape)
    except RuntimeError:
        check(False, name, f"r1 {tuple(r1.shape)} does not broadcast to input {tuple(self.shape)}", DOC)
    x = self.float()
    if rotate is not None:
        dtype_in(name, "rotate", rotate, FLOATS, DOC)
        check(rotate.shape == (d, d), name, f"rotate must be [{d}, {d}], got {tuple(rotate.shape)}", DOC)
        x_new = x @ rotate.float()
    elif rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        x_new = torch.cat((-x2, x1), dim=-1)
    else:
        x_new = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return (r1.float() * x + r2.float() * x_new).to(self.dtype)


INTERLEAVE_DOC = "Ascend/op-plugin torch_npu-npu_interleave_rope.md; ops-transformer interleave_rope_b1sd.h"


@op("npu_interleave_rope(Tensor x, Tensor cos, Tensor sin) -> Tensor")
def npu_interleave_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs, output de-interleaved (see the module docstring)."""
    name = "npu_interleave_rope"
    dtype_in(name, "x", x, HALFS, INTERLEAVE_DOC)
    for arg, t in (("x", x), ("cos", cos), ("sin", sin)):
        check(t.dim() == 4, name, f"{arg} must be 4-D [B, N, S, D], got {t.dim()}-D", INTERLEAVE_DOC)
        check(t.shape[-1] == 64, name, f"{arg}'s D must be 64, got {t.shape[-1]}", INTERLEAVE_DOC)
        contiguous(name, arg, t, INTERLEAVE_DOC)
    check(
        cos.dtype == x.dtype and sin.dtype == x.dtype, name, "cos and sin must have x's dtype", INTERLEAVE_DOC
    )
    check(cos.shape == sin.shape, name, "sin must have cos's shape", INTERLEAVE_DOC)
    check(cos.shape[1] == 1, name, f"cos/sin's N must be 1, got {cos.shape[1]}", INTERLEAVE_DOC)
    check(
        cos.shape[0] == x.shape[0],
        name,
        f"cos/sin's B {cos.shape[0]} must equal x's {x.shape[0]}",
        INTERLEAVE_DOC,
    )
    check(
        cos.shape[2] in (1, x.shape[2]),
        name,
        f"cos/sin's S must be 1 or x's S ({x.shape[2]})",
        INTERLEAVE_DOC,
    )
    xf, c, s = x.float(), cos.float(), sin.float()
    real, imag = xf[..., 0::2], xf[..., 1::2]
    out = torch.cat(
        (real * c[..., :32] - imag * s[..., :32], imag * c[..., 32:] + real * s[..., 32:]), dim=-1
    )
    return out.to(x.dtype)
