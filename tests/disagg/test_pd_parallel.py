"""PD between parallel servers: prefill and decode servers of 1 and 2 ranks, in every pairing, give
the colocated server's output, greedy and seeded, and every pool ends whole.

Every rank has its own Mooncake transport: decode rank r takes the request's state straight from
prefill rank r mod P (disagg/lanes.py), so no rank copies pages to another. A decode rank 1 missing
its state would attend over other state in its heads and change the output. The layout fingerprint
is the same at every parallel size, so these servers pair."""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any

import httpx
import pytest

from dsv4_engine.testing import random_ids

LENGTHS = [17, 130, 515]
MAX_TOKENS = 8
PAIRS = [("P2", "D1"), ("P1", "D2"), ("P2", "D2")]
GREEDY = {"temperature": 0, "ignore_eos": True}


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


def rank_bytes(server: Any) -> dict[tuple[str, str], float]:
    """dsv4_pd_rank_bytes_total by (prefill rank, decode rank)."""
    out = {}
    for line in httpx.get(f"{server.base}/metrics", timeout=10).text.splitlines():
        if line.startswith("dsv4_pd_rank_bytes_total{"):
            labels, _, value = line.rpartition(" ")
            pairs = dict(x.split("=") for x in labels[labels.index("{") + 1 : -1].split(","))
            out[(pairs["rank"].strip('"'), pairs["peer_rank"].strip('"'))] = float(value)
    return out


@pytest.mark.parametrize(("prefill", "decode"), PAIRS)
def test_pd_between_parallel_servers_equals_colocated(
    cluster: dict[str, Any], pd: Any, prefill: str, decode: str
) -> None:
    seeded = {"temperature": 1.0, "top_p": 0.9, "sampling_seed": 7, "ignore_eos": True}
    with cf.ThreadPoolExecutor(3) as ex:
        want = list(
            ex.map(lambda n: pd.generate(cluster["C"], random_ids(n, seed=n), MAX_TOKENS, **GREEDY), LENGTHS)
        )
        got = list(
            ex.map(
                lambda n: pd.pd_generate(
                    cluster[prefill], cluster[decode], random_ids(n, seed=n), MAX_TOKENS, **GREEDY
                ),
                LENGTHS,
            )
        )
    assert got == want
    prompt = random_ids(300, seed=3)
    got_seeded = pd.pd_generate(cluster[prefill], cluster[decode], prompt, MAX_TOKENS, **seeded)
    assert got_seeded == pd.generate(cluster["C"], prompt, MAX_TOKENS, **seeded)
    pd.settle(cluster[prefill], cluster[decode], initial=cluster["initial"])


def test_each_decode_rank_takes_its_state_from_its_own_prefill_rank(cluster: dict[str, Any], pd: Any) -> None:
    """P2 to D2: prefill rank 1 writes decode rank 1's copy over its own transport, as many bytes as
    rank 0 writes decode rank 0's, and rank 0 writes none of it; the output is the colocated one."""
    P, D = cluster["P2"], cluster["D2"]
    assert "rank 1: Mooncake session" in P.log() and "rank 1: Mooncake session" in D.log()
    before = rank_bytes(P)
    prompt = random_ids(515, seed=11)
    assert pd.pd_generate(P, D, prompt, MAX_TOKENS, **GREEDY) == pd.generate(
        cluster["C"], prompt, MAX_TOKENS, **GREEDY
    )
    after = rank_bytes(P)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta[("1", "1")] > 0 and delta[("1", "1")] == delta[("0", "0")], delta
    assert delta.get(("0", "1"), 0.0) == 0, delta
    pd.settle(P, D, initial=cluster["initial"])


def test_one_ranks_failed_write_fails_the_request_and_frees_every_rank(
    cluster: dict[str, Any], pd: Any
) -> None:
    """Prefill rank 1's write to decode rank 1 is refused by Mooncake (test hook): the request fails
    on both legs naming the rank, every pool (every rank mirrors rank 0's) ends at its initial free
    count, and the next request pairs again and matches."""
    P, D = cluster["P2"], cluster["D2"]
    prompt = random_ids(300, seed=21)
    body = pd.pd_body(P, {"input_ids": prompt, "sampling_params": {"max_new_tokens": MAX_TOKENS, **GREEDY}})
    P.post("/debug/pd/fail_rank", params={"room": body["bootstrap_room"], "rank": 1}).raise_for_status()
    p, d = pd.send_pair(P, D, body, "/generate")
    assert d.status_code == 502, d.text
    assert "pd_transfer_failed" in d.text and "rank 1" in d.text, d.text
    assert p.status_code == 502, p.text
    pd.settle(P, D, initial=cluster["initial"])
    assert pd.pd_generate(P, D, prompt, MAX_TOKENS, **GREEDY) == pd.generate(
        cluster["C"], prompt, MAX_TOKENS, **GREEDY
    )
    pd.settle(P, D, initial=cluster["initial"])
