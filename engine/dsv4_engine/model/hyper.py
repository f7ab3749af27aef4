"""mHC: manifold-constrained hyper-connections.

The residual is `hc_mult` parallel streams `[T, N, D]`. Before each sub-block a one-layer
map of the (RMS-normalised, flattened) streams gives `pre` (collapse N streams into the
block input), `post` (spread the block output back over N streams) and `comb` (mix the
input streams), the last projected towards a doubly-stochastic matrix by Sinkhorn-Knopp.
All of it runs in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4_engine.config import Dsv4Config
from dsv4_engine.model.ops import KernelChoice, Module, unweighted_rms_norm


def stream_mixes(streams: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
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


class HyperConnection(Module, KernelChoice):
    def __init__(self, config: Dsv4Config) -> None:
        super().__init__()
        self.n = config.hc_mult
        self.iters = config.hc_sinkhorn_iters
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + self.n) * self.n, self.n * config.hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + self.n) * self.n))
        self.scale = nn.Parameter(torch.ones(3))

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pre [T, N], post [T, N], comb [T, N, N] before Sinkhorn), fp32, for streams `[T, N, D]`."""
        n = self.n
        mixes = stream_mixes(streams, self.fn, self.norm_eps)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), dim=-1) + self.hc_eps
        return pre, post, comb

    @staticmethod
    def collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """The sub-block input: `sum_i pre_i * streams_i`, in fp32: one `[1, N] @ [N, D]` product per
        row instead of a `[T, N, D]` temporary."""
        return torch.bmm(pre.unsqueeze(1), streams.float()).squeeze(1).to(streams.dtype)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(post [T, N], comb [T, N, N], collapsed [T, D]) for streams `[T, N, D]`.

        On CPU `dsv4::hc_pre` computes `reference` in one call: its Sinkhorn is ~80 small ops, about
        half of this map's time in a prefill of a thousand tokens (tests/decode/test_kernels.py); a
        compiler fuses `reference` itself."""
        if k := self.kernel_for(streams, loops=False):  # the kernel takes BLAS for many rows itself
            return k.hc_pre(streams, self.fn, self.base, self.scale, self.iters, self.hc_eps, self.norm_eps)
        return self.reference(streams)

    def expand(
        self,
        post: torch.Tensor,
        comb: torch.Tensor,
        out: torch.Tensor,
        streams: torch.Tensor,
        into: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The new streams after the sub-block (module-level `expand`), as `dsv4::hc_post` on CPU for up to
        `LOOP_ROWS` fp32 rows; under a compiler into a fresh tensor (`into` is for eager large buffers)."""
        if k := self.kernel_for(streams):
            return k.hc_post(post, comb, out, streams)
        return expand(post, comb, out, streams, into=None if torch.compiler.is_compiling() else into)

    def reference(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`forward` in torch ops: the definition the kernel is tested against."""
        pre, post, comb = self.weights(streams)
        # Sinkhorn-Knopp: columns, then (rows, columns) iters - 1 times; in place (same rounding).
        eps = self.hc_eps
        comb.div_(comb.sum(dim=-2, keepdim=True).add_(eps))
        for _ in range(self.iters - 1):
            comb.div_(comb.sum(dim=-1, keepdim=True).add_(eps))
            comb.div_(comb.sum(dim=-2, keepdim=True).add_(eps))
        return post, comb, self.collapse(pre, streams)


def expand(
    post: torch.Tensor,
    comb: torch.Tensor,
    out: torch.Tensor,
    streams: torch.Tensor,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """New streams: `post_k * out + sum_j comb[j, k] * streams_j`; fp32 ones are written to `into`
    (a buffer of streams' shape, not `streams` itself) when given."""
    dtype = streams.dtype
    if dtype != torch.float32:  # HF's op order: one fused rounding moves bf16 logits by > 1 ulp
        spread = post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2)
        return spread + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    spread = torch.mul(post.unsqueeze(-1), out.unsqueeze(-2), out=into)
    return spread.baddbmm_(comb.transpose(-1, -2), streams)  # in place: no third [T, N, D] buffer


class HyperHead(Module):
    """Final collapse of the streams before the model norm."""

    def __init__(self, config: Dsv4Config) -> None:
        super().__init__()
        self.n = config.hc_mult
        self.eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(self.n, self.n * config.hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(self.n))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = stream_mixes(streams, self.hc_fn, self.norm_eps)
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return HyperConnection.collapse(pre, streams)
