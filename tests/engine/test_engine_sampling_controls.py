"""Penalties, logit_bias, min_p, min_tokens and logprobs: their definitions on known logits, each
request in a mixed batch getting what it gets alone, and logprobs equal to a log-softmax of HF's
logits (the raw distribution, whatever the sampling settings)."""

from __future__ import annotations

import pytest
import torch

from dsv4_engine.llm import LLM
from dsv4_engine.sampler import process_logits, sample
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.testing import hf_stable_topk, random_ids

PROMPT = random_ids(40, seed=11)
LONG = random_ids(300, seed=12)  # spans three 128-token prefill chunks
TOL = 1e-4


@pytest.fixture(scope="module")
def llm(make_llm) -> LLM:
    return make_llm("A", chunked_prefill_size=128, max_num_batched_tokens=256)


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, **kw})  # type: ignore[arg-type]


def seeded(seed: int, **kw: object) -> SamplingParams:
    base = {"temperature": 0.9, "top_k": 50, "seed": seed, "max_tokens": 8, "ignore_eos": True}
    return SamplingParams(**{**base, **kw})  # type: ignore[arg-type]


# ---- definitions, on known logits --------------------------------------------------------------
def test_penalties_follow_vllm_and_openai_definitions() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)]
    out = process_logits(logits, params, prompt_ids=[[0]], output_ids=[[1, 1, 3]])
    # repetition over prompt + output ({0, 1, 3}): positive / 2, negative * 2; then frequency (count
    # times 0.5) and presence (0.25 once) over the output only, so the prompt's token 0 gets neither.
    want = [2.0 / 2, -1.0 * 2 - 2 * 0.5 - 0.25, 0.5, 3.0 / 2 - 0.5 - 0.25, 0.0]
    assert out[0].tolist() == pytest.approx(want)
    assert logits[0].tolist() == [2.0, -1.0, 0.5, 3.0, 0.0]  # the caller's (raw) logits are untouched


def test_bias_min_tokens_and_min_p() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 4)
    params = [
        SamplingParams(logit_bias={0: 5.0, 3: -100.0}),
        SamplingParams(min_tokens=2, stop_token_ids=[2], max_tokens=4),  # EOS (3) and stop id 2 masked
        SamplingParams(min_tokens=2, stop_token_ids=[2], max_tokens=4, ignore_eos=True),  # EOS is not
        SamplingParams(min_tokens=1, stop_token_ids=[2], max_tokens=4),  # one token made: nothing masked
    ]
    out = process_logits(logits, params, output_ids=[[], [7], [7], [7]], eos_token_ids={3})
    assert out[0].tolist() == [5.0, 1.0, 2.0, -97.0]
    assert out[1].tolist() == [0.0, 1.0, float("-inf"), float("-inf")]
    assert out[2].tolist() == [0.0, 1.0, float("-inf"), 3.0]
    assert out[3].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert sample(logits, params, [None] * 4, output_ids=[[], [7], [7], [7]], eos_token_ids={3})[1] in (0, 1)
    # min_p 0.3 keeps tokens with at least 0.3 x the top probability: e^-1 = 0.37 stays, e^-2 does not.
    few = [SamplingParams(min_p=0.3, seed=s) for s in range(64)]
    draws = sample(logits[:1].expand(64, 4), few, [torch.Generator().manual_seed(s) for s in range(64)])
    assert set(draws) == {2, 3}


def test_rows_of_a_mixed_batch_sample_as_alone() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 64, generator=g) * 3
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (5, 9, 1, 30, 12)]
    outputs = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (0, 4, 7, 2, 11)]
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.8, seed=1, presence_penalty=1.0, frequency_penalty=0.4),
        SamplingParams(temperature=1.2, seed=2, min_p=0.2, logit_bias={5: 4.0}),
        SamplingParams(temperature=0.7, seed=3, top_k=8, top_p=0.9, min_tokens=4, stop_token_ids=[1, 2]),
        SamplingParams(temperature=0.0),
    ]

    def gens() -> list[torch.Generator | None]:
        return [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]

    batch = sample(logits, params, gens(), prompt_ids=prompts, output_ids=outputs, eos_token_ids={0})
    alone = [
        sample(
            logits[i : i + 1], [p], [gen], prompt_ids=[prompts[i]], output_ids=[outputs[i]], eos_token_ids={0}
        )[0]
        for i, (p, gen) in enumerate(zip(params, gens(), strict=True))
    ]
    assert batch == alone
    assert batch[3] not in (0, 1, 2)  # before min_tokens: neither EOS nor a stop id
    assert batch[4] == int(logits[4].argmax())


def test_sampling_params_validate_the_new_fields() -> None:
    for bad in (
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3.0},
        {"repetition_penalty": 0.0},
        {"min_p": 1.5},
        {"min_tokens": 17},  # more than max_tokens (16)
        {"logit_bias": {-1: 1.0}},
        {"logit_bias": {1: float("inf")}},
        {"logprobs": 21},
        {"prompt_logprobs": -1},
    ):
        with pytest.raises(ValueError, match=next(iter(bad)).split("_")[0]):
            SamplingParams(**bad)  # type: ignore[arg-type]


# ---- the engine --------------------------------------------------------------------------------
def test_mixed_batch_gives_each_request_what_it_gets_alone(llm: LLM, assert_released) -> None:
    params = [
        greedy(max_tokens=12, repetition_penalty=1.8, logprobs=3),  # avoids a prompt token at 8
        seeded(5, presence_penalty=1.5, frequency_penalty=0.7, logit_bias={40: 6.0}),
        seeded(6, min_p=0.1, min_tokens=3, logprobs=0),
        greedy(prompt_logprobs=2, logprobs=1),
        greedy(),
        seeded(7),
    ]
    prompts = [PROMPT, PROMPT, LONG, LONG, random_ids(70, seed=70), PROMPT]
    alone = [llm.generate([p], sp)[0] for p, sp in zip(prompts, params, strict=True)]
    together = llm.generate(prompts, params)
    for a, t in zip(alone, together, strict=True):
        assert t.token_ids == a.token_ids
        for name in ("logprobs", "prompt_logprobs"):
            want, got = getattr(a, name), getattr(t, name)
            assert (want is None) == (got is None)
            for w, g in zip(want or [], got or [], strict=True):
                assert (w is None) == (g is None)
                if w is not None:
                    assert (g.token_id, [t for t, _ in g.top]) == (w.token_id, [t for t, _ in w.top])
                    assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
    # The settings really changed the output: without them the same requests generate otherwise.
    plain = llm.generate([PROMPT, PROMPT], [greedy(max_tokens=12), seeded(5)])
    assert plain[0].token_ids != together[0].token_ids
    assert plain[1].token_ids != together[1].token_ids
    assert together[4].logprobs is None and together[4].prompt_logprobs is None
    assert len(together[0].logprobs) == 12 and all(len(e.top) == 3 for e in together[0].logprobs)
    assert len(together[3].prompt_logprobs) == len(LONG) and together[3].prompt_logprobs[0] is None
    assert_released(llm)


def test_logit_bias_and_penalties_steer_greedy_output(llm: LLM) -> None:
    (forced,) = llm.generate([PROMPT], greedy(logit_bias={42: 100.0}))
    assert forced.token_ids == [42] * 8
    (base,) = llm.generate([PROMPT], greedy(max_tokens=16))
    assert len(set(base.token_ids)) < 16  # the tiny model repeats itself...
    (fresh,) = llm.generate([PROMPT], greedy(max_tokens=16, presence_penalty=2.0, frequency_penalty=2.0))
    assert len(set(fresh.token_ids)) > len(set(base.token_ids))  # ...less with the penalties


def test_min_tokens_holds_eos_and_stop_ids_back(llm: LLM) -> None:
    (base,) = llm.generate([PROMPT], greedy())
    stop = base.token_ids[0]
    engine = llm.engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = {stop}
    try:
        outs = llm.generate(
            [PROMPT] * 3,
            [
                SamplingParams(temperature=0.0, max_tokens=8),
                SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4),
                SamplingParams(
                    temperature=0.0, max_tokens=8, min_tokens=4, stop_token_ids=[base.token_ids[1]]
                ),
            ],
        )
    finally:
        engine.eos_token_ids = saved
    assert outs[0].token_ids == [stop] and outs[0].finish_reason == "stop"
    for out in outs[1:]:
        assert len(out.token_ids) >= 4
        assert stop not in out.token_ids[:4]
    assert base.token_ids[1] not in outs[2].token_ids[:4]


def _hf_logprobs(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with hf_stable_topk(), torch.inference_mode():
        return hf(torch.tensor([ids]), use_cache=False).logits[0].float().log_softmax(-1)


def test_logprobs_equal_log_softmax_of_hf_logits(llm: LLM, hf_models) -> None:
    params = [
        greedy(logprobs=5, prompt_logprobs=3),
        # Sampled with temperature, penalties and bias: the logprobs are still the raw model's.
        seeded(9, repetition_penalty=1.3, presence_penalty=0.5, logit_bias={7: 2.0}, logprobs=2),
    ]
    outs = llm.generate([LONG, LONG], params)
    for out in outs:
        ref = _hf_logprobs(hf_models("A"), LONG + out.token_ids[:-1])
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            row = ref[len(LONG) - 1 + i]
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(float(row[token]), abs=TOL)
            assert [lp for _, lp in entry.top] == pytest.approx(
                row.topk(len(entry.top)).values.tolist(), abs=TOL
            )
            assert [float(row[t]) for t, _ in entry.top] == pytest.approx(
                [lp for _, lp in entry.top], abs=TOL
            )
    prompt_lps = outs[0].prompt_logprobs
    assert prompt_lps is not None and prompt_lps[0] is None and len(prompt_lps) == len(LONG)
    ref = _hf_logprobs(hf_models("A"), LONG)
    got = torch.tensor([e.logprob for e in prompt_lps[1:]])
    want = ref[torch.arange(len(LONG) - 1), torch.tensor(LONG[1:])]
    assert torch.allclose(got, want, atol=TOL, rtol=0)
    assert [e.token_id for e in prompt_lps[1:]] == LONG[1:]
    tops = torch.tensor([[lp for _, lp in e.top] for e in prompt_lps[1:]])
    assert torch.allclose(tops, ref[:-1].topk(3, dim=-1).values, atol=TOL, rtol=0)


def test_prompt_logits_only_for_requests_that_ask(llm: LLM) -> None:
    model = llm.engine.model
    rows: list[int] = []
    compute = model.compute_logits

    def counting(hidden: torch.Tensor, *kernels: object) -> torch.Tensor:
        rows.append(hidden.shape[0])
        return compute(hidden, *kernels)

    one = SamplingParams(temperature=0.0, max_tokens=1)
    model.compute_logits = counting  # type: ignore[method-assign]
    try:
        llm.generate([LONG, PROMPT], [one, one])
        plain = sum(rows)
        rows.clear()
        outs = llm.generate(
            [LONG, PROMPT], [SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), one]
        )
    finally:
        del model.compute_logits
    assert plain == 2  # the last row of each prompt
    assert sum(rows) == 2 + len(LONG) - 1  # plus every row of the one prompt that asked
    assert outs[1].prompt_logprobs is None and len(outs[0].prompt_logprobs) == len(LONG)


def test_prompt_logprobs_survive_preemption(make_llm, assert_released) -> None:
    # The test_engine_batching workload that forces preemption by recompute in 5 pages.
    lengths = [120, 7, 126, 250, 60]
    prompts = [random_ids(n, seed=2000 + n) for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=1, logprobs=1)
    roomy = make_llm("A", chunked_prefill_size=128, max_num_batched_tokens=256, num_pages=64)
    alone = [roomy.generate([p], params)[0] for p in prompts]
    tight = make_llm("A", chunked_prefill_size=128, max_num_batched_tokens=256, num_pages=5)
    together = tight.generate(prompts, params)
    assert tight.engine.metrics()["num_preemptions"] > 0
    for a, t, n in zip(alone, together, lengths, strict=True):
        assert t.token_ids == a.token_ids and len(t.logprobs) == 20
        assert len(t.prompt_logprobs) == n  # delivered once, not again after a recompute
        got = [e.logprob for e in t.prompt_logprobs[1:]]
        assert got == pytest.approx([e.logprob for e in a.prompt_logprobs[1:]], abs=1e-5)
    assert_released(tight)
