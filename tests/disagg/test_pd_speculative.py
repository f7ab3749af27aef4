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
