"""Turn last-position logits into next tokens, and logits into logprobs.

Sampling runs over the whole batch as tensor ops, in vLLM's order: `min_tokens` and `bad_words` mask
single tokens, `logit_bias` is added, then the repetition / frequency / presence penalties (from
per-row token counts built by one scatter), then the allowed-token masks: the grammar masks of
constrained requests (`dsv4_engine.grammar`) and `allowed_token_ids`, rows of a boolean mask, only for
the rows that have one; then greedy argmax or temperature, `min_p`, top-k / top-p and a seeded draw.
Every step is row-wise, so a request gets the same token whatever runs beside it. Python loops only
over the requests and their own short lists (stop ids, bias entries, token history), never over the
vocabulary.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from dsv4_engine.sampling_params import SamplingParams

# Rows of the batch under a grammar, and their allowed tokens (`[len(rows), V]` bool).
GrammarMask = tuple[list[int], torch.Tensor]


@dataclass
class TokenLogprobs:
    """One position's logprobs (raw model distribution): the token there (sampled, or the prompt's)
    and the k most likely tokens, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    *,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    output_ids: Sequence[Sequence[int]] | None = None,
    eos_token_ids: Collection[int] = (),
    grammar_mask: GrammarMask | None = None,
) -> list[int]:
    """One token per row of `logits [B, V]`. Rows with a generator draw from it (seeded).
    `prompt_ids` / `output_ids`: each row's tokens so far (penalties, min_tokens; none if omitted).
    `grammar_mask`: (rows, allowed `[len(rows), V]` bool) for the rows under a grammar.
    `logits` is not modified."""
    logits = process_logits(
        logits,
        params,
        prompt_ids=prompt_ids,
        output_ids=output_ids,
        eos_token_ids=eos_token_ids,
        grammar_mask=grammar_mask,
    )
    greedy = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy.tolist()
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=logits.device)
    scaled = apply_min_p(logits / temps[:, None], params)
    probs = filter_top_k_top_p(scaled, params).softmax(dim=-1)
    # Gumbel-max via exponential noise: argmax(p / E) samples from p; per-row generators keep seeds local.
    noise = torch.empty_like(probs)
    for i, gen in enumerate(generators):
        noise[i].exponential_(generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    return [int(g) if p.greedy else int(s) for p, g, s in zip(params, greedy, sampled, strict=True)]


def process_logits(
    logits: torch.Tensor,
    params: list[SamplingParams],
    *,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    output_ids: Sequence[Sequence[int]] | None = None,
    eos_token_ids: Collection[int] = (),
    grammar_mask: GrammarMask | None = None,
) -> torch.Tensor:
    """fp32 logits after min_tokens masking, logit_bias, penalties and grammar masks (a copy when
    any applies)."""
    logits = logits.float()
    vocab = logits.shape[-1]
    outputs: Sequence[Sequence[int]] = output_ids if output_ids is not None else [()] * len(params)
    mask_rows: list[int] = []  # (row, token) pairs masked to -inf: min_tokens' stops, bad words
    mask_cols: list[int] = []
    bias_rows: list[int] = []
    bias_cols: list[int] = []
    bias_vals: list[float] = []
    for i, p in enumerate(params):
        if p.min_tokens and len(outputs[i]) < p.min_tokens:
            stops = {*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)}
            ids = sorted(t for t in stops if t < vocab)  # an id past the vocabulary can never be sampled
            mask_rows += [i] * len(ids)
            mask_cols += ids
        if p.bad_words_token_ids:
            ids = sorted(t for t in banned_tokens(p.bad_words_token_ids, outputs[i]) if t < vocab)
            mask_rows += [i] * len(ids)
            mask_cols += ids
        if p.logit_bias:
            bias_rows += [i] * len(p.logit_bias)
            bias_cols += list(p.logit_bias)
            bias_vals += list(p.logit_bias.values())
    penalized = [i for i, p in enumerate(params) if p.penalized]
    allowed = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if not (mask_rows or bias_rows or penalized or grammar_mask or allowed):
        return logits
    logits = logits.clone()  # the caller's logits stay raw (logprobs are taken from them)
    device = logits.device
    if bias_rows:
        index = (torch.tensor(bias_rows, device=device), torch.tensor(bias_cols, device=device))
        logits.index_put_(index, torch.tensor(bias_vals, device=device), accumulate=True)
    if mask_rows:
        index = (torch.tensor(mask_rows, device=device), torch.tensor(mask_cols, device=device))
        logits.index_put_(index, torch.tensor(float("-inf"), device=device))
    if penalized:
        rows = torch.tensor(penalized, device=device)
        sub = [params[i] for i in penalized]
        prompts = [prompt_ids[i] for i in penalized] if prompt_ids is not None else [()] * len(sub)
        logits[rows] = apply_penalties(logits[rows], sub, prompts, [outputs[i] for i in penalized])
    if grammar_mask:
        _keep_only(logits, grammar_mask[0], grammar_mask[1].to(device))
    if allowed:
        keep = torch.zeros(len(allowed), vocab, dtype=torch.bool, device=device)
        for j, i in enumerate(allowed):
            ids = [t for t in params[i].allowed_token_ids or () if t < vocab]
            keep[j, torch.tensor(ids, dtype=torch.long, device=device)] = True
        _keep_only(logits, allowed, keep)
    return logits


def _keep_only(logits: torch.Tensor, rows: list[int], allowed: torch.Tensor) -> None:
    """In place: rows `rows` of `logits` keep the tokens `allowed` (`[len(rows), V]` bool), -inf else."""
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def banned_tokens(sequences: Sequence[Sequence[int]], output: Sequence[int]) -> set[int]:
    """The tokens that would complete one of `sequences` after `output` (vLLM's bad-words rule)."""
    banned = set()
    for seq in sequences:
        head = len(seq) - 1
        if head == 0 or (len(output) >= head and list(output[len(output) - head :]) == list(seq[:head])):
            banned.add(seq[-1])
    return banned


def token_counts(rows: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """`[len(rows), vocab]` int64: how often each token id occurs in each row (one scatter_add)."""
    width = max((len(r) for r in rows), default=0) or 1
    padded = torch.tensor(
        [[*r, *([vocab] * (width - len(r)))] for r in rows], dtype=torch.long, device=device
    )
    counts = torch.zeros(len(rows), vocab + 1, dtype=torch.long, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab]  # column `vocab` collected the padding


def apply_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens (HF/vLLM: positive logits divided by it,
    negative ones multiplied), then frequency (times the count) and presence (once) penalties over
    the output tokens (OpenAI's definition). `[B, V]` fp32 in, a new tensor out."""
    vocab, device = logits.shape[-1], logits.device
    out_counts = token_counts(output_ids, vocab, device)
    seen = out_counts > 0
    rep = torch.tensor([p.repetition_penalty for p in params], device=device)
    if bool((rep != 1.0).any()):
        in_prompt = token_counts(prompt_ids, vocab, device) > 0
        penalty = torch.where(in_prompt | seen, rep[:, None], 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    freq = torch.tensor([p.frequency_penalty for p in params], device=device)
    presence = torch.tensor([p.presence_penalty for p in params], device=device)
    return logits - freq[:, None] * out_counts - presence[:, None] * seen


def apply_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Set to -inf every logit whose probability is below min_p times its row's largest (rows with
    min_p 0 unchanged); on temperature-scaled logits, as vLLM."""
    min_p = torch.tensor([p.min_p for p in params], device=logits.device)
    if not bool((min_p > 0).any()):
        return logits
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


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


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprobs]:
    """Row i: log-softmax of `logits[i]` at `token_ids[i]`, and its `num_top[i]` most likely tokens."""
    if not token_ids:
        return []
    logprobs = logits.float().log_softmax(dim=-1)
    index = torch.tensor(token_ids, dtype=torch.long, device=logits.device)[:, None]
    chosen = logprobs.gather(1, index)[:, 0].tolist()
    k = min(max(num_top), logprobs.shape[-1])
    if k > 0:
        values, ids = logprobs.topk(k, dim=-1)
        top_v, top_i = values.tolist(), ids.tolist()
    else:
        top_v = top_i = [[] for _ in token_ids]
    return [
        TokenLogprobs(t, c, list(zip(ti[:n], tv[:n], strict=True)))
        for t, c, ti, tv, n in zip(token_ids, chosen, top_i, top_v, num_top, strict=True)
    ]
