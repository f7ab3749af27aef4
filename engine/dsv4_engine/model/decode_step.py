"""The batched decode step: one token per row, every row from the paged pools, no host syncs.

`decode_logits(model, input_ids, meta, pools)` is the whole decode forward for a batch-size bucket,
driven only by its static `AttentionMetadata` (DecodeBuffers): no per-request loop, no `.item()` /
`.tolist()`, no Python branch on tensor values, so it can run eagerly, under `torch.compile`, or be
captured once per bucket by a device graph (CUDA graphs, aclgraph) and replayed.

Numerically it is the reference `Dsv4ForCausalLM.forward` over `PagedSeqCache` up to summation
order: the mHC Sinkhorn sums with a batched matmul (one op instead of two per normalisation, the
eager step is dispatch-bound), and routed experts run as gathered or dense batched matmuls instead
of a per-expert loop whose trip count depends on the routing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4_engine.attention.metadata import AttentionMetadata
from dsv4_engine.attention.paged_decode import PoolViews, paged_decode_attention
from dsv4_engine.model.decode_ops import TorchOps
from dsv4_engine.model.model import Dsv4ForCausalLM
from dsv4_engine.model.moe import MoE, swiglu
from dsv4_engine.model.packed import Packed


def moe_decode(
    moe: MoE, x: torch.Tensor, input_ids: torch.Tensor, ops: TorchOps, shared_pack: Packed | None = None
) -> torch.Tensor:
    """MoE with a static output shape. With `ops.moe_kernel`, `dsv4::moe_experts` groups the rows by
    expert (two GEMMs per expert in use, any batch size; a skinny GEMM that reads each picked
    expert's weights once, also faster than what a compiler makes of the gathered forms). Without
    it: gathered expert weights while B*k < E (per slot under a compiler, its best form there), else
    every expert densely. `shared_pack`: the shared expert's gate and up projections as one GEMM."""
    weights, ids = ops.route(moe.gate, x, input_ids)  # [B, k]
    experts = moe.experts
    bsz, k = ids.shape
    num_experts, limit = experts.num_experts, experts.limit
    small, for_compiler = bsz * k < num_experts, ops.for_compiler
    if ops.moe_kernel:
        routed = torch.ops.dsv4.moe_experts(x, experts.gate_up_proj, experts.down_proj, ids, weights, limit)
        return routed + ops.shared_expert(moe, x, shared_pack)
    if small and for_compiler:  # one gathered batched GEMV per slot: the compiler's best form here
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
        gate_up = experts.gate_up_proj
        h = F.linear(x, gate_up.flatten(0, 1)).view(bsz, num_experts, -1)  # [B, E, 2I]
        gate, up = h.chunk(2, dim=-1)
        act = swiglu(gate, up, limit).transpose(0, 1)  # [E, B, I]
        y = torch.bmm(act, experts.down_proj.transpose(1, 2))  # [E, B, D]
        dense = torch.zeros(bsz, num_experts, dtype=y.dtype, device=y.device)
        dense = dense.scatter_add(1, ids, weights.to(y.dtype))
        routed = torch.einsum("be,ebd->bd", dense, y)
    return routed.to(x.dtype) + ops.shared_expert(moe, x, shared_pack)


def decode_logits(
    model: Dsv4ForCausalLM,
    input_ids: torch.Tensor,
    meta: AttentionMetadata,
    pools: PoolViews,
    *,
    ops: TorchOps | None = None,
    num_pages: int | None = None,
    packs: list[tuple[Packed, Packed]] | None = None,
) -> torch.Tensor:
    """Logits `[B, vocab]` (fp32) of one decode token per row; writes the step's KV and state.
    `ops`: plain torch (default) or the `dsv4::` CPU kernels (`decode_ops`), chosen outside traced code.
    `num_pages` (eager only): the step's longest context in pages (`paged_decode_attention`).
    `packs`: per layer, the packed attention-input and shared-expert projections (`model.packed`)."""
    ops = ops or TorchOps()
    m = model.model
    rope = {id(t): t.lookup(meta.positions) for t in m.rope.tables.values()}
    x = m.embed_tokens(input_ids)
    streams = x.unsqueeze(1).expand(-1, m.config.hc_mult, -1).contiguous()
    for i, layer in enumerate(m.layers):
        attn = layer.self_attn
        attn_pack, shared_pack = packs[i] if packs is not None else (None, None)
        cos, sin = rope[id(attn.rope)]
        post, comb, collapsed = ops.hc_pre(layer.attn_hc, streams)
        x = ops.norm(layer.input_layernorm, collapsed)
        out = paged_decode_attention(attn, x, meta, pools, cos, sin, ops, num_pages, attn_pack)
        streams = ops.hc_post(post, comb, out, streams)
        post, comb, collapsed = ops.hc_pre(layer.ffn_hc, streams)
        x = ops.norm(layer.post_attention_layernorm, collapsed)
        streams = ops.hc_post(post, comb, moe_decode(layer.mlp, x, input_ids, ops, shared_pack), streams)
    return ops.linear(model.lm_head, ops.norm(m.norm, m.hc_head(streams))).float()  # compute_logits
