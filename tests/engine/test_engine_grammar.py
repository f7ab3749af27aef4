"""Grammar-constrained sampling in the engine: the mask on known logits, a mixed batch of grammar and
free requests giving each what it gets alone, outputs that validate, and the PD decode side
continuing the grammar from the first token the prefill server sampled."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from dsv4_engine.grammar import json_grammar
from dsv4_engine.llm import LLM
from dsv4_engine.sampler import process_logits, sample
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.testing import random_ids

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "word": {"type": "string", "maxLength": 5},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["id", "word", "flags"],
    "additionalProperties": False,
}
PROMPT = random_ids(24, seed=21)


@pytest.fixture(scope="module")
def llm(make_llm) -> LLM:
    return make_llm("A")


def test_the_mask_only_touches_its_rows() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 3)
    allowed = torch.tensor([[True, False, True, False]])
    params = [SamplingParams(temperature=0.0)] * 3
    out = process_logits(logits, params, grammar_mask=([1], allowed))
    assert out[0].tolist() == out[2].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert out[1].tolist() == [0.0, float("-inf"), 2.0, float("-inf")]
    assert sample(logits, params, [None] * 3, grammar_mask=([1], allowed)) == [3, 2, 3]


def test_a_mixed_batch_gives_each_request_what_it_gets_alone(llm: LLM) -> None:
    grammar = json_grammar(SCHEMA)
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=80, grammar=grammar if s % 2 else None)
        for s in range(6)
    ]
    together = llm.generate([PROMPT] * len(params), params)
    for p, out in zip(params, together, strict=True):
        alone = llm.generate([PROMPT], [p])[0]
        assert alone.token_ids == out.token_ids
        if p.grammar:
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), SCHEMA)


def test_the_pd_decode_side_continues_the_grammar_from_the_first_token(llm: LLM) -> None:
    grammar = json_grammar(SCHEMA)
    first = llm.generate([PROMPT], [SamplingParams(seed=3, max_tokens=80, grammar=grammar)])[0].token_ids[0]
    engine = llm.engine
    # What a PD decode server does: pages for the prompt (whose KV the transfer would fill; here
    # whatever they hold), the request admitted with the prefill's first token.
    req_idx, _ = engine.prealloc(len(PROMPT))
    params = SamplingParams(seed=4, max_tokens=80, grammar=grammar)
    engine.admit_transferred("pd-grammar", PROMPT, params, req_idx, first, None)
    tokens, reason = [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            reason = out.finish_reason if out.finished else reason
    assert tokens[0] == first and reason == "stop"
    jsonschema.validate(json.loads(llm.tokenizer.decode(tokens, skip_special_tokens=True)), SCHEMA)
