"""Which of a verify step's drafts a request keeps.

Before accepting, each row gets what the sampler applies to one token, as the step after the output
so far and the drafts before that row would see it (`verify_logits`): penalties, biases, bad words,
allowed tokens, min_tokens, and the grammar's mask (its matcher advanced over the drafts and rolled
back, grammar.py). So every request speculates, and what is kept is what one-token steps sample.

`verify` keeps the output distribution exactly the target's. Greedy: a draft is kept while it equals
the target's argmax, and the first mismatch is replaced by the argmax. Sampling: the drafts are point
masses (the MTP layer's argmax), so draft d at a position is kept with probability p(d), the target's
probability there after temperature, min_p, top-k and top-p; a rejected one is replaced by a draw
from p with d removed and renormalised. P(x) = p(d)[x = d] + (1 - p(d)) p(x)[x != d] / (1 - p(d))
= p(x), position after position (Leviathan et al. 2023, with q a point mass). When every draft is
kept, the last position's distribution gives one more token.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from dsv4_engine.sampler import apply_min_p, filter_top_k_top_p, process_logits
from dsv4_engine.sampling_params import SamplingParams


def verify_logits(
    logits: torch.Tensor,
    drafts: list[int],
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    eos_token_ids: Collection[int],
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The verify rows' logits `[k+1, V]` after what the sampler applies to one token (min_tokens,
    logit_bias, bad words, penalties, allowed tokens, the grammar's mask `allowed [k+1, V]`): row j as
    the step that follows `output_ids` and drafts[:j] would see it, so whatever is kept is what
    one-token steps would have sampled."""
    n = len(logits)
    return process_logits(
        logits,
        [params] * n,
        prompt_ids=[prompt_ids] * n,
        output_ids=[[*output_ids, *drafts[:j]] for j in range(n)],
        eos_token_ids=eos_token_ids,
        grammar_mask=(list(range(n)), allowed) if allowed is not None else None,
    )


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled token is drawn from, at each row of `logits [n, V]`."""
    rows = [params] * len(logits)
    scaled = apply_min_p(logits.float() / params.temperature, rows)
    return filter_top_k_top_p(scaled, rows).softmax(dim=-1)


def verify(
    logits: torch.Tensor, drafts: list[int], params: SamplingParams, generator: torch.Generator | None
) -> list[int]:
    """The tokens a verify step emits: the kept drafts, then one of the target's. `logits [k+1, V]`:
    row j is the target's at the position draft j was proposed for (row k: after the last draft)."""
    if params.greedy:
        target = logits.argmax(dim=-1).tolist()
        kept = 0
        while kept < len(drafts) and drafts[kept] == target[kept]:
            kept += 1
        return [*drafts[:kept], target[kept]]
    probs = target_probs(logits, params)
    u = torch.rand(len(drafts), generator=generator, device=generator.device if generator else "cpu")
    out: list[int] = []
    for j, d in enumerate(drafts):
        if float(u[j]) < float(probs[j, d]):
            out.append(d)
            continue
        residual = probs[j].clone()
        residual[d] = 0.0
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(drafts)], 1, generator=generator)))
    return out
