"""Small numeric helpers shared by the model's modules."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32; the weight is kept in fp32 and the result cast to the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.mul_(self.weight).to(x.dtype)  # in place on the fresh product: one buffer fewer


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation without a weight; the scale is computed in fp32, applied in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def unweighted_rms_norm_(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`unweighted_rms_norm` in place, for a tensor nothing else reads."""
    return x.mul_(torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype))


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries along the last dim; ties go to the lower index.

    Exact ties are common in the indexer (ReLU zeros); an unstable top-k would make the
    selected set depend on memory layout.
    """
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[..., :k]
