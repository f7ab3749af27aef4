"""Speculative decoding through PD: the decode server drafts with the MTP layer, starting from the
drafts the prefill server's MTP layer made after the first token (they ride in the transfer's
answer); the output is exactly a colocated server's without speculation, and the pools settle."""

from __future__ import annotations

from typing import Any

import pytest

from dsv4_engine.testing import random_ids

LENGTHS = [5, 130, 300]
SPEC = ("--speculative-num-steps", "2")


@pytest.fixture(scope="module")
def cluster(spawn: Any, pd: Any) -> dict[str, Any]:
    servers = {
        "P": spawn("P", "--disaggregation-mode", "prefill", *SPEC),
        "D": spawn("D", "--disaggregation-mode", "decode", *SPEC),
        "C": spawn("C"),
    }
    pd.wait_healthy(*servers.values())
    servers["initial"] = {name: s.free_pages() for name, s in servers.items()}
    return servers


def test_greedy_pd_with_speculation_equals_colocated(cluster: dict[str, Any], pd: Any) -> None:
    prefill, decode = cluster["P"], cluster["D"]
    greedy = {"temperature": 0, "ignore_eos": True}
    drafts = decode.engine()["spec_decode_num_drafts"]
    for n in LENGTHS:
        prompt = random_ids(n, seed=900 + n)
        want = pd.generate(cluster["C"], prompt, 12, **greedy)
        assert pd.pd_generate(prefill, decode, prompt, 12, **greedy) == want, n
    assert decode.engine()["spec_decode_num_drafts"] > drafts
    pd.settle(prefill, decode, initial=cluster["initial"])


def test_first_decode_step_verifies_the_prefill_drafts(cluster: dict[str, Any], pd: Any) -> None:
    """Three tokens: the prefill's first, then one decode step with room for one draft (the last
    token is always the target's own). Only a draft that came with the transfer can be there."""
    prefill, decode = cluster["P"], cluster["D"]
    greedy = {"temperature": 0, "ignore_eos": True}
    before = decode.engine()
    prompt = random_ids(64, seed=77)
    want = pd.generate(cluster["C"], prompt, 3, **greedy)
    assert pd.pd_generate(prefill, decode, prompt, 3, **greedy) == want
    after = decode.engine()
    assert after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"] == 1
    assert after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"] == 1
    pd.settle(prefill, decode, initial=cluster["initial"])


@pytest.fixture(scope="module")
def demo_cluster(spawn: Any, pd: Any) -> dict[str, Any]:
    """The demo model (its MTP layer trained, so its drafts are kept often) as a prefill/decode pair
    and a colocated server, all speculating."""
    from dsv4_engine.demo import bundled

    demo = bundled()
    servers = {
        "P": spawn("demo-P", "--disaggregation-mode", "prefill", *SPEC, model=demo),
        "D": spawn("demo-D", "--disaggregation-mode", "decode", *SPEC, model=demo),
        "D2": spawn("demo-D2", "--disaggregation-mode", "decode", "--tp-size", "2", *SPEC, model=demo),
        "S": spawn("demo-S", *SPEC, model=demo),
    }
    pd.wait_healthy(*servers.values())
    servers["initial"] = {s.name: s.free_pages() for s in servers.values()}
    return servers


COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


@pytest.mark.parametrize("decode_name", ["D", "D2"])
def test_the_decode_drafts_as_a_colocated_server_does(
    demo_cluster: dict[str, Any], pd: Any, decode_name: str
) -> None:
    """The prefill sends its MTP layer's window rows with the state, so the decode server's drafts
    read the prompt's last positions as a colocated speculating server's do: per request, the same
    drafts proposed and kept (a decode drafting from its own positions only would propose others
    for the first window of tokens), and the same output. A 2-rank decode's rank 0 hands the rows to
    rank 1, whose MTP heads read them too."""
    from pydoc_data.topics import topics

    from transformers import AutoTokenizer

    from dsv4_engine.demo import bundled

    tokenizer = AutoTokenizer.from_pretrained(str(bundled()))
    prefill, decode, alone = demo_cluster["P"], demo_cluster[decode_name], demo_cluster["S"]
    greedy = {"temperature": 0, "ignore_eos": True}
    for text in list(topics.values())[:3]:
        prompt = tokenizer.encode(text[:240])
        assert len(prompt) > 40  # past the demo's 16-position window
        s0, d0 = alone.engine(), decode.engine()
        want = pd.generate(alone, prompt, 24, **greedy)
        assert pd.pd_generate(prefill, decode, prompt, 24, **greedy) == want
        s1, d1 = alone.engine(), decode.engine()
        assert {c: d1[c] - d0[c] for c in COUNTERS} == {c: s1[c] - s0[c] for c in COUNTERS}
        assert s1["spec_decode_num_accepted_tokens"] > s0["spec_decode_num_accepted_tokens"]
    pd.settle(prefill, decode, initial=demo_cluster["initial"])
