"""PD faults on real processes: each ends with every server's pools back at their initial free counts,
no request left waiting, and every client answered (an error is an answer; a hang is not).

Work is held open by pausing an engine between steps (/debug/pause), never by timing: a paused
prefill keeps a room's transfer from starting while the test kills, stops or disconnects something.
"""

from __future__ import annotations

import concurrent.futures as cf
import signal
from typing import Any

import httpx
import pytest

from dsv4_engine.testing import random_ids

HEARTBEAT = ("--disaggregation-heartbeat-interval", "1", "--disaggregation-heartbeat-failures", "2")
PROMPT = {"model": "tiny", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def s(spawn: Any, pd: Any) -> dict[str, Any]:
    servers = {
        "PF": spawn("PF", "--disaggregation-mode", "prefill"),
        "DF": spawn("DF", "--disaggregation-mode", "decode"),
        "PX": spawn("PX", "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-timeout", "3"),
        "DX": spawn("DX", "--disaggregation-mode", "decode", *HEARTBEAT),
        "DS": spawn("DS", "--disaggregation-mode", "decode", "--num-pages", "10", "--max-waiting", "1"),
        "DM": spawn("DM", "--disaggregation-mode", "decode", "--page-size", "256"),
        "DW": spawn("DW", "--disaggregation-mode", "decode", "--disaggregation-waiting-timeout", "2"),
    }
    pd.wait_healthy(*servers.values())
    servers["initial"] = {name: srv.free_pages() for name, srv in servers.items()}
    return servers


@pytest.fixture
def pool() -> Any:
    with cf.ThreadPoolExecutor(8) as ex:
        yield ex


def body(prefill: Any, pd: Any, n: int = 300, **extra: Any) -> dict[str, Any]:
    return pd.pd_body(prefill, {**PROMPT, "prompt": random_ids(n, seed=n), **extra})


def post(server: Any, b: dict[str, Any], route: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"{server.base}{route}", json=b, timeout=300)


def depth(server: Any, queue: str) -> int:
    return server.get("/debug/pd")["depths"][queue]


def error(r: httpx.Response) -> dict[str, Any]:
    return r.json()["error"]


def test_bad_bootstrap_fields_get_a_400_naming_the_field(s: dict[str, Any]) -> None:
    ok = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 9, "bootstrap_room": 1}
    cases = [
        ({}, "bootstrap_host"),
        ({"bootstrap_host": "127.0.0.1"}, "bootstrap_room"),
        ({**ok, "bootstrap_host": "a b/c"}, "bootstrap_host"),
        ({**ok, "bootstrap_port": 70000}, "bootstrap_port"),
        ({**ok, "bootstrap_room": -1}, "bootstrap_room"),
        ({**ok, "bootstrap_room": "12"}, "bootstrap_room"),
    ]
    for server in (s["PF"], s["DF"]):
        for fields, param in cases:
            r = post(server, {**PROMPT, "prompt": "hi", **fields})
            assert r.status_code == 400, (fields, r.text)
            assert error(r)["param"] == param, (fields, r.text)
        batch = {
            **PROMPT,
            "prompt": ["a", "b"],
            **ok,
            "bootstrap_host": ["x", "y"],
            "bootstrap_port": [9, None],
        }
        assert error(post(server, batch))["param"] == "bootstrap_room"  # one room per prompt
        r = post(
            server, {**batch, "bootstrap_room": [5], "bootstrap_host": ["x", "y"], "bootstrap_port": [9, 9]}
        )
        assert r.status_code == 400 and error(r)["param"] == "bootstrap_room"


def test_unclaimed_room_times_out_and_a_room_in_use_is_refused(s: dict[str, Any], pd: Any, pool: Any) -> None:
    b = body(s["PX"], pd)
    first = pool.submit(post, s["PX"], b)
    pd.wait_until(lambda: depth(s["PX"], "bootstrap") == 1, 60, "the room to wait for a decode server")
    again = post(s["PX"], b)
    assert again.status_code == 400 and error(again)["param"] == "bootstrap_room"
    assert error(again)["code"] == "pd_room_in_use"
    r = first.result(timeout=120)  # no decode ever claims it: the 3 s bootstrap timeout ends it
    assert r.status_code == 504 and error(r)["code"] == "pd_bootstrap_timeout"
    pd.settle(s["PX"], initial=s["initial"])


def test_layout_mismatch_fails_naming_the_field(s: dict[str, Any], pd: Any) -> None:
    p, d = pd.send_pair(s["PF"], s["DM"], body(s["PF"], pd))
    assert d.status_code == 502 and "page_size" in error(d)["message"], d.text
    assert p.status_code >= 400 and "layout_mismatch" in error(p)["code"], p.text  # told, so it ended
    pd.settle(s["PF"], s["DM"], initial=s["initial"])


def test_full_decode_queues_to_its_bound_then_503(s: dict[str, Any], pd: Any, pool: Any) -> None:
    # DS has 10 full pages and --max-waiting 1: a 1000-token request takes 8, a second queues, a
    # third is refused with Retry-After, and the prefill of the refused one ends at once.
    P, D = s["PF"], s["DS"]
    P.pause()
    try:
        first = [body(P, pd, 1000), body(P, pd, 1001)]
        futures = [pool.submit(pd.send_pair, P, D, first[0])]
        pd.wait_until(lambda: depth(D, "transfer") == 1, 60, "the first request to reserve its pages")
        futures.append(pool.submit(pd.send_pair, P, D, first[1]))
        pd.wait_until(lambda: depth(D, "prealloc") == 1, 60, "the second request to queue for pages")
        p, d = pd.send_pair(P, D, body(P, pd, 1002))
        assert d.status_code == 503 and d.headers["Retry-After"], d.text
        assert p.status_code >= 400 and error(p)["code"].startswith("pd_"), p.text
    finally:
        P.resume()
    for future in futures:
        p, d = future.result(timeout=300)
        assert p.status_code == d.status_code == 200, (p.text, d.text)
        assert d.json()["usage"]["completion_tokens"] == 4
    pd.settle(P, D, initial=s["initial"])


def test_a_preempted_pd_request_is_recomputed_not_lost(s: dict[str, Any], pd: Any, pool: Any) -> None:
    # Two 630-token prompts take all 10 of DS's full pages (5 each); held until both are resident,
    # their first decode steps past position 640 need an 11th page, so one is preempted and must be
    # recomputed on the decode server from its prompt and outputs.
    P, D = s["PF"], s["DS"]
    asks = [{**PROMPT, "prompt": random_ids(630, seed=20 + i), "max_tokens": 24} for i in range(2)]
    want = [pd.send_pair(P, s["DF"], pd.pd_body(P, a))[1].json()["choices"][0]["text"] for a in asks]
    before = D.engine()["num_preemptions"]
    D.pause()
    try:
        futures = [pool.submit(pd.send_pair, P, D, pd.pd_body(P, a)) for a in asks]
        pd.wait_until(lambda: D.engine()["num_running"] == 2, 120, "both requests to be admitted")
    finally:
        D.resume()
    outs = [f.result(timeout=300)[1] for f in futures]
    assert [o.json()["choices"][0]["text"] for o in outs] == want
    assert D.engine()["num_preemptions"] > before
    pd.settle(P, D, initial=s["initial"])


def test_a_transfer_past_the_waiting_timeout_fails_and_the_pair_stays_paired(
    s: dict[str, Any], pd: Any, pool: Any
) -> None:
    P, D = s["PF"], s["DW"]
    b = body(P, pd)
    P.pause()  # the prefill never starts: DW's 2 s waiting timeout (from reserving its pages) ends it
    try:
        fp, fd = pool.submit(post, P, b), pool.submit(post, D, b)
        r = fd.result(timeout=120)
        assert r.status_code == 504 and error(r)["code"] == "pd_transfer_timeout", r.text
        assert fp.result(timeout=60).status_code >= 400  # the abort ended the prefill's leg too
    finally:
        P.resume()
    pd.settle(P, D, initial=s["initial"])
    # An abort is not a death: the prefill still takes rooms from DW's session.
    assert D.get("/debug/pd")["decode_id"] not in P.get("/debug/pd")["dead_sessions"]


def _held_open(P: Any, D: Any, pd: Any, pool: Any, b: dict[str, Any]) -> tuple[Any, Any]:
    """Start a pair with P paused: the decode has reserved and sent its pages, nothing is written."""
    P.pause()
    fp, fd = pool.submit(post, P, b), pool.submit(post, D, b)
    pd.wait_until(lambda: depth(D, "transfer") == 1, 60, "the decode to wait for the transfer")
    return fp, fd


@pytest.mark.parametrize("leg", ["decode", "prefill"])
def test_a_client_that_leaves_either_leg_frees_both(s: dict[str, Any], pd: Any, pool: Any, leg: str) -> None:
    P, D = s["PF"], s["DF"]
    gone, other = (D, P) if leg == "decode" else (P, D)
    b = body(P, pd, stream=True)
    P.pause()
    try:
        answer = pool.submit(post, other, b)
        with httpx.stream("POST", f"{gone.base}/v1/completions", json=b, timeout=60) as r:
            assert r.status_code == 200
            pd.wait_until(lambda: depth(D, "transfer") == 1, 60, "the decode to wait for the transfer")
        # Closing the stream hung up on one server; the other side's client hears why.
        assert "pd_client_gone" in answer.result(timeout=60).text
    finally:
        P.resume()
    pd.settle(P, D, initial=s["initial"])


@pytest.mark.parametrize("staging", ["auto", "always", "pack_only_pipelined"])
def test_sigstopped_prefill_writes_late_into_quarantined_pages_only(
    s: dict[str, Any], pd: Any, pool: Any, staging: str
) -> None:
    """With staging "always" the late write lands in the decode's staging span, which stays
    quarantined with the pages (the decode offers a span either way) while the live requests are
    staged through the same arena; with "pack_only_pipelined" it lands in the pages as Mooncake
    batches submitted in pieces, each packed while the one before was on the wire."""
    P, D = s["PX"], s["DX"]
    ask = {**PROMPT, "prompt": random_ids(200, seed=9)}
    reference = pd.send_pair(s["PF"], s["DF"], pd.pd_body(s["PF"], ask))[1]
    for prefill in (P, s["PF"]):
        prefill.post("/debug/pd/staging", params={"mode": staging}).raise_for_status()
    P.post("/debug/pd/deaf", params={"on": True}).raise_for_status()  # it will write despite the abort
    b = body(P, pd, 500)
    fp, fd = _held_open(P, D, pd, pool, b)
    P.signal(signal.SIGSTOP)
    try:
        r = fd.result(timeout=120)  # two missed 1 s heartbeats declare it dead
        assert r.status_code == 502 and error(r)["code"] == "pd_prefill_dead", r.text
        assert depth(D, "quarantine") == 1
        assert depth(D, "staging") == 1  # the span it offered is held too
        live = pd.send_pair(s["PF"], D, pd.pd_body(s["PF"], ask))[1]
        assert live.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]
    finally:
        P.signal(signal.SIGCONT)
        P.resume()
    room = str(b["bootstrap_room"])
    pd.wait_until(lambda: room in P.get("/debug/pd")["checksums"], 120, "the late write to land")
    assert fp.result(timeout=60).status_code == 200  # the stalled prefill finished its part
    live = pd.send_pair(s["PF"], D, pd.pd_body(s["PF"], ask))[1]
    assert live.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]
    P.post("/debug/pd/deaf", params={"on": False}).raise_for_status()
    for prefill in (P, s["PF"]):
        prefill.post("/debug/pd/staging", params={"mode": "auto"}).raise_for_status()
    pd.settle(P, D, initial=s["initial"])  # the quarantine (10 s here) ends and frees


def test_killed_prefill_fails_the_request_and_a_restart_pairs_again(
    s: dict[str, Any], pd: Any, pool: Any
) -> None:
    P, D = s["PX"], s["DX"]
    fp, fd = _held_open(P, D, pd, pool, body(P, pd))
    P.kill()
    r = fd.result(timeout=120)
    assert r.status_code == 502 and error(r)["code"] == "pd_prefill_dead", r.text
    with pytest.raises(httpx.HTTPError):
        fp.result(timeout=60)
    pd.settle(D, initial=s["initial"])
    P.start()
    pd.wait_healthy(P)
    p, d = pd.send_pair(P, D, body(P, pd))
    assert p.status_code == d.status_code == 200
    pd.settle(P, D, initial=s["initial"])


def test_vanished_decode_frees_the_prefill_and_a_restart_pairs_again(
    s: dict[str, Any], pd: Any, pool: Any
) -> None:
    P, D = s["PF"], s["DX"]
    dead_id = D.get("/debug/pd")["decode_id"]
    try:
        fp, _ = _held_open(P, D, pd, pool, body(P, pd))
        D.kill()
        r = fp.result(timeout=120)
        assert r.status_code == 502 and error(r)["code"] == "pd_decode_gone", r.text
    finally:
        P.resume()
    pd.settle(P, initial=s["initial"])
    # Later rooms for the dead session fail fast, until that decode registers again.
    claim = httpx.put(
        f"http://127.0.0.1:{P.bootstrap_port}/rooms/7", json={"decode_id": dead_id, "prompt_digest": "x"}
    )
    assert claim.status_code == 502 and claim.json()["reason"] == "peer_dead", claim.text
    D.start()
    pd.wait_healthy(D)
    p, d = pd.send_pair(P, D, body(P, pd))
    assert p.status_code == d.status_code == 200, (p.text, d.text)
    pd.settle(P, D, initial=s["initial"])


def test_sigterm_prefill_finishes_the_transfers_it_started(s: dict[str, Any], pd: Any, pool: Any) -> None:
    P, D = s["PX"], s["DF"]
    fp, fd = _held_open(P, D, pd, pool, body(P, pd))
    P.signal(signal.SIGTERM)
    pd.wait_until(lambda: httpx.get(f"{P.base}/health", timeout=5).status_code == 503, 60, "draining")
    P.resume()
    p, d = fp.result(timeout=120), fd.result(timeout=120)
    assert p.status_code == d.status_code == 200, (p.text, d.text)
    assert d.json()["usage"]["completion_tokens"] == 4
    assert P.proc.wait(120) == 0
    pd.settle(D, initial=s["initial"])
