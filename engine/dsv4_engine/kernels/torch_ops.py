"""The plain-torch building blocks of the torch kernel set (`torch_forms.py`), also what the model's
modules and tests call directly: SwiGLU, the mHC stream mix and expand, the stable top-k, pool row
gathers, the page staging segments. Each is the definition the fused kernels are tested against."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
NEG_INF = float("-inf")


def swiglu(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def clamp_gate_up_(h: Tensor, limit: float) -> tuple[Tensor, Tensor]:
    """DSV4's SwiGLU clamps, in place on `h = [gate | up]`: gate at most `limit`, up within
    +-`limit`. Returns the two halves (views of h)."""
    inter = h.shape[-1] // 2
    return h[..., :inter].clamp_(max=limit), h[..., inter:].clamp_(min=-limit, max=limit)


def swiglu_(h: Tensor, limit: float) -> Tensor:
    """`swiglu` of `h = [gate | up]`, computed in h's own storage (returns a view of it)."""
    gate, up = clamp_gate_up_(h, limit)
    return F.silu(gate, inplace=True).mul_(up)


def dense_ids(ids: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """Another rank's pairs (-1) as local expert 0 at weight 0, for forms that index every pair."""
    here = ids >= 0
    return torch.where(here, ids, 0), weights * here


def by_expert(
    x: Tensor, ids: Tensor, weights: Tensor, num_experts: int, expert: Callable[[Tensor, int], Tensor]
) -> Tensor:
    """Dispatch by expert: the (token, expert) pairs sorted by expert and gathered once; per expert in
    use, `expert(rows, e)` on its contiguous slice and one weighted scatter-add. Another rank's pairs
    (id -1) are dropped. Host reads (the counts): extend steps only."""
    flat_ids = ids.flatten()
    order = torch.argsort(flat_ids, stable=True)
    foreign = flat_ids < 0  # another rank's pairs (id -1) sort first: drop them
    if bool(foreign.any()):
        order = order[~foreign.index_select(0, order)]
        flat_ids = flat_ids[~foreign]
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    tokens = order // ids.shape[1]
    xs = x.index_select(0, tokens)
    flat_weights = weights.flatten().index_select(0, order)[:, None]
    out = torch.zeros_like(x)
    start = 0
    for e, count in enumerate(counts):
        if count:
            end = start + count
            y = expert(xs[start:end], e)
            out.index_add_(0, tokens[start:end], y.mul_(flat_weights[start:end]).to(out.dtype))
            start = end
    return out


def dense_experts(
    x: Tensor, gate_up: Tensor, down: Tensor, ids: Tensor, weights: Tensor, limit: float
) -> Tensor:
    """Every expert for every row: one GEMM for every expert's gate/up, one batched GEMM down."""
    bsz, num_experts = x.shape[0], gate_up.shape[0]
    h = F.linear(x, gate_up.flatten(0, 1)).view(bsz, num_experts, -1)  # [B, E, 2I]
    gate, up = h.chunk(2, dim=-1)
    act = swiglu(gate, up, limit).transpose(0, 1)  # [E, B, I]
    y = torch.bmm(act, down.transpose(1, 2))  # [E, B, D]
    dense = torch.zeros(bsz, num_experts, dtype=y.dtype, device=y.device)
    dense = dense.scatter_add(1, ids, weights.to(y.dtype))
    return torch.einsum("be,ebd->bd", dense, y).to(x.dtype)


def unweighted_rms_norm(x: Tensor, eps: float) -> Tensor:
    """RMS normalisation without a weight; the scale is computed in fp32, applied in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def stream_mixes(streams: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`linear(unweighted_rms_norm(streams.flatten(1)), weight)` in fp32 for streams `[T, N, D]`.

    With fp32 streams the RMS scale, a per-row scalar, is applied to the few output columns instead
    of the `[T, N*D]` input and the mean square comes from a norm (one pass, no temporaries). A bf16
    model keeps HF's op order: a last-bit change here moves its bf16 casts downstream.
    """
    x = streams.flatten(1).float()
    if streams.dtype != torch.float32:
        return F.linear(unweighted_rms_norm(x, eps), weight.float())
    sum_sq = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square()
    return F.linear(x, weight.float()) * torch.rsqrt(sum_sq / x.shape[-1] + eps)


def collapse(pre: Tensor, streams: Tensor) -> Tensor:
    """`sum_i pre_i * streams_i` in fp32: one `[1, N] @ [N, D]` product per row instead of a
    `[T, N, D]` temporary."""
    return torch.bmm(pre.unsqueeze(1), streams.float()).squeeze(1).to(streams.dtype)


def expand(post: Tensor, comb: Tensor, out: Tensor, streams: Tensor, into: Tensor | None = None) -> Tensor:
    """New streams: `post_k * out + sum_j comb[j, k] * streams_j`; fp32 ones are written to `into`
    (a buffer of streams' shape, not `streams` itself) when given."""
    dtype = streams.dtype
    if dtype != torch.float32:  # HF's op order: one fused rounding moves bf16 logits by > 1 ulp
        spread = post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2)
        return spread + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    spread = torch.mul(post.unsqueeze(-1), out.unsqueeze(-2), out=into)
    return spread.baddbmm_(comb.transpose(-1, -2), streams)  # in place: no third [T, N, D] buffer


def index_scores(q: Tensor, weights: Tensor, keys: Tensor, scale: float) -> Tensor:
    """The extend indexer's scores `[n, N]` of one request's queries `[n, H, Di]` (head weights `[n, H]`)
    over its rows `[N, Di]`: sum_h weights_h * relu(q_h . key_j) * scale, in fp32."""
    scores = F.relu(torch.matmul(q.float(), keys.float().T)) * scale  # [n, H, N]
    return (scores * weights[:, :, None]).sum(dim=1)


def stable_topk(scores: Tensor, k: int) -> Tensor:
    """Indices of the k largest entries along the last dim; ties go to the lower index.

    Exact ties are common in the indexer (ReLU zeros); an unstable top-k would make the
    selected set depend on memory layout.
    """
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[..., :k]


def stable_topk_rows(scores: Tensor, k: int, by_keys: bool) -> Tensor:
    """`stable_topk` of fp32 scores `[B, N]`.

    by_keys: one `topk` over unique int64 keys (order-preserving integer image of the float, then
    the reversed index) instead of a stable sort, which is an order of magnitude slower on small
    rows here; the same indices (-0.0 is folded into +0.0 first: they tie in the float order).
    """
    if not by_keys:
        return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    n = scores.shape[-1]
    bits = (scores.float() + 0.0).view(torch.int32).to(torch.int64)
    order = torch.where(bits >= 0, bits, -(bits & 0x7FFFFFFF))  # monotone in the float value
    rev = n - 1 - torch.arange(n, device=scores.device)
    return torch.topk(order * n + rev, k, dim=-1).indices


def all_row_slots(page_table: Tensor, ratio: int, page_size: int) -> Tensor:
    """Slots `[B, N]` of compressed rows 0..N-1 of every request (N = pages * P / ratio)."""
    per_page = page_size // ratio
    j = torch.arange(page_table.shape[1] * per_page, device=page_table.device)
    return page_table.to(torch.int64)[:, j // per_page] * per_page + j % per_page


def gather_rows(pool: Tensor, slots: Tensor) -> Tensor:
    """`pool[slots]` for a flat pool `[S, W]` and slots of any shape, as one `index_select` (advanced
    indexing is several times slower on CPU for these shapes)."""
    return pool.index_select(0, slots.reshape(-1)).view(*slots.shape, pool.shape[-1])


def visible_bias(visible: Tensor) -> Tensor:
    return torch.where(visible, 0.0, NEG_INF)


def staged_nbytes(buffers: list[Tensor], pages: int) -> int:
    """Bytes `pages` pages of every buffer take when packed (`gather_pages`' layout)."""
    return pages * sum(b[0].nbytes for b in buffers)


def page_segments(buffers: list[Tensor], pages: Tensor, staged: Tensor):  # type: ignore[no-untyped-def]
    n, at = int(pages.numel()), 0
    if staged.numel() != staged_nbytes(buffers, n):
        raise ValueError(f"{staged.numel()} staged bytes for {n} pages of {len(buffers)} buffers")
    for buf in buffers:
        size = n * buf[0].nbytes
        yield buf, staged[at : at + size].view(buf.dtype).view(n, *buf.shape[1:])
        at += size
