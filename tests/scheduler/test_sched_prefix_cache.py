"""Property: with the prefix cache, any workload of prompts sharing prefixes (arrivals, aborts, PD
holds released later, pools tight enough to evict and preempt) only ever schedules a chunk whose
reads are resident: the full slots and compressed rows before it, the SWA window of its first token
and the C4 state its first block borrows. At the end every page is free or the cache's alone, and a
flush frees them all."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, example, given, settings, target
from hypothesis import strategies as st

from dsv4_engine.memory.state_tail import state_read_range
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.scheduler import ScheduledChunk, Sequence

BASES = [[random.Random(b).randrange(3, 50) for _ in range(700)] for b in range(3)]
WINDOW = 16  # the harness's layout

request = st.tuples(
    st.integers(0, 6),  # arrival step
    st.integers(0, 2),  # base prompt
    st.integers(0, 600),  # tokens shared with it
    st.integers(1, 150),  # own tail
    st.integers(1, 40),  # max tokens
    st.booleans(),  # held after finishing (a PD prefill), released a few steps later
)


def _assert_resident(h, chunk: ScheduledChunk) -> None:
    row, start, pool = chunk.seq.req_idx, chunk.start, h.req_pool
    assert row is not None
    assert bool((pool.req_to_token[row, :start] > 0).all()), ("full", start)
    assert bool((pool.req_to_token_c4[row, : start // 4] > 0).all()), ("c4 rows", start)
    assert bool((pool.req_to_token_swa[row, max(0, start - WINDOW + 1) : start] > 0).all()), ("swa", start)
    lo, hi = state_read_range(4, start)
    assert bool((pool.req_to_token_c4_state[row, max(0, lo) : hi] > 0).all()), ("c4 state", start)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    requests=st.lists(request, min_size=2, max_size=10),
    aborts=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 9)), max_size=3),
    full_pages=st.integers(6, 16),
    swa_pages=st.integers(6, 16),
    state_pages=st.integers(8, 16),
    budget=st.sampled_from([128, 256, 512]),
    chunk=st.sampled_from([None, 128, 256]),
)
# Found by the search (it raised OutOfPages): a resume shares a snapshot's SWA page that an earlier
# chunk of the step releases, so the step's count of pages needed went stale.
@example(
    requests=[(0, 0, 0, 1, 1, False)] * 6
    + [(0, 0, 0, 1, 3, False), (0, 0, 0, 127, 3, False), (0, 0, 128, 128, 2, False), (0, 0, 128, 1, 2, False)],
    aborts=[], full_pages=8, swa_pages=6, state_pages=8, budget=256, chunk=None,
)  # fmt: skip
def test_any_workload_reads_only_resident_state(
    make_harness, requests, aborts, full_pages: int, swa_pages: int, state_pages: int, budget: int, chunk
) -> None:
    h = make_harness(
        full_pages=full_pages, swa_pages=swa_pages, state_pages=state_pages, max_num_batched_tokens=budget,
        chunk_size=chunk, max_ctx=2048, prefix_cache=True,
    )  # fmt: skip
    seqs: list[Sequence] = []
    release_at: dict[str, int] = {}
    step = 0
    while step < 20 or h.sched.has_unfinished() or h.sched.held:
        for arrival, base, shared, tail, max_tokens, hold in requests:
            if arrival == step:
                prompt = BASES[base][:shared] + [
                    random.Random(len(seqs)).randrange(3, 50) for _ in range(tail)
                ]
                s = Sequence(f"r{len(seqs)}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                s.hold = hold
                try:
                    h.sched.add(s)
                except ValueError:
                    continue  # can never fit this pool: rejected up front
                seqs.append(s)
        for at, which in aborts:
            if at == step and seqs:
                h.sched.abort(seqs[which % len(seqs)].request_id)
        for rid in [r for r in h.sched.held if r not in release_at]:
            release_at[rid] = step + 3
        for rid, at in list(release_at.items()):
            if at <= step:
                h.sched.release(rid)
                del release_at[rid]
        out = h.sched.schedule()
        if out is not None:
            h.alloc.take_state_copies()  # the model runner's, before the forward
            for c in out.chunks:
                _assert_resident(h, c)
            h.steps.append(out)
            sampled = {c.seq.request_id: 7 for c in out.chunks if c.sample}
            h.sched.postprocess(out, sampled)
            h.alloc.take_state_copies()
        step += 1
        assert step < 5000, "no progress"
    for s in seqs:
        assert s.finish_reason in ("length", "abort")
        if s.finish_reason == "length":
            assert len(s.output_token_ids) == s.params.max_tokens
    totals = {f: p.num_pages for f, p in h.alloc.pools.items()}
    assert h.alloc.num_available() == totals
    h.alloc.flush_cache()
    assert h.alloc.num_free() == totals and h.alloc.num_free_requests() == 8
    m = h.sched.metrics()
    target(m["prefix_cache_hits"])  # steer the search toward workloads that hit
    target(m["num_preemptions"], label="preemptions")
