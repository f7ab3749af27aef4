"""Turn last-position logits into next tokens: greedy, or temperature / top-k / top-p sampling."""

from __future__ import annotations

import torch

from dsv4_engine.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """One token per row of `logits [B, V]` (fp32). Rows with a generator draw from it (seeded)."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy.tolist()
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=logits.device)
    probs = filter_top_k_top_p(logits / temps[:, None], params).softmax(dim=-1)
    # Gumbel-max via exponential noise: argmax(p / E) samples from p; per-row generators keep seeds local.
    noise = torch.empty_like(probs)
    for i, gen in enumerate(generators):
        noise[i].exponential_(generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    return [int(g) if p.greedy else int(s) for p, g, s in zip(params, greedy, sampled, strict=True)]


def filter_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k and top-p (nucleus) set."""
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=logits.device)
    top_p = torch.tensor([p.top_p for p in params], device=logits.device)
    if bool((top_k >= vocab).all()) and bool((top_p >= 1.0).all()):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= top_k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep a token if the mass strictly before it is below top_p (the first token always stays).
    before = probs.cumsum(dim=-1) - probs
    drop |= before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
