"""Unit checks of the pieces whose failure parity would only show indirectly."""

from __future__ import annotations

import torch

from dsv4_engine.config import Dsv4Config
from dsv4_engine.kernels import choose_kernels
from dsv4_engine.kernels.torch_ops import stable_topk
from dsv4_engine.model.moe import Experts, Router, swiglu

KERNELS = choose_kernels("cpu")  # what an engine with default options runs


def test_stable_topk_breaks_ties_by_lower_index() -> None:
    scores = torch.tensor([[0.0, 2.0, 0.0, 2.0, 0.0, float("-inf"), 1.0]])
    assert stable_topk(scores, 4).tolist() == [[1, 3, 6, 0]]
    # many exact zeros (the indexer's ReLU): the lowest indices win, whatever the layout
    zeros = torch.zeros(3, 50)
    assert torch.equal(stable_topk(zeros, 5), torch.arange(5).expand(3, 5))
    assert torch.equal(stable_topk(zeros.t().contiguous().t(), 5), torch.arange(5).expand(3, 5))


def _tiny_config(checkpoints) -> Dsv4Config:
    return Dsv4Config.from_pretrained(checkpoints["A"])


def test_expert_dispatch_equals_per_token_loop(checkpoints) -> None:
    cfg = _tiny_config(checkpoints)
    experts = Experts(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2, generator=g)
        experts.down_proj.normal_(0, 0.2, generator=g)
    x = torch.randn(37, cfg.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:2] for _ in range(37)])
    weights = torch.rand(37, 2, generator=g)
    want = torch.zeros_like(x)
    for t in range(37):  # the obvious per-token reference
        for j in range(2):
            e = int(ids[t, j])
            gate, up = (experts.gate_up_proj[e] @ x[t]).chunk(2)
            want[t] += weights[t, j] * (experts.down_proj[e] @ swiglu(gate, up, cfg.swiglu_limit))
    assert torch.allclose(experts(x, weights, ids, KERNELS), want, atol=1e-5)


def test_correction_bias_steers_selection_not_weights(checkpoints) -> None:
    cfg = _tiny_config(checkpoints)
    router = Router(cfg, is_hash=False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.weight.normal_(0, 0.1, generator=g)
    x = torch.randn(5, cfg.hidden_size, generator=g)
    with torch.no_grad():
        router.e_score_correction_bias.zero_()
        router.e_score_correction_bias[3] = 100.0  # forces expert 3 into every selection
        weights, ids = router(x, torch.zeros(5, dtype=torch.long), KERNELS)
    assert (ids == 3).any(dim=1).all()
    scores = torch.nn.functional.softplus(x @ router.weight.T).sqrt()
    picked = scores.gather(1, ids)
    assert torch.allclose(weights, picked / picked.sum(1, keepdim=True) * cfg.routed_scaling_factor)


def test_a_model_module_calls_forward_directly_yet_runs_every_kind_of_hook() -> None:
    """`model.ops.Module` skips `nn.Module.__call__` only while nothing needs it: forward hooks,
    pre-hooks (which may replace the input), global hooks and `Module.compile()` still take effect."""
    import torch.nn.modules.module as torch_module

    from dsv4_engine.model.ops import Module, RMSNorm

    norm = RMSNorm(8, 1e-6)
    assert isinstance(norm, Module)
    x = torch.randn(3, 8)
    assert torch.equal(norm(x, KERNELS), norm.forward(x, KERNELS))
    calls: list[str] = []
    pre = norm.register_forward_pre_hook(lambda m, args: (args[0] * 2, *args[1:]))
    post = norm.register_forward_hook(lambda m, args, out: calls.append("post"))
    assert torch.equal(norm(x, KERNELS), norm.forward(x * 2, KERNELS)) and calls == ["post"]
    pre.remove()
    post.remove()
    handle = torch_module.register_module_forward_hook(lambda m, args, out: calls.append("global"))
    try:
        norm(x, KERNELS)
    finally:
        handle.remove()
    assert calls == ["post", "global"]
    norm(x, KERNELS)
    assert calls == ["post", "global"]  # removed hooks no longer run
