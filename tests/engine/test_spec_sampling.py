"""Speculative decoding keeps the target's output distribution.

`verify` is checked against the distribution it must reproduce (many seeded draws, a stated
tolerance), then the engine: seeded temperature-1 requests with and without speculation give the
same token distributions. Drafts there are fixed tokens the target often samples, so they are kept
often and rejected often; a verify that kept drafts too readily (or never) moves the distributions
far past the tolerance.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.speculative import verify, verify_logits
from dsv4_engine.speculative.accept import target_probs
from dsv4_engine.testing import random_ids

from .test_engine_speculative import _llm, mtp_checkpoints  # noqa: F401  (the fixture)

DRAWS = 20000
# Per token, 5 standard deviations of an empirical frequency over DRAWS draws at p = 0.5.
TOLERANCE = 5 * (0.25 / DRAWS) ** 0.5


def _judged(params: SamplingParams, drafts: list[int], rows: torch.Tensor, output: list[int]) -> list[int]:
    """What a greedy verify keeps of `drafts` over raw `rows`, after `output` (prompt: [1, 2])."""
    return verify(
        verify_logits(rows, drafts, params, [1, 2], output, eos_token_ids=(0,)), drafts, params, None
    )


def test_each_verify_row_sees_the_drafts_before_it() -> None:
    """Row j of a verify is processed as the step after output + drafts[:j]: a token drafted at row 0
    is penalised at row 1, min_tokens' stop mask lifts exactly at the row where the output reaches
    it, and a bad word's last token is banned right after its first was drafted."""
    flat = torch.zeros(3, 16)
    flat[:, 7], flat[:, 8] = 2.0, 1.5  # 7 leads by 0.5 everywhere
    greedy = dict(temperature=0.0, max_tokens=64)
    assert _judged(SamplingParams(**greedy), [7, 7], flat, [5]) == [7, 7, 7]
    # One 7 drafted before row 1: a frequency penalty of 1 puts 8 ahead there.
    assert _judged(SamplingParams(frequency_penalty=1.0, **greedy), [7, 7], flat, [5]) == [7, 8]
    assert _judged(SamplingParams(presence_penalty=1.0, **greedy), [7, 7], flat, [5]) == [7, 8]
    eos = flat.clone()
    eos[:, 0] = 5.0  # the end token leads wherever min_tokens lets it
    # 2 tokens out, min_tokens 3: row 0 (2 out) masks it, row 1 (3 out with the draft) does not.
    assert _judged(SamplingParams(min_tokens=3, **greedy), [7, 7], eos, [5, 5]) == [7, 0]
    # Bad word [7, 8]: after the draft 7 at row 0, row 1 may not pick 8.
    bad = flat.clone()
    bad[1:, 8] = 3.0  # 8 leads from row 1 on
    params = SamplingParams(bad_words_token_ids=[[7, 8]], **greedy)
    assert _judged(SamplingParams(**greedy), [7, 8], bad, [5]) == [7, 8, 8]
    assert _judged(params, [7, 8], bad, [5]) == [7, 7]


def test_greedy_keeps_drafts_while_they_are_the_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    greedy = SamplingParams(temperature=0.0)
    assert verify(logits, [1, 0], greedy, None) == [1, 0, 2]  # both kept, then the last argmax
    assert verify(logits, [1, 2], greedy, None) == [1, 0]  # the second replaced by the argmax
    assert verify(logits, [2, 0], greedy, None) == [1]
    assert verify(logits[:1], [], greedy, None) == [1]


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3)]
)
def test_rejection_sampling_reproduces_the_target_distribution(params: SamplingParams) -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 1.5
    probs = target_probs(logits, params)
    drafts = [int(probs[0].argmax()), int(probs[1].argsort()[-2])]  # a likely and a less likely one
    gen = torch.Generator().manual_seed(1)
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()  # the next token, when the first draft was kept
    kept_first = 0
    for _ in range(DRAWS):
        out = verify(logits, drafts, params, gen)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            kept_first += 1
            second[out[1]] += 1
    for t in range(6):
        assert abs(first[t] / DRAWS - float(probs[0, t])) < TOLERANCE, (t, first)
    assert abs(kept_first / DRAWS - float(probs[0, drafts[0]])) < TOLERANCE
    n = sum(second.values())
    for t in range(6):
        assert abs(second[t] / n - float(probs[1, t])) < 5 * (0.25 / n) ** 0.5, (t, second)


SAMPLES = 400
# Top-2 sampling: output token i takes at most 2^(i+1) values. Two 400-sample estimates of such a
# distribution (8 values) differ by ~0.075 in total variation when they are the same distribution;
# the seeds are fixed, so the figure is the same every run.
TV_TOLERANCE = 0.15


def _token_marginals(llm, prompt: list[int], params: SamplingParams) -> list[Counter[int]]:  # type: ignore[no-untyped-def]
    outs = llm.generate(
        [prompt] * SAMPLES, [SamplingParams(**{**params.__dict__, "seed": s}) for s in range(SAMPLES)]
    )
    return [Counter(o.token_ids[i] for o in outs) for i in range(params.max_tokens)]


def _tv(a: Counter[int], b: Counter[int]) -> float:
    return 0.5 * sum(abs(a[t] - b[t]) for t in a.keys() | b.keys()) / SAMPLES


def test_seeded_sampling_keeps_its_distribution(mtp_checkpoints: dict[str, Path]) -> None:  # noqa: F811
    prompt = random_ids(40, seed=5)
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=3, ignore_eos=True)
    off = _token_marginals(_llm(mtp_checkpoints["A"], max_num_seqs=32), prompt, params)
    spec = _llm(mtp_checkpoints["A"], max_num_seqs=32, speculative_num_steps=2)
    drafter = spec.engine.runner.drafter
    assert drafter is not None
    # Each output position's most frequent token without speculation: often right, often not.
    likely = [c.most_common(1)[0][0] for c in off] + [0, 0]
    propose = drafter.propose

    def fixed(rows, streams):  # type: ignore[no-untyped-def]
        drafts = propose(rows, streams)
        index = {r.request_id: r.start + len(r.next_ids) - len(prompt) for r in rows}  # of the pending token
        return {rid: likely[index[rid] + 1 : index[rid] + 1 + len(d)] for rid, d in drafts.items()}

    drafter.propose = fixed  # type: ignore[method-assign]
    on = _token_marginals(spec, prompt, params)
    m = spec.engine.metrics()
    assert 0.1 < m["spec_decode_num_accepted_tokens"] / m["spec_decode_num_draft_tokens"] < 0.9
    for i in range(1, params.max_tokens):  # the first token is the prefill's; the rest went through verify
        assert _tv(on[i], off[i]) < TV_TOLERANCE, (i, on[i], off[i])
