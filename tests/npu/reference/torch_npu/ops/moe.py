"""MoE: gating top-k, init routing v2, grouped matmul, finalize routing.

Sources:
- npu_moe_gating_top_k: torch_npu 2.14.0 `_op_plugin_docs.py` and meta; formula and limits from
  aclnnMoeGatingTopK.md / aclnnMoeGatingTopKV2.md (ops-transformer `moe/moe_gating_top_k/docs`) and
  the numpy reference in Ascend/pytorch `test/.../test_npu_moe_gating_top_k.py`: norm = softmax
  (norm_type 0) or sigmoid (1) of x; bias added for *selection only*; groups ranked by their max
  (group_select_mode 0) or top-2 sum (1), k_group kept; top-k over the kept experts (ties: lower
  index first, a stable sort); y = norm[idx], divided by (sum + eps) when norm_type is 1, times
  routed_scaling_factor. Limits: x 2-D float16/bfloat16/float32 (non-contiguous allowed) with at
  most 2048 experts; bias 1-D of E with x's dtype; renorm 0 only; 1 <= k_group <= group_count;
  E % group_count == 0 and E / group_count > 2; align32(E / group_count) * group_count <= 2048;
  1 <= k <= E / group_count * k_group. Hash mode (the V2 aclnn): input_ids (int32/int64 [N]) and
  tid2eid (int32/int64 [V, k]) together, idx = tid2eid[input_ids] (bias unused), k <= 64, input_ids
  within [0, V). DSV4 scores experts by sqrt(softplus(x)), which is neither norm_type: the
  ops-transformer master documents a norm_type 2 (SqrtSoftplus) and renorm 1 for softmax, which the
  torch_npu 2.14.0 docstring does not, so both stay refused here until an A3 node shows CANN 9.1.0
  takes them.
- npu_moe_init_routing_v2: `_op_plugin_docs.py`: x 2-D (float16, bfloat16, float32, int8),
  expert_idx int32 [N, K] with ids < expert_num (int64 only on the 950, aclnnMoeInitRoutingV2.md);
  drop_pad_mode 0 only; quant_mode -1 (modelled) or 1; expert_tokens_num_type 1 (count) or 2
  (key_value); expert_num in (0, 10240] ((0, 5120] for key_value); expert_tokens_num_flag True;
  active_expert_range [start, end) within expert_num. Rows are sorted by expert (stable), kept if
  their expert is in range; expanded_x[j] = x[src_j // K]; expanded_row_idx (row_idx_type 0, the
  gather form) maps each flattened (token, k) to its row in expanded_x, -1 if dropped; counts int64.
- npu_moe_finalize_routing: `_op_plugin_docs.py` formula: out[i] = skip1[i] + skip2[i] +
  sum_k scales[i, k] * (expanded[expanded_src_to_dst_row[i + k * num_rows]] + bias[expert[i, k]]);
  drop_pad_mode picks how the map is laid out (aclnnMoeFinalizeRoutingV2.md, which the op calls):
  0 column-major as above (init_routing v1's map), 2 row-major, index i * K + k (init_routing_v2's
  expanded_row_idx: what vllm-ascend and omni-infer pass after it); 1 and 3 (drop-pad) are not
  modelled. The map is int32 within [0, NUM_ROWS * K); scales of the rows' dtype, or float32 with
  bfloat16 rows (the A2/A3 mixed-precision case); inputs may be non-contiguous.
- npu_grouped_matmul: `_op_plugin_docs.py`: the MoE form only — one x [M, K], one weight [E, K, N],
  group_list int64 of at most 1024 groups (group_list_type 0: cumsum, non-decreasing; 1: counts,
  not of length 1; non-negative), group_type 0 (split M), split_item 2 or 3 (one output [M, N]);
  x/weight float16, bfloat16, float32, or int8 with scale [E, N] and per_token_scale [M] (float32)
  and output_dtype, which on A2/A3 pairs a bfloat16 output with a bfloat16 scale and a float16 one
  with a float32 scale (the docstring's table "group_list输入类型为Tensor时", pertoken rows; None
  means x's dtype, int8, whose int64 scale is not modelled); inner dims below 65536. "x 不支持转置": x must be contiguous; "支持weight转置":
  weight contiguous or the transpose of a contiguous [E, N, K] (strides [N*K, 1, K]), nothing
  else. Rows past group_list's total are left unwritten (aclnnGroupedMatmulV4.md; zero here).
"""

from __future__ import annotations

import torch

from ._registry import DTYPE_ENUM, check, dtype_in, op

DOC = "torch_npu 2.14.0 _op_plugin_docs.py"
GATE_DOC = "aclnnMoeGatingTopK.md, aclnnMoeGatingTopKV2.md (ops-transformer) + torch_npu 2.14.0 docstring"
FINALIZE_DOC = "aclnnMoeFinalizeRoutingV2.md (ops-transformer) + torch_npu 2.14.0 docstring"
GMM_DOC = "torch_npu 2.14.0 _op_plugin_docs.py (npu_grouped_matmul), aclnnGroupedMatmulV4.md"
FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _align32(n: int) -> int:
    return (n + 31) // 32 * 32


@op(
    "npu_moe_gating_top_k(Tensor x, int k, *, Tensor? bias=None, Tensor? input_ids=None, Tensor? tid2eid=None, "
    "int k_group=1, int group_count=1, int group_select_mode=0, int renorm=0, int norm_type=0, "
    "bool out_flag=False, float routed_scaling_factor=1.0, float eps=1e-20) -> (Tensor, Tensor, Tensor)"
)
def npu_moe_gating_top_k(
    x: torch.Tensor,
    k: int,
    *,
    bias: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    tid2eid: torch.Tensor | None = None,
    k_group: int = 1,
    group_count: int = 1,
    group_select_mode: int = 0,
    renorm: int = 0,
    norm_type: int = 0,
    out_flag: bool = False,
    routed_scaling_factor: float = 1.0,
    eps: float = 1e-20,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, expert_idx int32, norm_out float32); see the module docstring."""
    name = "npu_moe_gating_top_k"
    dtype_in(name, "x", x, FLOATS, GATE_DOC)
    check(x.dim() == 2, name, f"x must be 2-D, got {x.dim()}-D", GATE_DOC)
    e = x.shape[-1]
    check(e <= 2048, name, f"{e} experts exceed 2048", GATE_DOC)
    check(renorm == 0, name, f"renorm must be 0, got {renorm}", GATE_DOC)
    check(
        norm_type in (0, 1), name, f"norm_type must be 0 (softmax) or 1 (sigmoid), got {norm_type}", GATE_DOC
    )
    check(
        group_select_mode in (0, 1),
        name,
        f"group_select_mode must be 0 or 1, got {group_select_mode}",
        GATE_DOC,
    )
    check(
        group_count > 0 and e % group_count == 0,
        name,
        f"{e} experts do not split into {group_count} groups",
        GATE_DOC,
    )
    per = e // group_count
    check(per > 2, name, f"experts per group ({per}) must exceed 2", GATE_DOC)
    check(_align32(per) * group_count <= 2048, name, f"align32({per}) * {group_count} exceeds 2048", GATE_DOC)
    check(
        1 <= k_group <= group_count,
        name,
        f"k_group {k_group} not in [1, group_count={group_count}]",
        GATE_DOC,
    )
    check(1 <= k <= per * k_group, name, f"k {k} not in [1, {per * k_group}]", GATE_DOC)
    if bias is not None:
        check(bias.dim() == 1 and bias.shape[0] == e, name, f"bias must be 1-D of {e}", GATE_DOC)
        check(bias.dtype == x.dtype, name, f"bias dtype {bias.dtype} must equal x's {x.dtype}", GATE_DOC)
    check(
        (input_ids is None) == (tid2eid is None),
        name,
        "input_ids and tid2eid must be given together",
        GATE_DOC,
    )
    xf = x.float()
    norm = torch.softmax(xf, dim=-1) if norm_type == 0 else torch.sigmoid(xf)
    if tid2eid is not None:
        dtype_in(name, "input_ids", input_ids, (torch.int32, torch.int64), GATE_DOC)
        dtype_in(name, "tid2eid", tid2eid, (torch.int32, torch.int64), GATE_DOC)
        check(input_ids.shape == (x.shape[0],), name, "input_ids must be 1-D with x's rows", GATE_DOC)
        check(tid2eid.dim() == 2 and tid2eid.shape[1] == k, name, f"tid2eid must be [V, k={k}]", GATE_DOC)
        check(k <= 64, name, f"k {k} exceeds 64 in hash mode", GATE_DOC)
        check(
            bool(((input_ids >= 0) & (input_ids < tid2eid.shape[0])).all()),
            name,
            "input_ids out of tid2eid's range",
            GATE_DOC,
        )
        idx = tid2eid[input_ids.long()].long()
        check(
            bool(((idx >= 0) & (idx < e)).all()), name, f"tid2eid holds expert ids outside [0, {e})", GATE_DOC
        )
    else:
        score = norm + bias.float() if bias is not None else norm
        if group_count > 1:
            grouped = score.view(-1, group_count, per)
            if group_select_mode == 0:
                group_score = grouped.amax(dim=-1)
            else:
                group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)
            keep = torch.argsort(-group_score, dim=-1, stable=True)[:, :k_group]
            mask = torch.ones_like(group_score, dtype=torch.bool).scatter_(1, keep, False)
            score = grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).view(-1, e)
        idx = torch.argsort(-score, dim=-1, stable=True)[:, :k]
    y = norm.gather(1, idx)
    if norm_type == 1:
        y = y / (y.sum(dim=-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    return y.to(x.dtype), idx.to(torch.int32), norm if out_flag else torch.empty_like(norm)


@op(
    "npu_moe_init_routing_v2(Tensor x, Tensor expert_idx, *, Tensor? scale=None, Tensor? offset=None, "
    "int active_num=-1, int expert_capacity=-1, int expert_num=-1, int drop_pad_mode=0, "
    "int expert_tokens_num_type=0, bool expert_tokens_num_flag=False, int quant_mode=-1, "
    "int[2] active_expert_range=[], int row_idx_type=0, int? x_dtype=None) -> (Tensor, Tensor, Tensor, Tensor)"
)
def npu_moe_init_routing_v2(
    x: torch.Tensor,
    expert_idx: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    offset: torch.Tensor | None = None,
    active_num: int = -1,
    expert_capacity: int = -1,
    expert_num: int = -1,
    drop_pad_mode: int = 0,
    expert_tokens_num_type: int = 0,
    expert_tokens_num_flag: bool = False,
    quant_mode: int = -1,
    active_expert_range: list[int] = (),  # type: ignore[assignment]
    row_idx_type: int = 0,
    x_dtype: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(expanded_x, expanded_row_idx int32, expert_token counts int64, expanded_scale float32)."""
    name = "npu_moe_init_routing_v2"
    dtype_in(name, "x", x, (*FLOATS, torch.int8), DOC)
    dtype_in(name, "expert_idx", expert_idx, (torch.int32,), DOC)
    check(x.dim() == 2 and expert_idx.dim() == 2, name, "x and expert_idx must be 2-D", DOC)
    check(x.shape[0] == expert_idx.shape[0], name, "x and expert_idx must have one number of rows", DOC)
    most = 5120 if expert_tokens_num_type == 2 else 10240
    check(0 < expert_num <= most, name, f"expert_num must be in (0, {most}], got {expert_num}", DOC)
    check(drop_pad_mode == 0, name, "drop_pad_mode must be 0 (dropless)", DOC)
    check(
        expert_tokens_num_type in (1, 2),
        name,
        f"expert_tokens_num_type must be 1 or 2, got {expert_tokens_num_type}",
        DOC,
    )
    check(expert_tokens_num_flag, name, "expert_tokens_num_flag must be True", DOC)
    check(quant_mode == -1, name, f"quant_mode {quant_mode}: only -1 (no quantisation) is modelled", DOC)
    check(row_idx_type == 0, name, "row_idx_type 1 (scatter form) is not modelled", DOC)
    start, end = active_expert_range if len(active_expert_range) == 2 else (0, expert_num)
    check(
        0 <= start < end <= expert_num,
        name,
        f"active_expert_range [{start}, {end}) must lie in [0, {expert_num}]",
        DOC,
    )
    n, k = expert_idx.shape
    flat = expert_idx.reshape(-1).long()
    check(
        bool(((flat >= 0) & (flat < expert_num)).all()), name, f"expert ids must be in [0, {expert_num})", DOC
    )
    order = torch.argsort(flat, stable=True)
    kept = order[(flat[order] >= start) & (flat[order] < end)]
    limit = kept.numel() if active_num <= 0 else min(active_num, kept.numel())
    kept = kept[:limit]
    expanded_x = torch.zeros(n * k, x.shape[1], dtype=x.dtype)
    expanded_x[: kept.numel()] = x[kept // k]
    row_idx = torch.full((n * k,), -1, dtype=torch.int32)
    row_idx[kept] = torch.arange(kept.numel(), dtype=torch.int32)
    counts = torch.bincount(flat[kept] - start, minlength=end - start).to(torch.int64)
    if expert_tokens_num_type == 2:
        ids = torch.arange(start, end)[counts > 0]
        pairs = torch.zeros(expert_num, 2, dtype=torch.int64)
        pairs[: ids.numel(), 0], pairs[: ids.numel(), 1] = ids, counts[counts > 0]
        counts = pairs
    expanded_scale = torch.zeros(n * k, dtype=torch.float32)
    if scale is not None:
        dtype_in(name, "scale", scale, (torch.float32,), DOC)
        check(scale.shape == (n,), name, f"scale must be 1-D of {n} rows without quantisation", DOC)
        expanded_scale[: kept.numel()] = scale[kept // k]
    return expanded_x, row_idx, counts, expanded_scale


@op(
    "npu_moe_finalize_routing(Tensor expanded_permuted_rows, Tensor? skip1, Tensor? skip2, Tensor? bias, "
    "Tensor? scales, Tensor expanded_src_to_dst_row, Tensor? export_for_source_row, int? drop_pad_mode=0, int? k=1) -> Tensor"
)
def npu_moe_finalize_routing(
    expanded_permuted_rows: torch.Tensor,
    skip1: torch.Tensor | None,
    skip2: torch.Tensor | None,
    bias: torch.Tensor | None,
    scales: torch.Tensor | None,
    expanded_src_to_dst_row: torch.Tensor,
    export_for_source_row: torch.Tensor | None,
    drop_pad_mode: int | None = 0,
    k: int | None = 1,
) -> torch.Tensor:
    """out[i] = skip1[i] + skip2[i] + sum_k scales[i, k] * (rows[dst[i*K+k]] + bias[expert[i, k]])."""
    name = "npu_moe_finalize_routing"
    rows = expanded_permuted_rows
    dtype_in(name, "expanded_permuted_rows", rows, FLOATS, DOC)
    check(rows.dim() == 2, name, "expanded_permuted_rows must be 2-D (dropless)", DOC)
    check(
        drop_pad_mode in (0, 2),
        name,
        f"drop_pad_mode {drop_pad_mode}: only the dropless layouts 0 (column-major) and 2 (row-major) "
        "are modelled",
        FINALIZE_DOC,
    )
    dtype_in(name, "expanded_src_to_dst_row", expanded_src_to_dst_row, (torch.int32,), DOC)
    kk = scales.shape[1] if scales is not None else int(k or 1)
    n = expanded_src_to_dst_row.shape[0] // kk
    check(
        expanded_src_to_dst_row.shape == (n * kk,),
        name,
        "expanded_src_to_dst_row must be 1-D of NUM_ROWS * K",
        DOC,
    )
    check(not (skip2 is None and skip1 is not None), name, "skip1 must be None when skip2 is None", DOC)
    for arg, t in (("skip1", skip1), ("skip2", skip2), ("bias", bias)):
        check(t is None or t.dtype == rows.dtype, name, f"{arg} must have expanded_permuted_rows' dtype", DOC)
    if scales is not None:
        mixed = rows.dtype == torch.bfloat16 and scales.dtype == torch.float32
        check(
            scales.dtype == rows.dtype or mixed,
            name,
            f"scales dtype {scales.dtype} must be expanded_permuted_rows' ({rows.dtype}), or float32 with "
            "bfloat16 rows",
            FINALIZE_DOC,
        )
    flat = expanded_src_to_dst_row.long()
    check(
        bool(((flat >= 0) & (flat < n * kk)).all()),
        name,
        f"expanded_src_to_dst_row out of [0, {n * kk})",
        DOC,
    )
    # mode 0 reads the map column-major (entry i + k * n), mode 2 row-major (entry i * K + k)
    dst = flat.view(kk, n).T if drop_pad_mode == 0 else flat.view(n, kk)
    check(bool((dst < rows.shape[0]).all()), name, "expanded_src_to_dst_row points past the rows", DOC)
    picked = rows.float()[dst]  # [n, K, H]
    if bias is not None:
        check(export_for_source_row is not None, name, "bias needs export_for_source_row", DOC)
        picked = picked + bias.float()[export_for_source_row.long()]
    weights = scales.float() if scales is not None else torch.ones(n, kk)
    out = (picked * weights.unsqueeze(-1)).sum(dim=1)
    for t in (skip1, skip2):
        if t is not None:
            out = out + t.float()
    return out.to(rows.dtype)


@op(
    "npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
    "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
    "Tensor[]? per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None, "
    "Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0, "
    "int? group_type=None, int? group_list_type=0, int? act_type=0, int[]? tuning_config=None, "
    "int? output_dtype=None, int? x_dtype=None, int? weight_dtype=None, int? scale_dtype=None, "
    "int? per_token_scale_dtype=None) -> Tensor[]"
)
def npu_grouped_matmul(
    x: list[torch.Tensor],
    weight: list[torch.Tensor],
    *,
    bias: list[torch.Tensor] | None = None,
    scale: list[torch.Tensor] | None = None,
    per_token_scale: list[torch.Tensor] | None = None,
    group_list: torch.Tensor | None = None,
    split_item: int | None = 0,
    group_type: int | None = None,
    group_list_type: int | None = 0,
    act_type: int | None = 0,
    output_dtype: int | None = None,
    **unmodelled: object,
) -> list[torch.Tensor]:
    """The MoE form: y[rows of group e] = x[rows of group e] @ weight[e] (see the module docstring)."""
    name = "npu_grouped_matmul"
    check(
        all(v in (None, 0) for v in unmodelled.values()),
        name,
        f"{sorted(k for k, v in unmodelled.items() if v not in (None, 0))} are not modelled",
        DOC,
    )
    check(
        len(x) == 1 and len(weight) == 1,
        name,
        "only one x and one weight tensor (the MoE form) are modelled",
        DOC,
    )
    check(
        group_type == 0 and split_item in (2, 3),
        name,
        "only group_type 0 with split_item 2/3 is modelled",
        DOC,
    )
    check(act_type == 0, name, "activation fusion is not modelled", DOC)
    a, w = x[0], weight[0]
    check(
        a.dim() == 2 and w.dim() == 3,
        name,
        f"x must be [M, K] and weight [E, K, N], got {tuple(a.shape)} and {tuple(w.shape)}",
        DOC,
    )
    check(a.shape[1] == w.shape[1], name, "x's K must equal weight's K", DOC)
    check(a.is_contiguous(), name, "x must be contiguous (x transposed or strided is unsupported)", GMM_DOC)
    check(
        w.is_contiguous() or w.transpose(1, 2).is_contiguous(),
        name,
        "weight must be contiguous or the transpose of a contiguous [E, N, K] tensor",
        GMM_DOC,
    )
    check(a.shape[1] < 65536 and w.shape[2] < 65536, name, "inner dims must be below 65536 (InnerLimit)", DOC)
    check(group_list is not None, name, "group_list is required with group_type 0", DOC)
    dtype_in(name, "group_list", group_list, (torch.int64,), DOC)
    check(group_list.shape == (w.shape[0],), name, f"group_list must be 1-D of E={w.shape[0]}", DOC)
    check(group_list_type in (0, 1), name, "group_list_type must be 0 (cumsum) or 1 (counts)", DOC)
    check(w.shape[0] <= 1024, name, f"{w.shape[0]} groups exceed 1024", GMM_DOC)
    check(
        not (group_list_type == 1 and w.shape[0] == 1),
        name,
        "group_list of counts (group_list_type 1) must not have length 1",
        GMM_DOC,
    )
    check(bool((group_list >= 0).all()), name, "group_list must be non-negative", DOC)
    ends = group_list.cumsum(0) if group_list_type == 1 else group_list
    check(bool((ends[1:] >= ends[:-1]).all()), name, "group_list (cumsum) must be non-decreasing", DOC)
    check(
        int(ends[-1]) <= a.shape[0],
        name,
        f"group_list covers {int(ends[-1])} rows but x has {a.shape[0]}",
        DOC,
    )
    quantised = a.dtype == torch.int8
    if quantised:
        check(w.dtype == torch.int8, name, "int8 x needs int8 weight", DOC)
        check(
            scale is not None and per_token_scale is not None,
            name,
            "int8 needs scale and per_token_scale",
            DOC,
        )
        dtype_in(name, "scale", scale[0], (torch.float32, torch.bfloat16), DOC)
        check(scale[0].shape == (w.shape[0], w.shape[2]), name, "scale must be [E, N]", DOC)
        dtype_in(name, "per_token_scale", per_token_scale[0], (torch.float32,), DOC)
        check(per_token_scale[0].shape == (a.shape[0],), name, "per_token_scale must be [M]", DOC)
        # None means x's dtype: an int8 output, which takes an int64 scale (npu_trans_quant_param)
        out_dtype = torch.int8 if output_dtype is None else DTYPE_ENUM.get(output_dtype, torch.uint8)
        pairs = {torch.bfloat16: torch.bfloat16, torch.float16: torch.float32}  # output -> its scale
        check(
            out_dtype in pairs,
            name,
            f"output_dtype {out_dtype} with per_token_scale is not bfloat16 or float16 (not modelled)",
            DOC,
        )
        check(
            scale[0].dtype == pairs[out_dtype],
            name,
            f"a {out_dtype} output with per_token_scale takes a {pairs[out_dtype]} scale, not {scale[0].dtype}",
            DOC,
        )
    else:
        dtype_in(name, "x", a, FLOATS, DOC)
        check(w.dtype == a.dtype, name, f"weight dtype {w.dtype} must equal x's {a.dtype}", DOC)
        out_dtype = a.dtype if output_dtype is None else DTYPE_ENUM.get(output_dtype, torch.uint8)
        check(out_dtype == a.dtype, name, "output_dtype must equal x's dtype without quantisation", DOC)
    y = torch.zeros(a.shape[0], w.shape[2], dtype=torch.float64)
    begin = 0
    for e, end in enumerate(ends.tolist()):
        if end > begin:
            if quantised:
                part = (a[begin:end].int() @ w[e].int()).double() * scale[0][e].double()
                part = part * per_token_scale[0][begin:end].double().unsqueeze(-1)
            else:
                part = a[begin:end].double() @ w[e].double()
            if bias is not None:
                part = part + bias[0][e].double()
            y[begin:end] = part
        begin = end
    return [y.to(out_dtype)]
