"""The ops of the decode step (`attention.paged_decode.DecodeBatch.ops`), in three implementations
picked once per runner. The model's one forward calls them through the batch; an extend batch's are
the modules' own forwards (`model.batch.ExtendOps`).

`TorchOps` is plain torch: the reference formulations, which a compiler fuses and a device graph
captures (`for_compiler` picks the forms inductor fuses best over those with fewest eager ops).
`KernelOps` runs the same math as `dsv4::` CPU kernels (`dsv4_engine.kernels`), one dispatch each:
an eager CPU step pays ~5-10 us per dispatched op whatever its size. `CompiledOps`, for a compiled
CPU step, keeps the torch forms the compiler fuses and takes only the kernels that do less work or
stream memory faster than anything it generates (projections, routed experts, compressors).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4_engine.attention import paged_decode
from dsv4_engine.attention.metadata import CompressMetadata
from dsv4_engine.model.attention import Dsv4Attention, GroupedLinear
from dsv4_engine.model.compressor import Compressor, Indexer
from dsv4_engine.model.hyper import HyperConnection, expand
from dsv4_engine.model.moe import MoE, Router, swiglu
from dsv4_engine.model.ops import RMSNorm, unweighted_rms_norm
from dsv4_engine.model.packed import Packed
from dsv4_engine.rope import rotate


def _per_row(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """cos/sin `[B, R]` viewed to broadcast over x `[B, ..., D]`."""
    return t.view(t.shape[0], *([1] * (x.dim() - 2)), t.shape[-1])


class TorchOps:
    # Routed experts by `dsv4::moe_experts` (grouped by expert) instead of the torch forms in `moe`.
    moe_kernel = False

    def __init__(self, for_compiler: bool = False) -> None:
        self.for_compiler = for_compiler

    def linear(self, m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return m(x)

    def project(self, pack: Packed, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return pack(x)

    def grouped_linear(self, m: GroupedLinear, x: torch.Tensor) -> torch.Tensor:
        return m(x)

    def norm(self, m: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return m(x)

    def unit_norm(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        return unweighted_rms_norm(x, eps)

    def rotate(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
    ) -> torch.Tensor:
        """RoPE on x `[B, ..., D]` with one cos/sin row `[B, R]` per batch row; inverse undoes it."""
        return rotate(x, _per_row(cos, x), _per_row(-sin if inverse else sin, x))

    def hc_pre(
        self, hc: HyperConnection, streams: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`HyperConnection.forward`. Eagerly each Sinkhorn sum + eps is one `baddbmm` (fewer ops);
        for a compiler the sums stay reductions, which it fuses into one kernel."""
        n, bsz = hc.n, streams.shape[0]
        pre, post, comb = hc.weights(streams)
        if self.for_compiler:
            comb = comb / (comb.sum(dim=-2, keepdim=True) + hc.hc_eps)
            for _ in range(hc.iters - 1):
                comb = comb / (comb.sum(dim=-1, keepdim=True) + hc.hc_eps)
                comb = comb / (comb.sum(dim=-2, keepdim=True) + hc.hc_eps)
            return post, comb, hc.collapse(pre, streams)
        eps = comb.new_full((1, 1, 1), hc.hc_eps)
        ones_row = comb.new_ones(1, 1, n).expand(bsz, 1, n)
        ones_col = comb.new_ones(1, n, 1).expand(bsz, n, 1)
        comb = comb / torch.baddbmm(eps, ones_row, comb)  # columns
        for _ in range(hc.iters - 1):
            comb = comb / torch.baddbmm(eps, comb, ones_col)  # rows
            comb = comb / torch.baddbmm(eps, ones_row, comb)  # columns
        return post, comb, hc.collapse(pre, streams)

    def hc_post(
        self,
        post: torch.Tensor,
        comb: torch.Tensor,
        out: torch.Tensor,
        streams: torch.Tensor,
        into: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`expand` into a fresh tensor (`into` is for the extend step's large buffers)."""
        return expand(post, comb, out, streams)

    def masked_put(
        self, pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor
    ) -> None:
        """pool[slots] = rows where mask, else the KV sentinel (0) into slot 0 (which it already holds)."""
        keep = mask[:, None]
        pool.index_put_((torch.where(mask, slots, 0),), torch.where(keep, rows.to(pool.dtype), 0.0))

    def route(
        self, router: Router, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return router(x, input_ids)

    def shared_expert(self, moe: MoE, x: torch.Tensor, pack: Packed | None) -> torch.Tensor:
        """`pack`: the shared expert's gate and up projections as one GEMM (`model.packed`)."""
        return moe.shared_experts(x) if pack is None else moe.shared_experts.combine(*pack(x))

    def moe(
        self, moe: MoE, x: torch.Tensor, input_ids: torch.Tensor, shared_pack: Packed | None = None
    ) -> torch.Tensor:
        """MoE with a static output shape. With `moe_kernel`, `dsv4::moe_experts` groups the rows by
        expert (two GEMMs per expert in use, any batch size; a skinny GEMM that reads each picked
        expert's weights once, also faster than what a compiler makes of the gathered forms).
        Without it: gathered expert weights while B*k < E (per slot under a compiler, its best form
        there), else every expert densely. `shared_pack`: the shared expert's gate and up
        projections as one GEMM."""
        weights, ids = self.route(moe.gate, x, input_ids)  # [B, k]
        experts = moe.experts
        bsz, k = ids.shape
        num_experts, limit = experts.num_experts, experts.limit
        small = bsz * k < num_experts
        if self.moe_kernel:
            ids, weights = experts.localise(ids, weights)
            routed = torch.ops.dsv4.moe_experts(
                x, experts.gate_up_proj, experts.down_proj, ids, weights, limit
            )
            return routed + self.shared_expert(moe, x, shared_pack)
        ids, weights = experts.localise(ids, weights, dense=True)
        if small and self.for_compiler:  # one gathered batched GEMV per slot: the compiler's best form
            routed = x.new_zeros(())
            for slot in range(k):
                picked = ids[:, slot]
                h = torch.bmm(experts.gate_up_proj[picked], x[:, :, None]).squeeze(-1)  # [B, 2I]
                gate, up = h.chunk(2, dim=-1)
                y = torch.bmm(experts.down_proj[picked], swiglu(gate, up, limit)[:, :, None]).squeeze(-1)
                routed = routed + y * weights[:, slot, None].to(y.dtype)
        elif small:  # read only the picked experts' weights
            h = torch.matmul(experts.gate_up_proj[ids], x[:, None, :, None]).squeeze(-1)  # [B, k, 2I]
            gate, up = h.chunk(2, dim=-1)
            y = torch.matmul(experts.down_proj[ids], swiglu(gate, up, limit)[..., None]).squeeze(-1)
            routed = (y * weights[..., None].to(y.dtype)).sum(dim=1)
        else:  # large batch: one GEMM for every expert's gate/up, one batched GEMM down
            h = F.linear(x, experts.gate_up_proj.flatten(0, 1)).view(bsz, num_experts, -1)  # [B, E, 2I]
            gate, up = h.chunk(2, dim=-1)
            act = swiglu(gate, up, limit).transpose(0, 1)  # [E, B, I]
            y = torch.bmm(act, experts.down_proj.transpose(1, 2))  # [E, B, D]
            dense = torch.zeros(bsz, num_experts, dtype=y.dtype, device=y.device)
            dense = dense.scatter_add(1, ids, weights.to(y.dtype))
            routed = torch.einsum("be,ebd->bd", dense, y)
        return routed.to(x.dtype) + self.shared_expert(moe, x, shared_pack)

    def attend(
        self, attn: Dsv4Attention, q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        """Softmax over [keys | sink] per head; `q [B, H, D]`, `keys [B, K, D]`, `bias [B, K]`."""
        logits = torch.matmul(q, keys.transpose(1, 2)) * attn.scaling + bias[:, None, :].to(q.dtype)
        sinks = attn.sinks.view(1, -1, 1).expand(q.shape[0], -1, 1)
        logits = torch.cat([logits, sinks], dim=-1)  # sinks are fp32: promotes like the reference
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = logits.softmax(dim=-1)[..., :-1].to(keys.dtype)
        return torch.matmul(probs, keys)  # [B, H, D]

    # Attention over the pools: the torch forms themselves (attention/paged_decode.py, ops first).
    compress = paged_decode.compress_decode
    index_topk = paged_decode.index_topk
    paged_attend = paged_decode.paged_attend


class CompiledOps(TorchOps):
    """`TorchOps` for a compiled CPU step, with the kernels a compiler does not beat: projections as a
    skinny GEMM that streams each weight once at full bandwidth (MKL's at a few rows runs at about
    half), routed and shared experts likewise, and compressors that pool only the rows
    completing a block (the static torch form pools every row, every step). Each is one opaque call
    in the compiled graph; fp32 only, other dtypes take the torch forms."""

    moe_kernel = True

    def __init__(self, for_compiler: bool = True) -> None:
        super().__init__(for_compiler=for_compiler)

    def linear(self, m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.dsv4.linear(x, m.weight) if m.bias is None else m(x)

    def project(self, pack: Packed, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.ops.dsv4.linear(x, pack.weight).split(pack.sizes, dim=-1)

    def grouped_linear(self, m: GroupedLinear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.dsv4.grouped_linear(x, m.weight)

    def shared_expert(self, moe: MoE, x: torch.Tensor, pack: Packed | None) -> torch.Tensor:
        if pack is None:
            return moe.shared_experts(x)
        down = moe.shared_experts.down_proj.weight
        return torch.ops.dsv4.shared_expert(x, pack.weight, down, moe.shared_experts.limit)

    def compress(
        self,
        comp: Compressor,
        kv: torch.Tensor,
        gate: torch.Tensor,
        positions: torch.Tensor,
        cm: CompressMetadata,
        state: torch.Tensor,
        rows: torch.Tensor,
        sparse: bool,
    ) -> None:
        cos, sin = comp.rope.tables()
        norm = comp.kv_norm
        if not _fp32(kv, gate, state, rows, comp.position_bias, cos, norm.weight):
            return super().compress(comp, kv, gate, positions, cm, state, rows, sparse)
        torch.ops.dsv4.compress_decode(
            kv, gate, comp.position_bias, positions, cm.state_write_mask, cm.state_write_loc,
            cm.state_read_start, cm.state_read_slots, cm.block_mask, cm.block_loc, cm.block_positions,
            cos, sin, norm.weight, norm.eps, state, rows,
        )  # fmt: skip


class KernelOps(CompiledOps):
    """Every op a kernel: the eager CPU step, one dispatch per op. The attention over the pools
    (`index_topk`, `paged_attend`) as loops that read the pools in place (kernels/attention.cpp)."""

    def __init__(self) -> None:
        super().__init__(for_compiler=False)

    def norm(self, m: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.dsv4.rms_norm(x, m.weight, m.eps)

    def unit_norm(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.ops.dsv4.rms_norm(x, None, eps)

    def rotate(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
    ) -> torch.Tensor:
        return torch.ops.dsv4.rope_rotate(x, cos, sin, inverse)

    def hc_pre(
        self, hc: HyperConnection, streams: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return hc(streams)  # on CPU, HyperConnection.forward is dsv4::hc_pre

    def hc_post(
        self,
        post: torch.Tensor,
        comb: torch.Tensor,
        out: torch.Tensor,
        streams: torch.Tensor,
        into: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return torch.ops.dsv4.hc_post(post, comb, out, streams)

    def masked_put(
        self, pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor
    ) -> None:
        torch.ops.dsv4.masked_put(pool, slots, rows, mask)

    def route(
        self, router: Router, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        table = router.tid2eid if router.is_hash else router.e_score_correction_bias
        return torch.ops.dsv4.route(
            x, input_ids, router.weight, table, router.is_hash, router.top_k, router.scaling
        )

    def attend(
        self, attn: Dsv4Attention, q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        return torch.ops.dsv4.sink_attention(q, keys, bias, attn.sinks, attn.scaling)

    def index_topk(
        self,
        indexer: Indexer,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        page_table: torch.Tensor,
        visible: torch.Tensor,
        page_size: int,
    ) -> torch.Tensor:
        if not _fp32(q, weights, keys):
            return super().index_topk(indexer, q, weights, keys, page_table, visible, page_size)
        return torch.ops.dsv4.index_topk(
            q, weights, keys, page_table, visible, indexer.ratio, page_size, indexer.softmax_scale, indexer.topk
        )  # fmt: skip

    def paged_attend(
        self,
        attn: Dsv4Attention,
        q: torch.Tensor,
        swa: torch.Tensor,
        swa_slots: torch.Tensor,
        comp: torch.Tensor | None,
        page_table: torch.Tensor,
        rows: torch.Tensor | None,
        visible: torch.Tensor | None,
        page_size: int,
    ) -> torch.Tensor:
        if not _fp32(q, swa, attn.sinks, *([comp] if comp is not None else [])):
            return super().paged_attend(attn, q, swa, swa_slots, comp, page_table, rows, visible, page_size)
        return torch.ops.dsv4.paged_attention(
            q, swa, swa_slots, comp, page_table, rows, visible, attn.ratio, page_size, attn.sinks, attn.scaling
        )  # fmt: skip


def _fp32(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 for t in tensors)
