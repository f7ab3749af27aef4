"""Aborts at every stage, with preemption in the mix, leave every pool at its initial free count;
the engine's step/abort/metrics contract."""

from __future__ import annotations

import pytest

from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.testing import random_ids


def test_aborts_and_preemption_release_every_page(make_llm, assert_released) -> None:
    llm = make_llm("A", chunked_prefill_size=128, max_num_batched_tokens=256, num_pages=5)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    lengths = {"wait": 300, "chunk": 600, "decode": 40, "keep1": 120, "keep2": 100, "late": 200}
    for rid, n in lengths.items():
        engine.add_request(random_ids(n, seed=n), params, request_id=rid)
    engine.abort_request("wait")  # still waiting
    seen: dict[str, list[int]] = {}
    finished: dict[str, str | None] = {}
    steps = 0
    stages: list[str] = []
    while engine.has_unfinished():
        for out in engine.step():
            seen.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out.finish_reason
        steps += 1
        running = {s.request_id: s for s in engine.scheduler.running}
        if "chunk" in running and 0 < running["chunk"].num_computed < lengths["chunk"]:
            engine.abort_request("chunk")  # mid chunked prefill
            stages.append("chunk")
        if "decode" in running and len(seen.get("decode", [])) == 3:
            engine.abort_request("decode")  # while decoding
            stages.append("decode")
        engine.abort_request("no-such-request")  # unknown ids are ignored
        assert steps < 2000
    m = engine.metrics()
    assert sorted(stages) == ["chunk", "decode"]
    assert m["num_aborted"] == 3 and m["num_preemptions"] > 0
    assert finished == {"keep1": "length", "keep2": "length", "late": "length"}
    assert "wait" not in seen and len(seen["decode"]) == 3
    assert all(len(seen[r]) == 30 for r in ("keep1", "keep2", "late"))
    assert_released(llm)


def test_step_without_work_and_metric_keys(make_llm) -> None:
    engine = make_llm("A").engine
    assert engine.step() == [] and not engine.has_unfinished()
    m = engine.metrics()
    for key in (
        "num_running",
        "num_waiting",
        "num_preemptions",
        "prompt_tokens_total",
        "generation_tokens_total",
    ):
        assert key in m
    for fam in ("full", "swa", "c4s", "c128s"):
        assert {f"pool_usage/{fam}", f"pool_free/{fam}", f"pool_total/{fam}"} <= m.keys()
    assert all(isinstance(v, float) for v in m.values())


def test_pool_sizing_options(make_llm) -> None:
    from dsv4_engine.memory.sizing import pool_bytes

    budget = 64 * 2**20
    engine = make_llm("A", num_pages=None, kv_cache_memory_bytes=budget, max_num_seqs=4).engine
    assert pool_bytes(engine.layout, engine.pool_sizes) <= budget
    assert engine.pool_sizes.full_pages >= engine.max_model_len // engine.layout.page_size
    small = make_llm("A", num_pages=2, max_num_seqs=4).engine
    assert small.metrics()["pool_total/full"] == 2.0
    with pytest.raises(ValueError, match="never fit"):  # 300 + 100 tokens need 4 pages of 128
        small.add_request(random_ids(300, seed=1), SamplingParams(max_tokens=100))
    assert not small.has_unfinished()
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        make_llm("A", chunked_prefill_size=100)
