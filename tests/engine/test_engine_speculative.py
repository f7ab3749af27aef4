"""Speculative decoding with the MTP layer: what a speculating engine emits and leaves in its pools is
what it would without drafts.

The parity checkpoints carry a random MTP layer: its drafts are rarely right, which exercises
rejection. Where the accept paths matter, the drafter's proposals are replaced by an
oracle (the speculation-off run's own continuation) corrupted at random, so steps keep every draft,
some, or none.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from dsv4_engine.llm import LLM
from dsv4_engine.memory.state_copies import StateCopy
from dsv4_engine.memory.state_tail import state_alloc_offset
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.speculative import DraftCache, Drafter
from dsv4_engine.testing import greedy_divergences, random_ids
from speculative_util import record_drafts  # tests/ is on sys.path (tests/conftest.py)

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# Prompt lengths on and around the 4 and 128 grids and the windows (8-32 in the parity configs).
LENGTHS = [1, 5, 31, 126, 127, 130, 300]


@pytest.fixture(scope="module")
def mtp_checkpoints(checkpoints: dict[str, Path]) -> dict[str, Path]:
    """The parity checkpoints: each carries a random MTP layer (tests/conftest.py)."""
    return checkpoints


def _llm(path: Path, **kw: object) -> LLM:
    kw.setdefault("max_model_len", 1024)
    kw.setdefault("max_num_seqs", 16)
    kw.setdefault("num_pages", 64)
    kw.setdefault("disable_radix_cache", True)
    return LLM(path, dtype="float32", device="cpu", **kw)


def _prompts(seed: int) -> list[list[int]]:
    return [random_ids(n, seed=seed + n) for n in LENGTHS]


@pytest.mark.parametrize(("name", "k", "page"), [("A", 1, 128), ("A", 3, 128), ("B", 2, 128), ("C", 3, 256)])
def test_greedy_output_equals_no_speculation(mtp_checkpoints, hf_models, assert_released, name, k, page):
    prompts = _prompts(seed=11)
    off = _llm(mtp_checkpoints[name], page_size=page).generate(prompts, GREEDY)
    spec = _llm(mtp_checkpoints[name], page_size=page, speculative_num_steps=k)
    on = spec.generate(prompts, GREEDY)
    for a, b in zip(on, off, strict=True):
        assert a.token_ids == b.token_ids, len(a.prompt_token_ids)
    m = spec.engine.metrics()
    assert m["spec_decode_num_drafts"] > 0
    assert m["spec_decode_num_draft_tokens"] >= m["spec_decode_num_drafts"]
    if name == "A" and k == 3:
        excused = sum(len(greedy_divergences(hf_models(name), o.prompt_token_ids, o.token_ids)) for o in on)
        assert excused <= 1, excused
    assert_released(spec)


def _oracle(drafter: Drafter, truth: dict[str, list[int]], rng: random.Random) -> None:
    """Replace the drafter's proposals by the true continuation (`truth`: prompt and output), each
    draft corrupted with probability 0.3 (what follows a corrupt draft is rejected anyway)."""
    propose = drafter.propose

    def oracle(rows, streams):  # type: ignore[no-untyped-def]
        proposed = propose(rows, streams)  # the MTP layer still runs and fills its rows
        out = {}
        for r in rows:
            if r.request_id in proposed:
                pending = r.start + len(r.next_ids)  # the position of the token the step sampled
                want = truth[r.request_id][pending + 1 : pending + 1 + len(proposed[r.request_id])]
                out[r.request_id] = [t if rng.random() > 0.3 else (t + 1) % 512 for t in want]
        return out

    drafter.propose = oracle  # type: ignore[method-assign]


def _read_state(llm: LLM, req_idx: int, seq_len: int) -> dict[str, torch.Tensor]:
    """Every state row a step starting at seq_len reads, by type, in position order."""
    kv, tables, layout = llm.engine.kv_pool, llm.engine.req_pool, llm.engine.layout

    def flat(buf: torch.Tensor) -> torch.Tensor:
        return buf.view(-1, buf.shape[-1])

    out = {}
    swa = tables.req_to_token_swa[req_idx, max(0, seq_len - layout.window) : seq_len].long()
    out["swa"] = torch.stack([flat(kv.swa_kv[i])[swa] for i in kv.swa_kv])
    c4 = tables.req_to_token_c4[req_idx, : seq_len // 4].long()
    out["c4"] = torch.cat([flat(kv.c4_kv[i])[c4] for i in kv.c4_kv])
    out["indexer"] = torch.cat([flat(kv.indexer_kv[i])[c4] for i in kv.indexer_kv])
    c128 = tables.req_to_token_c128[req_idx, : seq_len // 128].long()
    out["c128"] = torch.cat([flat(kv.c128_kv[i])[c128] for i in kv.c128_kv]) if kv.c128_kv else torch.zeros(0)
    s4 = tables.req_to_token_c4_state[req_idx, state_alloc_offset(4, seq_len) : seq_len].long()
    out["c4_state"] = torch.cat([flat(kv.c4_state[i])[s4] for i in kv.c4_state])
    out["indexer_state"] = torch.cat([flat(kv.c4_index_state[i])[s4] for i in kv.c4_index_state])
    s128 = tables.req_to_token_c128_state[req_idx, state_alloc_offset(128, seq_len) : seq_len].long()
    out["c128_state"] = (
        torch.cat([flat(kv.c128_state[i])[s128] for i in kv.c128_state]) if kv.c128_state else torch.zeros(0)
    )
    for name, slots in (("swa", swa), ("c4", c4), ("c128", c128), ("c4_state", s4), ("c128_state", s128)):
        assert bool((slots > 0).all()), f"{name}: a position the next step reads is not resident"
    beyond = [tables.req_to_token[req_idx, seq_len:], tables.req_to_token_c4[req_idx, -(-seq_len // 4) :]]
    beyond.append(tables.req_to_token_c128[req_idx, -(-seq_len // 128) :])
    assert all(int(t.abs().sum()) == 0 for t in beyond), "table entries past the row's end"
    return out


def _run_held(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    ids = [llm.engine.add_request(p, params, f"r{i}", hold=True) for i, p in enumerate(prompts)]
    outs: dict[str, list[int]] = {i: [] for i in ids}
    while llm.engine.has_unfinished():
        for step in llm.engine.step():
            outs[step.request_id] += step.new_token_ids
    return outs


@pytest.mark.parametrize(("name", "page"), [("A", 128), ("C", 256)])
def test_random_accept_reject_leaves_the_pools_as_no_drafting(mtp_checkpoints, assert_released, name, page):
    """Drafts kept, partly kept and rejected at random: the output is the speculation-off run's, and
    once done every state row the next step would read (SWA window, compressed rows, indexer keys,
    compressor state tails) equals that run's, with no table entry past the row's end. The GEMMs see
    other batch shapes (a verify runs k + 1 tokens), so values are compared to 1e-5, not bitwise."""
    prompts = _prompts(seed=23)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    off = _llm(mtp_checkpoints[name], page_size=page)
    truth = _run_held(off, prompts, params)
    spec = _llm(mtp_checkpoints[name], page_size=page, speculative_num_steps=3)
    drafter = spec.engine.runner.drafter
    assert drafter is not None
    _oracle(
        drafter, {rid: [*p, *truth[rid]] for rid, p in zip(truth, prompts, strict=True)}, random.Random(7)
    )
    got = _run_held(spec, prompts, params)
    assert got == truth
    m = spec.engine.metrics()
    assert 0 < m["spec_decode_num_accepted_tokens"] < m["spec_decode_num_draft_tokens"]
    for rid, prompt in zip(truth, prompts, strict=True):
        seq_len = len(prompt) + params.max_tokens - 1
        a = _read_state(spec, spec.engine.scheduler.held[rid].req_idx, seq_len)
        b = _read_state(off, off.engine.scheduler.held[rid].req_idx, seq_len)
        for kind in a:
            torch.testing.assert_close(a[kind], b[kind], atol=1e-5, rtol=1e-5, msg=f"{rid} {kind}")
    for llm in (spec, off):
        for rid in truth:
            llm.engine.release_held(rid)
        assert_released(llm)


def test_speculation_from_a_cached_prefix(mtp_checkpoints, assert_released) -> None:
    """A request resumed from the prefix cache speculates too (its MTP window comes back with the
    snapshot): the output is the no-speculation engine's, with the same cache hits."""
    base = random_ids(300, seed=41)
    prompts = [base + random_ids(9, seed=42), base + random_ids(17, seed=43)]
    outs = {}
    for k in (0, 2):
        llm = _llm(mtp_checkpoints["A"], disable_radix_cache=False, speculative_num_steps=k)
        outs[k] = [llm.generate([p], GREEDY)[0] for p in prompts]  # one after the other: the second hits
        assert outs[k][1].num_cached_tokens == 256
        if k:
            assert llm.engine.metrics()["spec_decode_num_drafts"] > 0
            assert_released(llm)
    assert [o.token_ids for o in outs[2]] == [o.token_ids for o in outs[0]]


def test_a_snapshot_keeps_the_draft_window_only_where_the_pass_reached() -> None:
    """A save at P keeps ring rows [P - window, P - 1) and the stream at P - 1 when the row's pass of
    that step ended at P - 1; a restore puts them into the resumed row, whose first pass from P then
    carries row P - 1. A row whose pass ended elsewhere leaves a snapshot without a window."""
    cache = DraftCache(2, 4, 1, 3, torch.float32, torch.device("cpu"), stream_shape=(2, 3), snapshot_slots=2)
    cache.kv[:] = torch.arange(cache.kv.numel(), dtype=torch.float32).view_as(cache.kv)
    cache.held, cache.tail[0] = {0: (2, 7)}, 5.0  # row 0's pass covered [2, 8), window from 2
    cache.apply([StateCopy(slot=1, row=0, save=True, req_idx=0, position=8)])
    assert cache.snap_from[1] == 4  # P - window: what a query at P - 1 reads
    cache.apply([StateCopy(slot=1, row=0, save=False, req_idx=1, position=8)])
    assert torch.equal(cache.read(1, 4, 7), cache.read(0, 4, 7))
    assert torch.equal(cache.tail[1], cache.tail[0])
    assert cache.first_pass(1, 8) == (4, True) and cache.first_pass(1, 9) == (9, False)

    cache.held = {0: (0, 9)}  # the pass went past P - 1: its tail is not P - 1's stream
    cache.apply([StateCopy(slot=2, row=0, save=True, req_idx=0, position=8)])
    assert cache.snap_from[2] is None
    cache.apply([StateCopy(slot=2, row=0, save=False, req_idx=1, position=8)])
    assert cache.first_pass(1, 8) == (8, False)


def test_a_resumed_request_drafts_as_if_it_had_prefilled_its_prefix(mtp_checkpoints, assert_released) -> None:
    """A snapshot keeps the MTP layer's window: a request resumed at P = 256 with 3 more prompt tokens
    (fewer than the 16-token window) proposes every draft that the same request, prefilled from 0 in
    a chunk ending at 256 with the cache off, proposes. Its first pass computes row 255 from the
    snapshot's stream (`carried`) and reads the window from 240."""
    base = random_ids(256, seed=51)
    first, second = base + random_ids(5, seed=52), base + random_ids(3, seed=53)
    kw = {"speculative_num_steps": 2, "chunked_prefill_size": 256}
    cached = _llm(mtp_checkpoints["A"], disable_radix_cache=False, **kw)
    cached.generate([first], GREEDY)
    got, rows = record_drafts(cached)
    resumed = cached.generate([second], GREEDY)[0]
    assert resumed.num_cached_tokens == 256
    window = cached.engine.layout.window
    carried = [r for r in rows if r.carried]  # type: ignore[attr-defined]
    assert [(r.start, r.window_from) for r in carried] == [(255, 256 - window)]  # type: ignore[attr-defined]
    assert_released(cached)

    plain = _llm(mtp_checkpoints["A"], **kw)
    want, _ = record_drafts(plain)
    again = plain.generate([second], GREEDY)[0]
    assert again.token_ids == resumed.token_ids
    assert len(got) == len(want) > 1
    assert got == want


def test_an_imported_prefix_keeps_its_draft_window(mtp_checkpoints, assert_released, tmp_path) -> None:
    """Exported, written to a prefix-cache file and imported into another engine (`dsv4 serve
    --prefix-cache-dir`), a snapshot keeps its MTP window: a request resumed from it proposes the
    drafts of the cache-off engine."""
    from dsv4_engine.server import prefix_file

    base = random_ids(256, seed=51)
    kw = {"speculative_num_steps": 2, "chunked_prefill_size": 256}
    source = _llm(mtp_checkpoints["A"], disable_radix_cache=False, **kw)
    source.generate([base + random_ids(5, seed=52)], GREEDY)
    exported = source.engine.export_prefix_cache().records
    assert any(r.extra for r in exported)
    prefix_file.write(tmp_path / "cache.safetensors", prefix_file.contents(exported, {"version": 1}))
    records = prefix_file.read(tmp_path / "cache.safetensors", {"version": 1})
    target = _llm(mtp_checkpoints["A"], disable_radix_cache=False, **kw)
    assert target.engine.import_prefix_cache(records) == len(records)
    got, rows = record_drafts(target)
    resumed = target.generate([base + random_ids(3, seed=53)], GREEDY)[0]
    assert resumed.num_cached_tokens == 256
    assert [r.start for r in rows if r.carried] == [255]
    assert_released(target)

    plain = _llm(mtp_checkpoints["A"], **kw)
    want, _ = record_drafts(plain)
    assert plain.generate([base + random_ids(3, seed=53)], GREEDY)[0].token_ids == resumed.token_ids
    assert got == want


# What the sampler applies beyond temperature/top-k/top-p, each on its own request: kept drafts must
# be what one-token steps would sample after the drafts before them.
PROCESSED = [
    dict(repetition_penalty=1.3),
    dict(frequency_penalty=0.8, presence_penalty=0.5),
    dict(logit_bias={7: 3.0, 11: -100.0}),
    dict(bad_words_token_ids=[[5, 9]]),
    dict(min_tokens=20, stop_token_ids=[3, 4, 6]),
    dict(logprobs=3),
]


def test_processed_requests_speculate_with_the_output_of_one_token_steps(
    mtp_checkpoints, assert_released
) -> None:
    """Penalties, logit_bias, bad words, min_tokens and logprobs with speculation: drafts are proposed
    and (oracle) mostly kept, and tokens, finish reasons and logprobs equal the speculation-off run's.
    A verify that judged its rows without the drafts before them (penalties counting only the output
    so far, min_tokens' mask lifted too early, a bad word's first token not seen) would keep drafts
    one-token steps never sample."""
    prompts = _prompts(seed=61)[:4]
    cases = [(p, SamplingParams(temperature=0.0, max_tokens=32, **kw)) for p in prompts for kw in PROCESSED]
    off = _llm(mtp_checkpoints["A"])
    spec = _llm(mtp_checkpoints["A"], speculative_num_steps=3)
    truth = {}
    for i, (p, params) in enumerate(cases):
        truth[f"r{i}"] = off.engine.add_request(p, params, f"r{i}")
    want = _collect(off)
    drafter = spec.engine.runner.drafter
    assert drafter is not None
    _oracle(drafter, {rid: [*cases[int(rid[1:])][0], *want[rid][0]] for rid in want}, random.Random(3))
    for i, (p, params) in enumerate(cases):
        spec.engine.add_request(p, params, f"r{i}")
    got = _collect(spec)
    assert [got[r][0] for r in truth] == [want[r][0] for r in truth]
    assert [got[r][1] for r in truth] == [want[r][1] for r in truth]
    for rid in truth:
        for a, b in zip(got[rid][2], want[rid][2], strict=True):
            assert (a.token_id, [t for t, _ in a.top]) == (b.token_id, [t for t, _ in b.top])
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    m = spec.engine.metrics()
    assert m["spec_decode_num_accepted_tokens"] > m["spec_decode_num_draft_tokens"] / 2
    assert any(got[r][2] for r in truth)  # the logprobs requests reported theirs
    assert_released(spec)


def _collect(llm: LLM) -> dict[str, tuple[list[int], str | None, list]]:
    """Every request's tokens, finish reason and logprobs entries, stepping until none is left."""
    outs: dict[str, tuple[list[int], str | None, list]] = {}
    while llm.engine.has_unfinished():
        for step in llm.engine.step():
            tokens, _, logprobs = outs.get(step.request_id, ([], None, []))
            outs[step.request_id] = (
                tokens + step.new_token_ids,
                step.finish_reason,
                logprobs + (step.logprobs or []),
            )
    return outs


JSON_SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "maximum": 999}, "word": {"type": "string", "maxLength": 6}},
    "required": ["id", "word"],
    "additionalProperties": False,
}


def test_grammar_requests_speculate_and_keep_only_what_the_grammar_allows(
    mtp_checkpoints, assert_released
) -> None:
    """JSON-schema requests speculate: each verify row is masked by the matcher advanced over the
    drafts before it (then rolled back), so greedy output equals the run without speculation and
    sampled output always validates, though the oracle's drafts (the greedy continuation, corrupted
    at random) are often outside the grammar where sampling went elsewhere."""
    import json

    import jsonschema

    from dsv4_engine.grammar import json_grammar

    grammar = json_grammar(JSON_SCHEMA)
    prompts = _prompts(seed=71)[:3]
    greedy = SamplingParams(temperature=0.0, max_tokens=60, grammar=grammar)
    off = _llm(mtp_checkpoints["A"])
    for i, p in enumerate(prompts):
        off.engine.add_request(p, greedy, f"r{i}")
    want = _collect(off)
    spec = _llm(mtp_checkpoints["A"], speculative_num_steps=3)
    drafter = spec.engine.runner.drafter
    assert drafter is not None
    truth = {f"r{i}": [*p, *want[f"r{i}"][0]] for i, p in enumerate(prompts)}
    truth |= {f"s{i}-{seed}": t for i, t in enumerate(truth.values()) for seed in range(4)}
    _oracle(drafter, truth, random.Random(5))
    for i, p in enumerate(prompts):
        spec.engine.add_request(p, greedy, f"r{i}")
        for seed in range(4):
            sampled = SamplingParams(temperature=1.0, seed=seed, max_tokens=60, grammar=grammar)
            spec.engine.add_request(p, sampled, f"s{i}-{seed}")
    got = _collect(spec)
    assert {r: got[r][0] for r in want} == {r: want[r][0] for r in want}
    for rid, (tokens, reason, _) in got.items():
        assert reason == "stop", rid
        jsonschema.validate(json.loads(spec.tokenizer.decode(tokens, skip_special_tokens=True)), JSON_SCHEMA)
    m = spec.engine.metrics()
    assert 0 < m["spec_decode_num_accepted_tokens"] < m["spec_decode_num_draft_tokens"]
    assert_released(spec)
