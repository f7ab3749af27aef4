"""npu_fusion_attention: dense "Transformer Attention Score" (FlashAttentionScore), the op HF
transformers' Ascend integration imports (`transformers/integrations/npu_flash_attention.py` does
`from torch_npu import npu_fusion_attention` whenever torch_npu is importable, and calls it for
flash_attention_2 on NPU: BSND, or TND with cumulative `actual_seq_qlen`/`actual_seq_kvlen`, the
causal case as the compressed 2048x2048 mask with sparse_mode 2 or 3). The engine itself never calls
it; it is here so that import succeeds and, if a model is ever run through it, computes what the op
documents.

Sources (torch_npu 2.14.0 wheel): the schema from `csrc/aten/npu_native_functions_by_codegen.yaml`;
semantics and rules from `_op_plugin_docs.py` (y = Softmax(Mask(scale * q k^T, atten_mask)) v, mask
True = masked; layouts BSH, SBH, BSND, BNSD, TND; fp16/bf16/fp32 with q, k, v of one dtype; Nq a
multiple of Nkv, Nq <= 256; Dq = Dk >= Dv, D <= 768; atten_mask bool/uint8 of BNSS, B1SS, 11SS or SS
shape; sparse_mode 0 defaultMask, 1 allMask, 2 leftUpCausal (j > i masked), 3 rightDownCausal
(j > i + Skv - Sq masked), modes 2-4 with the compressed 2048x2048 mask; no atten_mask: full
attention whatever sparse_mode says; padding_mask unsupported; keep_prob in (0, 1]; "does not support
graph mode or aclgraph"); output shapes from `op_plugin/meta/_meta_registrations.py` (attention_out in
the input layout with Dv; softmax_max/softmax_sum fp32 [B, N, Sq, 8], and [T, N, 8] for TND, the
meta's, though the docstring calls TND's default layout NTD; softmax_out empty; seed, offset, numels
0 without dropout).

Modelled: sparse_mode 0-3 (0/1 with a full mask, not in varlen), no mask; a row with every key
masked outputs zeros here (the doc's "invalid row", which the device computes specially with
inner_precise 2 or on its own; what it writes there is not documented). Not modelled, refused as such: dropout
(keep_prob < 1), pse, sink, prefix, dropout_mask, sparse_mode 4-8, pre/next_tockens windows.
"""

from __future__ import annotations

import itertools

import torch

from ._registry import check, dtype_in, op

DOC = "torch_npu 2.14.0 _op_plugin_docs.py npu_fusion_attention + meta"
NOT_MODELLED = "not modelled by the reference"
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
_MAX32 = 2147483647
_COMPRESSED = (2048, 2048)


def _heads(t: torch.Tensor, layout: str) -> int:
    """N of a BSND, BNSD or TND tensor."""
    return t.shape[1] if layout == "BNSD" else t.shape[-2]


def _to_bnsd(t: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    """[B, N, S, D] of a BSH, SBH, BSND or BNSD tensor."""
    if layout == "BSH":
        return t.reshape(t.shape[0], t.shape[1], heads, -1).permute(0, 2, 1, 3)
    if layout == "SBH":
        return t.reshape(t.shape[0], t.shape[1], heads, -1).permute(1, 2, 0, 3)
    return t.permute(0, 2, 1, 3) if layout == "BSND" else t


def _from_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BSH":
        return t.permute(0, 2, 1, 3).flatten(2)
    if layout == "SBH":
        return t.permute(2, 0, 1, 3).flatten(2)
    return t.permute(0, 2, 1, 3) if layout == "BSND" else t


def _causal(sq: int, skv: int, sparse_mode: int) -> torch.Tensor:
    """True where masked: leftUpCausal (2) j > i, rightDownCausal (3) j > i + skv - sq."""
    shift = 0 if sparse_mode == 2 else skv - sq
    return torch.arange(skv)[None, :] > torch.arange(sq)[:, None] + shift


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, masked: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [..., Nq, Sq, D], k/v [..., Nkv, Skv, D(v)] in fp32: (out, row max, row sum of exp)."""
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    s = scale * (q @ k.transpose(-1, -2))
    if masked is not None:
        s = s.masked_fill(masked, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    live = torch.isfinite(m)  # a row with every key masked is an "invalid row": zeros
    e = torch.exp(s - torch.where(live, m, 0.0))
    total = e.sum(dim=-1, keepdim=True)
    out = torch.where(live, e / total.clamp(min=torch.finfo(torch.float32).tiny), 0.0) @ v
    return out, m.squeeze(-1), total.squeeze(-1)


def _mask(
    name: str,
    atten_mask: torch.Tensor | None,
    sparse_mode: int,
    shape: tuple[int, int, int, int],
    varlen: bool,
) -> torch.Tensor | None:
    """The [B or 1, N or 1, Sq, Skv] boolean mask (True = masked), or None for full attention."""
    if atten_mask is None:
        return None  # the doc: without atten_mask, sparse_mode and the windows have no effect
    dtype_in(name, "atten_mask", atten_mask, (torch.bool, torch.uint8), DOC)
    b, n, sq, skv = shape
    if sparse_mode in (2, 3):
        check(tuple(atten_mask.shape) == _COMPRESSED, name,
              f"sparse_mode {sparse_mode} takes the compressed 2048x2048 mask, got {tuple(atten_mask.shape)}", DOC)  # fmt: skip
        check(torch.equal(atten_mask.bool(), torch.ones(_COMPRESSED, dtype=torch.bool).triu(1)), name,
              "the compressed mask must be triu(ones(2048, 2048), 1) (another gives wrong results on the "
              f"device, which the reference does not reproduce) [{NOT_MODELLED}]", DOC)  # fmt: skip
        return _causal(sq, skv, sparse_mode)[None, None]
    check(
        not varlen, name, f"sparse_mode {sparse_mode} with an SS mask in varlen (TND) is {NOT_MODELLED}", DOC
    )
    allowed = {(b, n, sq, skv), (b, 1, sq, skv), (1, 1, sq, skv), (sq, skv)}
    check(tuple(atten_mask.shape) in allowed, name,
          f"atten_mask {tuple(atten_mask.shape)} must be BNSS, B1SS, 11SS or SS for [B, N, Sq, Skv] = {list(shape)}",
          DOC)  # fmt: skip
    return atten_mask.bool()  # broadcasts over [B, N, Sq, Skv]


def _segments(name: str, ends: list[int] | None, rows: int, what: str) -> list[tuple[int, int]]:
    """(start, length) per batch from cumulative lengths; trailing zeros mark batches not computed."""
    check(ends is not None, name, f"TND needs {what} (cumulative lengths)", DOC)
    assert ends is not None
    used = list(ends)
    while len(used) > 1 and used[-1] == 0:
        used.pop()
    check(bool(used) and all(e >= 0 for e in used) and all(b >= a for a, b in itertools.pairwise(used)), name,
          f"{what} must be a non-decreasing prefix sum (trailing zeros allowed), got {ends}", DOC)  # fmt: skip
    check(used[-1] <= rows, name, f"{what} ends at {used[-1]} > T={rows}", DOC)
    return [(a, b - a) for a, b in zip([0, *used[:-1]], used, strict=True)]


@op(
    "npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, Tensor? pse=None, "
    "Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., float keep_prob=1., "
    "int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, int[]? prefix=None, "
    "int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, "
    'bool sync=False, str softmax_layout="", Tensor? sink=None, Tensor? dropout_mask=None, int seed=0, '
    "int offset=0) -> (Tensor, Tensor, Tensor, Tensor, int, int, int)",
    capturable=False,
)
def npu_fusion_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = _MAX32,
    next_tockens: int = _MAX32,
    inner_precise: int = 0,
    prefix: list[int] | None = None,
    actual_seq_qlen: list[int] | None = None,
    actual_seq_kvlen: list[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    seed: int = 0,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels); see the module
    docstring."""
    name = "npu_fusion_attention"
    check(
        input_layout in LAYOUTS,
        name,
        f"input_layout must be one of {', '.join(LAYOUTS)}, got {input_layout!r}",
        DOC,
    )
    check(padding_mask is None, name, "padding_mask is not supported yet", DOC)
    check(0 < keep_prob <= 1, name, f"keep_prob must lie in (0, 1], got {keep_prob}", DOC)
    check(keep_prob == 1, name, f"dropout (keep_prob < 1) is {NOT_MODELLED}", DOC)
    for arg, given in (("pse", pse), ("sink", sink), ("prefix", prefix), ("dropout_mask", dropout_mask)):
        check(given is None, name, f"{arg} is {NOT_MODELLED}", DOC)
    check(0 <= sparse_mode <= 8, name, f"sparse_mode must be 0-8, got {sparse_mode}", DOC)
    check(sparse_mode <= 3, name, f"sparse_mode {sparse_mode} is {NOT_MODELLED}", DOC)
    check(atten_mask is None or sparse_mode != 0 or (pre_tockens == _MAX32 and next_tockens == _MAX32), name,
          f"pre_tockens/next_tockens windows are {NOT_MODELLED}", DOC)  # fmt: skip
    check(
        softmax_layout in ("", "TND"),
        name,
        f"softmax_layout must be '' or 'TND', got {softmax_layout!r}",
        DOC,
    )
    check(
        softmax_layout == "" or input_layout == "TND",
        name,
        "softmax_layout 'TND' needs input_layout TND",
        DOC,
    )
    dims = 3 if input_layout in ("BSH", "SBH", "TND") else 4
    for arg, t in (("query", query), ("key", key), ("value", value)):
        dtype_in(name, arg, t, FLOATS, DOC)
        check(t.dim() == dims, name, f"{input_layout} {arg} must be {dims}-D, got {t.dim()}-D", DOC)
        check(t.numel() > 0, name, f"{arg} must not be empty", DOC)
    check(
        key.dtype == query.dtype and value.dtype == query.dtype,
        name,
        "query, key and value must share a dtype",
        DOC,
    )
    check(1 <= head_num <= 256, name, f"head_num (Nq) must lie in 1-256, got {head_num}", DOC)
    if input_layout in ("BSH", "SBH"):
        check(
            query.shape[-1] % head_num == 0,
            name,
            f"query H={query.shape[-1]} is not a multiple of head_num",
            DOC,
        )
        d = query.shape[-1] // head_num
        check(key.shape[-1] % d == 0, name, f"key H={key.shape[-1]} is not a multiple of D={d}", DOC)
        n_kv = key.shape[-1] // d
        check(
            value.shape[-1] % n_kv == 0,
            name,
            f"value H={value.shape[-1]} is not a multiple of Nkv={n_kv}",
            DOC,
        )
        d_v = value.shape[-1] // n_kv
    else:
        n_q = _heads(query, input_layout)
        check(n_q == head_num, name, f"query has {n_q} heads, head_num is {head_num}", DOC)
        n_kv, d, d_v = _heads(key, input_layout), query.shape[-1], value.shape[-1]
        check(key.shape[-1] == d, name, f"Dk={key.shape[-1]} must equal Dq={d}", DOC)
        check(_heads(value, input_layout) == n_kv, name, "key and value must have the same heads", DOC)
    check(n_kv > 0 and head_num % n_kv == 0, name, f"Nq={head_num} must be a multiple of Nkv={n_kv}", DOC)
    check(1 <= d <= 768 and d_v <= d, name, f"D must lie in 1-768 with Dv <= Dk, got D={d}, Dv={d_v}", DOC)
    check(key.shape[:-1] == value.shape[:-1] if input_layout not in ("BSH", "SBH") else key.shape[:2] == value.shape[:2],
          name, "key and value must have one shape but for their head dim", DOC)  # fmt: skip
    if input_layout == "TND":
        return _varlen(query, key, value, head_num, n_kv, d_v, atten_mask, scale, sparse_mode,
                       actual_seq_qlen, actual_seq_kvlen)  # fmt: skip
    check(actual_seq_qlen is None and actual_seq_kvlen is None, name,
          f"actual_seq_qlen/actual_seq_kvlen outside TND are {NOT_MODELLED}", DOC)  # fmt: skip
    q = _to_bnsd(query, input_layout, head_num).float()
    k = _to_bnsd(key, input_layout, n_kv).float()
    v = _to_bnsd(value, input_layout, n_kv).float()
    check(q.shape[0] == k.shape[0], name, f"batch sizes differ: query {q.shape[0]}, key {k.shape[0]}", DOC)
    masked = _mask(
        name, atten_mask, sparse_mode, (q.shape[0], head_num, q.shape[2], k.shape[2]), varlen=False
    )
    out, m, total = _attend(q, k, v, scale, masked)
    eight = (*m.shape, 8)
    return (
        _from_bnsd(out.to(query.dtype), input_layout).contiguous(),
        m.unsqueeze(-1).expand(eight).contiguous(),
        total.unsqueeze(-1).expand(eight).contiguous(),
        torch.empty(0, dtype=query.dtype),
        0,
        0,
        0,
    )


def _varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    heads: int,
    kv_heads: int,
    d_v: int,
    atten_mask: torch.Tensor | None,
    scale: float,
    sparse_mode: int,
    qlen: list[int] | None,
    kvlen: list[int] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """TND: each batch's query rows attend to its own key rows."""
    name = "npu_fusion_attention"
    q_spans = _segments(name, qlen, query.shape[0], "actual_seq_qlen")
    kv_spans = _segments(name, kvlen, key.shape[0], "actual_seq_kvlen")
    check(
        len(q_spans) == len(kv_spans),
        name,
        "actual_seq_qlen and actual_seq_kvlen name different batch counts",
        DOC,
    )
    check(len(q_spans) <= 1024, name, f"varlen takes at most 1024 batches, got {len(q_spans)}", DOC)
    tokens = query.shape[0]
    out = torch.zeros(tokens, heads, d_v)
    m = torch.full((tokens, heads), float("-inf"))
    total = torch.zeros(tokens, heads)
    for (qs, sq), (ks, skv) in zip(q_spans, kv_spans, strict=True):
        if sq == 0:
            continue
        q = query[qs : qs + sq].float().transpose(0, 1)  # [N, Sq, D]
        k = key[ks : ks + skv].float().transpose(0, 1)
        v = value[ks : ks + skv].float().transpose(0, 1)
        masked = _mask(name, atten_mask, sparse_mode, (1, heads, sq, skv), varlen=True)
        o, mx, tot = _attend(q, k, v, scale, masked[0] if masked is not None else None)
        out[qs : qs + sq], m[qs : qs + sq], total[qs : qs + sq] = o.transpose(0, 1), mx.T, tot.T
    eight = (tokens, heads, 8)
    return (
        out.to(query.dtype),
        m.unsqueeze(-1).expand(eight).contiguous(),
        total.unsqueeze(-1).expand(eight).contiguous(),
        torch.empty(0, dtype=query.dtype),
        0,
        0,
        0,
    )
