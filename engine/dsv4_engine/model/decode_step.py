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
from dsv4_engine.model.hyper import HyperConnection, expand
from dsv4_engine.model.model import Dsv4ForCausalLM
from dsv4_engine.model.moe import MoE, swiglu


def hyper_connection(
    hc: HyperConnection, streams: torch.Tensor, matmul_sums: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`HyperConnection.forward`; `matmul_sums` does each Sinkhorn sum + eps as one `baddbmm` (fewer
    eager ops); without it the sums stay reductions, which a compiler fuses into one kernel."""
    n, bsz = hc.n, streams.shape[0]
    pre, post, comb = hc.weights(streams)
    if not matmul_sums:
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


def moe_decode(
    moe: MoE, x: torch.Tensor, input_ids: torch.Tensor, for_compiler: bool = False
) -> torch.Tensor:
    """MoE with a static shape: gathered expert weights while B*k < E, else every expert densely.
    For a compiler the gathered form is written as multiply + sum, which it fuses into one
    reduction reading the picked experts' weights in place (no copy of them)."""
    weights, ids = moe.gate(x, input_ids)  # [B, k]
    experts = moe.experts
    bsz, k = ids.shape
    num_experts, limit = experts.num_experts, experts.limit
    if bsz * k < num_experts and for_compiler:
        h = (experts.gate_up_proj[ids] * x[:, None, None, :]).sum(dim=-1)  # [B, k, 2I]
        gate, up = h.chunk(2, dim=-1)
        act = swiglu(gate, up, limit)
        y = (experts.down_proj[ids] * act[:, :, None, :]).sum(dim=-1)  # [B, k, D]
        routed = (y * weights[..., None].to(y.dtype)).sum(dim=1)
    elif bsz * k < num_experts:  # small batch: read only the picked experts' weights
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
    return routed.to(x.dtype) + moe.shared_experts(x)


def decode_logits(
    model: Dsv4ForCausalLM,
    input_ids: torch.Tensor,
    meta: AttentionMetadata,
    pools: PoolViews,
    *,
    for_compiler: bool = False,
) -> torch.Tensor:
    """Logits `[B, vocab]` (fp32) of one decode token per row; writes the step's KV and state.
    `for_compiler` picks the formulations a compiler fuses best over those with fewest eager ops."""
    m = model.model
    rope = {id(t): t.lookup(meta.positions) for t in m.rope.tables.values()}
    x = m.embed_tokens(input_ids)
    streams = x.unsqueeze(1).expand(-1, m.config.hc_mult, -1).contiguous()
    for layer in m.layers:
        attn = layer.self_attn
        cos, sin = rope[id(attn.rope)]
        post, comb, collapsed = hyper_connection(layer.attn_hc, streams, not for_compiler)
        out = paged_decode_attention(
            attn, layer.input_layernorm(collapsed), meta, pools, cos, sin, for_compiler
        )
        streams = expand(post, comb, out, streams)
        post, comb, collapsed = hyper_connection(layer.ffn_hc, streams, not for_compiler)
        out = moe_decode(layer.mlp, layer.post_attention_layernorm(collapsed), input_ids, for_compiler)
        streams = expand(post, comb, out, streams)
    return model.compute_logits(m.norm(m.hc_head(streams)))
