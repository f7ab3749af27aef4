"""bf16 against HF in bf16 (prompts <= 64 tokens: CPU bf16 matmuls are slow).

Tolerance: one bf16 ulp at the largest |logit|. Our model mirrors HF's dtype flow (the same
parameters stay fp32: norms, mHC, sinks, compressor position bias, correction bias; the same
casts before and after each fp32 island), so the two differ only by accumulation order, which
moves a bf16 result by at most about one ulp. Getting the dtype policy wrong is much larger:
putting any one of the sinks, the position bias, a layer-norm weight or an mHC projection in
bf16 moves these logits by 0.04 to 0.95, i.e. 1.25 to 30 ulps at this scale.
"""

from __future__ import annotations

import math

import pytest
import torch


@pytest.mark.parametrize("length", [16, 64])
def test_bf16_matches_hf_bf16(models, length: int) -> None:
    ids = models.random_ids(length, seed=length)
    ours = models.ours("A", torch.bfloat16)
    assert ours.model.layers[0].self_attn.q_a_proj.weight.dtype == torch.bfloat16
    assert ours.model.layers[0].self_attn.sinks.dtype == torch.float32
    with models.stable_topk(), torch.inference_mode():
        ref = models.hf("A", torch.bfloat16)(torch.tensor([ids]), use_cache=False).logits[0].float()
    got = models.logits(ours, ids)
    scale = ref.abs().max().item()
    ulp = 2.0 ** (math.floor(math.log2(scale)) - 7)  # bf16 keeps 8 significant bits
    diff = (got - ref).abs().max().item()
    print(f"bf16 L={length}: max abs diff {diff:.3g}, one ulp at |logit| {scale:.3g} is {ulp:.3g}")
    assert diff <= ulp
