"""The NPU kernel set: `TorchKernels` with the ops torch_npu has a fused form of (the seed's Ascend
path), so the rest of the forward runs as torch forms on the device until each gets its op.

So far: RMSNorm (`npu_rms_norm`), the interleaved RoPE (`npu_rotary_mul`, rotary_mode 'interleave',
with the position's cos/sin rows broadcast over heads, as the seed's `Dsv4NpuRoPE` feeds it), the
shared expert's SwiGLU (`npu_swiglu`, after DSV4's clamps), the MoE (routing through
`npu_moe_gating_top_k`; the routed experts as `npu_moe_init_routing_v2`, `npu_grouped_matmul`,
the clamped `npu_swiglu`, `npu_grouped_matmul`, `npu_moe_finalize_routing`), W8A8 projections
(`npu_dynamic_quant` + `npu_quant_matmul`) and W8A8 routed experts (the same MoE ops with int8 grouped
matmuls, `npu_dynamic_quant` before each), the attention over the window and compressed pages
(`npu_sparse_flash_attention`, one call per pool, merged by their softmax statistics), the CSA
indexer (`npu_lightning_indexer`) and every paged write (`npu_scatter_nd_update_`). The decode
variant runs each MoE layer's shared expert on a second stream beside its routed experts.

The rules: an op is used only where its documented constraints hold (bf16/fp16, DSV4's 512/64/128
head dims, a power-of-2 head count, the indexer's sparse_count list); anything else (an fp32 model,
another tiny shape) runs the torch form, so a test model of any shape still serves. Index inputs are
int32 with the valid entries first and -1 after, as the sparse ops read them. Every op has static
shapes and reads nothing on the host, so the decode variant captures as it is. docs/npu.md lists each
op's rules; tests/npu compares every op here with the CPU kernels through the reference torch_npu.
torch_npu is imported when the set is built, which happens only for an `npu` device
(`choose_kernels`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from dsv4_engine import quant
from dsv4_engine.kernels.base import KernelSet
from dsv4_engine.kernels.torch_forms import StaticTorchKernels, TorchKernels
from dsv4_engine.kernels.torch_ops import all_row_slots, clamp_gate_up_, dense_ids

Tensor = torch.Tensor
_TINY = torch.finfo(torch.float32).tiny
_HALVES = (torch.bfloat16, torch.float16)  # what the attention ops take
# npu_sparse_flash_attention: a 512-wide latent (also the value) and 64 rope channels, one KV head,
# query heads a power of 2 up to 128 (ops-transformer's tiling).
_SFA_LATENT, _SFA_ROPE, _SFA_HEADS = 512, 64, (1, 2, 4, 8, 16, 32, 64, 128)
_LI_DIM = 128  # npu_lightning_indexer's only head dim
_LI_COUNTS = frozenset((*range(1, 2049), 3072, 4096, 5120, 6144, 7168, 8192))  # its sparse_count list
# npu_scatter_nd_update_'s self/updates dtypes on A2/A3 (not int32).
_SCATTER_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.bool)


def _valid_first(idx: Tensor, valid: Tensor) -> Tensor:
    """idx `[B, n]` as the sparse ops' index rows: the valid entries first, in order, then -1; int32.
    One argsort of unique keys (static shapes, on the device)."""
    col = torch.arange(idx.shape[-1], device=idx.device)
    order = torch.where(valid, col, col + idx.shape[-1]).argsort(dim=-1)
    return torch.where(valid, idx, -1).gather(-1, order).to(torch.int32)


def _merge(window: tuple[Tensor, Tensor, Tensor], comp: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """One softmax over both key sets from two partial ones: each part's output (normalised over its
    own keys, the window's denominator with the sink) weighted by its denominator `sum * exp(max)`,
    taken against the larger max. A part with no keys (max -inf, sum 0) weighs 0; a padding row with
    none at all comes out 0 (its values are never kept)."""
    (out_w, max_w, sum_w), (out_c, max_c, sum_c) = window, comp
    top = torch.maximum(max_w, max_c)
    top = torch.where(torch.isfinite(top), top, 0.0)
    weight_w = (sum_w * torch.exp(max_w - top))[0, :, :, None]  # [1, B, H] (TND's N2, T, G) -> [B, H, 1]
    weight_c = (sum_c * torch.exp(max_c - top))[0, :, :, None]
    total = (weight_w + weight_c).clamp(min=_TINY)
    return ((out_w.float() * weight_w + out_c.float() * weight_c) / total).to(out_w.dtype)


class _NpuOps:
    """The torch_npu forms, shared by the extend and decode variants."""

    native_w8a8: ClassVar[bool] = True  # A3 has no fp8 matmul: W8A8 runs as int8 (npu_quant_matmul)

    def __init__(self) -> None:
        self.npu: Any = importlib.import_module("torch_npu")
        # Zero key_rope inputs, one per (pool rows, dtype, device): made on the first (eager) step,
        # so a captured step reads a buffer that outlives it.
        self._zero_ropes: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}

    def quant_linear(self, x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
        """`npu_dynamic_quant` (int8 rows, one fp32 scale per token) then `npu_quant_matmul` with the
        weight's transpose as x2 (a view of the stored [out, in]: the op's transposed layout, no
        copy), the fp32 per-row scale and the per-token scales. The ops take fp16/bf16 only, and no
        empty tensor: an fp32 x is quantised from bf16 and the result cast back."""
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], weight.shape[0])
        half = rows if rows.dtype in (torch.float16, torch.bfloat16) else rows.to(torch.bfloat16)
        q, token_scale = self.npu.npu_dynamic_quant(half)
        y = self.npu.npu_quant_matmul(
            q, weight.t(), scale, pertoken_scale=token_scale, output_dtype=half.dtype
        )
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    def quant_grouped_linear(self, x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
        """`npu_dynamic_quant` of the [T*G, in] rows, then one `npu_grouped_matmul` whose groups are
        the projection's: the rows group-major (T a group), the weight's [G, in, R] transposed view
        of the stored [G*R, in] (no copy), the per-row scale [G, R] as the op pairs it with the output
        (`quant.grouped_matmul_scale`) and the rows' per-token scales. fp32 x runs in bf16."""
        tokens, groups, width = x.shape
        if tokens == 0:  # the ops take no empty tensors
            return x.new_empty(0, weight.shape[0])
        half = x if x.dtype in _HALVES else x.to(torch.bfloat16)
        q, token_scale = self.npu.npu_dynamic_quant(half.reshape(tokens * groups, width))
        rows = q.view(tokens, groups, width).transpose(0, 1).reshape(groups * tokens, width)
        row_scale = token_scale.view(tokens, groups).t().reshape(-1)
        # Counts of one group would be refused; one group's count is also its cumsum.
        counts = torch.full((groups,), tokens, dtype=torch.int64, device=x.device)
        (y,) = self.npu.npu_grouped_matmul(
            [rows], [weight.view(groups, -1, width).transpose(1, 2)],
            scale=[quant.grouped_matmul_scale(scale.view(groups, -1), half.dtype)],
            per_token_scale=[row_scale], output_dtype=half.dtype, group_list=counts, split_item=2,
            group_type=0, group_list_type=int(groups > 1),
        )  # fmt: skip
        return y.view(groups, tokens, -1).transpose(0, 1).reshape(tokens, -1).to(x.dtype)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        # The op wants gamma in x's dtype (it computes in fp32 either way).
        return self.npu.npu_rms_norm(x, weight.to(x.dtype), epsilon=eps)[0]

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
        """In place on x's last `cos.shape[-1]` channels, like the torch form. The op takes 4-D
        [S, N, 1, D] input with one [S, 1, 1, D] table per position (its S11D layout)."""
        width, rows = cos.shape[-1], cos.shape[0]
        part = x[..., -width:]
        table = (rows, 1, 1, width)
        r1 = cos.to(x.dtype).reshape(table)
        r2 = (-sin if inverse else sin).to(x.dtype).reshape(table)
        out = self.npu.npu_rotary_mul(part.reshape(rows, -1, 1, width), r1, r2, rotary_mode="interleave")
        part.copy_(out.view(part.shape))
        return x

    def shared_expert(self, x: Tensor, gate_up: Tensor, down: Tensor, limit: float) -> Tensor:
        h = F.linear(x, gate_up)
        clamp_gate_up_(h, limit)  # DSV4's clamps first: the op computes a plain SwiGLU
        return F.linear(self.npu.npu_swiglu(h, dim=-1), down)

    def route(
        self,
        x: Tensor,
        input_ids: Tensor,
        weight: Tensor,
        table: Tensor,
        is_hash: bool,
        top_k: int,
        scaling: float,
    ) -> tuple[Tensor, Tensor]:
        """`npu_moe_gating_top_k` on DSV4's scores; ids come back int32 (what init_routing takes).

        The op normalises its input by softmax or sigmoid only (torch_npu 2.14.0), and DSV4 scores
        are s = sqrt(softplus(logits)) in (0, inf). So s is computed here in fp32 and handed over as
        logit(s / c) with c = 2 * max(s) (a device scalar: no host read): the op's sigmoid gives back
        s / c, its selection adds bias / c (the same order as s + bias), and its renormalised picks
        (s / c)_i / sum (s / c) are DSV4's weights; it then applies routed_scaling_factor. Hash
        layers go through the op's tid2eid mode (ids = table[input_ids], no bias)."""
        scores = F.softplus(F.linear(x, weight).float()).sqrt()
        c = scores.amax().clamp(min=_TINY) * 2  # s / c <= 1/2: logit finite and well conditioned
        shrunk = (scores / c).clamp_(min=_TINY)  # an underflowed score stays a finite logit
        logits = torch.log(shrunk) - torch.log1p(-shrunk)  # sigmoid^-1
        picks: dict[str, Tensor] = (
            {"input_ids": input_ids, "tid2eid": table} if is_hash else {"bias": table.float() / c}
        )
        weights, ids, _ = self.npu.npu_moe_gating_top_k(
            logits, top_k, k_group=1, group_count=1, group_select_mode=0, renorm=0, norm_type=1,
            routed_scaling_factor=scaling, eps=1e-20, **picks,
        )  # fmt: skip
        return weights.to(x.dtype), ids

    def routed_experts(
        self, x: Tensor, gate_up: Tensor, down: Tensor, ids: Tensor, weights: Tensor, limit: float
    ) -> Tensor:
        """Dropless dispatch: `npu_moe_init_routing_v2` sorts the (token, expert) pairs by expert
        (rows [T*k, D] and the per-expert counts, on the device), two `npu_grouped_matmul` run each
        expert on its rows with DSV4's clamped SwiGLU between them, and `npu_moe_finalize_routing`
        sums each token's rows by its weights. Another rank's pairs (-1) run on local expert 0 at
        weight 0, keeping the shapes static (a multi-rank NPU server belongs to dispatch/combine
        ops)."""
        if x.shape[0] == 0:  # the ops take no empty tensors
            return torch.zeros_like(x)
        ids, weights = dense_ids(ids, weights)
        rows, row_idx, groups, _ = self._dispatch(x, ids, gate_up.shape[0], None)
        # Weights as stored ([E, out, in]) are the op's transposed layout: no copy.
        (h,) = self.npu.npu_grouped_matmul([rows], [gate_up.transpose(1, 2)], **groups)
        clamp_gate_up_(h, limit)  # DSV4's clamps first: the op computes a plain SwiGLU
        (y,) = self.npu.npu_grouped_matmul([self.npu.npu_swiglu(h, dim=-1)], [down.transpose(1, 2)], **groups)
        return self._combine(y, weights, row_idx)

    def quant_routed_experts(
        self,
        x: Tensor,
        gate_up: Tensor,
        gate_up_scale: Tensor,
        down: Tensor,
        down_scale: Tensor,
        ids: Tensor,
        weights: Tensor,
        limit: float,
    ) -> Tensor:
        """`routed_experts` in W8A8: the tokens quantised once (`npu_dynamic_quant`, T rows, not T*k),
        their int8 rows and per-token scales sorted together by `npu_moe_init_routing_v2` (its `scale`
        passes through unquantised mode as `expanded_scale`), each `npu_grouped_matmul` int8 x int8
        with the experts' per-row `scale` [E, N] and the rows' `per_token_scale` [M] into x's dtype,
        the SwiGLU output quantised again between them. The op pairs a bf16 output with bf16 scales
        and an fp16 one with fp32 (`quant.grouped_matmul_scale`); fp32 x runs in bf16, as
        `quant_linear` does."""
        if x.shape[0] == 0:  # the ops take no empty tensors
            return torch.zeros_like(x)
        half = x if x.dtype in _HALVES else x.to(torch.bfloat16)
        ids, weights = dense_ids(ids, weights)
        q, token_scale = self.npu.npu_dynamic_quant(half)
        rows, row_idx, groups, row_scale = self._dispatch(q, ids, gate_up.shape[0], token_scale)

        def gmm(a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor) -> Tensor:
            (y,) = self.npu.npu_grouped_matmul(
                [a], [w.transpose(1, 2)], scale=[quant.grouped_matmul_scale(w_scale, half.dtype)],
                per_token_scale=[a_scale], output_dtype=half.dtype, **groups,
            )  # fmt: skip
            return y

        h = gmm(rows, row_scale, gate_up, gate_up_scale)
        clamp_gate_up_(h, limit)  # then the plain SwiGLU, as in `routed_experts`
        act, act_scale = self.npu.npu_dynamic_quant(self.npu.npu_swiglu(h, dim=-1))
        return self._combine(gmm(act, act_scale, down, down_scale), weights, row_idx).to(x.dtype)

    def _dispatch(
        self, x: Tensor, ids: Tensor, num_experts: int, scale: Tensor | None
    ) -> tuple[Tensor, Tensor, dict[str, Any], Tensor]:
        """`npu_moe_init_routing_v2` of x's rows by local ids `[T, k]` (no -1): (rows [T*k, D] sorted
        by expert, the row-major map, the grouped matmul's group arguments, the rows' `scale`)."""
        rows, row_idx, counts, row_scale = self.npu.npu_moe_init_routing_v2(
            x,
            ids.to(torch.int32),
            scale=scale,
            active_num=x.shape[0] * ids.shape[1],
            expert_num=num_experts,
            expert_tokens_num_type=1,  # per-expert counts (int64), the grouped matmul's group_list
            expert_tokens_num_flag=True,
            active_expert_range=[0, num_experts],
        )
        # The op refuses a list of counts of length 1; one expert's count is also its cumsum.
        groups: dict[str, Any] = {
            "group_list": counts,
            "split_item": 2,
            "group_type": 0,
            "group_list_type": int(num_experts > 1),
        }
        return rows, row_idx, groups, row_scale

    def _combine(self, y: Tensor, weights: Tensor, row_idx: Tensor) -> Tensor:
        """Each token's k rows of y summed by its weights (`npu_moe_finalize_routing`)."""
        # drop_pad_mode 2: init_routing_v2's map is row-major (token * k + slot)
        return self.npu.npu_moe_finalize_routing(
            y, None, None, None, weights.to(y.dtype), row_idx, None, drop_pad_mode=2
        )

    # ---- the extend step's attention and indexer (one request's chunk, dense keys) ------------------
    def block_attention(self, q: Tensor, keys: Tensor, bias: Tensor, sinks: Tensor, scaling: float) -> Tensor:
        """`npu_sparse_flash_attention` with each query block a batch (BSND): its b queries over its K
        keys, each reading the keys its mask leaves (the extend's biases are 0 / -inf masks: 0 reads),
        valid first; the sinks in the op. The rope inputs are zeros, as in the decode step."""
        nb, b, heads, dim = q.shape
        if not (q.dtype in _HALVES and keys.dtype == q.dtype and dim == _SFA_LATENT and heads in _SFA_HEADS):
            return super().block_attention(q, keys, bias, sinks, scaling)  # type: ignore[misc]
        width = keys.shape[1]
        cols = torch.arange(width, device=q.device).expand(nb, b, width)
        picked = _valid_first(cols, bias == 0).view(nb, b, 1, width)
        kv = keys.contiguous().view(nb, width, 1, dim)
        out, _, _ = self.npu.npu_sparse_flash_attention(
            q.contiguous(), kv, kv, picked, scaling,
            query_rope=q.new_zeros(nb, b, heads, _SFA_ROPE), key_rope=keys.new_zeros(nb, width, 1, _SFA_ROPE),
            layout_query="BSND", layout_kv="BSND", sparse_mode=0, attention_mode=2, sinks=sinks,
        )  # fmt: skip
        return out.view(nb * b, heads, dim)

    def index_bias(
        self, q: Tensor, weights: Tensor, keys: Tensor, visible: Tensor, scale: float, k: int
    ) -> Tensor:
        """`npu_lightning_indexer` with each query its own batch (BSND, one token) over the request's
        rows as one paged sequence (zero-padded to whole blocks, every batch's block table the same
        identity), its kv length its visible rows; the picks become the 0 / -inf bias. At most k rows:
        every visible one, no scores (the torch form)."""
        n, num_rows = q.shape[0], keys.shape[0]
        count = min(k, num_rows)
        if not (
            num_rows > k
            and q.dtype in _HALVES
            and keys.dtype == q.dtype
            and q.shape[-1] == _LI_DIM
            and count in _LI_COUNTS
        ):
            return super().index_bias(q, weights, keys, visible, scale, k)  # type: ignore[misc]
        heads, dim = q.shape[1:]
        block = min(1024, -(-num_rows // 16) * 16)  # the op's blocks: 16-aligned, at most 1024 rows
        blocks = -(-num_rows // block)
        paged = F.pad(keys, (0, 0, 0, blocks * block - num_rows)).view(blocks, block, 1, dim)
        table = torch.arange(blocks, dtype=torch.int32, device=q.device).expand(n, blocks).contiguous()
        picks, _ = self.npu.npu_lightning_indexer(
            q.contiguous().view(n, 1, heads, dim), paged, (weights.float() * scale).to(q.dtype).view(n, 1, heads),
            actual_seq_lengths_key=visible.to(torch.int32), block_table=table,
            layout_query="BSND", layout_key="PA_BSND", sparse_count=count, sparse_mode=0,
        )  # fmt: skip
        picks = picks.view(n, count).long()
        bias = q.new_full((n, num_rows + 1), float("-inf"), dtype=torch.float32)  # a spare column for -1
        return bias.scatter_(1, torch.where(picks >= 0, picks, num_rows), 0.0)[:, :num_rows]

    # ---- the decode step's paged writes, attention and indexer ------------------------------------
    def put_rows(self, pool: Tensor, slots: Tensor, rows: Tensor) -> None:
        """`npu_scatter_nd_update_` (each slot a 1-element index tuple): the seed's paged-cache write,
        free of aclnnIndexPut's int32-values limit. Dtypes the op refuses (int32) keep index_put_."""
        if pool.dtype not in _SCATTER_DTYPES or rows.dtype != pool.dtype or slots.numel() == 0:
            super().put_rows(pool, slots, rows)  # type: ignore[misc]
            return
        self.npu.npu_scatter_nd_update_(pool, slots.view(-1, 1), rows)

    def paged_attention(
        self,
        q: Tensor,
        swa: Tensor,
        swa_slots: Tensor,
        comp: Tensor | None,
        page_table: Tensor,
        rows: Tensor | None,
        visible: Tensor | None,
        ratio: int,
        page_size: int,
        sinks: Tensor,
        scaling: float,
    ) -> Tensor:
        """`npu_sparse_flash_attention` over the window (with the sinks) and, with a compressed pool,
        over its rows (HCA: every row below visible; CSA: the indexer's picks), the two merged by
        their softmax statistics. The pools differ, so one call each. Other dtypes and shapes (an
        fp32 model, a head dim other than 512): the torch form."""
        pools = (swa,) if comp is None else (swa, comp)
        if not (
            q.dtype in _HALVES
            and q.shape[-1] == _SFA_LATENT
            and q.shape[1] in _SFA_HEADS
            and all(p.dtype == q.dtype and p.is_contiguous() for p in pools)
        ):
            return super().paged_attention(  # type: ignore[misc]
                q, swa, swa_slots, comp, page_table, rows, visible, ratio, page_size, sinks, scaling
            )
        window = _valid_first(swa_slots, swa_slots >= 0)  # a window before position 0 starts with -1s
        if comp is None or visible is None:
            return self._sparse(q, swa, window, scaling, sinks, lse=False)[0]
        slots = all_row_slots(page_table, ratio, page_size)  # [B, N]
        seen = visible[:, None]
        if rows is None:  # HCA: rows 0..visible-1, already a prefix
            picked = torch.where(torch.arange(slots.shape[1], device=q.device) < seen, slots, -1).to(
                torch.int32
            )
        else:  # CSA: the picks, those not rows (-1, or at or past visible) dropped
            picked = _valid_first(slots.gather(1, rows.clamp(min=0)), (rows >= 0) & (rows < seen))
        return _merge(
            self._sparse(q, swa, window, scaling, sinks, lse=True),
            self._sparse(q, comp, picked, scaling, None, lse=True),
        )

    def _sparse(
        self, q: Tensor, pool: Tensor, picked: Tensor, scaling: float, sinks: Tensor | None, lse: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One `npu_sparse_flash_attention` of q `[B, H, 512]` over a flat pool `[S, 512]` at the
        absolute slots `picked [B, n]` (int32, valid first, -1 after): the B rows are one TND batch of
        B query tokens over the whole pool as one sequence (sparse_mode 0: no causal mask), each token
        reading its own slots, so no block table is needed for any pool's page size (a ratio-128 pool
        has one row a page, which no 16-aligned block fits). DSV4's 512 channels, rope included, are
        the op's latent and value (K = V); its separate 64-channel rope inputs are zeros."""
        bsz, heads, _ = q.shape
        rows = pool.shape[0]
        kv = pool.view(rows, 1, pool.shape[-1])
        return self.npu.npu_sparse_flash_attention(
            q.contiguous(), kv, kv, picked.view(bsz, 1, -1), scaling,
            actual_seq_lengths_query=torch.full((1,), bsz, dtype=torch.int32, device=q.device),
            actual_seq_lengths_kv=torch.full((1,), rows, dtype=torch.int32, device=q.device),
            query_rope=q.new_zeros(bsz, heads, _SFA_ROPE), key_rope=self._zero_rope(pool),
            layout_query="TND", layout_kv="TND", sparse_mode=0, attention_mode=2,
            return_softmax_lse=lse, sinks=sinks,
        )  # fmt: skip

    def _zero_rope(self, pool: Tensor) -> Tensor:
        key = (pool.shape[0], pool.dtype, pool.device)
        if key not in self._zero_ropes:
            self._zero_ropes[key] = pool.new_zeros(pool.shape[0], 1, _SFA_ROPE)
        return self._zero_ropes[key]

    def index_topk(
        self,
        q: Tensor,
        weights: Tensor,
        keys: Tensor,
        page_table: Tensor,
        visible: Tensor,
        ratio: int,
        page_size: int,
        scale: float,
        k: int,
    ) -> Tensor:
        """`npu_lightning_indexer` on the paged indexer pool: one query token per batch row (BSND),
        the request's page table as the block table (P / ratio rows a block), kv lengths = visible.
        The op scores `sum_h w_h * relu(q_h . key)` with no scale, so the (positive) scale goes into
        the weights, cast to q's dtype as the op wants. Past visible it pads with -1 (not rows, as the
        CPU kernels mark them); int64 like the other sets' picks."""
        per_page = page_size // ratio
        count = min(k, page_table.shape[1] * per_page)
        if not (
            q.dtype in _HALVES
            and keys.dtype == q.dtype
            and q.shape[-1] == _LI_DIM
            and per_page % 16 == 0
            and per_page <= 1024
            and count in _LI_COUNTS
        ):
            return super().index_topk(q, weights, keys, page_table, visible, ratio, page_size, scale, k)  # type: ignore[misc]
        bsz, heads, dim = q.shape
        picks, _ = self.npu.npu_lightning_indexer(
            q.contiguous().view(bsz, 1, heads, dim), keys.view(-1, per_page, 1, dim),
            (weights.float() * scale).to(q.dtype).view(bsz, 1, heads),
            actual_seq_lengths_key=visible.to(torch.int32), block_table=page_table.to(torch.int32).contiguous(),
            layout_query="BSND", layout_key="PA_BSND", sparse_count=count, sparse_mode=0,
        )  # fmt: skip
        return picks.view(bsz, count).long()


class NpuKernels(_NpuOps, TorchKernels):
    """Extend steps' NPU set."""

    name = "npu"

    def for_decode(self, compiled: bool) -> KernelSet:
        # No compiler for NPU here: a decode step is eager or captured (aclgraph), one static form.
        return NpuDecodeKernels()


class NpuDecodeKernels(_NpuOps, StaticTorchKernels):
    """The batched decode step's NPU set (static shapes, no host reads: graph-capturable), which
    overlaps each MoE layer's shared expert with its routed experts on a second stream."""

    name = "npu"

    def __init__(self) -> None:
        super().__init__()
        self._alt: Any = None  # the shared expert's stream: one per set, made on the first step

    def routed_and_shared(self, routed: Callable[[], Tensor], shared: Callable[[], Tensor]) -> Tensor:
        """The shared expert on the alt stream while the router and routed experts (gating top-k,
        init_routing, two grouped matmuls, finalize) run on the current one: at decode sizes both are
        chains of small ops that fill each other's gaps (the seed turns this overlap on for NPU).
        Alt forks from the current stream before reading x and joins back before the sum, which
        aclgraph captures as one graph. Memory: alt reads only x and weights, made on the current
        stream and held past the join (the caller holds x through the sum), so no `record_stream`;
        the shared output is alt's and read only after the join. Same ops and the same sum as one
        stream, so the same output bit for bit."""
        npu = self.npu.npu
        main = npu.current_stream()
        if self._alt is None:
            self._alt = npu.Stream(device=main.device)
        self._alt.wait_stream(main)  # x and everything before it are written
        with npu.stream(self._alt):
            shared_out = shared()
        out = routed()
        main.wait_stream(self._alt)  # the shared output is complete
        return out.add_(shared_out)
