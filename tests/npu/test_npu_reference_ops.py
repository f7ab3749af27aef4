"""Each reference torch_npu op against the same math written another way on the host, and the calls
the hardware rejects. The references here are deliberately naive (loops, complex numbers, dense
masks) so they do not share code or structure with the ops under test."""

from __future__ import annotations

import math
from types import ModuleType

import pytest
import torch

BF16 = torch.bfloat16


def npu(t: torch.Tensor) -> torch.Tensor:
    return t.to("npu")


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-2) -> None:
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=tol, atol=tol)


# --- schemas: the dispatcher holds every op to the wheel's signature --------------------------------
def test_schemas_are_the_wheels(reference_npu: ModuleType) -> None:
    torch_npu = reference_npu
    schema = str(torch.ops.npu.npu_moe_gating_top_k.default._schema)
    assert schema.startswith(
        "npu::npu_moe_gating_top_k(Tensor x, int k, *, Tensor? bias=None, Tensor? input_ids=None"
    )
    assert "Tensor? sinks=None" in str(torch.ops.npu.npu_sparse_flash_attention.default._schema)
    with pytest.raises(RuntimeError, match="positional"):  # keyword-only arguments stay keyword-only
        torch.ops.npu.npu_moe_gating_top_k(npu(torch.randn(2, 8)), 2, None)
    with pytest.raises(NotImplementedError, match="CPU"):  # host tensors never reach the kernel
        torch_npu.npu_swiglu(torch.randn(2, 4))


# --- norm, activation, rope -----------------------------------------------------------------------
def test_rms_norm(torch_npu: ModuleType) -> None:
    x, g = torch.randn(3, 2, 16), torch.randn(16)
    y, rstd = torch_npu.npu_rms_norm(npu(x), npu(g), epsilon=1e-5)
    want = torch.stack(
        [row / math.sqrt(float((row**2).mean()) + 1e-5) * g for row in x.reshape(-1, 16)]
    ).reshape(x.shape)
    close(y, want, 1e-5)
    assert rstd.shape == (3, 2, 1) and rstd.dtype == torch.float32


def test_rms_norm_rejects_a_weight_of_another_dtype(reference_npu: ModuleType) -> None:
    torch_npu = reference_npu
    with pytest.raises(
        RuntimeError, match=r"gamma dtype torch\.float32 must equal self dtype torch\.bfloat16"
    ):
        torch_npu.npu_rms_norm(npu(torch.randn(2, 8, dtype=BF16)), npu(torch.ones(8)))


def test_swiglu(torch_npu: ModuleType) -> None:
    x = torch.randn(4, 10)
    a, b = x[:, :5], x[:, 5:]
    close(torch_npu.npu_swiglu(npu(x)), a / (1 + torch.exp(-a)) * b, 1e-5)


def test_swiglu_rejects(reference_npu: ModuleType) -> None:
    torch_npu = reference_npu
    with pytest.raises(RuntimeError, match="must be even"):
        torch_npu.npu_swiglu(npu(torch.randn(4, 7)))
    with pytest.raises(RuntimeError, match=r"dtype torch\.int32"):
        torch_npu.npu_swiglu(npu(torch.ones(4, 8, dtype=torch.int32)))


def _complex_rope(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs as complex numbers times e^{i angle} (DSV4's own formulation)."""
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle)).flatten(-2)


def test_rotary_mul_interleave_is_complex_rope(torch_npu: ModuleType) -> None:
    b, s, n, d = 2, 3, 4, 64
    x = torch.randn(b, s, n, d)
    angle = torch.rand(s, d // 2) * 6
    cos = angle.cos().repeat_interleave(2, -1).view(1, s, 1, d)  # the seed's table layout
    sin = angle.sin().repeat_interleave(2, -1).view(1, s, 1, d)
    got = torch_npu.npu_rotary_mul(npu(x), npu(cos), npu(sin), rotary_mode="interleave")
    close(got, _complex_rope(x, angle.view(1, s, 1, d // 2)), 1e-5)


def test_rotary_mul_rejects_per_batch_tables_in_interleave_mode(reference_npu: ModuleType) -> None:
    torch_npu = reference_npu
    x = npu(torch.randn(2, 3, 4, 64))
    table = npu(torch.randn(2, 3, 1, 64))  # B S 1 D: not 1S1D
    with pytest.raises(RuntimeError, match="broadcast over B and N"):
        torch_npu.npu_rotary_mul(x, table, table, rotary_mode="interleave")
    with pytest.raises(RuntimeError, match="must be even and < 896"):
        torch_npu.npu_rotary_mul(
            npu(torch.randn(1, 1, 1, 63)), npu(torch.randn(1, 1, 1, 63)), npu(torch.randn(1, 1, 1, 63))
        )


def test_interleave_rope_deinterleaves(torch_npu: ModuleType) -> None:
    b, n, s = 2, 3, 5
    x = torch.randn(b, n, s, 64, dtype=BF16)
    angle = torch.rand(b, 1, s, 32) * 6
    cos = torch.cat((angle.cos(), angle.cos()), -1).to(BF16)  # half layout
    sin = torch.cat((angle.sin(), angle.sin()), -1).to(BF16)
    got = torch_npu.npu_interleave_rope(npu(x), npu(cos), npu(sin))
    rotated = _complex_rope(x, angle.to(BF16).float())  # interleaved result
    want = torch.cat((rotated[..., 0::2], rotated[..., 1::2]), -1)  # the kernel writes it de-interleaved
    close(got, want, 0.05)


@pytest.mark.parametrize(
    ("d", "dtype", "match"),
    [(128, BF16, "D must be 64"), (64, torch.float32, "dtype torch.float32")],
)
def test_interleave_rope_rejects(reference_npu: ModuleType, d: int, dtype: torch.dtype, match: str) -> None:
    torch_npu = reference_npu
    x, t = torch.randn(1, 2, 3, d, dtype=dtype), torch.randn(1, 1, 3, d, dtype=dtype)
    with pytest.raises(RuntimeError, match=match):
        torch_npu.npu_interleave_rope(npu(x), npu(t), npu(t))


def test_interleave_rope_rejects_a_non_contiguous_input(reference_npu: ModuleType) -> None:
    torch_npu = reference_npu
    x = npu(torch.randn(1, 3, 2, 64, dtype=BF16)).transpose(1, 2)
    t = npu(torch.randn(1, 1, 3, 64, dtype=BF16))
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        torch_npu.npu_interleave_rope(x, t, t)


# --- paged cache writes ---------------------------------------------------------------------------
def test_scatter_nd_update_writes_rows_in_place(torch_npu: ModuleType) -> None:
    cache = npu(torch.zeros(6, 2, 4, dtype=BF16))
    ptr = cache.data_ptr()
    rows = torch.tensor([[4], [1]], dtype=torch.int32)
    upd = torch.randn(2, 2, 4, dtype=BF16)
    out = torch_npu.npu_scatter_nd_update_(cache, npu(rows), npu(upd))
    assert out.data_ptr() == ptr
    want = torch.zeros(6, 2, 4, dtype=BF16)
    for i, r in enumerate(rows[:, 0].tolist()):
        want[r] = upd[i]
    assert torch.equal(cache.cpu(), want)


@pytest.mark.parametrize(
    ("cache", "rows", "match"),
    [
        (torch.zeros(6, 4, dtype=torch.int32), torch.tensor([[1]], dtype=torch.int32), "dtype torch.int32"),
        (torch.zeros(6, 4), torch.tensor([[1]], dtype=torch.int16), "indices has dtype torch.int16"),
        (torch.zeros(6, 4), torch.tensor([[6]], dtype=torch.int32), "out of range"),
        (torch.zeros(6, 4), torch.tensor([1], dtype=torch.int32), "at least 2-D"),
    ],
)
def test_scatter_nd_update_rejects(
    reference_npu: ModuleType, cache: torch.Tensor, rows: torch.Tensor, match: str
) -> None:
    torch_npu = reference_npu
    upd = (
        torch.ones(*rows.shape[:-1], 4, dtype=cache.dtype)
        if rows.dim() > 1
        else torch.ones(4, dtype=cache.dtype)
    )
    with pytest.raises(RuntimeError, match=match):
        torch_npu.npu_scatter_nd_update_(npu(cache), npu(rows), npu(upd))


def test_scatter_update_writes_each_batch_at_its_position(torch_npu: ModuleType) -> None:
    data = torch.zeros(2, 3, 8, 4)  # [B, N, S, D], axis -2
    pos = torch.tensor([5, 0])
    upd = torch.randn(2, 3, 1, 4)
    torch_npu.scatter_update_(d := npu(data), npu(pos), npu(upd), -2)
    want = data.clone()
    for b in range(2):
        want[b, :, pos[b], :] = upd[b, :, 0, :]
    assert torch.equal(d.cpu(), want)


def test_scatter_update_rejects_out_of_range_positions(reference_npu: ModuleType) -> None:
    """The device does not check ("索引越界不校验"): the reference does."""
    data, upd = npu(torch.zeros(2, 3, 8, 4)), npu(torch.randn(2, 3, 1, 4))
    with pytest.raises(RuntimeError, match="out of range"):
        reference_npu.scatter_update_(data, npu(torch.tensor([8, 0])), upd, -2)


def test_index_put_refuses_int32_values_and_host_values(reference_npu: ModuleType) -> None:
    """The seed's aclnnIndexPut limit (full_to_swa_index_mapping), and values left on the host."""
    table = npu(torch.zeros(8, dtype=torch.int32))
    idx = npu(torch.tensor([1, 2]))
    with pytest.raises(RuntimeError, match="int32 values"):
        table[idx] = npu(torch.tensor([5, 6], dtype=torch.int32))
    mapping = npu(torch.zeros(8, dtype=torch.int64))
    mapping[idx] = npu(torch.tensor([5, 6]))  # the int64 form works
    assert mapping.cpu()[1:3].tolist() == [5, 6]
    with pytest.raises(RuntimeError, match="same device"):
        mapping.index_put_((idx,), torch.tensor([7, 8]))


# --- W8A8 -----------------------------------------------------------------------------------------
def test_dynamic_quant_per_token(torch_npu: ModuleType) -> None:
    x = torch.randn(5, 32, dtype=BF16)
    y, scale = torch_npu.npu_dynamic_quant(npu(x))
    assert y.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (5,)
    for r in range(5):
        s = float(x[r].float().abs().max()) / 127
        assert scale.cpu()[r].item() == pytest.approx(s, rel=1e-6)
        assert torch.equal(y.cpu()[r], torch.round(x[r].float() / s).to(torch.int8))


def test_dynamic_quant_rejects_float32(reference_npu: ModuleType) -> None:
    with pytest.raises(RuntimeError, match=r"input has dtype torch\.float32"):
        reference_npu.npu_dynamic_quant(npu(torch.randn(5, 32)))


def test_quant_matmul_dequantises_per_channel_and_per_token(torch_npu: ModuleType) -> None:
    a = torch.randint(-128, 128, (3, 64), dtype=torch.int8)
    w = torch.randint(-128, 128, (64, 16), dtype=torch.int8)
    scale, tok = torch.rand(16), torch.rand(3)
    got = torch_npu.npu_quant_matmul(npu(a), npu(w), npu(scale), pertoken_scale=npu(tok), output_dtype=BF16)
    want = torch.zeros(3, 16, dtype=torch.float64)
    for i in range(3):
        for j in range(16):
            want[i, j] = sum(int(a[i, k]) * int(w[k, j]) for k in range(64)) * float(scale[j]) * float(tok[i])
    assert got.dtype == BF16
    close(got, want, 0.02)


def test_quant_matmul_rejects_bfloat16_inputs(reference_npu: ModuleType) -> None:
    a, scale = npu(torch.randn(3, 64, dtype=BF16)), npu(torch.rand(16))
    with pytest.raises(RuntimeError, match=r"x1 has dtype torch\.bfloat16"):
        reference_npu.npu_quant_matmul(a, npu(torch.randn(64, 16, dtype=BF16)), scale)


# --- MoE ------------------------------------------------------------------------------------------
def test_gating_top_k_grouped_sigmoid_with_bias(torch_npu: ModuleType) -> None:
    torch.manual_seed(0)
    x, bias = torch.randn(6, 64), torch.randn(64) * 0.1
    y, idx, _ = torch_npu.npu_moe_gating_top_k(
        npu(x), 4, bias=npu(bias), k_group=2, group_count=4, group_select_mode=1, norm_type=1,
        routed_scaling_factor=2.5, eps=1e-20,
    )  # fmt: skip
    assert idx.dtype == torch.int32
    for r in range(6):
        s = torch.sigmoid(x[r])
        choice = s + bias
        groups = sorted(range(4), key=lambda g: -float(choice[g * 16 : g * 16 + 16].topk(2).values.sum()))[:2]
        allowed = [e for g in groups for e in range(g * 16, g * 16 + 16)]
        top = sorted(allowed, key=lambda e: -float(choice[e]))[:4]
        assert idx.cpu()[r].tolist() == top
        w = s[top] / s[top].sum() * 2.5
        close(y.cpu()[r], w, 1e-5)


def test_gating_top_k_hash_routing(torch_npu: ModuleType) -> None:
    x = torch.randn(3, 16)
    tid2eid = torch.tensor([[0, 5], [7, 1], [3, 3], [2, 9]], dtype=torch.int32)
    ids = torch.tensor([3, 0, 1], dtype=torch.int32)
    y, idx, _ = torch_npu.npu_moe_gating_top_k(
        npu(x), 2, input_ids=npu(ids), tid2eid=npu(tid2eid), norm_type=1
    )
    assert idx.cpu().tolist() == [[2, 9], [0, 5], [7, 1]]
    s = torch.sigmoid(x).gather(1, idx.cpu().long())
    close(y, s / s.sum(-1, keepdim=True), 1e-5)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"k_group": 3, "group_count": 2}, "k_group 3"),
        ({"group_count": 32}, "experts per group"),
        ({"norm_type": 2}, "norm_type must be 0"),
        ({"renorm": 1}, "renorm must be 0"),
    ],
)
def test_gating_top_k_rejects(reference_npu: ModuleType, kw: dict, match: str) -> None:
    torch_npu = reference_npu
    with pytest.raises(RuntimeError, match=match):
        torch_npu.npu_moe_gating_top_k(npu(torch.randn(2, 64)), 2, **kw)


def test_moe_pipeline_matches_a_dense_loop(torch_npu: ModuleType) -> None:
    """init_routing_v2 -> grouped_matmul -> swiglu -> grouped_matmul -> finalize_routing."""
    torch.manual_seed(1)
    n, k, e, h, f = 5, 2, 4, 8, 6
    x = torch.randn(n, h)
    experts = torch.stack([torch.randperm(e)[:k] for _ in range(n)]).to(torch.int32)
    weights = torch.rand(n, k)
    w_up, w_down = torch.randn(e, h, 2 * f), torch.randn(e, f, h)
    expanded, row_idx, counts, _ = torch_npu.npu_moe_init_routing_v2(
        npu(x), npu(experts), active_num=n * k, expert_num=e, expert_tokens_num_type=1,
        expert_tokens_num_flag=True, active_expert_range=[0, e],
    )  # fmt: skip
    assert (
        counts.dtype == torch.int64
        and counts.cpu().tolist() == torch.bincount(experts.flatten().long(), minlength=e).tolist()
    )
    (up,) = torch_npu.npu_grouped_matmul(
        [expanded], [npu(w_up)], group_list=counts, split_item=2, group_type=0, group_list_type=1
    )
    (down,) = torch_npu.npu_grouped_matmul(
        [torch_npu.npu_swiglu(up)],
        [npu(w_down)],
        group_list=counts,
        split_item=2,
        group_type=0,
        group_list_type=1,
    )
    # init_routing_v2's map is row-major: finalize reads it that way with drop_pad_mode 2
    out = torch_npu.npu_moe_finalize_routing(
        down, None, None, None, npu(weights), row_idx, npu(experts), drop_pad_mode=2
    )
    want = torch.zeros(n, h)
    for i in range(n):
        for j in range(k):
            g = x[i] @ w_up[experts[i, j]]
            a, b = g[:f], g[f:]
            want[i] += weights[i, j] * ((a * torch.sigmoid(a) * b) @ w_down[experts[i, j]])
    close(out, want, 1e-4)


def test_init_routing_v2_wants_int32_expert_ids(reference_npu: ModuleType) -> None:
    torch_npu = reference_npu
    with pytest.raises(RuntimeError, match=r"expert_idx has dtype torch\.int64"):
        torch_npu.npu_moe_init_routing_v2(
            npu(torch.randn(2, 4)), npu(torch.zeros(2, 1, dtype=torch.int64)), expert_num=2,
            expert_tokens_num_type=1, expert_tokens_num_flag=True,
        )  # fmt: skip


def test_grouped_matmul_wants_int64_group_list(reference_npu: ModuleType) -> None:
    torch_npu = reference_npu
    with pytest.raises(RuntimeError, match=r"group_list has dtype torch\.int32"):
        torch_npu.npu_grouped_matmul(
            [npu(torch.randn(4, 8))], [npu(torch.randn(2, 8, 3))], group_list=npu(torch.tensor([2, 2], dtype=torch.int32)),
            split_item=2, group_type=0, group_list_type=1,
        )  # fmt: skip


# --- sparse attention with sinks, and the indexer ------------------------------------------------
def _paged(kv: torch.Tensor, block: int, order: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter `kv` [S, D] into blocks in the page order `order`: (cache [blocks, block, 1, D], table)."""
    cache = torch.zeros(max(order) + 1, block, 1, kv.shape[-1], dtype=kv.dtype)
    for i, page in enumerate(order):
        part = kv[i * block : (i + 1) * block]
        cache[page, : part.shape[0], 0] = part
    return cache, torch.tensor([order], dtype=torch.int32)


def test_sparse_flash_attention_with_sinks_on_a_paged_cache(torch_npu: ModuleType) -> None:
    """MLA-absorb (attention_mode 2): scores q . k + q_rope . k_rope over the picked keys, the value
    the 512-wide key itself, each head's sink in the denominator; softmax_max/sum returned."""
    torch.manual_seed(2)
    heads, d, kv_len, block = 4, 512, 40, 16
    q = torch.randn(2, heads, d, dtype=BF16) * 0.05  # TND: the last two tokens of one sequence
    q_rope = torch.randn(2, heads, 64, dtype=BF16) * 0.05
    kv, k_rope = torch.randn(kv_len, d, dtype=BF16), torch.randn(kv_len, 64, dtype=BF16)
    cache, table = _paged(kv, block, [2, 0, 1])
    rope_cache, _ = _paged(k_rope, block, [2, 0, 1])
    sel = torch.tensor([[[3, 39, 17, 38, -1, -1]], [[0, 39, 12, -1, -1, -1]]], dtype=torch.int32)
    sinks = torch.randn(heads)
    out, top, total = torch_npu.npu_sparse_flash_attention(
        npu(q), npu(cache), None, npu(sel), 0.125, block_table=npu(table),
        actual_seq_lengths_query=npu(torch.tensor([2], dtype=torch.int32)),
        actual_seq_lengths_kv=npu(torch.tensor([kv_len], dtype=torch.int32)),
        query_rope=npu(q_rope), key_rope=npu(rope_cache), layout_query="TND", layout_kv="PA_BSND",
        sparse_mode=3, attention_mode=2, return_softmax_lse=True, sinks=npu(sinks),
    )  # fmt: skip
    assert top.shape == total.shape == (1, 2, heads) and top.dtype == torch.float32  # [N2, T, G]
    seen = []
    for t in range(2):
        causal = kv_len - 2 + t  # the last key token t may see
        keys = [int(i) for i in sel[t, 0] if 0 <= i <= causal]
        seen.append(keys)
        for h in range(heads):
            logits = [
                0.125 * float(q[t, h].float() @ kv[i].float() + q_rope[t, h].float() @ k_rope[i].float())
                for i in keys
            ]
            z = sum(math.exp(v) for v in logits) + math.exp(float(sinks[h]))
            want = sum(math.exp(v) / z * kv[i].float() for v, i in zip(logits, keys, strict=True))
            close(out.cpu()[t, h], want, 0.02)
            # exp(max) * sum is the whole denominator, sink included
            close(top.cpu()[0, t, h].exp() * total.cpu()[0, t, h], torch.tensor(z), 1e-4)
    assert seen == [[3, 17, 38], [0, 39, 12]]  # token 0 may not see key 39; token 1 may


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"d": 256}, "D must be 512"),  # a head dim the op does not tile
        ({"rope_d": 32}, "rope_key D must be 64|key_rope D must be 64"),
        ({"sel_dtype": torch.int64}, "sparse_indices has dtype torch.int64"),
        ({"table_dtype": torch.int64}, "block_table has dtype torch.int64"),
        ({"dtype": torch.float32}, "query has dtype torch.float32"),
        ({"block": 24}, "multiple of 16"),
        ({"transposed": True}, "query must be contiguous"),
        ({"strided_cache": True}, "key must be contiguous"),  # a cache sliced out of a wider buffer
        ({"attention_mode": 0}, "attention_mode must be 2"),
        ({"no_rope": True}, "query_rope and key_rope are required"),
        ({"heads": 6}, "power of 2"),
    ],
)
def test_sparse_flash_attention_rejects(reference_npu: ModuleType, change: dict, match: str) -> None:
    torch_npu = reference_npu
    d, block, dtype = change.get("d", 512), change.get("block", 16), change.get("dtype", BF16)
    heads, rope_d = change.get("heads", 1), change.get("rope_d", 64)
    q = torch.zeros(4, heads, d, dtype=dtype)
    query = npu(torch.zeros(4, heads, 2 * d, dtype=dtype))[..., :d] if change.get("transposed") else npu(q)
    cache = npu(torch.zeros(2, block, 1, d, dtype=dtype))
    if change.get("strided_cache"):  # e.g. the latent part of a [.., 512 + 64] buffer
        cache = npu(torch.zeros(2, block, 1, d + 64, dtype=dtype))[..., :d]
    ropes: dict = {
        "query_rope": npu(torch.zeros(4, heads, rope_d, dtype=dtype)),
        "key_rope": npu(torch.zeros(2, block, 1, rope_d, dtype=dtype)),
    }
    if change.get("no_rope"):
        ropes = {}
    sel = npu(torch.zeros(4, 1, 2, dtype=change.get("sel_dtype", torch.int32)))
    with pytest.raises(RuntimeError, match=match):
        torch_npu.npu_sparse_flash_attention(
            query, cache, None, sel, 1.0, block_table=npu(torch.zeros(1, 2, dtype=change.get("table_dtype", torch.int32))),
            actual_seq_lengths_query=npu(torch.tensor([4], dtype=torch.int32)),
            actual_seq_lengths_kv=npu(torch.tensor([4], dtype=torch.int32)), layout_query="TND", layout_kv="PA_BSND",
            attention_mode=change.get("attention_mode", 2), **ropes,
        )  # fmt: skip


def test_lightning_indexer_top_k_is_causal_and_padded(torch_npu: ModuleType) -> None:
    torch.manual_seed(3)
    heads, d, kv_len = 4, 128, 10
    q = torch.randn(3, heads, d, dtype=BF16)  # TND: the last three tokens
    keys = torch.randn(kv_len, d, dtype=BF16)
    w = torch.randn(3, heads, dtype=BF16)
    cache, table = _paged(keys, 16, [1])
    idx, values = torch_npu.npu_lightning_indexer(
        npu(q), npu(cache), npu(w), actual_seq_lengths_query=npu(torch.tensor([3], dtype=torch.int32)),
        actual_seq_lengths_key=npu(torch.tensor([kv_len], dtype=torch.int32)), block_table=npu(table),
        layout_query="TND", layout_key="PA_BSND", sparse_count=9, return_value=True,
    )  # fmt: skip
    assert idx.shape == (3, 1, 9) and idx.dtype == torch.int32
    for t in range(3):
        visible = kv_len - 3 + t + 1
        score = [
            sum(float(w[t, h]) * max(0.0, float(q[t, h].float() @ keys[s].float())) for h in range(heads))
            for s in range(visible)
        ]
        top = sorted(range(visible), key=lambda s: (-score[s], s))[:9]
        assert idx.cpu()[t, 0].tolist() == top + [-1] * (9 - len(top))
        close(values.cpu()[t, 0, : len(top)], torch.tensor([score[s] for s in top]), 0.05)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"sparse_count": 2049}, "sparse_count 2049"),
        ({"d": 64}, "D=64: only 128"),  # the indexer's head dim must be 128
        ({"table_dtype": torch.int64}, "block_table has dtype torch.int64"),
        ({"lens_dtype": torch.int64}, "actual_seq_lengths_key has dtype torch.int64"),
        ({"weights_dtype": torch.float32}, "weights has dtype torch.float32"),
        ({"strided_key": True}, "key must be contiguous"),
        ({"block": 24}, "multiple of 16"),
        ({"no_table": True}, "block_table is required"),
    ],
)
def test_lightning_indexer_rejects(reference_npu: ModuleType, change: dict, match: str) -> None:
    d, block = change.get("d", 128), change.get("block", 16)
    q = npu(torch.randn(3, 4, d, dtype=BF16))
    w = npu(torch.randn(3, 4).to(change.get("weights_dtype", BF16)))
    cache = npu(torch.randn(1, block, 1, d, dtype=BF16))
    if change.get("strided_key"):
        cache = npu(torch.randn(1, block, 1, 2 * d, dtype=BF16))[..., :d]
    table = (
        None
        if change.get("no_table")
        else npu(torch.zeros(1, 1, dtype=change.get("table_dtype", torch.int32)))
    )
    with pytest.raises(RuntimeError, match=match):
        reference_npu.npu_lightning_indexer(
            q, cache, w, actual_seq_lengths_query=npu(torch.tensor([3], dtype=torch.int32)),
            actual_seq_lengths_key=npu(torch.tensor([block], dtype=change.get("lens_dtype", torch.int32))),
            block_table=table, layout_query="TND", layout_key="PA_BSND", sparse_count=change.get("sparse_count", 8),
        )  # fmt: skip


# --- dense attention (what HF transformers' Ascend integration imports and calls) -----------------
def _dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, shift: int | None
) -> torch.Tensor:
    """q [Sq, N, D], k/v [Skv, Nkv, D]: each head's softmax over the keys it may see, one row at a
    time; shift None: every key, else key j visible from query i when j <= i + shift."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1])
    group = q.shape[1] // k.shape[1]
    for i in range(q.shape[0]):
        keys = [j for j in range(k.shape[0]) if shift is None or j <= i + shift]
        for h in range(q.shape[1]):
            logits = torch.tensor([scale * float(q[i, h] @ k[j, h // group]) for j in keys])
            out[i, h] = sum(p * v[j, h // group] for p, j in zip(logits.softmax(0), keys, strict=True))
    return out


CAUSAL = torch.ones(2048, 2048, dtype=torch.bool).triu(1)  # the compressed mask of sparse modes 2-4


@pytest.mark.parametrize(("sparse_mode", "shift"), [(None, None), (2, 0), (3, 3)])
def test_fusion_attention_bsnd_gqa(torch_npu: ModuleType, sparse_mode: int | None, shift: int | None) -> None:
    torch.manual_seed(4)
    q, k, v = torch.randn(2, 5, 4, 16), torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16)
    mask = {} if sparse_mode is None else {"atten_mask": npu(CAUSAL), "sparse_mode": sparse_mode}
    out, smax, ssum, sout, seed, offset, numels = torch_npu.npu_fusion_attention(
        npu(q), npu(k), npu(v), 4, "BSND", scale=0.25, **mask
    )
    for b in range(2):
        close(out.cpu()[b], _dense(q[b], k[b], v[b], 0.25, shift), 1e-5)
    assert smax.shape == ssum.shape == (2, 4, 5, 8) and smax.dtype == torch.float32
    assert sout.numel() == 0 and (seed, offset, numels) == (0, 0, 0)


def test_fusion_attention_varlen_tnd(torch_npu: ModuleType) -> None:
    """TND: cumulative lengths per batch, rightDownCausal within each (what transformers' varlen
    path passes)."""
    torch.manual_seed(5)
    q, k, v = torch.randn(9, 4, 16), torch.randn(11, 4, 16), torch.randn(11, 4, 16)
    out = torch_npu.npu_fusion_attention(
        npu(q), npu(k), npu(v), 4, "TND", scale=0.3, atten_mask=npu(CAUSAL), sparse_mode=3,
        actual_seq_qlen=[4, 9], actual_seq_kvlen=[5, 11],
    )[0]  # fmt: skip
    close(out.cpu()[:4], _dense(q[:4], k[:5], v[:5], 0.3, 1), 1e-5)
    close(out.cpu()[4:], _dense(q[4:], k[5:], v[5:], 0.3, 1), 1e-5)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"keep_prob": 0.9}, "dropout"),
        ({"padding_mask": True}, "padding_mask is not supported"),
        ({"sparse_mode": 3}, "compressed 2048x2048 mask"),  # a full [Sq, Skv] mask with a causal mode
        ({"layout": "TND"}, "TND needs actual_seq_qlen"),
        ({"dtype": torch.float16}, "share a dtype"),
    ],
)
def test_fusion_attention_rejects(reference_npu: ModuleType, change: dict, match: str) -> None:
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8, dtype=change.get("dtype", torch.float32))
    layout = change.get("layout", "BSND")
    if layout == "TND":
        q, k = q[0], k[0]
    kw: dict = {"keep_prob": change.get("keep_prob", 1.0)}
    if change.get("padding_mask"):
        kw["padding_mask"] = npu(torch.zeros(4, 4, dtype=torch.bool))
    if "sparse_mode" in change:
        kw |= {"atten_mask": npu(torch.zeros(4, 4, dtype=torch.bool)), "sparse_mode": change["sparse_mode"]}
    with pytest.raises(RuntimeError, match=match):
        reference_npu.npu_fusion_attention(npu(q), npu(k), npu(k), 2, layout, **kw)
