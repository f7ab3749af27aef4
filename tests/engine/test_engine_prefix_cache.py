"""The prefix cache: a request resumed from a cached prefix gives what it gives without the cache.

Prompts share prefixes of lengths on and off the page (128 or 256), the sliding window (8-32 in the
parity configs), and the ratio-4 and ratio-128 grids. A first request fills the cache; a first wave of
variants runs (and puts snapshots at the junctions where they part from it); a second wave with other
tails resumes from those snapshots. Every output, and the first token's top logprobs, must equal the
cache-off engine's, which the parity tests hold to HF; the second wave is also checked against HF.
"""

from __future__ import annotations

import pytest

from dsv4_engine.llm import LLM, RequestOutput
from dsv4_engine.memory.prefix_store import PrefixRecord
from dsv4_engine.memory.sizing import SLOTS_PER_SNAPSHOT
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.testing import greedy_divergences, random_ids

BASE = random_ids(1100, seed=77)
SHARED = [5, 127, 128, 129, 131, 132, 136, 160, 255, 256, 257, 300, 384, 515, 1024]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)


def _variant(shared: int, wave: int) -> list[int]:
    return BASE[:shared] + random_ids(20 + shared % 7, seed=1000 * wave + shared)


def _waves(llm: LLM) -> list[list[RequestOutput]]:
    first = llm.generate([BASE[:1100] + random_ids(20, seed=5)], GREEDY)
    return [first, *(llm.generate([_variant(s, w) for s in SHARED], GREEDY) for w in (1, 2))]


def _first_logprobs(out: RequestOutput) -> dict[int, float]:
    assert out.logprobs is not None
    return dict(out.logprobs[0].top)


CASES = [("A", 128, 128), ("A", -1, 128), ("B", 128, 128), ("C", 256, 256), ("C", -1, 256)]


@pytest.mark.parametrize(("name", "chunk", "page"), CASES)
def test_resumed_prefill_equals_full_prefill(make_llm, hf_models, assert_released, name, chunk, page):
    kw = {"chunked_prefill_size": chunk, "page_size": page, "max_num_batched_tokens": 4096}
    on = _waves(make_llm(name, **kw))
    off = _waves(make_llm(name, disable_radix_cache=True, **kw))
    for wave_on, wave_off in zip(on, off, strict=True):
        for a, b in zip(wave_on, wave_off, strict=True):
            assert a.token_ids == b.token_ids, (len(a.prompt_token_ids), a.num_cached_tokens)
            la, lb = _first_logprobs(a), _first_logprobs(b)
            assert la.keys() == lb.keys()
            assert all(abs(la[t] - lb[t]) < 1e-4 for t in la), (la, lb)
            assert b.num_cached_tokens == 0
    # The second wave resumes every variant from the snapshot the first put at its junction: the
    # shared prefix rounded down to the page (nothing for prefixes under one page).
    for s, out in zip(SHARED, on[2], strict=True):
        assert out.num_cached_tokens == s // page * page, s
    if name == "A" and chunk == 128:
        excused = sum(
            len(greedy_divergences(hf_models(name), o.prompt_token_ids, o.token_ids)) for o in on[2]
        )
        assert excused <= 1, excused
    llm = make_llm(name, **kw)
    _waves(llm)
    assert llm.engine.metrics()["prefix_cache_hits"] > 0
    assert_released(llm)


def test_identical_prompts_prefill_once(make_llm, assert_released):
    """n copies of a prompt submitted together: one prefills it, the others wait and resume from its
    last page boundary, so the engine runs the shared part once."""
    llm = make_llm("A")
    prompt = random_ids(700, seed=3)
    outs = llm.generate([prompt] * 4, GREEDY)
    assert all(o.token_ids == outs[0].token_ids for o in outs)
    assert sorted(o.num_cached_tokens for o in outs) == [0, 640, 640, 640]
    m = llm.engine.metrics()
    # forwarded: the prompt once, three 60-token tails, and every decode step
    assert m["forwarded_tokens_total"] == 700 + 3 * 60 + 4 * 3
    assert m["prefix_cache_queries"] == 4 * 700 and m["prefix_cache_hits"] == 3 * 640
    assert_released(llm)


def test_seeded_sample_unchanged_by_a_hit(make_llm):
    prompt = random_ids(400, seed=4)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    llm = make_llm("A")
    cold = llm.generate([prompt], seeded)[0]
    warm = llm.generate([prompt], seeded)[0]
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 384
    assert warm.token_ids == cold.token_ids


def test_prompt_logprobs_bypass_the_cache(make_llm):
    """Prompt logprobs need every position's logits, so such a request never resumes from the cache."""
    prompt = random_ids(300, seed=6)
    llm = make_llm("A")
    llm.generate([prompt], GREEDY)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    out = llm.generate([prompt], params)[0]
    assert out.num_cached_tokens == 0
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)


def test_eviction_under_a_small_pool(make_llm, assert_released):
    """Pools for a few requests, many more distinct prefixes than they hold: cached prefixes are
    evicted (least recently used first) instead of a request failing or being preempted for them."""
    llm = make_llm("A", num_pages=24, max_num_seqs=4)
    prompts = [random_ids(600, seed=100 + i) for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    first = llm.generate(prompts, params)
    again = llm.generate(prompts[-2:], params)  # the most recent survive eviction
    assert all(o.finish_reason == "length" for o in first + again)
    assert [o.token_ids for o in again] == [o.token_ids for o in first[-2:]]
    assert all(o.num_cached_tokens == 512 for o in again)
    alloc = llm.engine.allocator
    cache = alloc.prefix_cache
    assert cache is not None and cache.num_nodes <= 24 < 12 * 4  # 12 prompts offered 4 pages each
    # One 4-row slot per snapshot (SLOTS_PER_SNAPSHOT x max_num_seqs of them), and no C4 state page
    # held by the cache.
    assert 0 < cache.num_snapshots <= alloc.snapshot_slots.num_pages == 4 * SLOTS_PER_SNAPSHOT
    assert alloc.snapshot_slots.num_free == alloc.snapshot_slots.num_pages - cache.num_snapshots
    assert alloc.num_free()["c4s"] == alloc.pools["c4s"].num_pages
    assert llm.engine.metrics()["num_preemptions"] == 0
    assert_released(llm)


def test_disabled_cache_never_hits(make_llm, assert_released):
    llm = make_llm("A", disable_radix_cache=True)
    prompt = random_ids(300, seed=8)
    outs = [llm.generate([prompt], GREEDY)[0] for _ in range(2)]
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert llm.engine.allocator.prefix_cache is None
    assert llm.engine.metrics()["prefix_cache_hits"] == 0
    assert_released(llm)


@pytest.mark.parametrize(("name", "page"), [("A", 128), ("C", 256)])
def test_exported_prefixes_resume_on_another_engine(make_llm, assert_released, name, page) -> None:
    """A chat's turns leave nested snapshots; exported, each record keeps only the pages past the
    previous one it extends. Another engine (other pool sizes) imports them all and resumes the next
    turn at the deepest, answering as the cache-off engine does; after /flush_cache its pools are whole.
    """
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    source = make_llm(name, page_size=page)
    turn = BASE[:300]
    for i in range(3):  # three turns of growing history
        turn = turn + source.generate([turn], params)[0].token_ids + random_ids(150, seed=60 + i)
    records = source.engine.export_prefix_cache().records
    assert len(records) >= 2
    assert [r.base for r in records[1:]] == [len(r.tokens) for r in records[:-1]]  # each extends the last
    deepest = len(records[-1].tokens)

    target = make_llm(name, page_size=page, num_pages=200)
    assert target.engine.import_prefix_cache(records) == len(records)
    assert target.engine.import_prefix_cache(records) == 0  # all cached already
    question = turn + random_ids(30, seed=70)
    got = target.generate([question], params)[0]
    want = make_llm(name, page_size=page, disable_radix_cache=True).generate([question], params)[0]
    assert got.num_cached_tokens == deepest
    assert got.token_ids == want.token_ids
    assert_released(target)


def test_import_stops_where_free_pages_end(make_llm, assert_released) -> None:
    """An import never evicts what it imported: with pools for part of the records it caches a prefix
    of them and stops; a record whose pages do not fit the layout is refused by name."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    source = make_llm("A")
    source.generate([BASE[:1100]], params)
    records = source.engine.export_prefix_cache().records
    target = make_llm("A", num_pages=6)
    done = target.engine.import_prefix_cache(records)
    assert 0 < done < len(records)
    assert target.engine.metrics()["prefix_cache_snapshots"] == done
    assert_released(target)

    first = records[0]
    damaged = type(first)(first.tokens, first.base, {t: [d[:0] for d in ds] for t, ds in first.pages.items()})
    fresh = make_llm("A")
    with pytest.raises(ValueError, match="do not fit this layout"):
        fresh.engine.import_prefix_cache([damaged])
    assert_released(fresh)


def test_import_stops_where_snapshot_slots_end(make_llm, assert_released) -> None:
    """Fewer snapshot slots than records: the import caches as many prefixes as there are slots and
    stops, rather than evicting the snapshots it imported first."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    source = make_llm("A")
    source.generate([random_ids(600, seed=90 + i) for i in range(4)], params)
    records = source.engine.export_prefix_cache().records
    target = make_llm("A", max_num_seqs=1)  # SLOTS_PER_SNAPSHOT slots
    slots = target.engine.allocator.snapshot_slots.num_pages
    assert len(records) > slots == SLOTS_PER_SNAPSHOT
    assert target.engine.import_prefix_cache(records) == slots
    cache = target.engine.allocator.prefix_cache
    assert cache is not None and sorted(r.tokens for r in cache.resumable()) == sorted(
        r.tokens for r in records[:slots]
    )
    assert_released(target)


def _chat(llm: LLM, seed: int, turns: int) -> list[int]:
    """A conversation's history after `turns` turns (each caches its prefix)."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    history = random_ids(300, seed=seed)
    for i in range(turns):
        history = history + llm.generate([history], params)[0].token_ids + random_ids(150, seed=seed + 1 + i)
    return history


def _size(rec: PrefixRecord) -> int:
    tensors = [*(d for data in rec.pages.values() for d in data), *rec.extra.values()]
    return sum(t.numel() * t.element_size() for t in tensors) + 8 * len(rec.tokens)


def test_a_capped_export_keeps_the_most_recently_used_prefixes(make_llm, assert_released) -> None:
    """Two conversations, the older one used again last: an export capped at that one's size holds its
    prefixes only and leaves the other's out (`over_cap`). Reading leaves the cache's LRU order and
    change count as they were, so a server can save while it serves. The capped records import into
    another engine, whose next turn of the kept conversation resumes at its deepest prefix."""
    llm = make_llm("A")
    old = _chat(llm, seed=300, turns=2)
    _chat(llm, seed=400, turns=2)
    old = (
        old + llm.generate([old], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].token_ids
    )
    cache = llm.engine.allocator.prefix_cache
    assert cache is not None
    before, version = cache.resumable(), llm.engine.prefix_cache_version()

    everything = llm.engine.export_prefix_cache()
    assert (everything.busy, everything.over_cap) == (0, 0)
    mine = [r for r in everything.records if tuple(old[: len(r.tokens)]) == r.tokens]
    others = len(everything.records) - len(mine)
    assert mine and others
    capped = llm.engine.export_prefix_cache(max_bytes=sum(_size(r) for r in mine))
    assert [r.tokens for r in capped.records] == [r.tokens for r in mine]
    assert (capped.busy, capped.over_cap) == (0, others)
    assert cache.resumable() == before and llm.engine.prefix_cache_version() == version

    target = make_llm("A")
    assert target.engine.import_prefix_cache(capped.records) == len(mine)
    question = old + random_ids(30, seed=500)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = target.generate([question], params)[0]
    want = make_llm("A", disable_radix_cache=True).generate([question], params)[0]
    assert got.num_cached_tokens == len(mine[-1].tokens) and got.token_ids == want.token_ids
    assert_released(llm)
    assert_released(target)


def test_an_export_in_parts_reads_each_record_whole_while_the_cache_changes(
    make_llm, assert_released
) -> None:
    """A save while serving reads the cache a record at a time between steps (budget 0: one record a
    part) while requests run and add prefixes: the records read import into another engine, which
    resumes the deepest and answers as the cache-off engine does. A flush between two parts drops
    the prefixes not read yet: they are counted `gone`, not `busy` (which would skip the save)."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    source = make_llm("A", chunked_prefill_size=128)
    turn = BASE[:300]
    for i in range(3):  # nested snapshots: a chat's growing history
        turn = turn + source.generate([turn], params)[0].token_ids + random_ids(150, seed=80 + i)
    engine = source.engine
    exporter = engine.prefix_exporter()
    planned, version = len(exporter.order), engine.prefix_cache_version()
    assert planned >= 3
    for i in range(2):
        engine.add_request(turn + random_ids(40, seed=90 + i), params)
    parts = 0
    while not exporter.done or engine.has_unfinished():
        if engine.has_unfinished():
            engine.step()
        if not exporter.done:
            exporter.read(0.0)
            parts += 1
    got = exporter.result()
    assert parts == planned and not got.busy and not got.gone and len(got.records) == planned
    assert engine.prefix_cache_version() > version  # the requests cached prefixes between the parts

    flushed = engine.prefix_exporter()
    flushed.read(0.0)
    engine.flush_cache()
    assert flushed.read() and len(flushed.result().records) == 1
    assert (flushed.result().gone, flushed.result().busy) == (len(flushed.order) - 1, 0) != (0, 0)
    assert_released(source)

    target = make_llm("A", num_pages=200)
    assert target.engine.import_prefix_cache(got.records) == planned
    question = max((r.tokens for r in got.records), key=len) + tuple(random_ids(30, seed=99))
    resumed = target.generate([list(question)], params)[0]
    want = make_llm("A", disable_radix_cache=True).generate([list(question)], params)[0]
    assert resumed.num_cached_tokens == len(question) - 30 and resumed.token_ids == want.token_ids
    assert_released(target)


def test_an_export_between_steps_leaves_running_requests_as_they_were(make_llm, assert_released) -> None:
    """An export while requests run (a server saving on an interval) borrows a free row and gives it
    back: the requests finish with the tokens they give without it, and the cache's entries stay."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [BASE[:600], BASE[:300] + random_ids(200, seed=9)]

    def run(export: bool) -> tuple[list[list[int]], int, int]:
        llm = make_llm("A", chunked_prefill_size=128)
        llm.generate([BASE[:400]], params)  # something cached before the requests start
        engine = llm.engine
        ids = [engine.add_request(p, params) for p in prompts]
        out: dict[str, list[int]] = {i: [] for i in ids}
        exported = 0
        while engine.has_unfinished():
            for step in engine.step():
                out[step.request_id] += step.new_token_ids
            if export and engine.has_unfinished():
                exported = max(exported, len(engine.export_prefix_cache().records))
        version = engine.prefix_cache_version()
        assert_released(llm)
        return [out[i] for i in ids], version, exported

    with_export, version, exported = run(export=True)
    without, version_without, _ = run(export=False)
    assert exported > 0 and with_export == without and version == version_without


def test_a_peer_exports_only_the_prefix_a_server_lacks(make_llm, assert_released) -> None:
    """Two servers of one layout, each with part of a conversation cached: the one that saw fewer turns
    asks how far each could resume the next turn (`resumable_length`, the hint a server reads without
    the engine thread, equal to what a match finds), takes from the other the record of the pages from
    its own resume point on (`export_prefix`, which leaves the exporter's cache as it was), caches it,
    and answers the next turn from the deepest prefix as the cache-off engine does."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    peer, local = make_llm("A"), make_llm("A")
    history = BASE[:300]
    turns = []
    for i in range(3):
        history = history + peer.generate([history], params)[0].token_ids + random_ids(150, seed=700 + i)
        turns.append(history)
    local.generate([turns[0]], params)  # saw the first turn only
    question = history + random_ids(30, seed=710)

    def match(llm: LLM) -> int:
        cache = llm.engine.allocator.prefix_cache
        assert cache is not None
        return cache.match(question, len(question), touch=False).length

    have, deepest = local.engine.resumable_length(question), peer.engine.resumable_length(question)
    assert (have, deepest) == (match(local), match(peer))
    assert 0 < have < deepest
    cache = peer.engine.allocator.prefix_cache
    assert cache is not None
    before, version = cache.resumable(), peer.engine.prefix_cache_version()
    rec = peer.engine.export_prefix(question, have)
    assert rec is not None and (rec.base, len(rec.tokens)) == (have, deepest)
    assert rec.tokens == tuple(question[:deepest])
    assert cache.resumable() == before and peer.engine.prefix_cache_version() == version
    assert peer.engine.export_prefix(question, deepest) is None  # nothing longer than the asker's own

    assert local.engine.import_prefix_cache([rec], evict=True) == 1
    assert local.engine.resumable_length(question) == deepest
    got = local.generate([question], params)[0]
    want = make_llm("A", disable_radix_cache=True).generate([question], params)[0]
    assert got.num_cached_tokens == deepest and got.token_ids == want.token_ids
    for llm in (peer, local):
        assert_released(llm)
        assert llm.engine.resumable_length(question) == 0  # flushed


def test_a_fetched_prefix_evicts_older_ones_where_a_file_import_stops(make_llm, assert_released) -> None:
    """A pool the cache has filled: a record from a file is refused rather than evict what is cached,
    but one fetched for a request about to resume from it (evict=True) takes the least recently used
    pages, and the request resumes there."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    peer = make_llm("A")
    prompt = random_ids(700, seed=720)
    peer.generate([prompt], params)
    question = prompt + random_ids(20, seed=721)
    rec = peer.engine.export_prefix(question, 0)
    assert rec is not None and rec.base == 0

    local = make_llm("A", num_pages=12)
    for i in range(4):  # fill the pool with other prefixes
        local.generate([random_ids(700, seed=730 + i)], params)
    assert local.engine.import_prefix_cache([rec]) == 0
    assert local.engine.import_prefix_cache([rec], evict=True) == 1
    got = local.generate([question], params)[0]
    want = make_llm("A", disable_radix_cache=True).generate([question], params)[0]
    assert got.num_cached_tokens == len(rec.tokens) and got.token_ids == want.token_ids
    assert_released(local)
    assert_released(peer)
