"""LLMEngine / LLM.generate / SamplingParams / sampler behaviour on the tiny checkpoint."""

from __future__ import annotations

import pytest
import torch

from dsv4_engine import LLM, SamplingParams
from dsv4_engine.engine import LLMEngine
from dsv4_engine.sampler import filter_top_k_top_p, sample

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(checkpoints) -> LLM:
    return LLM(checkpoints["A"], dtype="auto", device="cpu")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": -1}, "seed"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ],
)
def test_sampling_params_validate(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_generate_strings_and_token_lists(llm: LLM) -> None:
    text_prompt = "hello world"
    ids_prompt = llm.tokenizer.encode(text_prompt)
    outs = llm.generate([text_prompt, ids_prompt, [5, 6, 7]], GREEDY)
    assert [len(o.token_ids) for o in outs] == [12, 12, 12]
    assert all(o.finish_reason == "length" for o in outs)
    assert outs[0].prompt_token_ids == ids_prompt
    assert outs[0].token_ids == outs[1].token_ids  # same prompt, batched together
    assert outs[0].text == llm.tokenizer.decode(outs[0].token_ids, skip_special_tokens=True)
    assert len({o.request_id for o in outs}) == 3


def test_batched_generation_equals_alone(llm: LLM) -> None:
    prompts = [[7, 8, 9, 10, 11] * 8, [100, 200, 300]]
    together = llm.generate(prompts, GREEDY)
    alone = [llm.generate([p], GREEDY)[0] for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]


def test_stop_token_and_eos(llm: LLM) -> None:
    (base,) = llm.generate([[5, 6, 7, 8]], GREEDY)
    stop = base.token_ids[3]
    first = base.token_ids.index(stop)
    (out,) = llm.generate(
        [[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop])
    )
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: first + 1]

    engine = llm.engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = {stop}
    try:
        (eos_out,) = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=12))
        (ignored,) = llm.generate([[5, 6, 7, 8]], GREEDY)
    finally:
        engine.eos_token_ids = saved
    assert eos_out.finish_reason == "stop" and eos_out.token_ids == base.token_ids[: first + 1]
    assert ignored.token_ids == base.token_ids  # ignore_eos keeps going and does not mask EOS


def test_seeded_sampling_is_reproducible(llm: LLM) -> None:
    p = [[40, 41, 42]]
    a = llm.generate(p, SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=11, max_tokens=10))[0]
    b = llm.generate(p, SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=11, max_tokens=10))[0]
    c = llm.generate(p, SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=12, max_tokens=10))[0]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_engine_step_abort_and_metrics(llm: LLM) -> None:
    engine: LLMEngine = llm.engine
    assert engine.step() == []  # no work: returns at once
    before = engine.metrics()
    a = engine.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    b = engine.add_request([8, 9], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True), "mine")
    assert b == "mine" and engine.metrics()["num_waiting"] == 2
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1], GREEDY, "mine")
    outs = engine.step()  # prefill of both
    assert {o.request_id for o in outs} == {a, b} and all(len(o.new_token_ids) == 1 for o in outs)
    assert engine.metrics()["num_running"] == 2
    req_b = engine.requests[b]
    engine.abort_request(b)
    assert req_b.req_idx is None and b not in engine.requests  # its row (and pages) freed
    finished = []
    while engine.has_unfinished():
        finished += [o for o in engine.step() if o.finished]
    assert [(o.request_id, o.finish_reason) for o in finished] == [(a, "length")]
    after = engine.metrics()
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == 5
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == 4  # 3 for a, 1 for b
    assert after["num_running"] == 0 and after["num_waiting"] == 0
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], GREEDY)


def test_sampler_filters() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [0.0, 3.0, 1.0, 2.0]])
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.5)]
    out = filter_top_k_top_p(logits, params)
    assert torch.isfinite(out[0]).tolist() == [False, True, False, True]
    assert torch.isfinite(out[1]).tolist() == [False, True, False, False]  # p(top1) = 0.64 >= 0.5
    gens = [torch.Generator().manual_seed(0), None]
    greedy_like = [SamplingParams(top_k=1, seed=0), SamplingParams(temperature=0.0)]
    assert sample(logits, greedy_like, gens) == [1, 1]
