"""Scheduler: chunked prefill rules, decode-first batching, admission, preemption, abort, metrics."""

from __future__ import annotations

import pytest

from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.scheduler import SeqStatus, Sequence


def seq(rid: str, n: int, max_tokens: int = 4, **kw) -> Sequence:
    return Sequence(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=max_tokens, **kw))


def test_chunks_respect_budget_and_end_on_pages(make_harness) -> None:
    h = make_harness(max_num_batched_tokens=300, chunk_size=256)
    h.sched.add(seq("a", 700))
    h.sched.add(seq("b", 50))
    out = h.sched.schedule()
    # a: min(700, 300, 256) = 256 (page-aligned already); b: 44 left of the budget, final chunk? no:
    # b needs 50 > 44, a non-final chunk of 44 rounds down to 0 -> b waits.
    assert [(c.seq.request_id, c.start, c.end) for c in out.chunks] == [("a", 0, 256)]
    h.sched.postprocess(out, {})
    out = h.sched.schedule()
    assert [(c.seq.request_id, c.start, c.end) for c in out.chunks] == [("a", 256, 512)]
    h.sched.postprocess(out, {})
    out = h.sched.schedule()
    # a's final chunk (188 tokens, not page-aligned: it samples) then b fits whole in the rest.
    assert [(c.seq.request_id, c.start, c.end, c.sample) for c in out.chunks] == [
        ("a", 512, 700, True), ("b", 0, 50, True),
    ]  # fmt: skip


def test_decodes_go_first_and_every_request_finishes(make_harness) -> None:
    h = make_harness(max_num_batched_tokens=256)
    for i, n in enumerate((5, 300, 129)):
        h.sched.add(seq(f"r{i}", n, max_tokens=6))
    h.run()
    for out in h.steps:
        assert out.num_tokens <= 256
        kinds = [c.is_decode for c in out.chunks]
        assert kinds == sorted(kinds, reverse=True)  # decodes before prefill chunks
        for c in out.chunks:
            if not c.sample:
                assert c.end % 128 == 0  # only final chunks may end off a page boundary
    m = h.sched.metrics()
    assert m["generation_tokens_total"] == 18 and m["prompt_tokens_total"] == 5 + 300 + 129
    assert m["num_running"] == 0 and m["num_waiting"] == 0


def test_stop_conditions(make_harness) -> None:
    h = make_harness()
    a = seq("a", 10, max_tokens=100, stop_token_ids=[])
    h.sched.add(a)
    out = h.sched.schedule()
    done = h.sched.postprocess(out, {"a": 1})  # EOS
    assert done == [a] and a.finish_reason == "stop" and a.status is SeqStatus.FINISHED
    b = seq("b", 10, max_tokens=100, ignore_eos=True, stop_token_ids=[7])
    h.sched.add(b)
    assert h.sched.postprocess(h.sched.schedule(), {"b": 1}) == []  # EOS ignored
    assert h.sched.postprocess(h.sched.schedule(), {"b": 7})[0].finish_reason == "stop"
    c = seq("c", 10, max_tokens=2)
    h.sched.add(c)
    h.sched.postprocess(h.sched.schedule(), {"c": 5})
    assert h.sched.postprocess(h.sched.schedule(), {"c": 5})[0].finish_reason == "length"
    assert h.alloc.num_free() == {"full": 64, "swa": 64, "c4s": 32, "c128s": 32}


def test_admission_waits_for_free_pages(make_harness) -> None:
    h = make_harness(full_pages=4, max_num_batched_tokens=1024)
    h.sched.add(seq("big", 400, max_tokens=2))  # 4 pages
    h.sched.add(seq("small", 10, max_tokens=2))
    h.step()
    assert [c.seq.request_id for c in h.steps[-1].chunks] == ["big"]  # small waits: no full page left
    assert h.sched.metrics()["num_waiting"] == 1
    h.run()
    assert h.sched.metrics()["num_preemptions"] == 0


def test_preemption_by_recompute_when_pools_run_short(make_harness) -> None:
    h = make_harness(full_pages=5, max_num_batched_tokens=1024)
    reqs = [seq(f"r{i}", 120, max_tokens=40) for i in range(4)]  # 4 x 1 page, each grows into a 2nd
    for r in reqs:
        h.sched.add(r)
    h.run()
    assert h.sched.metrics()["num_preemptions"] > 0
    for r in reqs:
        assert len(r.output_token_ids) == 40 and r.finish_reason == "length"
    assert h.alloc.num_free() == {"full": 5, "swa": 64, "c4s": 32, "c128s": 32}


def test_abort_waiting_and_running(make_harness) -> None:
    h = make_harness(max_num_seqs=1)
    h.sched.add(seq("run", 200, max_tokens=50))
    h.sched.add(seq("wait", 20))
    h.step()
    assert h.sched.metrics()["num_running"] == 1 and h.sched.metrics()["num_waiting"] == 1
    assert h.sched.abort("wait").finish_reason == "abort"
    h.step()
    assert h.sched.abort("run").finish_reason == "abort"
    assert h.sched.abort("nope") is None
    assert not h.sched.has_unfinished() and h.sched.metrics()["num_aborted"] == 2
    assert h.alloc.num_free() == {"full": 64, "swa": 64, "c4s": 32, "c128s": 32}
    assert h.alloc.num_free_requests() == 8


def test_rejects_requests_that_can_never_run(make_harness) -> None:
    h = make_harness(full_pages=2, max_ctx=1024)
    with pytest.raises(ValueError, match="never fit"):
        h.sched.add(seq("x", 200, max_tokens=100))
    with pytest.raises(ValueError, match="max_model_len"):
        h.sched.add(seq("y", 1024))
