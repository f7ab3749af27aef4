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
SMALL = ("--num-pages", "10")  # full pages: a 1000-token prompt takes 8, a 300-token one 3


@pytest.fixture(scope="module")
def s(spawn: Any, pd: Any) -> dict[str, Any]:
    """PF and PX write with Mooncake's shortest timeout (5 s, conftest); PS with 60 s, so a write
    held open stays in flight. DF's heartbeat never runs in a test (600 s): only a claim can tell it
    a prefill restarted. DX keeps pages a stalled prefill may still write for 35 s without word from
    it (its MC_TRANSFER_TIMEOUT + 5 s). DS keeps room for 8 more tokens per decoding request."""
    servers = {
        "PF": spawn("PF", "--disaggregation-mode", "prefill"),
        "DF": spawn("DF", "--disaggregation-mode", "decode", "--disaggregation-heartbeat-interval", "600"),
        "PX": spawn("PX", "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-timeout", "3"),
        "PS": spawn("PS", "--disaggregation-mode", "prefill", *SMALL, "--chunked-prefill-size", "128",
                    env={"MC_TRANSFER_TIMEOUT": "60"}),
        "DX": spawn("DX", "--disaggregation-mode", "decode", *HEARTBEAT, env={"MC_TRANSFER_TIMEOUT": "30"}),
        "DS": spawn("DS", "--disaggregation-mode", "decode", *SMALL, "--max-waiting", "1", *HEARTBEAT,
                    env={"DSV4_PD_RESERVED_DECODE_TOKENS": "8"}),
        "DM": spawn("DM", "--disaggregation-mode", "decode", "--page-size", "256"),
        "DW": spawn("DW", "--disaggregation-mode", "decode", "--disaggregation-waiting-timeout", "2"),
    }  # fmt: skip
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
    # Two 630-token prompts take all 10 of DS's full pages (5 each, which also hold their next 8
    # tokens: DS's headroom); held until both are resident, their first decode steps past position
    # 640 need an 11th page, so one is preempted and must be recomputed on the decode server from
    # its prompt and outputs.
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


def _resident(P: Any, D: Any, pd: Any, pool: Any, b: dict[str, Any]) -> Any:
    """Send a pair with D's engine paused: it is admitted (running, holding its pages) and decodes
    nothing until D resumes. Returns the pair's future."""
    D.pause()
    running = D.engine()["num_running"]
    future = pool.submit(pd.send_pair, P, D, b)
    pd.wait_until(lambda: D.engine()["num_running"] == running + 1, 120, "the request to be admitted")
    return future


def _held_open(P: Any, D: Any, pd: Any, pool: Any, b: dict[str, Any]) -> tuple[Any, Any]:
    """Start a pair with P paused: the decode has reserved and sent its pages, nothing is written, and
    P holds the prefill leg in flight. The decode's claim reaches P's bootstrap endpoint on its own, so
    it can come before the prefill leg does: both are awaited (a drain counts only the second)."""
    P.pause()
    fp, fd = pool.submit(post, P, b), pool.submit(post, D, b)
    pd.wait_until(lambda: depth(D, "transfer") == 1, 60, "the decode to wait for the transfer")
    pd.wait_until(lambda: P.get("/debug/state")["inflight"] >= 1, 60, "the prefill leg to reach P")
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
        # A request decoding on D while the late write lands: its pages' bytes must not change.
        live = _resident(s["PF"], D, pd, pool, pd.pd_body(s["PF"], ask))
        before = D.get("/debug/pd/live")
        P.signal(signal.SIGCONT)
        P.resume()
        room = str(b["bootstrap_room"])
        pd.wait_until(lambda: room in P.get("/debug/pd")["checksums"], 120, "the late write to land")
        assert D.get("/debug/pd/live") == before and len(before) == 1
    finally:
        P.signal(signal.SIGCONT)
        P.resume()
        D.resume()
    assert fp.result(timeout=60).status_code == 200  # the stalled prefill finished its part
    assert live.result(timeout=120)[1].json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]
    P.post("/debug/pd/deaf", params={"on": False}).raise_for_status()
    for prefill in (P, s["PF"]):
        prefill.post("/debug/pd/staging", params={"mode": "auto"}).raise_for_status()
    pd.settle(P, D, initial=s["initial"])  # the quarantine (10 s here) ends and frees


def test_killed_prefill_fails_the_request_and_a_restart_pairs_again(
    s: dict[str, Any], pd: Any, pool: Any
) -> None:
    P, D = s["PX"], s["DX"]
    p, d = pd.send_pair(P, s["DF"], body(P, pd))  # DF pairs with this PX process...
    assert p.status_code == d.status_code == 200, (p.text, d.text)
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
    # ...and, its heartbeat not due for 600 s, learns of the restart from the new process's claim
    # answer (an unknown session): it registers again and the request goes through.
    p, d = pd.send_pair(P, s["DF"], body(P, pd))
    assert p.status_code == d.status_code == 200, (p.text, d.text)
    pd.settle(P, D, s["DF"], initial=s["initial"])


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


def _hold(P: Any, room: int, action: str = "hold") -> None:
    P.post(f"/debug/pd/{action}", params={"room": room}).raise_for_status()


def test_an_entry_abandoned_at_the_deadline_lands_only_in_quarantined_pages(
    s: dict[str, Any], pd: Any, pool: Any
) -> None:
    """SGLang PR#27372 from the sending side. PF's first write of a room keeps one entry from
    Mooncake (a stalled peer) past its 5 s deadline: the room fails, but that entry may still land.
    Until it has, PF keeps the request's pages and DF the destination pages; a request decoding on
    DF meanwhile (it takes the lowest free pages: these, had they been freed) keeps its bytes when
    the entry finally lands."""
    P, D = s["PF"], s["DF"]
    ask = {**PROMPT, "prompt": random_ids(300, seed=31)}
    reference = pd.send_pair(P, D, pd.pd_body(P, ask))[1].json()["choices"][0]["text"]
    b = body(P, pd, 300)
    room = b["bootstrap_room"]
    _hold(P, room)
    try:
        fp, fd = pool.submit(post, P, b), pool.submit(post, D, b)
        r = fd.result(timeout=120)
        assert r.status_code == 502 and error(r)["code"] == "pd_transfer_failed", r.text
        assert "still running at the deadline" in error(r)["message"]
        assert fp.result(timeout=60).status_code == 502
        assert P.get("/debug/pd")["late"] == 1 and P.engine()["num_held"] == 1  # its pages are kept
        assert depth(D, "quarantine") == 1  # and so are the decode's
        live = _resident(P, D, pd, pool, pd.pd_body(P, ask))
        before = D.get("/debug/pd/live")
        _hold(P, room, "release")
        pd.wait_until(lambda: P.get("/debug/pd")["holds"][str(room)]["ended"], 60, "the late entry to land")
        assert D.get("/debug/pd/live") == before and len(before) == 1
    finally:
        _hold(P, room, "release")
        D.resume()
    p, d = live.result(timeout=120)
    assert p.status_code == 200 and d.json()["choices"][0]["text"] == reference
    pd.settle(P, D, initial=s["initial"])  # the late entry ended: both sides give their pages back


def test_a_request_under_a_write_is_not_preempted_into_reused_pages(
    s: dict[str, Any], pd: Any, pool: Any
) -> None:
    """PS has 10 full pages and prefills in chunks of 128: two 1000-token prompts admitted together
    fill them at their 5th chunk, and one must be preempted for the other to go on. The newer one's
    first write is held in flight (its peer stalls): its row is pinned, so the older one is the one
    preempted, and every byte each write carries is what its pages held when it was queued (the
    prefill digests them then). Preempting the newer one would hand its page to the older one's
    6th chunk under the held write."""
    P, D = s["PS"], s["DF"]
    asks = [body(P, pd, n) for n in (1000, 1001)]
    before = P.engine()["num_preemptions"]
    P.pause()
    try:
        futures = []
        for i, b in enumerate(asks):
            futures.append(pool.submit(pd.send_pair, P, D, b))
            pd.wait_until(
                lambda i=i: P.engine()["num_waiting"] == i + 1, 60, "the prompt to reach the engine"
            )
        _hold(P, asks[1]["bootstrap_room"])
    finally:
        P.resume()
    try:
        pd.wait_until(lambda: P.engine()["num_preemptions"] > before and P.engine()["num_held"] >= 1, 120,
                      "one request preempted and the other's prefill done")  # fmt: skip
    finally:
        _hold(P, asks[1]["bootstrap_room"], "release")
    for future in futures:
        p, d = future.result(timeout=300)
        assert p.status_code == d.status_code == 200, (p.text, d.text)
    for b in asks:
        room = str(b["bootstrap_room"])
        assert P.get("/debug/pd")["checksums"][room] == D.get("/debug/pd")["checksums"][room]
    pd.settle(P, D, initial=s["initial"])


def test_a_transfer_that_skipped_its_pages_fails_on_the_poison(s: dict[str, Any], pd: Any) -> None:
    """DF fills reserved pages with NaN (test hooks); PF writes only the aux slot of this room. The
    request fails naming the pages no write reached, and DF never decodes a token of it."""
    P, D = s["PF"], s["DF"]
    b = body(P, pd, 300)
    _hold(P, b["bootstrap_room"], "skip")
    forwarded = D.engine()["forwarded_tokens_total"]
    p, d = pd.send_pair(P, D, b)
    assert d.status_code == 502 and error(d)["code"] == "pd_payload_mismatch", d.text
    assert "NaN poison" in error(d)["message"] and "SWA" in error(d)["message"]
    assert p.status_code == 200  # the prefill's part (its writes) ended
    assert D.engine()["forwarded_tokens_total"] == forwarded
    pd.settle(P, D, initial=s["initial"])


@pytest.mark.parametrize("first", ["prefill", "decode"])
def test_a_prompt_that_differs_between_the_legs_fails_naming_it(
    s: dict[str, Any], pd: Any, pool: Any, first: str
) -> None:
    """The room's prompt digests differ (a router bug, or a client reusing a room): both legs answer
    400 naming the prompt, and both servers count the failure, whichever leg arrived first. Prefill
    first, the decode's claim finds the mismatch; decode first (its claim waiting for the state), the
    prefill finds it and the decode hears it relayed, which once answered 502."""
    P, D = s["PF"], s["DF"]
    b = body(P, pd, 40)
    other = {**b, "prompt": random_ids(40, seed=41)}
    failures = [_failures(x, "prompt_mismatch") for x in (P, D)]
    if first == "prefill":
        fp = pool.submit(post, P, b)
        pd.wait_until(lambda: depth(P, "bootstrap") == 1, 60, "the room to wait for a decode server")
        fd = pool.submit(post, D, other)
    else:
        fd = pool.submit(post, D, other)
        pd.wait_until(lambda: depth(D, "transfer") == 1, 60, "the decode to claim the room and wait")
        fp = pool.submit(post, P, b)
    for r in (fp.result(timeout=120), fd.result(timeout=120)):
        assert r.status_code == 400, r.text
        assert (error(r)["param"], error(r)["code"]) == ("prompt", "pd_prompt_mismatch"), r.text
        assert "prompt" in error(r)["message"]
    assert [_failures(x, "prompt_mismatch") for x in (P, D)] == [f + 1 for f in failures]
    pd.settle(P, D, initial=s["initial"])


def _failures(server: Any, reason: str) -> float:
    line = f'dsv4_pd_failures_total{{reason="{reason}"}} '
    text = httpx.get(f"{server.base}/metrics", timeout=10).text
    return sum(float(x[len(line) :]) for x in text.splitlines() if x.startswith(line))


def test_queued_at_the_decode_past_the_prefills_bootstrap_timeout_still_succeeds(
    s: dict[str, Any], pd: Any, pool: Any
) -> None:
    """The deadlines start at the decode's admission, not at arrival. PX gives up on a room 3 s after
    the last claim; DS (full) queues this request, renewing its claim every heartbeat (1 s), for
    longer than that: an unclaimed room opened on PX after it queued times out first. DS's own
    waiting timeout starts only when it reserves the pages."""
    P, D = s["PX"], s["DS"]
    filler = pd.pd_body(s["PF"], {**PROMPT, "prompt": random_ids(1000, seed=50), "max_tokens": 16})
    try:
        ff = _resident(s["PF"], D, pd, pool, filler)  # 8 of DS's 10 pages, until D resumes
        b = body(P, pd, 300)  # 3 pages
        fb = pool.submit(pd.send_pair, P, D, b)
        pd.wait_until(lambda: fb.done() or depth(D, "prealloc") == 1, 60, "the request to queue for pages")
        assert not fb.done(), [r.text for r in fb.result()]
        r = post(P, body(P, pd, 20))
        assert r.status_code == 504 and error(r)["code"] == "pd_bootstrap_timeout", r.text
        assert depth(D, "prealloc") == 1  # still queued, its room still open on PX
    finally:
        D.resume()
    for future in (ff, fb):
        p, d = future.result(timeout=300)
        assert p.status_code == d.status_code == 200, (p.text, d.text)
    pd.settle(P, D, s["PF"], initial=s["initial"])


def test_a_burst_of_four_times_the_decode_capacity_holds_the_queue_bound(s: dict[str, Any], pd: Any) -> None:
    """DS keeps room for each decoding request's next 8 tokens: a 250-token prompt with max_tokens 8
    grows to 3 full pages, so 3 of them fit its 10 at once. Twelve at once, the prefill held:
    3 reserve their pages, exactly --max-waiting (1) queues, 8 get 503 with Retry-After (their
    prefill legs end too), and the 4 admitted finish with nothing preempted."""
    P, D = s["PF"], s["DS"]
    asks = [
        pd.pd_body(P, {**PROMPT, "prompt": random_ids(250, seed=60 + i), "max_tokens": 8}) for i in range(12)
    ]
    preemptions = D.engine()["num_preemptions"]
    P.pause()
    with cf.ThreadPoolExecutor(12) as burst:
        try:
            futures = [burst.submit(pd.send_pair, P, D, b) for b in asks]
            refused = lambda: sum(f.done() for f in futures)  # noqa: E731
            pd.wait_until(lambda: refused() >= 8, 120, "8 of the burst to be refused")
            assert (depth(D, "transfer"), depth(D, "prealloc")) == (3, 1)
        finally:
            P.resume()
        answers = [f.result(timeout=300) for f in futures]
    decoded = [d for _, d in answers if d.status_code == 200]
    rejected = [(p, d) for p, d in answers if d.status_code != 200]
    assert len(decoded) == 4 and all(d.json()["usage"]["completion_tokens"] == 8 for d in decoded)
    assert len(rejected) == 8
    for p, d in rejected:
        assert d.status_code == 503 and d.headers["Retry-After"] and error(d)["code"] in (
            "queue_full", "pd_queue_full"), d.text  # fmt: skip
        assert p.status_code >= 400, p.text
    assert D.engine()["num_preemptions"] == preemptions
    pd.settle(P, D, initial=s["initial"])


# Last: PX does not come back.
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
