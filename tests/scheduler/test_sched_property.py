"""Property: any workload (arrivals, aborts, tight pools forcing preemption) ends with every pool at
its initial free count, every step within budget with page-aligned non-final chunks, and every
finished request holding exactly the tokens it would have produced alone."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.scheduler import Sequence


def expected_tokens(rid: str, prompt_len: int, n: int) -> list[int]:
    # conftest.fake_token, restated: the token sampled at position p depends only on (rid, p).
    return [(hash((rid, prompt_len + i)) % 47) + 3 for i in range(n)]


request = st.tuples(st.integers(0, 5), st.integers(1, 250), st.integers(1, 80))  # arrival step, prompt, max


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    requests=st.lists(request, min_size=2, max_size=8),
    aborts=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 7)), max_size=3),
    full_pages=st.integers(3, 8),
    budget=st.sampled_from([128, 256, 512]),
    chunk=st.sampled_from([None, 128, 256]),
)
def test_any_workload_is_clean(make_harness, requests, aborts, full_pages: int, budget: int, chunk) -> None:
    h = make_harness(full_pages=full_pages, max_num_batched_tokens=budget, chunk_size=chunk, max_ctx=2048)
    initial = h.alloc.num_free()
    seqs: list[Sequence] = []
    step = 0
    while step < 20 or h.sched.has_unfinished():
        for arrival, prompt, max_tokens in requests:
            if arrival == step:
                s = Sequence(
                    f"r{len(seqs)}", [5] * prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)
                )
                try:
                    h.sched.add(s)
                except ValueError:
                    continue  # can never fit this pool: rejected up front
                seqs.append(s)
        for at, which in aborts:
            if at == step and seqs:
                h.sched.abort(seqs[which % len(seqs)].request_id)
        h.step()
        for s in h.sched.running:  # the allocator and the scheduler agree on every cache length
            assert h.alloc.seq_len(s.req_idx) == s.num_computed
        step += 1
        assert step < 5000, "no progress"
    for out in h.steps:
        assert 0 < out.num_tokens <= budget
        for c in out.chunks:
            assert c.sample or c.end % h.page_size == 0
            assert chunk is None or c.end - c.start <= chunk
    for s in seqs:
        if s.finish_reason == "length":
            assert s.output_token_ids == expected_tokens(
                s.request_id, len(s.prompt_token_ids), s.params.max_tokens
            )
        else:
            assert s.finish_reason == "abort"
    assert h.alloc.num_free() == initial
    assert h.alloc.num_free_requests() == 8
    target(h.sched.metrics()["num_preemptions"])  # steer the search toward preempting workloads
