"""The torch kernel set: every op in plain torch, the reference the other sets are tested against
and fall back to (other dtypes, other sizes), and what a compiler fuses or a device graph captures.

Three variants, one per kind of step:
- `TorchKernels` (extend: prefill chunks, the reference decode): dynamic shapes and host reads allowed
  (the routed experts dispatch by expert from host counts);
- `StaticTorchKernels` (the batched decode step, eager or captured as a device graph): static shapes
  and no host reads (the routed experts gathered per slot or dense);
- `CompiledTorchKernels` (that step under `torch.compile`): the forms inductor handles best (one
  batched GEMV per expert slot, the stable top-k as one `topk`, no `out=` buffers).
The values are the same in every variant but the routed experts' summation order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from dsv4_engine import quant
from dsv4_engine.attention.decode_fill import fill_decode_buffers
from dsv4_engine.kernels.base import KernelSet
from dsv4_engine.kernels.torch_ops import (
    all_row_slots,
    by_expert,
    collapse,
    dense_experts,
    dense_ids,
    expand,
    gather_rows,
    index_scores,
    page_segments,
    stable_topk,
    stable_topk_rows,
    stream_mixes,
    swiglu,
    swiglu_,
    unweighted_rms_norm,
    visible_bias,
)
from dsv4_engine.rope import rotate_, rotate_rows

if TYPE_CHECKING:
    from dsv4_engine.attention.decode_fill import DecodeLocs
    from dsv4_engine.attention.metadata import AttentionMetadata, CompressMetadata
    from dsv4_engine.memory.req_to_token import Dsv4ReqPool

Tensor = torch.Tensor
NEG_INF = float("-inf")


class TorchKernels(KernelSet):
    """Extend steps' torch forms, and every other set's fallback."""

    name = "torch"
    # The stable top-k as one `topk` over int64 keys (a compiler's best form) instead of a stable sort.
    topk_by_keys = False

    def for_decode(self, compiled: bool) -> KernelSet:
        return CompiledTorchKernels() if compiled else StaticTorchKernels()

    # ---- dense layers --------------------------------------------------------------------------
    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        return F.linear(x, weight)

    def quant_linear(self, x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
        """The NPU's W8A8 arithmetic (npu_dynamic_quant, then npu_quant_matmul) in torch, so the
        rounding is the device's: exact int32 sums, rescaled in fp32."""
        rows = x.reshape(-1, x.shape[-1])
        q, token_scale = quant.quant_per_token(rows)
        sums = torch.matmul(q.to(torch.int32), weight.to(torch.int32).t())
        y = sums.to(torch.float32) * token_scale.unsqueeze(-1) * scale.to(torch.float32)
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    def grouped_linear(self, x: Tensor, weight: Tensor) -> Tensor:
        w = weight.view(x.shape[1], -1, x.shape[-1])  # [G, R, in]
        return torch.bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1).flatten(1)

    def quant_grouped_linear(self, x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
        """The NPU's arithmetic (npu_dynamic_quant of the [T*G, in] rows, then npu_grouped_matmul
        with the scale as that op takes it) in torch: exact int32 sums, rescaled in fp32."""
        tokens, groups, width = x.shape
        q, token_scale = quant.quant_per_token(x.reshape(tokens * groups, width))
        q = q.view(tokens, groups, width).transpose(0, 1).to(torch.int32)  # [G, T, in]
        w = weight.view(groups, -1, width).to(torch.int32)  # [G, R, in]
        sums = torch.bmm(q, w.transpose(1, 2)).to(torch.float32)  # [G, T, R]
        w_scale = quant.grouped_matmul_scale(scale, x.dtype).to(torch.float32).view(groups, 1, -1)
        y = sums * token_scale.view(tokens, groups).t().unsqueeze(-1) * w_scale
        return y.to(x.dtype).transpose(0, 1).reshape(tokens, -1)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return xf.mul_(weight).to(x.dtype)  # in place on the fresh product: one buffer fewer

    def head_rms_norm(self, x: Tensor, eps: float) -> Tensor:
        return x.mul_(torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype))

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
        shape = (cos.shape[0], *([1] * (x.dim() - 2)), cos.shape[-1])
        return rotate_(x, cos.view(shape), (-sin if inverse else sin).view(shape))

    # ---- mHC -----------------------------------------------------------------------------------
    def hc_pre(
        self,
        streams: Tensor,
        fn: Tensor,
        base: Tensor,
        scale: Tensor,
        iters: int,
        hc_eps: float,
        norm_eps: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        n = streams.shape[1]
        mixes = stream_mixes(streams, fn, norm_eps)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = base.split([n, n, n * n])
        pre_s, post_s, comb_s = scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), dim=-1) + hc_eps
        # Sinkhorn-Knopp: columns, then (rows, columns) iters - 1 times; in place (same rounding).
        comb.div_(comb.sum(dim=-2, keepdim=True).add_(hc_eps))
        for _ in range(iters - 1):
            comb.div_(comb.sum(dim=-1, keepdim=True).add_(hc_eps))
            comb.div_(comb.sum(dim=-2, keepdim=True).add_(hc_eps))
        return post, comb, collapse(pre, streams)

    def hc_post(self, post: Tensor, comb: Tensor, out: Tensor, streams: Tensor, into: Tensor) -> Tensor:
        return expand(post, comb, out, streams, into=into)

    # ---- MoE -----------------------------------------------------------------------------------
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
        scores = F.softplus(F.linear(x, weight)).sqrt()
        if is_hash:
            ids = table.index_select(0, input_ids).long()
        else:
            ids = torch.topk(scores + table, top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * scaling, ids

    def routed_experts(
        self, x: Tensor, gate_up: Tensor, down: Tensor, ids: Tensor, weights: Tensor, limit: float
    ) -> Tensor:
        def expert(rows: Tensor, e: int) -> Tensor:
            return F.linear(swiglu_(F.linear(rows, gate_up[e]), limit), down[e])

        return by_expert(x, ids, weights, gate_up.shape[0], expert)

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
        """Each expert's two matmuls as `quant_linear` (per-row int8 is the same on an expert's slice
        as on the whole batch), the scales rounded as the device's grouped matmul takes them. One form
        for every variant, host reads included: int8 experts reach a torch set only in tests (its
        `native_w8a8` is False, so an engine's are dequantised at load)."""
        up_scale = quant.grouped_matmul_scale(gate_up_scale, x.dtype)
        down_scale = quant.grouped_matmul_scale(down_scale, x.dtype)

        def expert(rows: Tensor, e: int) -> Tensor:
            h = swiglu_(self.quant_linear(rows, gate_up[e], up_scale[e]), limit)
            return self.quant_linear(h, down[e], down_scale[e])

        return by_expert(x, ids, weights, gate_up.shape[0], expert)

    def shared_expert(self, x: Tensor, gate_up: Tensor, down: Tensor, limit: float) -> Tensor:
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        return F.linear(swiglu(gate, up, limit), down)

    # ---- attention of an extend step -------------------------------------------------------------
    def block_attention(self, q: Tensor, keys: Tensor, bias: Tensor, sinks: Tensor, scaling: float) -> Tensor:
        nb, b, heads, dim = q.shape
        logits = torch.bmm(q.view(nb, b * heads, dim), keys.transpose(1, 2)).view(nb, b, heads, -1)
        logits = logits.mul_(scaling).add_(bias.to(q.dtype)[:, :, None, :])
        sink = sinks.view(1, 1, -1, 1).expand(nb, b, -1, 1)
        logits = torch.cat([logits, sink], dim=-1)  # sinks are fp32: promotes like HF
        # HF subtracts the row max first; softmax does exactly that itself (same values).
        probs = logits.softmax(dim=-1)[..., :-1].to(keys.dtype)
        return torch.bmm(probs.reshape(nb, b * heads, -1), keys).view(nb * b, heads, dim)

    def compress_blocks(
        self, kv: Tensor, score: Tensor, norm_weight: Tensor, norm_eps: float, cos: Tensor, sin: Tensor
    ) -> Tensor:
        weights = score.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        return self.rope(self.rms_norm((kv * weights).sum(dim=1), norm_weight, norm_eps), cos, sin)

    def index_bias(
        self, q: Tensor, weights: Tensor, keys: Tensor, visible: Tensor, scale: float, k: int
    ) -> Tensor:
        n, num_rows = len(q), len(keys)
        bias = q.new_full((n, num_rows), NEG_INF, dtype=torch.float32)
        if num_rows == 0:
            return bias
        future = torch.arange(num_rows, device=q.device)[None, :] >= visible[:, None]
        if num_rows <= k:  # the top-k of all rows is every visible row: no scores needed
            return bias.masked_fill_(~future, 0.0)
        scores = index_scores(q, weights, keys, scale).masked_fill_(future, NEG_INF)
        picked = stable_topk(scores, min(k, num_rows))
        valid = picked < visible[:, None]
        # Invalid picks go to a spare column that is dropped.
        picked = torch.where(valid, picked, torch.full_like(picked, num_rows))
        bias = torch.cat([bias, bias[:, :1]], dim=1)
        return bias.scatter_(1, picked, 0.0)[:, :num_rows]

    # ---- attention over the paged pools ----------------------------------------------------------
    def masked_put(self, pool: Tensor, slots: Tensor, rows: Tensor, mask: Tensor) -> None:
        keep = mask[:, None]
        self.put_rows(pool, torch.where(mask, slots, 0), torch.where(keep, rows.to(pool.dtype), 0.0))

    def put_rows(self, pool: Tensor, slots: Tensor, rows: Tensor) -> None:
        """`pool[slots] = rows` (rows in pool's dtype, slots 1-D): every paged write of a step goes
        through here, so a device set swaps in its scatter op once (NPU: npu_scatter_nd_update_)."""
        pool.index_put_((slots,), rows)

    def sink_attention(self, q: Tensor, keys: Tensor, bias: Tensor, sinks: Tensor, scaling: float) -> Tensor:
        logits = torch.matmul(q, keys.transpose(1, 2)) * scaling + bias[:, None, :].to(q.dtype)
        sink = sinks.view(1, -1, 1).expand(q.shape[0], -1, 1)
        logits = torch.cat([logits, sink], dim=-1)  # sinks are fp32: promotes like the reference
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = logits.softmax(dim=-1)[..., :-1].to(keys.dtype)
        return torch.matmul(probs, keys)  # [B, H, D]

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
        keys = gather_rows(swa, swa_slots.clamp(min=0)).to(q.dtype)  # [B, W, D], oldest first
        bias = visible_bias(swa_slots >= 0)
        if comp is not None and visible is not None:
            slots = all_row_slots(page_table, ratio, page_size)  # [B, N]
            if rows is None:
                comp_keys = gather_rows(comp, slots)
                seen = torch.arange(slots.shape[1], device=q.device)[None, :] < visible[:, None]
            else:  # a -1 pick reads row 0 and is masked, as one past visible is
                comp_keys = gather_rows(comp, slots.gather(1, rows.clamp(min=0)))
                seen = (rows >= 0) & (rows < visible[:, None])
            keys = torch.cat([keys, comp_keys.to(keys.dtype)], dim=1)
            bias = torch.cat([bias, visible_bias(seen)], dim=1)
        return self.sink_attention(q, keys, bias, sinks, scaling)

    def compress_paged(
        self,
        kv: Tensor,
        gate: Tensor,
        position_bias: Tensor,
        positions: Tensor,
        cm: CompressMetadata,
        cos: Tensor,
        sin: Tensor,
        norm_weight: Tensor,
        norm_eps: float,
        state: Tensor,
        rows: Tensor,
        sparse: bool,
    ) -> None:
        ratio, half = position_bias.shape
        score = gate + position_bias.index_select(0, positions % ratio)
        own = torch.cat([kv.to(state.dtype), score.to(state.dtype)], dim=-1)  # [B, 2*coff*D]
        # Write before read (so a compiler updates the pool in place instead of copying it): the token's
        # state row goes to its slot; masked rows rewrite the state sentinel (kv 0, score -inf) into slot 0.
        # The read below never sees it: columns at or after the token's position are slot 0 there.
        keep = cm.state_write_mask[:, None]
        sentinel_score = torch.full_like(own[:, half:], NEG_INF)
        masked = torch.cat(
            [torch.where(keep, own[:, :half], 0.0), torch.where(keep, own[:, half:], sentinel_score)], dim=-1
        )
        self.put_rows(state, torch.where(cm.state_write_mask, cm.state_write_loc, 0), masked)
        pool = (ratio, norm_weight, norm_eps, kv.dtype)
        if not sparse:
            row = self._pool(own, positions, cm.state_read_start, cm.state_read_slots, state, *pool)
            cos_b, sin_b = cos.index_select(0, cm.block_positions), sin.index_select(0, cm.block_positions)
            self.masked_put(rows, cm.block_loc, rotate_rows(row, cos_b, sin_b), cm.block_mask)
            return
        done = cm.block_mask.nonzero().squeeze(1)
        if len(done):
            start, slots = cm.state_read_start[done], cm.state_read_slots[done]
            row = self._pool(own[done], positions[done], start, slots, state, *pool)
            block_positions = cm.block_positions[done]
            cos_b, sin_b = cos.index_select(0, block_positions), sin.index_select(0, block_positions)
            self.put_rows(rows, cm.block_loc[done], rotate_rows(row, cos_b, sin_b).to(rows.dtype))

    def _pool(
        self,
        own: Tensor,
        positions: Tensor,
        read_start: Tensor,
        read_slots: Tensor,
        state: Tensor,
        ratio: int,
        norm_weight: Tensor,
        norm_eps: float,
        dtype: torch.dtype,
    ) -> Tensor:
        """The normalised compressed row `[B, D]` each row's window pools (the token's own state row in
        its column, the stored rows elsewhere), before RoPE."""
        r, d, half = ratio, norm_weight.shape[0], own.shape[-1] // 2
        width = read_slots.shape[1]
        stored = gather_rows(state, read_slots)  # [B, width, 2*coff*D]; sentinel rows where not stored
        col = torch.arange(width, device=own.device)[None, :] == (positions - read_start)[:, None]
        window = torch.where(col[..., None], own[:, None, :], stored)
        if half == 2 * d:  # overlap (ratio 4): row b pools block b-1's first halves and block b's second
            win_kv = torch.cat([window[:, :r, :d], window[:, r:, d:half]], dim=1)
            win_score = torch.cat([window[:, :r, half : half + d], window[:, r:, half + d :]], dim=1)
        else:
            win_kv, win_score = window[..., :half], window[..., half:]
        win_kv = win_kv.to(dtype)
        weights = win_score.to(dtype).softmax(dim=1, dtype=torch.float32).to(win_kv.dtype)
        return self.rms_norm((win_kv * weights).sum(dim=1), norm_weight, norm_eps)

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
        slots = all_row_slots(page_table, ratio, page_size)  # [B, N]
        idx_keys = gather_rows(keys, slots).float()  # [B, N, Di]
        scores = F.relu(torch.matmul(q.float(), idx_keys.transpose(1, 2))) * scale
        scores = (scores * weights[:, :, None]).sum(dim=1)  # [B, N]
        rows = torch.arange(slots.shape[1], device=q.device)[None, :]
        scores = scores.masked_fill(rows >= visible[:, None], NEG_INF)
        return stable_topk_rows(scores, min(k, slots.shape[1]), self.topk_by_keys)

    def fill_decode(
        self,
        buf: AttentionMetadata,
        req_pool: Dsv4ReqPool,
        page_size: int,
        req: Tensor,
        pos: Tensor,
        valid: Tensor,
        locs: DecodeLocs,
    ) -> None:
        fill_decode_buffers(buf, req_pool, page_size, req, pos, valid, locs)

    # ---- PD staging ----------------------------------------------------------------------------
    def gather_pages(self, buffers: list[Tensor], pages: Tensor, staged: Tensor) -> None:
        for buf, out in page_segments(buffers, pages, staged):
            torch.index_select(buf, 0, pages.to(buf.device), out=out)

    def scatter_pages(self, buffers: list[Tensor], pages: Tensor, staged: Tensor) -> None:
        for buf, src in page_segments(buffers, pages, staged):
            buf.index_copy_(0, pages.to(buf.device), src)


class StaticTorchKernels(TorchKernels):
    """The batched decode step's torch forms, eager or captured as a device graph."""

    def routed_experts(
        self, x: Tensor, gate_up: Tensor, down: Tensor, ids: Tensor, weights: Tensor, limit: float
    ) -> Tensor:
        """Static output shape and no host reads: gathered expert weights while B*k < E, else every
        expert densely (a static choice: B is the bucket's)."""
        bsz, k = ids.shape
        ids, weights = dense_ids(ids, weights)
        num_experts = gate_up.shape[0]
        if bsz * k < num_experts:  # read only the picked experts' weights
            h = torch.matmul(gate_up[ids], x[:, None, :, None]).squeeze(-1)  # [B, k, 2I]
            gate, up = h.chunk(2, dim=-1)
            y = torch.matmul(down[ids], swiglu(gate, up, limit)[..., None]).squeeze(-1)
            routed = (y * weights[..., None].to(y.dtype)).sum(dim=1)
            return routed.to(x.dtype)
        return dense_experts(x, gate_up, down, ids, weights, limit)


class CompiledTorchKernels(StaticTorchKernels):
    """The batched decode step's torch forms under `torch.compile`."""

    topk_by_keys = True

    def head_rms_norm(self, x: Tensor, eps: float) -> Tensor:
        return unweighted_rms_norm(x, eps)

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
        return rotate_rows(x, cos, sin, inverse)

    def hc_post(self, post: Tensor, comb: Tensor, out: Tensor, streams: Tensor, into: Tensor) -> Tensor:
        return expand(post, comb, out, streams)  # a fresh tensor: `out=` is eager's economy

    def routed_experts(
        self, x: Tensor, gate_up: Tensor, down: Tensor, ids: Tensor, weights: Tensor, limit: float
    ) -> Tensor:
        """While B*k < E one batched GEMV per expert slot (inductor's best form here), else dense."""
        bsz, k = ids.shape
        ids, weights = dense_ids(ids, weights)
        if bsz * k >= gate_up.shape[0]:
            return dense_experts(x, gate_up, down, ids, weights, limit)
        routed = x.new_zeros(())
        for slot in range(k):
            picked = ids[:, slot]
            h = torch.bmm(gate_up[picked], x[:, :, None]).squeeze(-1)  # [B, 2I]
            gate, up = h.chunk(2, dim=-1)
            y = torch.bmm(down[picked], swiglu(gate, up, limit)[:, :, None]).squeeze(-1)
            routed = routed + y * weights[:, slot, None].to(y.dtype)
        return routed.to(x.dtype)
