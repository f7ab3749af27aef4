"""Sparse attention with sinks (npu_sparse_flash_attention) and its indexer (npu_lightning_indexer).

Which op: the seed (SGLang's DSV4 NPU backend, `ascend_dsv4_backend.py`) calls sgl-kernel-npu's
custom `torch.ops.custom.npu_sparse_attn_sharedkv` (SWA + compressed KV, sinks, int32 block tables,
`cu_seqlens_q`/`seqused_kv` device tensors) and `torch.ops.custom.npu_quant_lightning_indexer`,
which torch_npu does not ship. torch_npu 2.14.0's own ops for this shape of attention are
`npu_sparse_flash_attention` (which gained `sinks` and `return_softmax_lse` in 2.14) and
`npu_lightning_indexer`, the DeepSeek-V3.2 pair vllm-ascend uses; both take their lengths as int32
*device tensors*, so a captured graph reads them from static buffers and needs no graph-task update
(which only FIA's host `actual_seq_lengths` lists need). `npu_fused_infer_attention_score_v2` also
takes `learnable_sink`, with host lengths; it is not modelled.

Sources: schemas from the wheel's yaml; rules from the wheel's `_op_plugin_docs.py` and meta, and
from the op's page in ops-transformer (`attention/sparse_flash_attention/README.md`): query N in
{1, 2, 4, ..., 128}, key/value N = 1; query/key/value D = 512 and query_rope/key_rope D = 64;
block_size a multiple of 16, at most 1024; sparse_block_size divides block_size; TND query with
BSND kv unsupported; without paging, layout_kv equals layout_query; query, key, value,
sparse_indices, ropes contiguous, bfloat16/float16; sparse_indices int32 with the valid entries
first and -1 after; lengths int32, the query's cumulative (TND, required) and non-decreasing. The
op's tiling (`op_host/sparse_flash_attention_tiling.cpp`) adds: attention_mode 2 (MLA-absorb) only,
query_rope and key_rope required (D 64, query's dtype), the value as wide as the key (512), a
block_table exactly when kv is PA_BSND. npu_lightning_indexer's tiling
(`lightning_indexer/op_host/lightning_indexer_tiling.cpp`): query, key and weights of one dtype
(bf16/fp16), head dim 128, one key head, a block_table and actual_seq_lengths_key exactly when
keys are PA_BSND, blocks a multiple of 16 up to 1024.

Semantics (sparse_block_size 1, the modelled case): for query token t of batch b and each head, the
scores are scale * (q . k + q_rope . k_rope) over the keys at positions sparse_indices[t, 0, :]
that are valid (>= 0, < kv length, and with sparse_mode 3 not after the token's causal position
kv_len - q_len + i); softmax over them, plus the head's sink logit in the denominator when `sinks`
is given (the 2.14.0 docstring does not describe `sinks`; this is the attention-sink form DSV4 and
gpt-oss use: verify on hardware); output = weights @ v (v = key when value is None, CANN >= 9.2).
A token with no valid key outputs zeros. With return_softmax_lse, softmax_max is each row's
largest logit (the sink's if larger) and softmax_sum its sum of exp(logit - max), the sink's term
included (-inf and 0 for a token with no valid key): the usual flash-attention statistics, which
is what a caller merging two calls relies on (verify the sink's part on hardware).
"""

from __future__ import annotations

import itertools

import torch

from ._registry import check, contiguous, dtype_in, op

DOC = "torch_npu 2.14.0 docstring/meta + ops-transformer attention/sparse_flash_attention/README.md"
TILING = "ops-transformer attention/sparse_flash_attention/op_host/sparse_flash_attention_tiling.cpp"
LI_DOC = "torch_npu 2.14.0 _op_plugin_docs.py npu_lightning_indexer + meta"
LI_TILING = "ops-transformer attention/lightning_indexer/op_host/lightning_indexer_tiling.cpp"
HALFS = (torch.float16, torch.bfloat16)
_MAX = (1 << 63) - 1


def _query_spans(
    name: str, layout: str, q: torch.Tensor, cu: torch.Tensor | None, doc: str
) -> list[tuple[int, int]]:
    """(start, length) of each batch's query tokens in q's first dim (TND) or per batch (BSND)."""
    if layout == "TND":
        check(cu is not None, name, "TND query needs actual_seq_lengths_query", doc)
        dtype_in(name, "actual_seq_lengths_query", cu, (torch.int32,), doc)
        ends = cu.tolist()
        check(all(e >= 0 for e in ends) and all(b >= a for a, b in itertools.pairwise(ends)), name,
              "actual_seq_lengths_query must be non-negative and non-decreasing (a prefix sum)", doc)  # fmt: skip
        check(
            ends[-1] <= q.shape[0], name, f"actual_seq_lengths_query ends at {ends[-1]} > T={q.shape[0]}", doc
        )
        return [(a, b - a) for a, b in zip([0, *ends[:-1]], ends, strict=True)]
    s1 = q.shape[1]
    lens = cu.tolist() if cu is not None else [s1] * q.shape[0]
    check(all(0 <= n <= s1 for n in lens), name, f"actual_seq_lengths_query must lie in [0, S={s1}]", doc)
    return [(b * s1, n) for b, n in enumerate(lens)]


def _kv_rows(
    name: str,
    layout: str,
    key: torch.Tensor,
    block_table: torch.Tensor | None,
    kv_lens: list[int],
    b: int,
    doc: str,
) -> torch.Tensor:
    """Row indices, into key flattened to [rows, N2, D], of batch b's first kv_lens[b] tokens."""
    n = kv_lens[b]
    pos = torch.arange(n)
    if layout == "PA_BSND":
        block = key.shape[1]
        pages = block_table[b, (pos // block)].long() if n else pos
        check(bool((pages >= 0).all()) and bool((pages < key.shape[0]).all()), name,
              f"block_table row {b} names a block outside [0, {key.shape[0]}) for a valid token", doc)  # fmt: skip
        return pages * block + pos % block
    if layout == "BSND":
        return b * key.shape[1] + pos
    return pos  # TND kv: offsets applied by the caller


def _kv_lengths(
    name: str, layout: str, key: torch.Tensor, lens: torch.Tensor | None, batches: int, doc: str
) -> list[int]:
    arg = "actual_seq_lengths_key" if name == "npu_lightning_indexer" else "actual_seq_lengths_kv"
    if lens is None:
        check(layout == "BSND", name, f"{arg} is required with paged or TND kv", doc)
        return [key.shape[1]] * batches
    dtype_in(name, arg, lens, (torch.int32,), doc)
    check(lens.dim() == 1 and lens.shape[0] == batches, name, f"{arg} must be 1-D of B={batches}", doc)
    values = lens.tolist()
    check(all(v >= 0 for v in values), name, f"{arg} must be non-negative", doc)
    # Lengths past the key tensor would read past its end (the device does not check).
    if layout == "TND":
        check(sum(values) <= key.shape[0], name, f"kv lengths sum to {sum(values)} > T={key.shape[0]}", doc)
    elif layout == "BSND":
        check(max(values, default=0) <= key.shape[1], name, f"a kv length exceeds S={key.shape[1]}", doc)
    return values


def _check_paging(
    name: str,
    layout_kv: str,
    key: torch.Tensor,
    block_table: torch.Tensor | None,
    kv_lens: list[int],
    doc: str,
) -> None:
    if layout_kv != "PA_BSND":
        return
    check(block_table is not None, name, "PA_BSND needs block_table", doc)
    dtype_in(name, "block_table", block_table, (torch.int32,), doc)
    block = key.shape[1]
    need = max((n + block - 1) // block for n in kv_lens) if kv_lens else 0
    check(block_table.dim() == 2 and block_table.shape[0] == len(kv_lens) and block_table.shape[1] >= need, name,
          f"block_table must be [B={len(kv_lens)}, >= {need}], got {tuple(block_table.shape)}", doc)  # fmt: skip


def _batches(
    name: str,
    doc: str,
    query: torch.Tensor,
    key: torch.Tensor,
    layouts: tuple[str, str],
    lengths: tuple[torch.Tensor | None, torch.Tensor | None],
    block_table: torch.Tensor | None,
) -> list[tuple[int, int, int, torch.Tensor]]:
    """Per batch: (first query row, query length, kv length, the kv rows of key flattened to [rows, D])."""
    layout_query, layout_kv = layouts
    spans = _query_spans(name, layout_query, query, lengths[0], doc)
    kv_lens = _kv_lengths(name, layout_kv, key, lengths[1], len(spans), doc)
    _check_paging(name, layout_kv, key, block_table, kv_lens, doc)
    out, offset = [], 0
    for b, (start, q_len) in enumerate(spans):
        rows = _kv_rows(name, layout_kv, key, block_table, kv_lens, b, doc)
        out.append((start, q_len, kv_lens[b], rows + offset if layout_kv == "TND" else rows))
        offset += kv_lens[b]
    return out


@op(
    "npu_sparse_flash_attention(Tensor query, Tensor key, Tensor? value, Tensor sparse_indices, float scale_value, *, "
    "Tensor? block_table=None, Tensor? actual_seq_lengths_query=None, Tensor? actual_seq_lengths_kv=None, "
    'Tensor? query_rope=None, Tensor? key_rope=None, int sparse_block_size=1, str layout_query="BSND", '
    'str layout_kv="BSND", int sparse_mode=3, int pre_tokens=9223372036854775807, '
    "int next_tokens=9223372036854775807, int attention_mode=0, bool return_softmax_lse=False, "
    "Tensor? sinks=None) -> (Tensor, Tensor, Tensor)"
)
def npu_sparse_flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None,
    sparse_indices: torch.Tensor,
    scale_value: float,
    *,
    block_table: torch.Tensor | None = None,
    actual_seq_lengths_query: torch.Tensor | None = None,
    actual_seq_lengths_kv: torch.Tensor | None = None,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    sparse_block_size: int = 1,
    layout_query: str = "BSND",
    layout_kv: str = "BSND",
    sparse_mode: int = 3,
    pre_tokens: int = _MAX,
    next_tokens: int = _MAX,
    attention_mode: int = 0,
    return_softmax_lse: bool = False,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(attention_out, softmax_max, softmax_sum); see the module docstring."""
    name = "npu_sparse_flash_attention"
    check(
        layout_query in ("BSND", "TND"), name, f"layout_query must be BSND or TND, got {layout_query!r}", DOC
    )
    check(
        layout_kv in ("BSND", "TND", "PA_BSND"),
        name,
        f"layout_kv must be BSND, TND or PA_BSND, got {layout_kv!r}",
        DOC,
    )
    check(
        not (layout_query == "TND" and layout_kv == "BSND"),
        name,
        "TND query with BSND kv is unsupported",
        DOC,
    )
    check(
        layout_kv == "PA_BSND" or layout_kv == layout_query,
        name,
        "without paging, layout_kv must equal layout_query",
        DOC,
    )
    check(sparse_mode in (0, 3), name, f"sparse_mode must be 0 or 3, got {sparse_mode}", DOC)
    check(sparse_block_size == 1, name, f"sparse_block_size {sparse_block_size}: only 1 is modelled", DOC)
    check(
        pre_tokens == _MAX and next_tokens == _MAX,
        name,
        "pre_tokens/next_tokens windows are not modelled",
        DOC,
    )
    # ops-transformer's tiling (CheckRopeExistence, CheckFeatureMlaNoQuantShape): only the MLA-absorb
    # mode, with both ropes of D 64 beside a 512-wide latent that is also the value.
    check(attention_mode == 2, name, f"attention_mode must be 2 (MLA-absorb), got {attention_mode}", TILING)
    check(
        query_rope is not None and key_rope is not None,
        name,
        "query_rope and key_rope are required (attention_mode 2)",
        TILING,
    )
    check(
        query.numel() > 0 and key.numel() > 0 and sparse_indices.numel() > 0,
        name,
        "query, key and sparse_indices must not be empty",
        DOC,
    )
    v = key if value is None else value
    for arg, t in (
        ("query", query),
        ("key", key),
        ("value", value),
        ("query_rope", query_rope),
        ("key_rope", key_rope),
    ):
        dtype_in(name, arg, t, HALFS, DOC)
        contiguous(name, arg, t, DOC)
    contiguous(name, "sparse_indices", sparse_indices, DOC)
    dtype_in(name, "sparse_indices", sparse_indices, (torch.int32,), DOC)
    check(
        key.dtype == query.dtype and v.dtype == query.dtype,
        name,
        "key and value must have query's dtype",
        DOC,
    )
    q_dims = 3 if layout_query == "TND" else 4
    kv_dims = 3 if layout_kv == "TND" else 4
    check(query.dim() == q_dims, name, f"{layout_query} query must be {q_dims}-D, got {query.dim()}-D", DOC)
    check(
        key.dim() == kv_dims and v.shape == key.shape,
        name,
        f"{layout_kv} key/value must be {kv_dims}-D of one shape",
        DOC,
    )
    n1, d = query.shape[-2], query.shape[-1]
    n2 = key.shape[-2]
    check(
        n1 in (1, 2, 4, 8, 16, 32, 64, 128), name, f"query heads N={n1} must be a power of 2 up to 128", DOC
    )
    check(n2 == 1, name, f"key/value heads N={n2} must be 1", DOC)
    check(
        d == 512 and key.shape[-1] == 512,
        name,
        f"query and key D must be 512, got {d} and {key.shape[-1]}",
        DOC,
    )
    assert query_rope is not None and key_rope is not None  # checked above
    check(
        query_rope.shape[-1] == 64 and key_rope.shape[-1] == 64,
        name,
        "query_rope and key_rope D must be 64",
        DOC,
    )
    check(query_rope.shape[:-1] == query.shape[:-1] and key_rope.shape[:-1] == key.shape[:-1], name,
          "ropes must match query/key in every dim but D", DOC)  # fmt: skip
    check(
        query_rope.dtype == query.dtype and key_rope.dtype == query.dtype,
        name,
        "query_rope and key_rope must have query's dtype",
        TILING,
    )
    check(
        (layout_kv == "PA_BSND") == (block_table is not None),
        name,
        "block_table is required with PA_BSND kv and must be None otherwise",
        TILING,
    )
    if layout_kv == "PA_BSND":
        block = key.shape[1]
        check(
            block % 16 == 0 and block <= 1024,
            name,
            f"block_size {block} must be a multiple of 16, at most 1024",
            DOC,
        )
    batches = _batches(
        name,
        DOC,
        query,
        key,
        (layout_query, layout_kv),
        (actual_seq_lengths_query, actual_seq_lengths_kv),
        block_table,
    )
    want = (query.shape[0], n2) if layout_query == "TND" else (query.shape[0], query.shape[1], n2)
    check(
        tuple(sparse_indices.shape[:-1]) == want,
        name,
        f"sparse_indices must be [{', '.join(map(str, want))}, sparse_size]",
        DOC,
    )
    if sinks is not None:
        dtype_in(name, "sinks", sinks, (torch.float32, torch.bfloat16, torch.float16), DOC)
        check(sinks.shape == (n1,), name, f"sinks must be 1-D of the query heads ({n1})", DOC)

    q = query.reshape(-1, n1, d).float()
    qr = query_rope.reshape(-1, n1, 64).float()
    k = key.reshape(-1, key.shape[-1])  # N2 = 1; only the picked rows are read (and widened)
    vv = v.reshape(-1, v.shape[-1])
    kr = key_rope.reshape(-1, 64)
    idx = sparse_indices.reshape(-1, sparse_indices.shape[-1]).long()
    out = torch.zeros(q.shape[0], n1, vv.shape[-1])
    lse_max = torch.full((q.shape[0], n1), float("-inf"))
    lse_sum = torch.zeros(q.shape[0], n1)
    for start, q_len, kv_len, rows in batches:
        for i in range(q_len):
            t = start + i
            sel = idx[t]
            valid = sel >= 0
            check(
                bool((valid[:-1] | ~valid[1:]).all()),
                name,
                f"sparse_indices row {t}: valid entries must come before -1s",
                DOC,
            )
            sel = sel[valid]
            limit = kv_len if sparse_mode == 0 else kv_len - q_len + i + 1
            sel = sel[sel < min(limit, kv_len)]
            if sel.numel() == 0:
                continue
            r = rows[sel]
            s = (q[t] @ k[r].float().T + qr[t] @ kr[r].float().T) * scale_value  # [N1, n]
            m = s.amax(dim=-1, keepdim=True)
            if sinks is not None:
                m = torch.maximum(m, sinks.float().unsqueeze(-1))
            e = torch.exp(s - m)
            denom = e.sum(dim=-1, keepdim=True)
            if sinks is not None:
                denom = denom + torch.exp(sinks.float().unsqueeze(-1) - m)
            out[t] = (e / denom) @ vv[r].float()
            lse_max[t], lse_sum[t] = m.squeeze(-1), denom.squeeze(-1)
    attention_out = out.to(query.dtype).reshape(*query.shape[:-1], vv.shape[-1])
    if not return_softmax_lse:
        return attention_out, torch.empty(0), torch.empty(0)
    if layout_query == "TND":  # [N2, T, N1/N2]
        return attention_out, lse_max.unsqueeze(0), lse_sum.unsqueeze(0)
    shape = (query.shape[0], query.shape[1], n1)  # -> [B, N2, S1, N1/N2]
    return attention_out, lse_max.reshape(shape).unsqueeze(1), lse_sum.reshape(shape).unsqueeze(1)


SPARSE_COUNTS = (*range(1, 2049), 3072, 4096, 5120, 6144, 7168, 8192)


@op(
    "npu_lightning_indexer(Tensor query, Tensor key, Tensor weights, *, Tensor? actual_seq_lengths_query=None, "
    'Tensor? actual_seq_lengths_key=None, Tensor? block_table=None, str layout_query="BSND", '
    'str layout_key="BSND", int sparse_count=2048, int sparse_mode=3, int pre_tokens=9223372036854775807, '
    "int next_tokens=9223372036854775807, bool return_value=False) -> (Tensor, Tensor)"
)
def npu_lightning_indexer(
    query: torch.Tensor,
    key: torch.Tensor,
    weights: torch.Tensor,
    *,
    actual_seq_lengths_query: torch.Tensor | None = None,
    actual_seq_lengths_key: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    layout_query: str = "BSND",
    layout_key: str = "BSND",
    sparse_count: int = 2048,
    sparse_mode: int = 3,
    pre_tokens: int = _MAX,
    next_tokens: int = _MAX,
    return_value: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of score[s] = sum_n weights[n] * relu(q[n] . k[s]) per query token: int32 positions, -1 padded.

    Ties go to the lower position (a stable sort); the hardware's order on ties is not documented."""
    name = "npu_lightning_indexer"
    check(
        layout_query in ("BSND", "TND"),
        name,
        f"layout_query must be BSND or TND, got {layout_query!r}",
        LI_DOC,
    )
    check(
        layout_key in ("BSND", "TND", "PA_BSND"),
        name,
        f"layout_key must be PA_BSND, BSND or TND, got {layout_key!r}",
        LI_DOC,
    )
    check(
        layout_key == "PA_BSND" or layout_key == layout_query,
        name,
        "without paging, layout_key must equal layout_query",
        LI_DOC,
    )
    check(
        sparse_count in SPARSE_COUNTS,
        name,
        f"sparse_count {sparse_count} not in 1-2048 or 3072..8192 (by 1024)",
        LI_DOC,
    )
    check(sparse_mode in (0, 3), name, f"sparse_mode must be 0 or 3, got {sparse_mode}", LI_DOC)
    check(
        pre_tokens == _MAX and next_tokens == _MAX,
        name,
        "pre_tokens/next_tokens windows are not modelled",
        LI_DOC,
    )
    check(query.numel() > 0 and key.numel() > 0, name, "query and key must not be empty", LI_DOC)
    for arg, t in (("query", query), ("key", key), ("weights", weights)):
        dtype_in(name, arg, t, HALFS, LI_DOC)
        contiguous(name, arg, t, LI_DOC)
    check(
        key.dtype == query.dtype and weights.dtype == query.dtype,
        name,
        "query, key and weights must have one dtype",
        LI_TILING,
    )
    n1, d = query.shape[-2], query.shape[-1]
    n2 = key.shape[-2]
    check(d == 128, name, f"query head_dim D={d}: only 128 is supported", LI_TILING)
    check(key.shape[-1] == d, name, f"key D {key.shape[-1]} must equal query D {d}", LI_DOC)
    check(n2 == 1, name, f"key heads N2={n2} must be 1", LI_TILING)
    paged = layout_key == "PA_BSND"
    check(paged == (block_table is not None), name,
          "block_table is required with PA_BSND keys and must be None otherwise", LI_TILING)  # fmt: skip
    check(not paged or actual_seq_lengths_key is not None, name,
          "PA_BSND keys need actual_seq_lengths_key", LI_TILING)  # fmt: skip
    if paged:
        block = key.shape[1]
        check(0 < block <= 1024 and block % 16 == 0, name,
              f"block_size {block} must be a multiple of 16 in (0, 1024]", LI_TILING)  # fmt: skip
    check(
        tuple(weights.shape) == tuple(query.shape[:-1]),
        name,
        f"weights must be {tuple(query.shape[:-1])}",
        LI_DOC,
    )
    batches = _batches(
        name,
        LI_DOC,
        query,
        key,
        (layout_query, layout_key),
        (actual_seq_lengths_query, actual_seq_lengths_key),
        block_table,
    )
    q = query.reshape(-1, n1, d).float()
    w = weights.reshape(-1, n1).float()
    k = key.reshape(-1, d).float()
    tokens = q.shape[0]
    indices = torch.full((tokens, sparse_count), -1, dtype=torch.int32)
    values = torch.zeros(tokens, sparse_count)
    for start, q_len, kv_len, rows in batches:
        scores_all = (
            w[start : start + q_len].unsqueeze(-1) * torch.relu(q[start : start + q_len] @ k[rows].T)
        ).sum(1)
        for i in range(q_len):
            visible = kv_len if sparse_mode == 0 else max(0, kv_len - q_len + i + 1)
            scores = scores_all[i, :visible]
            order = torch.argsort(-scores, stable=True)[:sparse_count]
            indices[start + i, : order.numel()] = order.to(torch.int32)
            values[start + i, : order.numel()] = scores[order]
    shape = (*query.shape[:-2], 1, sparse_count)
    out_values = values.to(query.dtype).reshape(shape) if return_value else torch.empty(0, dtype=query.dtype)
    return indices.reshape(shape), out_values
