"""mHC: manifold-constrained hyper-connections.

The residual is `hc_mult` parallel streams `[T, N, D]`. Before each sub-block a one-layer
map of the (RMS-normalised, flattened) streams gives `pre` (collapse N streams into the
block input), `post` (spread the block output back over N streams) and `comb` (mix the
input streams), the last projected towards a doubly-stochastic matrix by Sinkhorn-Knopp.
All of it runs in fp32 (`KernelSet.hc_pre` / `hc_post`; the torch forms in `kernels.torch_ops`).
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4_engine.config import Dsv4Config
from dsv4_engine.kernels import KernelSet
from dsv4_engine.kernels.torch_ops import collapse, stream_mixes
from dsv4_engine.model.ops import Module


class HyperConnection(Module):
    def __init__(self, config: Dsv4Config) -> None:
        super().__init__()
        self.n = config.hc_mult
        self.iters = config.hc_sinkhorn_iters
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + self.n) * self.n, self.n * config.hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + self.n) * self.n))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(
        self, streams: torch.Tensor, kernels: KernelSet
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(post [T, N], comb [T, N, N], collapsed [T, D]) for streams `[T, N, D]`."""
        return kernels.hc_pre(streams, self.fn, self.base, self.scale, self.iters, self.hc_eps, self.norm_eps)


class HyperHead(Module):
    """Final collapse of the streams before the model norm (torch: once a forward, a few ops)."""

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
        return collapse(pre, streams)
