"""PD faults with sglang-router 0.3.2 in the path, on real processes: each ends with every server's
pools back at their initial free counts, nothing queued (pd.settle), and every client answered within
BOUND (an error is an answer; a hang is not). Clients are the official `openai` client against the
router (chat completions), with the client's own retries off.

What the router does (0.3.2, seen in its debug log: `PD retry attempt N using prefill=P decode=D`):
- It POSTs the same body to a prefill and a decode server at once and waits for both legs' headers
  (`tokio::join!`), so an attempt lasts as long as its slower leg.
- `--request-timeout-secs` (T) bounds each leg of each attempt, response body included, not the
  whole request: a leg that has not finished after T fails the attempt (502) and it is retried. So
  T must exceed the longest non-streaming generation, or that request is cut and re-run on new pairs.
- On 408/429/5xx, or a leg that failed or timed out, it retries with a new pair and a new room,
  `--retry-max-retries` attempts in all (default 5), backoff 50 ms x 1.5^n with 20% jitter (under
  0.5 s over 5 attempts). The last attempt's decode status (or the prefill's) is the client's answer.
- `/health` every `--health-check-interval-secs` I (timeout H); after `--health-failure-threshold` N
  failures in a row (a 503 `draining` counts) the worker is unhealthy and no longer picked; it stays
  registered (`/workers`), so a server restarted on the same URL is picked again after
  `--health-success-threshold` (default 2) good checks. Separately, 10 failed requests to a worker
  open its circuit breaker for 60 s (`--cb-failure-threshold`, `--cb-timeout-duration-secs`).
- Which worker a retry picks is the policy's: `round_robin` alternates (a counter shared by all
  requests, so under concurrent traffic a retry can land on the same worker again); `random`,
  `power_of_two` and `cache_aware` can pick a draining decode for several attempts in a row (seen:
  up to 3 of 4), so a request exhausts all 5 on it with probability about 1/2^5 with two decodes,
  until the health checker (N x I) or the circuit breaker (10 failures) excludes it.

Worst-case client wait: `attempts x T + backoff` = 5T + 0.5 s. An attempt costs a full T only when
a leg neither answers nor fails: a stalled (SIGSTOPped, hung) worker, or a generation longer than T.
A killed worker refuses connections and a draining or full one answers 503 at once; the other leg
then ends at once too (a refusing decode aborts the room at its prefill, a refusing prefill fails
the room the decode claims, and a decode's heartbeat ends its wait for a dead prefill). A stalled
worker is picked until the health checker gives up on it, after at most `N x (I + H)`, and every
attempt that picks it until then costs T. With the router's defaults (T = 1800 s, 5 attempts,
I = 60 s, H = 5 s, N = 3) that is up to 2.5 h per request, and about 3 min during which new requests
can be routed to the stalled worker. Here R1 has T = 20 s with 1 s x 2 checks (H = 1 s): the
SIGSTOPped prefill costs its client one T before the retry on the other prefill answers; the other
routers have T = 60 s (their tests hold requests open) and never wait for it.
"""

from __future__ import annotations

import concurrent.futures as cf
import signal
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion

# router --request-timeout-secs, one leg of one attempt, body included: R1's is what a stalled
# prefill costs its client; the others' tests hold requests open (paused engines) for a while.
STALL_TIMEOUT = 20
HOLD_TIMEOUT = 60
ATTEMPTS = 5  # router --retry-max-retries (its default): attempts in all
BOUND = HOLD_TIMEOUT * ATTEMPTS + 30  # the worst case above, plus a margin for two busy cores
POLICY = ("--policy", "round_robin")
ROUTED = (*POLICY, "--request-timeout-secs", str(HOLD_TIMEOUT))
FAST_HEALTH = (
    "--health-check-interval-secs", "1", "--health-failure-threshold", "2",
    "--health-check-timeout-secs", "1",
)  # fmt: skip
HEARTBEAT = ("--disaggregation-heartbeat-interval", "1", "--disaggregation-heartbeat-failures", "2")
LONG = "hello " * 320  # about 970 prompt tokens with the chat template: 8 of DS's 10 pages


@pytest.fixture(scope="module")
def s(spawn: Any, pd: Any) -> dict[str, Any]:
    servers = {
        "PA": spawn("PA", "--disaggregation-mode", "prefill"),
        "PB": spawn("PB", "--disaggregation-mode", "prefill"),
        "DA": spawn("DA", "--disaggregation-mode", "decode", *HEARTBEAT),
        "DS": spawn("DS", "--disaggregation-mode", "decode", "--num-pages", "10", "--max-waiting", "1"),
        "DT": spawn("DT", "--disaggregation-mode", "decode", "--grace-period", "120"),
    }
    pd.wait_healthy(*servers.values())
    servers["initial"] = {name: srv.free_pages() for name, srv in servers.items()}
    return servers


@pytest.fixture(scope="module")
def r1(s: dict[str, Any], router: Any) -> Any:
    """Two prefill servers and one decode server, health-checked every second: shared by the
    prefill-kill, restart and SIGSTOP tests (the restart must be seen by the router that saw the kill)."""
    stall = ("--request-timeout-secs", str(STALL_TIMEOUT))
    return router("R1", [s["PA"], s["PB"]], [s["DA"]], *POLICY, *stall, *FAST_HEALTH)


@pytest.fixture
def pool() -> Iterator[cf.ThreadPoolExecutor]:
    with cf.ThreadPoolExecutor(8) as ex:
        yield ex


Answer = ChatCompletion | openai.APIStatusError


def ask(r: Any, content: str = "Hi", max_tokens: int = 4) -> Answer:
    """One chat completion through router `r`: the completion or the error status it answered with.
    A client timeout (no answer within BOUND) or a dropped connection raises: that is a hang."""
    try:
        return r.client(BOUND).chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": content}],
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    except openai.APIStatusError as err:
        return err


def ok(answer: Answer) -> ChatCompletion:
    assert isinstance(answer, ChatCompletion), f"{answer!r}: {getattr(answer, 'body', None)}"
    assert answer.usage is not None and answer.usage.completion_tokens == 4, answer
    return answer


def depth(server: Any, queue: str) -> int:
    return server.get("/debug/pd")["depths"][queue]


def n_open(server: Any) -> int:
    return server.get("/debug/state")["open"]


def finished(server: Any) -> float:
    """Requests the server answered (its dsv4_requests_finished_total, all finish reasons)."""
    text = httpx.get(f"{server.base}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("dsv4_requests_finished_total{")
    )


def pd_failures(server: Any, reason: str) -> float:
    """The server's dsv4_pd_failures_total{reason}: a prefill counts each room it ended, by why."""
    text = httpx.get(f"{server.base}/metrics", timeout=10).text
    line = f'dsv4_pd_failures_total{{reason="{reason}"}} '
    return sum(float(x[len(line) :]) for x in text.splitlines() if x.startswith(line))


def held_request(
    pool: cf.ThreadPoolExecutor, r: Any, pd: Any, landed: Callable[[], bool], what: str
) -> cf.Future[Answer]:
    """Send requests one at a time until one is held where `landed` says (a paused server); the
    others went to the other worker of the pair and must succeed."""
    for i in range(4):
        future = pool.submit(ask, r, f"held {i}")
        pd.wait_until(lambda f=future: f.done() or landed(), 60, what)
        if not future.done():
            return future
        ok(future.result())
    raise AssertionError(f"4 requests through {r.name} and none was held at {what}")


def tried(r: Any, since: int) -> list[tuple[int, str, str]]:
    return r.attempts()[since:]


def test_full_decode_queue_503_is_retried_and_leaves_nothing_on_the_prefill(
    s: dict[str, Any], pd: Any, router: Any, pool: cf.ThreadPoolExecutor
) -> None:
    # DS has 10 full pages and --max-waiting 1: a ~970-token request takes 8, a second queues for
    # pages, a third is refused with 503 + Retry-After (the decode aborts its room at the prefill).
    # The router retries the 503 with a new room each time, always on DS (its only decode): every
    # one of those rooms must end on the prefill too.
    P, D = s["PA"], s["DS"]
    r = router("R2", [P], [D], *ROUTED)
    P.pause()
    try:
        first = pool.submit(ask, r, f"1 {LONG}")
        pd.wait_until(lambda: depth(D, "transfer") == 1, 60, "the first request to reserve its pages")
        second = pool.submit(ask, r, f"2 {LONG}")
        pd.wait_until(lambda: depth(D, "prealloc") == 1, 60, "the second request to queue for pages")
        before, refused = len(r.attempts()), pd_failures(P, "queue_full")
        third = ask(r, f"3 {LONG}")
        assert isinstance(third, openai.APIStatusError) and third.status_code == 503, third
        assert [a[0] for a in tried(r, before)] == list(range(ATTEMPTS))  # retried, a new room each
        # DS aborted each attempt's room at PA, which ended it; only the queued request's room still
        # waits there.
        assert pd_failures(P, "queue_full") == refused + ATTEMPTS
        pd.wait_until(
            lambda: depth(P, "bootstrap") == 1 and n_open(P) == 2, 30, "the refused rooms to end at PA"
        )
        assert (depth(D, "transfer"), depth(D, "prealloc")) == (1, 1)
    finally:
        P.resume()
    for future in (first, second):
        answer = ok(future.result(timeout=BOUND))
        assert answer.usage is not None and 640 < answer.usage.prompt_tokens <= 1024 - 4
    pd.settle(P, D, initial=s["initial"])


def test_sigterm_decode_drains_while_the_router_routes_around_it(
    s: dict[str, Any], pd: Any, router: Any, pool: cf.ThreadPoolExecutor
) -> None:
    P, T, D = s["PB"], s["DT"], s["DA"]
    # ra keeps the router's default 60 s health interval, so it still picks the draining DT and must
    # retry its 503; rb checks every second and must stop picking DT once /health says draining.
    ra = router("R3a", [P], [T, D], *ROUTED)
    rb = router("R3b", [P], [T, D], *ROUTED, *FAST_HEALTH)
    T.pause()
    try:
        held = held_request(pool, ra, pd, lambda: T.engine()["num_running"] == 1, "DT running a request")
        T.signal(signal.SIGTERM)
        pd.wait_until(lambda: httpx.get(f"{T.base}/health", timeout=5).status_code == 503, 60, "draining")
        assert httpx.get(f"{T.base}/health", timeout=5).json()["status"] == "draining"
        start, refused = len(ra.attempts()), pd_failures(P, "server_draining")
        for i in range(4):  # round_robin alternates: DT's 503 is retried on DA
            before = len(ra.attempts())
            ok(ask(ra, f"during drain {i}"))
            attempts = tried(ra, before)
            assert attempts[-1][2] == D.base, attempts  # answered by the healthy decode
            assert all(d == T.base for _, _, d in attempts[:-1]), attempts  # DT refused, at once
        to_t = sum(d == T.base for _, _, d in tried(ra, start))
        assert to_t > 0, "the router never tried DT"
        # DT told PB of each room it refused, so PB's leg ended at once (not at the router's timeout).
        assert pd_failures(P, "server_draining") == refused + to_t
        pd.wait_until(lambda: not rb.healthy(T), 30, "R3b's health checker to mark DT unhealthy")
        before = len(rb.attempts())
        for i in range(3):
            ok(ask(rb, f"after the health check {i}"))
        assert [d for _, _, d in tried(rb, before)] == [D.base] * 3  # DT no longer picked at all
        assert n_open(T) == 1  # DT's request is still in flight, held by the pause
    finally:
        T.resume()
    ok(held.result(timeout=BOUND))  # drained: the in-flight request finished normally
    assert T.proc is not None and T.proc.wait(60) == 0
    pd.settle(P, D, initial=s["initial"])


def test_sigkilled_prefill_mid_transfer_is_retried_on_the_other(
    s: dict[str, Any], pd: Any, r1: Any, pool: cf.ThreadPoolExecutor
) -> None:
    P, other, D = s["PA"], s["PB"], s["DA"]
    P.pause()
    held = held_request(
        pool, r1, pd, lambda: n_open(P) == 1 and depth(D, "transfer") == 1, "a room of PA mid-transfer"
    )
    before = len(r1.attempts())
    P.kill()
    # DA's transfer call to PA is refused at once: 502 prefill_dead, the router retries on a new pair.
    ok(held.result(timeout=BOUND))
    assert r1.attempts()[before - 1][1] == P.base  # the held attempt was PA's
    assert r1.attempts()[-1][1] == other.base, r1.attempts()[before - 1 :]
    pd.settle(other, D, initial=s["initial"])  # DA's pages come back after their quarantine


def test_killed_prefill_restarted_pairs_again_through_the_same_router(
    s: dict[str, Any], pd: Any, r1: Any
) -> None:
    P, D = s["PA"], s["DA"]
    assert P.proc is not None
    if P.proc.poll() is None:  # run on its own: kill it here
        P.kill()
    pd.wait_until(lambda: not r1.healthy(P), 30, "R1 to mark the killed prefill unhealthy")
    for i in range(2):  # meanwhile everything goes to PB
        ok(ask(r1, f"while PA is down {i}"))
    P.start()  # same ports; DA and the router are not restarted
    pd.wait_healthy(P)
    pd.wait_until(lambda: r1.healthy(P), 30, "R1 to mark the restarted prefill healthy again")
    for i in range(4):
        ok(ask(r1, f"after the restart {i}"))
        if finished(P) > 0:
            break
    assert finished(P) > 0, "no request reached the restarted prefill"
    pd.settle(P, s["PB"], D, initial=s["initial"])


def test_sigstopped_prefill_costs_one_request_timeout_then_the_retry_answers(
    s: dict[str, Any], pd: Any, r1: Any, pool: cf.ThreadPoolExecutor
) -> None:
    P, other, D = s["PB"], s["PA"], s["DA"]
    if other.proc is not None and other.proc.poll() is not None:  # run on its own after a kill
        other.start()
        pd.wait_healthy(other)
    pd.wait_until(lambda: r1.healthy(other) and r1.healthy(P), 30, "R1 to see both prefills healthy")
    P.pause()
    stopped = False
    try:
        held = held_request(
            pool, r1, pd, lambda: n_open(P) == 1 and depth(D, "transfer") == 1, "a room of PB mid-transfer"
        )
        before = len(r1.attempts())
        P.signal(signal.SIGSTOP)
        stopped = True
        # DA's heartbeat declares PB dead (2 x 1 s): 502 at once. The prefill leg gets no headers from
        # the stopped process until the router's request timeout; join! waits for it, then retries.
        ok(held.result(timeout=BOUND))
        attempts = r1.attempts()
        assert attempts[before - 1][1] == P.base and attempts[-1][1] == other.base, attempts[before - 1 :]
    finally:
        if stopped:
            P.signal(signal.SIGCONT)
        P.resume()
    pd.wait_until(lambda: r1.healthy(P), 30, "R1 to mark the continued prefill healthy again")
    served = finished(P)
    for i in range(4):
        ok(ask(r1, f"after SIGCONT {i}"))
        if finished(P) > served:
            break
    assert finished(P) > served, "no request reached the continued prefill"
    pd.settle(P, other, D, initial=s["initial"])


def test_sigterm_prefill_drains_while_the_router_routes_around_it(
    s: dict[str, Any], pd: Any, router: Any, pool: cf.ThreadPoolExecutor
) -> None:
    # The prefill-side twin of the decode drain: a draining prefill refuses new requests with 503
    # and fails their rooms, so the decode's claim ends at once (502) and the router retries.
    P, other, D = s["PB"], s["PA"], s["DA"]
    for srv in (P, other):
        if srv.proc is not None and srv.proc.poll() is not None:  # run on its own after a kill
            srv.start()
            pd.wait_healthy(srv)
    r = router("R4", [P, other], [D], *ROUTED)  # default 60 s health interval: PB stays picked
    P.pause()
    try:
        held = held_request(
            pool, r, pd, lambda: n_open(P) == 1 and depth(D, "transfer") == 1, "a room of PB mid-transfer"
        )
        P.signal(signal.SIGTERM)
        pd.wait_until(lambda: httpx.get(f"{P.base}/health", timeout=5).status_code == 503, 60, "draining")
        start, refused = len(r.attempts()), pd_failures(P, "server_draining")
        for i in range(4):
            before = len(r.attempts())
            ok(ask(r, f"during drain {i}"))
            attempts = tried(r, before)
            assert attempts[-1][1] == other.base, attempts
            assert all(p == P.base for _, p, _ in attempts[:-1]), attempts
        to_p = sum(p == P.base for _, p, _ in tried(r, start))
        assert to_p > 0, "the router never tried PB"
        assert pd_failures(P, "server_draining") == refused + to_p
    finally:
        P.resume()
    ok(held.result(timeout=BOUND))
    assert P.proc is not None and P.proc.wait(60) == 0
    pd.settle(other, D, initial=s["initial"])
