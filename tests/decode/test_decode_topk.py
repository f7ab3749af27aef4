"""The compiler-friendly stable top-k (one topk over int64 keys) picks exactly what a stable sort picks."""

from __future__ import annotations

import torch

from dsv4_engine.kernels.torch_ops import stable_topk_rows


def test_key_topk_equals_stable_sort_with_ties_signed_zeros_and_inf() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 300, (1,), generator=g))
        s = torch.randn(3, n, generator=g)
        s = torch.where(torch.rand(3, n, generator=g) < 0.3, torch.round(s), s)  # exact ties
        s = torch.where(torch.rand(3, n, generator=g) < 0.3, torch.zeros(()), s)
        s = torch.where(torch.rand(3, n, generator=g) < 0.2, -torch.zeros(()), s)  # ties with +0.0
        s = torch.where(torch.rand(3, n, generator=g) < 0.2, torch.full((), float("-inf")), s)
        k = int(torch.randint(1, n + 1, (1,), generator=g))
        want = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(stable_topk_rows(s, k, by_keys=True), want)
        assert torch.equal(stable_topk_rows(s, k, by_keys=False), want)
