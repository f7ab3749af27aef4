"""PD disaggregation against a colocated server behind the same sglang-router, under Poisson load, one run.

    python bench/pd.py                     # small preset, the default rates and workload (~12 min on 2 cores)
    python bench/pd.py --preset tiny --rates 1 2 --requests 4 --long-tokens 256 384 --short-tokens 16 32 \
        --output-tokens 8                  # quick

Two stacks, both up for the whole run, each behind its own sglang-router 0.3.2 (same flags, so the router
hop is the same on both sides):
- PD: one `dsv4 serve --disaggregation-mode prefill` pinned to the first core, one `--disaggregation-mode
  decode` pinned to the second, the router in `--pd-disaggregation` mode;
- colocated: one `dsv4 serve` pinned to both cores, the router in regular mode (`--worker-urls`).
Engine defaults on every server (the same chunk size and token budget); torch threads = the cores a server
is pinned to (`os.sched_setaffinity` in the child, `OMP_NUM_THREADS`). The routers and this client are
not pinned.

The workload is fixed before the run from `--seed`: `--requests` text prompts, built from the checkpoint's
tokenizer out of one-token words so their token counts are known (the servers' counts are checked),
`--long-share` of them long (`--long-tokens`), the rest short (`--short-tokens`), each asking for
`--output-tokens` tokens with `ignore_eos`; Poisson arrivals, one unit-rate pattern scaled to each of
`--rates`. Every request is streamed on SGLang's /generate (httpx SSE, one new connection each: see
`client`), whose chunks carry the cumulative `completion_tokens` (through the router, /v1/completions
loses `continuous_usage_stats`, so its chunks would not say how many tokens they carry), and is timed on
the client: TTFT, every inter-token gap (a chunk of k tokens counts as k gaps of a k-th of its gap), end
to end. Through the PD router the first two tokens reach the client together (one ~0 ms gap per request,
seen in every PD request; likely because the router passes the decode stream on only once the prefill's
response has ended). The stacks take turns rate by rate (the order alternates), which damps load drift on
a shared machine. At a rate both stacks keep up with, both deliver the same tokens per second (the
arrivals set it); tokens/s parts only when one falls behind.

Before the loaded runs (after an untimed warm-up): unloaded figures from single sequential requests
through each router, the workload's longest long and longest short prompt. The SLOs come from colocated's:
TTFT `--ttft-slo-scale` x its unloaded TTFT of the request's class (long or short), ITL `--itl-slo-scale` x
its unloaded ITL p50, met by a request whose mean inter-token gap (DistServe's TPOT) is within it.
Goodput (DistServe): the highest of `--rates` up to which every rate has >= 90% of its requests meeting
both. The router hop: the same 16-token request sent one at a time to colocated's router and to its server
directly, alternating: max_new_tokens 1 not streamed, and the first token of a stream, each on one
kept-alive connection and on a new connection per request.

Prints one table (PD against colocated, ratio PD / colocated; target: PD's ITL p99 at most half of
colocated's at each rate, printed PASS/MISS, never failing the run) and the router hop table; writes the
raw per-request figures (requests.csv, unloaded.csv, router_hop.csv), an ITL CDF per rate (itl_cdf.png)
and the server and router logs to `--out-dir`. Every request has a timeout; every process is stopped at
the end, on error too (and is sent SIGTERM if this process dies). The default checkpoint is written once
by make_tiny under `$DSV4_CACHE` (default ~/.cache/dsv4)/models/<preset>.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from procs import Proc, Procs, free_port, healthy, percentile, wait_until  # bench/procs.py

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

NAME = "bench"
ROOT = Path(__file__).resolve().parents[1]
ATTAINMENT = 0.90  # DistServe: goodput is the highest rate at which >= 90% of requests meet both SLOs
ITL_P99_TARGET = 0.5  # PD's ITL p99 at most half of colocated's at the same rate
START_TIMEOUT = 300.0
CONFIGS = ("pd", "colocated")
LABELS = {"pd": "PD", "colocated": "colocated"}


# ---- workload ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    index: int
    kind: str  # "long" or "short"
    tokens: int  # with BOS, as the server counts them
    text: str
    arrival: float  # seconds after the run starts, at rate 1 req/s


def one_token_words(tokenizer_file: Path) -> list[str]:
    """' word' pieces the tokenizer encodes as exactly one token (byte-level BPE: words stay apart)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    pieces = sorted(
        p[1:] for p in tok.get_vocab() if p.startswith("Ġ") and p[1:].isascii() and p[1:].isalpha()
    )
    words = [f" {w}" for w in pieces if len(tok.encode(f" {w}", add_special_tokens=False).ids) == 1]
    if len(words) < 16:
        raise SystemExit(f"{tokenizer_file}: only {len(words)} one-token words, cannot build text prompts")
    return words


def text_of(words: list[str], tokens: int, rng: random.Random) -> str:
    return "".join(rng.choice(words) for _ in range(tokens - 1))  # + BOS


def make_workload(a: argparse.Namespace, words: list[str]) -> list[Prompt]:
    """Exactly round(n x long_share) long prompts at seeded positions; unit-rate Poisson arrivals."""
    rng = random.Random(a.seed)
    n = a.requests
    n_long = round(n * a.long_share)
    long_at = set(rng.sample(range(n), n_long))
    clock, prompts = 0.0, []
    for i in range(n):
        kind = "long" if i in long_at else "short"
        lo, hi = a.long_tokens if kind == "long" else a.short_tokens
        tokens = rng.randint(lo, hi)
        prompts.append(Prompt(i, kind, tokens, text_of(words, tokens, rng), clock))
        clock += rng.expovariate(1.0)
    return prompts


def check_counts(prompts: Sequence[Prompt], tokenizer_file: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    for p in prompts:
        got = len(tok.encode(p.text).ids)
        if got != p.tokens:
            raise SystemExit(f"prompt {p.index}: {got} tokens, built for {p.tokens}")


# ---- processes ---------------------------------------------------------------------------------


def serve(procs: Procs, ckpt: Path, name: str, cores: tuple[int, ...], *extra: str) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-c", "import sys; from dsv4_operator.cli import main; sys.exit(main())"]
    cmd += ["serve", "--model", str(ckpt), "--served-model-name", NAME, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--log-level", "warning", "--grace-period", "5", *extra]
    return procs.spawn(name, cmd, port=port, cores=cores)


def router(procs: Procs, name: str, workers: list[str], request_timeout: float) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--prometheus-port", str(free_port()), "--policy", "round_robin", "--disable-retries"]
    cmd += ["--request-timeout-secs", str(math.ceil(request_timeout)), "--log-level", "warn"]
    cmd += ["--worker-startup-timeout-secs", str(int(START_TIMEOUT)), *workers]
    return procs.spawn(name, cmd, port=port)


def answers(base: str) -> Callable[[], bool]:
    body = generate_body(" the model", 2, False)
    return lambda: httpx.post(f"{base}/generate", json=body, timeout=60).status_code == 200


@dataclass
class Stack:
    name: str
    router: Proc
    servers: list[Proc]


def start_stacks(procs: Procs, ckpt: Path, cores: tuple[int, int], timeout: float) -> dict[str, Stack]:
    boot = free_port()
    prefill_args = ["--disaggregation-mode", "prefill", "--bootstrap-port", str(boot)]
    prefill = serve(procs, ckpt, "pd-prefill", cores[:1], *prefill_args)
    decode = serve(procs, ckpt, "pd-decode", cores[1:], "--disaggregation-mode", "decode")
    colo = serve(procs, ckpt, "colocated", cores)
    servers = [prefill, decode, colo]
    for s in servers:
        wait_until(healthy(s.base), servers, START_TIMEOUT, f"{s.name} to become healthy")
    pd_args = ["--pd-disaggregation", "--prefill", prefill.base, str(boot), "--decode", decode.base]
    colo_router = router(procs, "router-colocated", ["--worker-urls", colo.base], timeout)
    stacks = {
        "pd": Stack("pd", router(procs, "router-pd", pd_args, timeout), [prefill, decode]),
        "colocated": Stack("colocated", colo_router, [colo]),
    }
    for st in stacks.values():
        wait_until(answers(st.router.base), [st.router, *st.servers], START_TIMEOUT, f"{st.router.name}")
    return stacks


# ---- requests ----------------------------------------------------------------------------------


@dataclass
class Result:
    config: str
    rate: float  # 0 for unloaded requests
    prompt: Prompt
    start: float = 0.0  # seconds after the run started
    ttft: float = math.nan
    e2e: float = math.nan
    output_tokens: int = 0
    prompt_tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float:
        return statistics.fmean(self.gaps) if self.gaps else math.nan


def generate_body(text: str, out_tokens: int, stream: bool) -> dict:
    """SGLang's native request: the router keeps its stream as the server sends it (on /v1/completions
    it drops `continuous_usage_stats`, so chunks would not say how many tokens they carry)."""
    params = {"max_new_tokens": out_tokens, "temperature": 0.0, "ignore_eos": True}
    return {"text": text, "sampling_params": params, "stream": stream}


async def stream_once(client: httpx.AsyncClient, base: str, body: dict, res: Result) -> None:
    """Each chunk carries the cumulative `meta_info.completion_tokens`."""
    t0 = time.perf_counter()
    last, seen = t0, 0
    async with client.stream("POST", f"{base}/generate", json=body) as r:
        if r.status_code != 200:
            res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                res.error = str(chunk["error"])[:200]
                return
            meta = chunk.get("meta_info") or {}
            done = meta.get("completion_tokens", seen)
            res.prompt_tokens = meta.get("prompt_tokens", res.prompt_tokens)
            now = time.perf_counter()
            if done > seen:
                if seen == 0:
                    res.ttft = now - t0
                else:
                    res.gaps += [(now - last) / (done - seen)] * (done - seen)
                last, seen = now, done
    res.output_tokens, res.e2e = seen, time.perf_counter() - t0


async def one_request(
    client: httpx.AsyncClient, base: str, res: Result, out_tokens: int, timeout: float
) -> None:
    try:
        await asyncio.wait_for(
            stream_once(client, base, generate_body(res.prompt.text, out_tokens, True), res), timeout
        )
    except TimeoutError:
        res.error = f"timed out after {timeout:g} s"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    if not res.error and res.output_tokens != out_tokens:
        res.error = f"{res.output_tokens} of {out_tokens} tokens"


def client(n: int, timeout: float, keepalive: bool = False) -> httpx.AsyncClient:
    """A new connection per request unless `keepalive`: sglang-router 0.3.2 does not set TCP_NODELAY
    on the connections it accepts, so on a kept-alive connection the first chunks of a stream wait for
    the client's delayed ACK (up to 40 ms: the router hop table shows it). A client that has not sent
    anything since the response began acknowledges at once, so a fresh connection does not stall."""
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4 if keepalive else 0)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits)


async def run_rate(
    base: str, config: str, prompts: Sequence[Prompt], rate: float, a: argparse.Namespace
) -> list[Result]:
    """Every prompt sent at its arrival time scaled to `rate`, each one bounded by --request-timeout."""
    results = [Result(config, rate, p) for p in prompts]
    async with client(len(prompts), a.request_timeout) as c:
        t0 = time.perf_counter()

        async def at_arrival(res: Result) -> None:
            await asyncio.sleep(max(0.0, t0 + res.prompt.arrival / rate - time.perf_counter()))
            res.start = time.perf_counter() - t0
            await one_request(c, base, res, a.output_tokens, a.request_timeout)

        await asyncio.gather(*(at_arrival(r) for r in results))
    return results


async def run_sequential(
    base: str, config: str, prompts: Sequence[Prompt], out_tokens: int, timeout: float
) -> list[Result]:
    results = [Result(config, 0.0, p) for p in prompts]
    async with client(1, timeout) as c:
        for res in results:
            await one_request(c, base, res, out_tokens, timeout)
    return results


def unloaded_prompts(prompts: Sequence[Prompt], repeats: int) -> list[Prompt]:
    """The longest prompt of each class, `repeats` times, alternating."""
    picks = [
        max((p for p in prompts if p.kind == k), key=lambda p: p.tokens, default=None)
        for k in ("long", "short")
    ]
    return [p for _ in range(repeats) for p in picks if p is not None]


HOP_TOKENS = 16  # the router-hop prompt: short, so the server's part is small against the hop
HOP_CASES = {  # name: (max_new_tokens, streamed, kept-alive connection)
    "max_new_tokens 1, one kept-alive connection": (1, False, True),
    "max_new_tokens 1, a new connection each": (1, False, False),
    "first token of a stream, a new connection each (as above)": (16, True, False),
    "first token of a stream, one kept-alive connection": (16, True, True),
}


async def timed_request(c: httpx.AsyncClient, base: str, body: dict) -> float:
    """Seconds to the whole answer, or to the first chunk of a stream (read to its end, untimed)."""
    t0 = time.perf_counter()
    seconds = math.nan
    async with c.stream("POST", f"{base}/generate", json=body) as r:
        r.raise_for_status()
        async for _ in r.aiter_bytes():
            if body["stream"] and math.isnan(seconds):
                seconds = time.perf_counter() - t0
    return time.perf_counter() - t0 if math.isnan(seconds) else seconds


async def hop_case(
    direct: str, routed: str, text: str, case: str, a: argparse.Namespace
) -> dict[str, list[float]]:
    """The same request direct and through the router, alternating, one at a time."""
    tokens, stream, keepalive = HOP_CASES[case]
    body = generate_body(text, tokens, stream)
    times: dict[str, list[float]] = {"direct": [], "router": []}
    async with client(2, a.request_timeout, keepalive) as c:
        for i in range(a.hop_pairs + 1):  # the first pair warms up, untimed
            for name, base in [("direct", direct), ("router", routed)][:: 1 if i % 2 else -1]:
                seconds = await asyncio.wait_for(timed_request(c, base, body), a.request_timeout)
                if i:
                    times[name].append(seconds)
    return times


def router_hop(
    direct: str, routed: str, text: str, a: argparse.Namespace
) -> dict[str, dict[str, list[float]]]:
    return {case: asyncio.run(hop_case(direct, routed, text, case, a)) for case in HOP_CASES}


# ---- figures -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Slo:
    ttft: dict[str, float]  # per prompt class
    itl: float

    def met(self, r: Result) -> bool:
        return not r.error and r.ttft <= self.ttft[r.prompt.kind] and r.tpot <= self.itl


def make_slo(unloaded: Sequence[Result], a: argparse.Namespace) -> Slo:
    ok = [r for r in unloaded if not r.error]
    if not ok:
        raise SystemExit("every unloaded request failed: " + "; ".join(r.error for r in unloaded))
    ttft = {
        k: a.ttft_slo_scale * statistics.median(r.ttft for r in ok if r.prompt.kind == k)
        for k in {r.prompt.kind for r in ok}
    }
    ttft.setdefault("long", ttft.get("short", math.inf))
    ttft.setdefault("short", ttft["long"])
    return Slo(ttft, a.itl_slo_scale * percentile([g for r in ok for g in r.gaps], 50))


@dataclass(frozen=True)
class Figures:
    itl_p50: float
    itl_p99: float
    ttft_p50: float
    ttft_p99: float
    tokens_per_s: float
    met: int
    total: int
    errors: int

    @property
    def attainment(self) -> float:
        return self.met / self.total if self.total else math.nan


def figures(results: Sequence[Result], slo: Slo) -> Figures:
    ok = [r for r in results if not r.error]
    gaps = [g for r in ok for g in r.gaps]
    span = max((r.start + r.e2e for r in ok), default=0.0) - min((r.start for r in results), default=0.0)
    tokens = sum(r.output_tokens for r in ok)
    return Figures(
        percentile(gaps, 50),
        percentile(gaps, 99),
        percentile([r.ttft for r in ok], 50),
        percentile([r.ttft for r in ok], 99),
        tokens / span if span > 0 else math.nan,
        sum(slo.met(r) for r in results),
        len(results),
        len(results) - len(ok),
    )


def goodput(by_rate: dict[float, Figures]) -> float:
    """The highest rate up to which every rate had >= 90% meeting both SLOs (0 when the lowest did not)."""
    best = 0.0
    for rate in sorted(by_rate):
        if not by_rate[rate].attainment >= ATTAINMENT:
            break
        best = rate
    return best


# ---- report ------------------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1000:.1f} ms"


def ratio(pd: float, colo: float) -> str:
    if math.isnan(pd) or math.isnan(colo) or colo == 0:
        return "n/a"
    return f"{pd / colo:.2f}x"


def row(measure: str, pd: str, colo: str, r: str, target: str = "") -> str:
    return f"| {measure} | {pd} | {colo} | {r} | {target} |"


def unloaded_rows(unloaded: dict[str, list[Result]]) -> list[str]:
    rows = []
    for kind in ("long", "short"):
        pick = {c: [r for r in unloaded[c] if r.prompt.kind == kind and not r.error] for c in CONFIGS}
        if not pick["colocated"]:
            continue
        tokens = pick["colocated"][0].prompt.tokens
        t = {c: statistics.median(r.ttft for r in pick[c]) if pick[c] else math.nan for c in CONFIGS}
        rows.append(
            row(
                f"unloaded TTFT, {kind} prompt ({tokens} tokens)",
                ms(t["pd"]),
                ms(t["colocated"]),
                ratio(t["pd"], t["colocated"]),
            )
        )
    itl = {c: percentile([g for r in unloaded[c] for g in r.gaps], 50) for c in CONFIGS}
    rows.append(
        row("unloaded ITL p50", ms(itl["pd"]), ms(itl["colocated"]), ratio(itl["pd"], itl["colocated"]))
    )
    return rows


def verdict(value: float, target: float) -> str:
    if math.isnan(value):
        return f"<= {target:.2f}x MISS"
    return f"<= {target:.2f}x {'PASS' if value <= target else 'MISS'}"


def rate_rows(rate: float, f: dict[str, Figures]) -> list[str]:
    pd, co = f["pd"], f["colocated"]
    at = f"{rate:g} req/s"
    p99 = pd.itl_p99 / co.itl_p99 if co.itl_p99 else math.nan
    att = [
        f"{x.attainment:.0%} ({x.met}/{x.total}{f', {x.errors} failed' if x.errors else ''})"
        for x in (pd, co)
    ]
    return [
        row(f"{at}: ITL p50", ms(pd.itl_p50), ms(co.itl_p50), ratio(pd.itl_p50, co.itl_p50)),
        row(
            f"{at}: ITL p99",
            ms(pd.itl_p99),
            ms(co.itl_p99),
            ratio(pd.itl_p99, co.itl_p99),
            verdict(p99, ITL_P99_TARGET),
        ),
        row(f"{at}: TTFT p50", ms(pd.ttft_p50), ms(co.ttft_p50), ratio(pd.ttft_p50, co.ttft_p50)),
        row(f"{at}: TTFT p99", ms(pd.ttft_p99), ms(co.ttft_p99), ratio(pd.ttft_p99, co.ttft_p99)),
        row(
            f"{at}: output tokens/s",
            f"{pd.tokens_per_s:.1f}",
            f"{co.tokens_per_s:.1f}",
            ratio(pd.tokens_per_s, co.tokens_per_s),
        ),
        row(
            f"{at}: requests meeting both SLOs",
            att[0],
            att[1],
            ratio(pd.attainment, co.attainment),
            f">= {ATTAINMENT:.0%}",
        ),
    ]


def goodput_text(g: float, rates: Sequence[float]) -> str:
    if not g:
        return f"< {min(rates):g} req/s"
    return f">= {g:g} req/s (the highest rate run)" if g == max(rates) else f"{g:g} req/s"


def goodput_ratio(pd: float, colo: float, rates: Sequence[float]) -> str:
    """PD / colocated; a bound where one side met the SLOs at the highest rate run or not at the lowest."""
    low, high = min(rates), max(rates)
    if not pd and not colo:
        return "n/a (neither meets the SLOs at the lowest rate)"
    if pd == colo == high:
        return "n/a (both meet the SLOs at the highest rate)"
    if not colo:
        return f"> {pd / low:.2f}x"
    if not pd:
        return f"< {low / colo:.2f}x"
    bound = ">= " if pd == high else "<= " if colo == high else ""
    return bound + ratio(pd, colo)


def goodput_row(rates: Sequence[float], by_config: dict[str, dict[float, Figures]]) -> str:
    g = {c: goodput(by_config[c]) for c in CONFIGS}
    text = {c: goodput_text(g[c], rates) for c in CONFIGS}
    r = goodput_ratio(g["pd"], g["colocated"], rates)
    return row("goodput: highest rate with >= 90% meeting both SLOs", text["pd"], text["colocated"], r)


def hop_table(hop: dict[str, dict[str, list[float]]]) -> list[str]:
    head = "| router hop (same request, one at a time) | through the router | direct to the server | added |"
    lines = [head + " ratio |", "|---|---:|---:|---:|---:|"]
    for case, times in hop.items():
        for q in (50, 99):
            rt, dt = percentile(times["router"], q), percentile(times["direct"], q)
            lines.append(
                f"| {case}: p{q} | {ms(rt)} | {ms(dt)} | {(rt - dt) * 1000:+.1f} ms | {rt / dt:.2f}x |"
            )
    return lines


def report(
    a: argparse.Namespace,
    ctx: dict,
    unloaded: dict[str, list[Result]],
    by_config: dict[str, dict[float, Figures]],
    slo: Slo,
    hop: dict[str, dict[str, list[float]]],
) -> None:
    c0, c1 = a.cores
    (l0, l1), (s0, s1) = a.long_tokens, a.short_tokens
    print(
        f"\npd: {ctx['model'].name} checkpoint, {a.requests} requests per rate ({ctx['n_long']} long "
        f"{l0}-{l1} tokens, the rest short {s0}-{s1}), {a.output_tokens} output tokens each (greedy, "
        f"ignore_eos), Poisson arrivals seed {a.seed}, streamed /generate through sglang-router 0.3.2; PD = "
        f"prefill on core {c0} + decode on core {c1}, colocated = one server on cores {c0},{c1} (torch "
        f"threads = pinned cores), engine defaults (prefill chunk {ctx['chunk']}, token budget "
        f"{ctx['budget']}); load average {ctx['load'][0]:.2f} / {os.getloadavg()[0]:.2f} (start / end), "
        f"{os.cpu_count()} CPUs; {ctx['wall']:.0f} s\n"
    )
    print(
        f"SLOs (from colocated's unloaded figures, fixed before the loaded runs): TTFT <= "
        f"{a.ttft_slo_scale:g}x unloaded = {ms(slo.ttft['long'])} (long) / {ms(slo.ttft['short'])} (short); "
        f"ITL (a request's mean gap, DistServe's TPOT) <= {a.itl_slo_scale:g}x unloaded p50 = {ms(slo.itl)}\n"
    )
    print(row("measure", "PD", "colocated", "PD / colocated", "target"))
    print("|---|---:|---:|---:|---:|")
    for line in unloaded_rows(unloaded):
        print(line)
    for rate in a.rates:
        for line in rate_rows(rate, {c: by_config[c][rate] for c in CONFIGS}):
            print(line)
    print(goodput_row(a.rates, by_config))
    print(
        f"\nrouter hop: {a.hop_pairs} pairs per case, alternating, a {HOP_TOKENS}-token prompt, colocated's "
        f"router against colocated's server; streams: 16 tokens\n"
    )
    print("\n".join(hop_table(hop)))
    print(f"\nraw figures, plot and logs: {a.out_dir}")


CSV_COLUMNS = [
    "config",
    "rate",
    "request",
    "kind",
    "prompt_tokens",
    "start_s",
    "ttft_s",
    "e2e_s",
    "output_tokens",
    "tpot_s",
    "itl_p50_s",
    "itl_max_s",
    "meets_ttft_slo",
    "meets_itl_slo",
    "error",
    "itl_gaps_s",
]


def csv_row(r: Result, slo: Slo) -> list[object]:
    gaps = " ".join(f"{g:.6f}" for g in r.gaps)
    meets_ttft = not r.error and r.ttft <= slo.ttft[r.prompt.kind]
    meets_itl = not r.error and r.tpot <= slo.itl
    return [
        r.config,
        r.rate,
        r.prompt.index,
        r.prompt.kind,
        r.prompt_tokens or r.prompt.tokens,
        f"{r.start:.4f}",
        f"{r.ttft:.6f}",
        f"{r.e2e:.6f}",
        r.output_tokens,
        f"{r.tpot:.6f}",
        f"{percentile(r.gaps, 50):.6f}",
        f"{max(r.gaps, default=math.nan):.6f}",
        int(meets_ttft),
        int(meets_itl),
        r.error,
        gaps,
    ]


def write_csv(path: Path, results: Sequence[Result], slo: Slo) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        w.writerows(csv_row(r, slo) for r in results)


def write_hop_csv(path: Path, hop: dict[str, dict[str, list[float]]]) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["case", "pair", "direct_s", "router_s"])
        for case, times in hop.items():
            pairs = zip(times["direct"], times["router"], strict=True)
            w.writerows([case, i, f"{d:.6f}", f"{r:.6f}"] for i, (d, r) in enumerate(pairs))


def plot(path: Path, loaded: dict[str, dict[float, list[Result]]], rates: Sequence[float], slo: Slo) -> None:
    """ITL CDF per rate, PD against colocated, log x; the ITL SLO as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rates), figsize=(5 * len(rates), 4), squeeze=False, sharey=True)
    for ax, rate in zip(axes[0], rates, strict=True):
        for config, color in (("pd", "tab:blue"), ("colocated", "tab:orange")):
            gaps = sorted(g * 1000 for r in loaded[config][rate] for g in r.gaps)
            if gaps:
                ys = [(i + 1) / len(gaps) for i in range(len(gaps))]
                ax.step(
                    gaps,
                    ys,
                    where="post",
                    color=color,
                    label=f"{LABELS[config]} (p99 {percentile(gaps, 99):.0f} ms)",
                )
        ax.axvline(slo.itl * 1000, color="gray", linestyle="--", label=f"ITL SLO {slo.itl * 1000:.0f} ms")
        ax.set_xscale("log")
        ax.set_title(f"{rate:g} req/s")
        ax.set_xlabel("inter-token gap (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    axes[0][0].set_ylabel("fraction of gaps")
    fig.suptitle("decode inter-token latency, PD vs colocated")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- main --------------------------------------------------------------------------------------


def default_model(preset: str) -> Path:
    root = Path(os.environ.get("DSV4_CACHE", Path.home() / ".cache" / "dsv4"))
    path = root / "models" / preset
    if not (path / "config.json").exists():
        from dsv4_engine.make_tiny import make_tiny

        print(f"writing the {preset} preset to {path} (once)", flush=True)
        make_tiny(path, seed=0, preset=preset)
    return path


def engine_defaults() -> tuple[int, int]:
    """(prefill chunk, token budget) of the engine's defaults, for the header."""
    from dsv4_engine import engine_config

    page = engine_config.DEFAULT_PAGE_SIZE
    chunk = engine_config.DEFAULT_CHUNK_PAGES * page
    return chunk, max(engine_config.DEFAULT_MAX_NUM_BATCHED_TOKENS, chunk)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", help="make_tiny preset (default small), written once")
    p.add_argument("--model", type=Path, help="checkpoint folder instead of the preset")
    p.add_argument("--rates", type=float, nargs="+", default=[0.1, 0.2, 0.4], help="requests/s")
    p.add_argument(
        "--requests", type=int, default=16, help="requests per rate (the same prompts at every rate)"
    )
    p.add_argument("--long-tokens", type=int, nargs=2, default=(2048, 4096), metavar=("MIN", "MAX"))
    p.add_argument("--short-tokens", type=int, nargs=2, default=(64, 256), metavar=("MIN", "MAX"))
    p.add_argument("--long-share", type=float, default=0.3)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--unloaded-repeats", type=int, default=2, help="single requests per prompt class")
    p.add_argument("--hop-pairs", type=int, default=30, help="router-hop requests per case on each side")
    p.add_argument("--ttft-slo-scale", type=float, default=5.0)
    p.add_argument("--itl-slo-scale", type=float, default=3.0)
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds, each request")
    p.add_argument(
        "--cores",
        type=int,
        nargs=2,
        metavar=("PREFILL", "DECODE"),
        default=sorted(os.sched_getaffinity(0))[:2],
        help="PD: prefill on the first, decode on the second; colocated on both",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "out" / "pd")
    a = p.parse_args(argv)
    if len(set(a.cores)) != 2:
        p.error(f"needs two distinct cores, got {a.cores} (allowed: {sorted(os.sched_getaffinity(0))})")
    a.rates = sorted(set(a.rates))
    a.cores = tuple(a.cores)
    return a


def measure(a: argparse.Namespace, ckpt: Path, prompts: list[Prompt], procs: Procs) -> tuple[dict, ...]:
    stacks = start_stacks(procs, ckpt, a.cores, a.request_timeout)
    base = {c: stacks[c].router.base for c in CONFIGS}
    print("warm-up, then unloaded: single requests through each router ...", flush=True)
    for c in CONFIGS:  # untimed: the first long prefill of a process pays one-time costs
        asyncio.run(run_sequential(base[c], c, unloaded_prompts(prompts, 1), 4, a.request_timeout))
    picks = unloaded_prompts(prompts, a.unloaded_repeats)
    unloaded = {
        c: asyncio.run(run_sequential(base[c], c, picks, a.output_tokens, a.request_timeout)) for c in CONFIGS
    }
    slo = make_slo(unloaded["colocated"], a)
    print(
        f"SLOs: TTFT {ms(slo.ttft['long'])} (long) / {ms(slo.ttft['short'])} (short), ITL {ms(slo.itl)}",
        flush=True,
    )
    hop_text = text_of(one_token_words(ckpt / "tokenizer.json"), HOP_TOKENS, random.Random(a.seed))
    print(f"router hop: {a.hop_pairs} pairs per case ...", flush=True)
    hop = router_hop(stacks["colocated"].servers[0].base, base["colocated"], hop_text, a)
    loaded: dict[str, dict[float, list[Result]]] = {c: {} for c in CONFIGS}
    for i, rate in enumerate(a.rates):
        for c in CONFIGS[:: 1 if i % 2 else -1]:
            print(f"{rate:g} req/s, {LABELS[c]}: {len(prompts)} requests ...", flush=True)
            loaded[c][rate] = asyncio.run(run_rate(base[c], c, prompts, rate, a))
    return unloaded, loaded, {"hop": hop, "slo": slo}


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    t0, load = time.monotonic(), os.getloadavg()
    ckpt = a.model or default_model(a.preset)
    words = one_token_words(ckpt / "tokenizer.json")
    prompts = make_workload(a, words)
    check_counts(prompts, ckpt / "tokenizer.json")
    (a.out_dir / "logs").mkdir(parents=True, exist_ok=True)
    procs = Procs(a.out_dir / "logs")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops every process
    try:
        unloaded, loaded, extra = measure(a, ckpt, prompts, procs)
    finally:
        procs.stop_all()
    slo = extra["slo"]
    by_config = {c: {rate: figures(loaded[c][rate], slo) for rate in a.rates} for c in CONFIGS}
    write_csv(
        a.out_dir / "requests.csv", [r for c in CONFIGS for rate in a.rates for r in loaded[c][rate]], slo
    )
    write_csv(a.out_dir / "unloaded.csv", [r for c in CONFIGS for r in unloaded[c]], slo)
    write_hop_csv(a.out_dir / "router_hop.csv", extra["hop"])
    plot(a.out_dir / "itl_cdf.png", loaded, a.rates, slo)
    chunk, budget = engine_defaults()
    ctx = {
        "model": ckpt,
        "n_long": sum(p.kind == "long" for p in prompts),
        "chunk": chunk,
        "budget": budget,
        "load": load,
        "wall": time.monotonic() - t0,
    }
    report(a, ctx, unloaded, by_config, slo, extra["hop"])
    everything = [r for c in CONFIGS for r in unloaded[c] + [x for rate in a.rates for x in loaded[c][rate]]]
    off = [r for r in everything if r.prompt_tokens and r.prompt_tokens != r.prompt.tokens]
    if off:
        print(f"\nwarning: {len(off)} requests' servers counted other prompt lengths than built ({off[0]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
