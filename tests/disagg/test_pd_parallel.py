"""PD between parallel servers: a prefill of 2 ranks to a decode of 1, and of 1 to 2, give the
colocated server's output, greedy and seeded, and every pool ends whole.

The transfer reaches the decode's rank 0, which copies the pages to its other ranks before the
request decodes (ranks.StepBroadcast.share_pages): a rank 1 missing them would attend over other
state in its heads and change the output. The layout fingerprint is the same at every parallel
size, so these servers pair."""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any

import pytest

from dsv4_engine.testing import random_ids

LENGTHS = [17, 130, 515]
MAX_TOKENS = 8
PAIRS = [("P2", "D1"), ("P1", "D2")]  # 2 -> 2 runs through the router in tests/up


@pytest.fixture(scope="module")
def cluster(spawn: Any, pd: Any) -> dict[str, Any]:
    servers = {
        "P1": spawn("P1", "--disaggregation-mode", "prefill"),
        "P2": spawn("P2", "--disaggregation-mode", "prefill", "--tp-size", "2"),
        "D1": spawn("D1", "--disaggregation-mode", "decode"),
        "D2": spawn("D2", "--disaggregation-mode", "decode", "--tp-size", "2"),
        "C": spawn("C"),
    }
    pd.wait_healthy(*servers.values())
    servers["initial"] = {name: s.free_pages() for name, s in servers.items()}
    return servers


@pytest.mark.parametrize(("prefill", "decode"), PAIRS)
def test_pd_between_parallel_servers_equals_colocated(
    cluster: dict[str, Any], pd: Any, prefill: str, decode: str
) -> None:
    greedy = {"temperature": 0, "ignore_eos": True}
    seeded = {"temperature": 1.0, "top_p": 0.9, "sampling_seed": 7, "ignore_eos": True}
    with cf.ThreadPoolExecutor(3) as ex:
        want = list(
            ex.map(lambda n: pd.generate(cluster["C"], random_ids(n, seed=n), MAX_TOKENS, **greedy), LENGTHS)
        )
        got = list(
            ex.map(
                lambda n: pd.pd_generate(
                    cluster[prefill], cluster[decode], random_ids(n, seed=n), MAX_TOKENS, **greedy
                ),
                LENGTHS,
            )
        )
    assert got == want
    prompt = random_ids(300, seed=3)
    got_seeded = pd.pd_generate(cluster[prefill], cluster[decode], prompt, MAX_TOKENS, **seeded)
    assert got_seeded == pd.generate(cluster["C"], prompt, MAX_TOKENS, **seeded)
    pd.settle(cluster[prefill], cluster[decode], initial=cluster["initial"])
